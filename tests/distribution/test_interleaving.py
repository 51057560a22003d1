"""The factory's dense and expert Muon parts planned and stepped together
(planner.interleaving): the expert part's owners count each rank's dense load, and its step
runs both parts' exchanges in rounds, so no scatter is awaited before a rank has computed both
parts' matrices; where memory does not allow it, the parts run apart as before. The updates are
megatron-core's either way (test_factory's reference cases run interleaved: asserted there)."""

import torch
import torch.distributed as dist

from megatron_muon import get_megatron_optimizer
from megatron_muon.observe.collectives import Observer, observed
from megatron_muon.estimate.step_time import (APPLIED, GATHER, NEWTON_SCHULZ, SCATTER,
                                              exchange_order)
from megatron_muon.planner.interleaving import MuonPart
from megatron_muon.planner.planned_muon import PlannedMuon
from megatron_muon.tools.testing import fsdp_gpt, init_parallel_state, lm_loss, optimizer_config

ONE_EXCHANGE = 1 << 30  # a budget that holds every matrix of a part in one exchange


def _step_events(model, optimizer, rank, together: bool) -> list:
    """What one step does, in order: all-to-alls (by group size), and each part's Newton-Schulz
    calls and updates applied (by part, repeats merged). Unmerged, they are what the scale
    model charges in its order (step_time.exchange_order, parts `together` or apart)."""
    events = []
    record = events.append

    class Order(Observer):
        def collective(self, call):
            if call.name == "alltoall_base_":
                events.append(("all-to-all", call.group_size))

    dense, expert = optimizer.muon_optimizers
    for part, name in ((dense, "dense"), (expert, "expert")):
        def orthogonalize(*args, owned=part.orthogonalize_owned, name=name):
            record(("computed", name))
            return owned(*args)

        def apply(plan, i, rows, apply=part.apply_update, name=name):
            record(("applied", name))
            apply(plan, i, rows)
        part.orthogonalize_owned, part.apply_update = orthogonalize, apply
    optimizer.zero_grad()
    lm_loss(model, 0, rank).backward()
    model.finish_grad_sync()
    with observed(Order()):
        assert optimizer.step()[0]
    assert events == _in_the_scale_models_order(optimizer, together)
    return [event for k, event in enumerate(events) if k == 0 or events[k - 1] != event]


def _in_the_scale_models_order(optimizer, together: bool) -> list:
    """The events _step_events records, as the scale model orders this rank's exchanges
    (exchange_order) and each plan's routes say what they hold: a gather's and a scatter's
    all-to-all where its route moves rows, a Newton-Schulz call for each batch this rank owns
    matrices of, and an update applied for each matrix."""
    parts = [(part.plans[0].routes, name, dist.get_world_size(part.plans[0].group))
             for part, name in zip(optimizer.muon_optimizers, ("dense", "expert"))]
    events = []
    for stage, s, k in exchange_order([len(routes) for routes, _, _ in parts], together):
        routes, name, size = parts[s]
        exchange = routes[k]
        events += {GATHER: [("all-to-all", size)] * exchange.gather.moves,
                   NEWTON_SCHULZ: [("computed", name)] * sum(map(bool, exchange.owned_batches)),
                   SCATTER: [("all-to-all", size)] * exchange.scatter.moves,
                   APPLIED: [("applied", name)] * len(exchange.batch)}[stage]
    return events


def _parts_step_in_rounds(rank, world_size):
    init_parallel_state(expert_parallel=2)
    model = fsdp_gpt(num_experts=4)
    # Owners by bytes: the plan, and so the events, the same in every run.
    optimizer = get_megatron_optimizer(optimizer_config(), [model], muon_owner_choice="bytes",
                                       muon_max_exchange_bytes=ONE_EXCHANGE)
    dense, expert = optimizer.muon_optimizers
    # What the planner and interleaving read of the optimizer, as their Protocols name it.
    assert all(isinstance(part, MuonPart) and isinstance(part, PlannedMuon)
               for part in (dense, expert))
    assert dense.interleaved is expert.interleaved is not None
    assert expert.planner.reserved is not None  # packed beside the dense part's exchanges
    assert [len(plan.routes) for plan in dense.plans + expert.plans] == [1, 1]
    # One exchange each, as one round: the dense part's gather (over dp_cp, 4 ranks) first, and
    # both parts' Newton-Schulz before either part's update is applied (apart, the dense part's
    # updates come before the expert part's Newton-Schulz).
    events = _step_events(model, optimizer, rank, together=True)
    computed = [k for k, (kind, _) in enumerate(events) if kind == "computed"]
    applied = [k for k, (kind, _) in enumerate(events) if kind == "applied"]
    assert events[0] == ("all-to-all", 4), events
    assert max(computed, default=-1) < min(applied), events
    assert [events[k] for k in applied] == [("applied", "dense"), ("applied", "expert")], events
    owners = torch.tensor([float(bool(computed))])
    dist.all_reduce(owners)
    assert owners.item() > 0  # some rank computes: the check above is not empty


def _parts_step_apart_where_memory_forbids(rank, world_size):
    init_parallel_state(expert_parallel=2)
    model = fsdp_gpt(num_experts=4)
    # A budget each batch alone exceeds: a rank cannot hold both parts' exchanges at once.
    optimizer = get_megatron_optimizer(optimizer_config(), [model], muon_owner_choice="bytes",
                                       muon_max_exchange_bytes=1)
    dense, expert = optimizer.muon_optimizers
    assert dense.interleaved is None and expert.interleaved is None
    assert expert.planner.reserved is None
    events = _step_events(model, optimizer, rank, together=False)
    parts = [name for kind, name in events if kind != "all-to-all"]
    assert parts == sorted(parts) and "dense" in parts, events  # the dense part's work first
    dense_calls, expert_calls = ([k for k, event in enumerate(events) if event == ("all-to-all", n)]
                                 for n in (4, 2))
    assert dense_calls and max(dense_calls) < min(expert_calls, default=len(events))


def test_the_dense_and_expert_parts_step_in_rounds(distributed):
    distributed(_parts_step_in_rounds, 4)


def test_the_parts_step_apart_where_a_rank_cannot_hold_both(distributed):
    distributed(_parts_step_apart_where_memory_forbids, 4)
