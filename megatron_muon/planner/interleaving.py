"""Two Muon parts of one chain planned and stepped together: megatron_muon's factory builds a
dense part (its matrices over dp_cp) and an expert part (over expert data parallelism), which
Megatron's chain steps one after the other, so each part's step lasts as long as its busiest
rank and a rank owning a large dense matrix may also own its full share of experts. Planned
together, the expert part's owners count each rank's load in the dense part (plan.rank_loads as
owned_batches' `base`), and the expert part's step runs both parts' exchanges in rounds
(exchange.exchange_rounds): round k is both parts' k-th exchange, all gathers issued, then both
parts' Newton-Schulz, then both scatters awaited, so a rank waits for no one between its dense
and its expert matrices. Only where Newton-Schulz runs changes: every update is the one the
parts compute apart (docs/design.md, "Dense and experts together").

The dense part is packed as apart, the expert part beside its working memory (plan.packed_beside),
its headroom covering both (share_headroom). Where a rank still cannot hold both (a budget the
user set), no rank interleaves and the expert part is planned apart again: one flag over the
world at construction decides, so that every rank issues its collectives in one order."""

from collections.abc import Callable, Iterator
from functools import partial
from typing import Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist

from ..distribution.exchange import exchange_rounds, run_overlapped
from ..distribution.team_groups import create_team_groups
from ..plan import rank_loads, working_memory
from .group_plan import Draft, GroupPlan
from .group_planner import GroupPlanner
from .planned_muon import PlannedMuon


class HeldOnHost(Protocol):
    """core.state_offload.HostState, as interleaving reads it: the params whose state it holds."""

    params: set


@runtime_checkable
class MuonPart(PlannedMuon, Protocol):
    """One Muon part of a chain (core.zero_muon.ZeROTensorParallelMuon), as its planning and
    interleaved step read it: its planner and plans, the offloaded state's params, its owner
    exchanges and the update rows they carry, and the Interleaved it steps with (None: apart)."""

    planner: GroupPlanner
    plans: list[GroupPlan]
    host_state: HeldOnHost
    interleaved: "Interleaved | None"

    def owner_exchanges(self, plan: GroupPlan, local_rows: Callable[[int], torch.Tensor],
                        apply: Callable[[GroupPlan, int, torch.Tensor], None]
                        ) -> Iterator[Iterator[None]]: ...

    def update_rows(self, plan: GroupPlan, i: int) -> torch.Tensor: ...

    def apply_update(self, plan: GroupPlan, i: int, rows: torch.Tensor) -> None: ...


class Interleaved:
    """`first`'s and `second`'s owner steps as one, run in `second`'s step (Megatron's chain
    steps `first` before it; `first`'s step leaves its exchanges to it)."""

    def __init__(self, first: MuonPart, second: MuonPart) -> None:
        self.parts = (first, second)

    def step(self, muon: MuonPart) -> None:
        if muon is self.parts[0]:
            return
        run_overlapped(exchange_rounds([
            part.owner_exchanges(plan, partial(part.update_rows, plan), part.apply_update)
            for part in self.parts for plan in part.plans]))


def share_headroom(muons: Sequence[MuonPart], interleaved: bool = False,
                   need: int | None = None) -> None:
    """The parts' exchanges packed with one budget per rank, in order, at construction, before
    any state: its saving over all parts plus the headroom (GroupPlanner.packed), the most a
    rank's batches alone need beyond its saving in any one part (`need`: this rank's most, where
    given). `interleaved` (two parts): the first packed so, as apart (the dense part: its
    all-to-alls, over every rank, are the dearest in latency), the second beside the first's
    working memory on each rank (GroupPlanner.reserved), its headroom covering that and its own
    batches alone: a rank holds both within its budget."""
    if len(muons) < 2:
        return
    saving = sum(muon.planner.saving() for muon in muons)
    need = max(muon.planner.need() for muon in muons) if need is None else need
    headroom = 0
    for k, muon in enumerate(muons):
        if interleaved and k == 1:
            muon.planner.reserved = max(_working_here(plan) for plan in muons[0].plans)
            need = muon.planner.reserved + muon.planner.need()
        muon.plans = muon.planner.packed(saving, need, headroom)
        headroom = muon.planner.headroom


def interleave(first: MuonPart, second: MuonPart) -> bool:
    """Plan `second` beside `first` and step them together (Interleaved), else plan them apart
    (share_headroom); whether they interleave. Owner mode, one exchange group each, no state
    offloaded (its streaming counts each part's exchanges alone), and every rank holds both
    parts' exchanges within its budget (by default so: the headroom covers them; under
    --muon-max-exchange-bytes where both fit it). Every rank calls it, at construction."""
    if not (_can_interleave(first) and _can_interleave(second)):
        share_headroom([first, second])
        return False
    apart = second.planner.drafts
    need_apart = max(first.planner.need(), second.planner.need())  # the first packed as apart
    here = _load_here(first)
    second.planner.drafts = [draft.beside(_gathered(here, draft)) for draft in apart]
    if second.max_team_size > 1:
        create_team_groups(second.planner.drafts)
    share_headroom([first, second], interleaved=True, need=need_apart)
    fits = torch.tensor([all(plan.fits_beside for plan in second.plans)],
                        dtype=torch.int32, device=second.device())
    dist.all_reduce(fits, op=dist.ReduceOp.MIN)
    if fits.item():
        first.interleaved = second.interleaved = Interleaved(first, second)
        return True
    second.planner.drafts, second.planner.reserved = apart, None
    share_headroom([first, second])
    return False


def _can_interleave(muon: MuonPart) -> bool:
    return (muon.dist_mode == "owner" and len(muon.plans) == 1
            and not muon.host_state.params)


def _load_here(muon: MuonPart) -> float:
    """This rank's load over `muon`'s groups, as their owners weighed it (plan.rank_loads)."""
    return sum(rank_loads(draft.matrices, draft.owned.owners, draft.owned.batches,
                          draft.params[0].element_size(), draft.cost)[draft.rank]
               for draft in muon.planner.drafts)


def _gathered(load: float, draft: Draft) -> list[float]:
    """Every rank of `draft`'s group's `load` (seconds where its owners are chosen by time,
    else FLOPs), exactly (float64), one collective."""
    device = draft.params[0].to_local().device
    table = torch.empty(draft.group.size(), dtype=torch.float64, device=device)
    dist.all_gather_into_tensor(table, torch.tensor([load], dtype=torch.float64, device=device),
                                group=draft.group)
    return table.tolist()


def _working_here(plan: GroupPlan) -> int:
    """This rank's working memory in `plan`'s exchanges (plan.working_memory)."""
    return working_memory(plan.matrices, plan.owners, [route.batches for route in plan.routes],
                          plan.param_of(0).element_size())[plan.rank]
