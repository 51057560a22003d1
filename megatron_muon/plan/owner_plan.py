"""One exchange group's plan from shapes alone: owners, batches and exchanges together."""

from dataclasses import dataclass
from typing import Sequence

from .budget import (MAX_EXCHANGE_BYTES, batch_bytes, batch_matrices, batches_ahead,
                     exchange_batches, rank_budgets, state_saved, step_headroom, working_memory)
from .layouts import Matrix, Nodes
from .owners import BYTE_SLACK, StepCost, choose_owners, choose_owners_by_time
from .traffic import gather_moves, scatter_moves


@dataclass(frozen=True)
class OwnedBatches:
    """One exchange group's owners, and its batches of same-shape matrices orthogonalized
    together: what a plan is packed from."""
    owners: list[int]
    batches: list[list[int]]


@dataclass(frozen=True)
class OwnerPlan:
    """One exchange group's owner step, from shapes alone: each matrix's owner, the batches of
    same-shape matrices orthogonalized together, the exchanges (lists of batches) that carry
    them, one collective per direction each, and each rank's working-memory budget; the
    matrices in `early` gather inside backward, in the first `ahead` exchanges, beside any
    gathered at the step (packed_plan)."""
    owners: list[int]
    batches: list[list[int]]
    exchanges: list[list[list[int]]]
    budgets: list[int]
    ahead: int = 0
    early: frozenset[int] = frozenset()


def owned_batches(matrices: Sequence[Matrix], element_bytes: int, byte_slack: float | None = None,
                  max_exchange_bytes: int | None = MAX_EXCHANGE_BYTES,
                  cost: StepCost | None = None, base: Sequence[float] | None = None,
                  nodes: Nodes | None = None) -> OwnedBatches:
    """Batches within batch_bytes, and owners by estimated time where `cost` is given
    (choose_owners_by_time; `byte_slack` caps the extra bytes, None: no cap), else fewest bytes
    first (choose_owners, balancing within `byte_slack`, by default BYTE_SLACK); each rank's load
    starting at `base` (its seconds with `cost`, else its FLOPs of one iteration, in the groups
    planned before, run interleaved with these; None: 0); teams on `nodes` (owners.TeamRule)."""
    batches = batch_matrices(matrices, batch_bytes(matrices, element_bytes, max_exchange_bytes),
                             element_bytes)
    if cost is None:
        owners = choose_owners(matrices, element_bytes,
                               BYTE_SLACK if byte_slack is None else byte_slack, base, nodes)
    else:
        owners = choose_owners_by_time(matrices, batches, element_bytes, cost, byte_slack, base,
                                       nodes)
    return OwnedBatches(owners, batches)


def packed_plan(matrices: Sequence[Matrix], owned: OwnedBatches, element_bytes: int,
                max_exchange_bytes: int | None, headroom: int | None,
                saved: Sequence[int] | None = None,
                reserved: Sequence[int] | None = None, ahead: bool = False) -> OwnerPlan:
    """`owned` packed into exchanges within each rank's budget (rank_budgets; `saved`: each
    rank's saving over every group it steps, None: this group's; `reserved`: what it holds
    beside, of another group's exchanges interleaved with these). `ahead` (the gather inside
    backward): the batches that may gather ahead (batches_ahead, within this group's saving),
    taken in the order their gradients become final (`final_first`), packed first in that
    order, the rest after them (_packed): either joining their exchanges where they fit (an
    exchange's batches gathered ahead send their rows inside backward, its others at the step,
    and its scatter carries all), or apart, in exchanges of their own (an exchange wholly
    gathered ahead issues no gather at the step). Each way, as many of them, in that order, as
    leave the step no more collectives than it has without any ahead (step_collectives): where
    carrying them twice as wide adds an exchange at the step, its round costs what their gather
    saved, and fewer go ahead, or none. Of the two, the one whose step issues fewer
    collectives, then the one gathering more elements ahead (`_better`)."""
    plain = _packed(matrices, owned, element_bytes, max_exchange_bytes, headroom, saved,
                    reserved, [], apart=False)
    if not ahead:
        return plain
    candidates = final_first(owned.batches)
    chosen = batches_ahead(matrices, owned.owners, candidates, element_bytes,
                           state_saved(matrices, element_bytes))
    early = [batch for batch, fits in zip(candidates, chosen) if fits]
    best, most = plain, step_collectives(matrices, plain.owners, plain.exchanges)
    for apart in (True, False):
        found, low, high = plain, 1, len(early)
        while low <= high:  # the longest prefix found that keeps the step's collectives
            middle = (low + high) // 2
            plan = _packed(matrices, owned, element_bytes, max_exchange_bytes, headroom, saved,
                           reserved, early[:middle], apart)
            if step_collectives(matrices, plan.owners, plan.exchanges, plan.early) <= most:
                found, low = plan, middle + 1
            else:
                high = middle - 1
        best = found if _better(found, best, matrices) else best
    return best


def _better(plan: OwnerPlan, than: OwnerPlan, matrices: Sequence[Matrix]) -> bool:
    """Whether `plan`'s step issues fewer collectives than `than`'s, or as many and `plan`
    gathers more elements ahead."""
    def rank(p: OwnerPlan) -> tuple[int, int]:
        return (step_collectives(matrices, p.owners, p.exchanges, p.early),
                -sum(matrices[i].layout.num_rows * matrices[i].cols for i in p.early))
    return rank(plan) < rank(than)


def step_collectives(matrices: Sequence[Matrix], owners: Sequence[int],
                     exchanges: Sequence[Sequence[Sequence[int]]],
                     early: frozenset[int] = frozenset()) -> int:
    """The all-to-alls a plan's step issues, as exchange.owner_exchange issues them: each
    exchange's scatter where it moves rows, and its gather where the matrices gathering at the
    step, not inside backward (`early`), move rows."""
    count = 0
    for exchange in exchanges:
        held = [i for batch in exchange for i in batch]
        count += scatter_moves(matrices, owners, held)
        count += gather_moves(matrices, owners, [i for i in held if i not in early])
    return count


def _packed(matrices: Sequence[Matrix], owned: OwnedBatches, element_bytes: int,
            max_exchange_bytes: int | None, headroom: int | None, saved: Sequence[int] | None,
            reserved: Sequence[int] | None, early: list[list[int]], apart: bool) -> OwnerPlan:
    """packed_plan with `early` (batches, in the order their gradients become final) packed
    first, the rest after them, first fit (`apart`: the rest joining none of the exchanges
    `early` opens), counted as they travel (Matrix.carrying_momentum: twice the update's columns
    gathered and assembled); the budgets are of the batches in that order (what each batch needs
    alone depends on the starts after it). The exchanges `early` opens come first: the first
    `ahead`."""
    taken = set(map(id, early))
    late = [batch for batch in owned.batches if id(batch) not in taken]
    carried = frozenset(i for batch in early for i in batch)
    counted = [m.carrying_momentum() if i in carried else m for i, m in enumerate(matrices)]
    budgets = rank_budgets(counted, owned.owners, early + late, element_bytes,
                           max_exchange_bytes, headroom, saved, reserved)
    exchanges = exchange_batches(counted, early + late, owned.owners, element_bytes, budgets,
                                 len(early) if apart else None)
    ahead = sum(any(i in carried for batch in exchange for i in batch) for exchange in exchanges)
    return OwnerPlan(owned.owners, owned.batches, exchanges, budgets, ahead, carried)


def final_first(batches: Sequence[Sequence[int]]) -> list[Sequence[int]]:
    """`batches` in the order their gradients become final in backward, which reduces the
    model's last params first (Megatron-FSDP's buckets in reverse): a batch is final once its
    matrix first in the model's order (the matrices' order, the params') is."""
    return sorted(batches, key=lambda batch: -min(batch))


def packed_beside(matrices: Sequence[Matrix], owned: OwnedBatches, element_bytes: int,
                  max_exchange_bytes: int | None, headroom: int | None,
                  saved: Sequence[int] | None, reserved: Sequence[int],
                  ahead: bool = False) -> tuple[OwnerPlan, list[bool]]:
    """`owned` packed to run interleaved with another group's exchanges, of which each rank holds
    up to `reserved` (its working_memory there): within each rank's budget less that
    (packed_plan, with `ahead`); and for each rank whether both fit the budget it has without
    them (what the groups one after the other are held to)."""
    plan = packed_plan(matrices, owned, element_bytes, max_exchange_bytes, headroom, saved,
                       reserved, ahead)
    apart = rank_budgets(matrices, owned.owners, owned.batches, element_bytes,
                         max_exchange_bytes, headroom, saved)
    held = working_memory(matrices, owned.owners, plan.exchanges, element_bytes)
    return plan, [mine + beside <= budget for mine, beside, budget in zip(held, reserved, apart)]


def owner_plan(matrices: Sequence[Matrix], element_bytes: int, byte_slack: float | None = None,
               max_exchange_bytes: int | None = MAX_EXCHANGE_BYTES,
               cost: StepCost | None = None) -> OwnerPlan:
    """The owner plan ZeROTensorParallelMuon carries out, and the scale model estimates, for one
    group alone (owned_batches, then packed_plan with its own step_headroom): the step's working
    memory stays within each rank's budget (working_memory; two exchanges in flight)."""
    owned = owned_batches(matrices, element_bytes, byte_slack, max_exchange_bytes, cost)
    return packed_plan(matrices, owned, element_bytes, max_exchange_bytes,
                       step_headroom(matrices, owned.owners, owned.batches, element_bytes))
