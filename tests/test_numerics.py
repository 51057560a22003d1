"""Phase 2: ZeROTensorParallelMuon on real Megatron-FSDP equals single-device Muon bit for bit."""

import itertools
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from fsdp_models import (MUON_KWARGS, QKV_SPLIT, STRATEGIES, batch, full_tensor, fully_shard,
                         make_models, muon_param_groups, reference_optimizers, split_params)
from megatron_muon import ZeROTensorParallelMuon
from megatron_muon.exchange import Traffic, observed

STEPS = 6


def _train_and_compare(rank, world_size):
    qkv_boundaries = set()
    for strategy in STRATEGIES:
        for dist_mode in ("owner", "allgather"):
            for unit_modules in (True, False):
                qkv_boundaries |= _compare(rank, world_size, strategy, dist_mode, unit_modules)
    # The QKV split was exercised with FSDP shard boundaries inside a head group, and on them.
    if world_size == 4:
        group_rows = sum(QKV_SPLIT)
        assert any(b % group_rows for b in qkv_boundaries), qkv_boundaries
        assert any(b % group_rows == 0 for b in qkv_boundaries), qkv_boundaries


def _compare(rank, world_size, strategy, dist_mode, unit_modules, outer=None):
    """Megatron-FSDP buckets per Linear (unit_modules: every matrix crosses shard boundaries) or
    the whole model as one unit (most matrices sit whole on one rank); HSDP with `outer`."""
    ref, fsdp = make_models(strategy, world_size, unit_modules, outer)
    ref_opts = reference_optimizers(ref)
    ref_params = dict(ref.named_parameters())
    matrices, vectors = split_params(fsdp)
    case = f"{strategy} outer={outer} {dist_mode} units={unit_modules} W={world_size}"
    opts = [ZeROTensorParallelMuon(muon_param_groups(matrices), dist_mode=dist_mode, **MUON_KWARGS),
            torch.optim.Adam(vectors, lr=0.01, foreach=False)]
    names = {id(p): n for n, p in fsdp.named_parameters()}

    for step in range(STEPS):
        x, y = batch(step, rank)
        torch.nn.functional.mse_loss(fsdp(x), y).backward()
        if not fsdp.model_auto_sync:
            fsdp.finish_grad_sync()
        # The reference sees exactly the gradient the sharded run reduced.
        for p in matrices + vectors:
            name = names[id(p)].removeprefix("module.")
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            ref_params[name].grad = full_tensor(grad, p)
        for opt in ref_opts + opts:
            opt.step()
        fsdp.install_optimized_model_weights()
        fsdp.zero_grad_buffer()
        for opt in ref_opts + opts:
            opt.zero_grad()

        worst = max((full_tensor(p, p) - ref_params[names[id(p)].removeprefix("module.")]).abs().max().item()
                    for p in matrices + vectors)
        assert worst == 0, f"{case} step {step}: max |diff| {worst}"

    for p in matrices:
        momentum = opts[0].state[p]["momentum_buffer"]
        assert isinstance(momentum, DTensor) and momentum.placements == p.placements
        assert momentum.to_local().shape == p.to_local().shape
    if rank == 0:
        print(f"{case}: max |diff| 0 after {STEPS} steps")
    return _inner_boundaries(fsdp.module.qkv.weight)


def _inner_boundaries(p) -> set[int]:
    """Rows at which the shards of a row-sharded matrix meet (none for replicated ones)."""
    if not any(placement == Shard(0) for placement in p.placements):
        return set()
    held = [None] * dist.get_world_size()
    dist.all_gather_object(held, p.to_local().shape[0])
    return {b for b in itertools.accumulate(held) if 0 < b < p.shape[0]}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_matches_single_device_muon_for_every_strategy(distributed, world_size):
    distributed(_train_and_compare, world_size)


# HSDP at W=4: 2 replicas x 2 shards. Megatron-FSDP shards the outer dim only under ZeRO-3.
HSDP_CASES = [("no_shard", "optim"), ("no_shard", "optim_grads"), ("no_shard", "optim_grads_params"),
              ("optim", "optim_grads_params")]


def _hsdp_train_and_compare(rank, world_size):
    for outer, strategy in HSDP_CASES:
        for dist_mode in ("owner", "allgather"):
            _compare(rank, world_size, strategy, dist_mode, unit_modules=True, outer=outer)


def test_hsdp_matches_single_device_muon(distributed):
    distributed(_hsdp_train_and_compare, 4)


def _count_newton_schulz(rank, world_size):
    import megatron.core.optimizer.emerging_optimizers as core_muon

    calls = []
    newton_schulz_tp = core_muon.newton_schulz_tp

    def counted(x, *args, **kwargs):
        calls.append(x.shape[0] if x.dim() == 3 else 1)
        return newton_schulz_tp(x, *args, **kwargs)

    with mock.patch.object(core_muon, "newton_schulz_tp", counted):
        _count_each_case(rank, world_size, calls)


def _count_each_case(rank, world_size, calls):
    cases = [(strategy, outer, "owner", 1) for strategy, outer in
             (("optim_grads_params", None), ("no_shard", None), ("optim_grads_params", "no_shard"),
              ("optim_grads_params", "optim"))]
    for strategy, outer, dist_mode, expected_repeats in cases + [
            ("optim_grads_params", None, "allgather", world_size)]:
        _, fsdp = make_models(strategy, world_size, outer=outer)
        matrices, _ = split_params(fsdp)
        opt = ZeROTensorParallelMuon(matrices, dist_mode=dist_mode, **MUON_KWARGS)
        for step in range(2):
            x, y = batch(step, rank)
            torch.nn.functional.mse_loss(fsdp(x), y).backward()
            if not fsdp.model_auto_sync:
                fsdp.finish_grad_sync()
            calls.clear()  # each step's own: the batching choice ran at construction
            opt.step()
            fsdp.zero_grad_buffer()
            # The QKV matrix is orthogonalized as three blocks.
            per_step = torch.tensor(sum(calls))
            dist.all_reduce(per_step)
            assert per_step.item() == expected_repeats * (len(matrices) + 2), (
                strategy, outer, dist_mode, step, per_step)


def test_owner_mode_runs_each_newton_schulz_once_across_ranks_and_replicas(distributed):
    distributed(_count_newton_schulz, 4)


def _count_traffic(rank, world_size):
    for unit_modules in (True, False):
        _, fsdp = make_models("optim_grads_params", world_size, unit_modules)
        matrices, _ = split_params(fsdp)
        opt = ZeROTensorParallelMuon(matrices, byte_slack=0.0, **MUON_KWARGS)
        # The bound, from megatron_fsdp's own chunk metadata: every row not on the rank holding
        # most of its matrix travels to that rank and back.
        expected = 0
        for p in matrices:
            held = [None] * world_size
            dist.all_gather_object(held, p.to_local().shape[0])
            expected += 2 * (p.shape[0] - max(held)) * p.shape[1] * p.element_size()
        x, y = batch(0, rank)
        torch.nn.functional.mse_loss(fsdp(x), y).backward()
        fsdp.finish_grad_sync()
        with observed(Traffic()) as traffic:
            opt.step()
        received = torch.tensor(traffic.received_bytes)
        dist.all_reduce(received)
        assert received.item() == expected, (unit_modules, received.item(), expected)
        exchanges = sum(len(plan.routes) for plan in opt.plans)
        assert traffic.by_name.keys() <= {"alltoall_base_"}
        assert traffic.collectives <= 2 * exchanges
        whole_on_owner = [m.layout.held(o) == m.layout.num_rows
                          for plan in opt.plans for m, o in zip(plan.matrices, plan.owners)]
        if not unit_modules:  # one bucket: some matrices sit whole on their owner and move nothing
            assert any(whole_on_owner), whole_on_owner


def test_owner_mode_moves_exactly_the_layout_minimum(distributed):
    distributed(_count_traffic, 4)


def _batching_under_bf16_matmuls(rank, world_size):
    """With `medium` (bf16 matmuls, Megatron's default) an owner's same-shape matrices go through
    one batched Newton-Schulz each batch, with no per-shape exactness check (docs/design.md,
    "Library")."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(*[torch.nn.Linear(16, 16, bias=False) for _ in range(4)])
    fsdp = fully_shard(module, "optim_grads_params", world_size, [torch.nn.Linear])
    opt = ZeROTensorParallelMuon(list(fsdp.parameters()), **{**MUON_KWARGS, "fp32_matmul_prec": "medium"})
    matrices_per_call = []
    orthogonalize = opt.orthogonalize

    def counted(p, grad, **kwargs):
        matrices_per_call.append(grad.shape[0] if grad.dim() == 3 else 1)
        return orthogonalize(p, grad, **kwargs)

    opt.orthogonalize = counted
    fsdp(torch.randn(6, 16)).square().mean().backward()
    fsdp.finish_grad_sync()
    opt.step()
    owned_batches = sum(1 for plan in opt.plans for routes in plan.routes
                        for owned in routes.owned_batches if owned)
    assert len(matrices_per_call) == owned_batches, (matrices_per_call, owned_batches)
    assert all(opt.batched_newton_schulz.values())  # bf16: batched, no bit-identity probe
    total = torch.tensor([sum(matrices_per_call), max(matrices_per_call, default=0)])
    dist.all_reduce(total[:1])
    dist.all_reduce(total[1:], op=dist.ReduceOp.MAX)
    assert total.tolist()[0] == 4 and total.tolist()[1] > 1, total


def test_bf16_newton_schulz_batches_same_shape_matrices(distributed):
    distributed(_batching_under_bf16_matmuls, 2)
