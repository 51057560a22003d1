"""The optimizer step's collectives, counted (a count, not a time), so that a new one cannot slip
in: ours issues Adam's on the same Megatron-FSDP layout (the grad norm's all-reduce,
Megatron-FSDP's own param gathers) plus the owner exchange's all-to-alls, one per direction of
each exchange that moves rows (at the default budget, what Muon's state saves a rank, these
tiny matrices mostly go one exchange each); with every matrix in one exchange, on ZeRO-1 no more
than megatron-core's layer-wise optimizer on the same model."""

from collections import Counter

import pytest

from megatron_muon import get_megatron_optimizer
from megatron_muon.exchange import Traffic, observed
from megatron_muon.testing import (ddp_gpt, fsdp_gpt, init_parallel_state, lm_loss,
                                   optimizer_config)

STEPS = 2  # the second step is counted: the first may create state
ONE_EXCHANGE = 1 << 30  # a budget that holds every matrix here


def _step_collectives(model, optimizer, rank) -> Counter:
    """The collectives (by c10d op) of the last of STEPS steps, gradients synced before it."""
    for step in range(STEPS):
        optimizer.zero_grad()
        lm_loss(model, step, rank).backward()
        model.finish_grad_sync()
        with observed(Traffic()) as traffic:
            assert optimizer.step()[0]
    return traffic.by_name


def _exchange_all_to_alls(optimizer) -> int:
    """One all-to-all per direction of every exchange that moves rows, as the plans say."""
    return sum(route.moves for muon in optimizer.muon_optimizers for plan in muon.plans
               for routes in plan.routes for route in (routes.gather, routes.scatter))


def _ours_is_adams_plus_the_exchange(rank, world_size, strategy, num_experts):
    init_parallel_state(expert_parallel=2 if num_experts else 1)
    counted = {}
    for optimizer_name in ("muon", "adam"):
        model = fsdp_gpt(strategy=strategy, num_experts=num_experts)
        optimizer = get_megatron_optimizer(optimizer_config(optimizer_name), [model])
        counted[optimizer_name] = _step_collectives(model, optimizer, rank)
        if optimizer_name == "muon":
            all_to_alls = _exchange_all_to_alls(optimizer)
    assert all_to_alls > 0  # the matrices are cut across ranks: rows move
    assert counted["muon"] == counted["adam"] + Counter(alltoall_base_=all_to_alls), strategy
    assert counted["adam"]["allreduce_"] == 1  # the grad norm, which also decides a skip
    if strategy == "optim":
        model = fsdp_gpt(strategy=strategy)
        ours = sum(_step_collectives(model, get_megatron_optimizer(
            optimizer_config(), [model], muon_max_exchange_bytes=ONE_EXCHANGE), rank).values())
        model = ddp_gpt(layer_wise=True)
        # megatron-core refuses its layer-wise optimizer in fp32; bf16 set on a fp32 model keeps
        # its params and arithmetic fp32 (docs/reliability.md, "Refused configurations").
        layer_wise = get_megatron_optimizer(optimizer_config(
            use_distributed_optimizer=False, use_layer_wise_distributed_optimizer=True,
            bf16=True), [model])
        layer_wise_count = sum(_step_collectives(model, layer_wise, rank).values())
        assert ours <= layer_wise_count, (ours, layer_wise_count)


@pytest.mark.parametrize("world_size, strategy, num_experts", [
    (2, "optim", None), (2, "optim_grads_params", None), (4, "optim", None),
    pytest.param(4, "optim_grads_params", 4, marks=pytest.mark.slow)])
def test_the_step_issues_adams_collectives_plus_the_exchanges_all_to_alls(
        distributed, world_size, strategy, num_experts):
    distributed(_ours_is_adams_plus_the_exchange, world_size, strategy, num_experts)
