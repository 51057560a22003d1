"""One exchange group's plan from shapes alone: owners, batches and exchanges together."""

from dataclasses import dataclass
from typing import Sequence

from .budget import (MAX_EXCHANGE_BYTES, batch_bytes, batch_matrices, exchange_batches,
                     rank_budgets, step_headroom)
from .layouts import Matrix
from .owners import BYTE_SLACK, StepCost, choose_owners, choose_owners_by_time


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
    them, one collective per direction each, and each rank's working-memory budget."""
    owners: list[int]
    batches: list[list[int]]
    exchanges: list[list[list[int]]]
    budgets: list[int]


def owned_batches(matrices: Sequence[Matrix], element_bytes: int, byte_slack: float | None = None,
                  max_exchange_bytes: int | None = MAX_EXCHANGE_BYTES,
                  cost: StepCost | None = None) -> OwnedBatches:
    """Batches within batch_bytes, and owners by estimated time where `cost` is given
    (choose_owners_by_time; `byte_slack` caps the extra bytes, None: no cap), else fewest bytes
    first (choose_owners, balancing within `byte_slack`, by default BYTE_SLACK)."""
    batches = batch_matrices(matrices, batch_bytes(matrices, element_bytes, max_exchange_bytes),
                             element_bytes)
    if cost is None:
        owners = choose_owners(matrices, element_bytes,
                               BYTE_SLACK if byte_slack is None else byte_slack)
    else:
        owners = choose_owners_by_time(matrices, batches, element_bytes, cost, byte_slack)
    return OwnedBatches(owners, batches)


def packed_plan(matrices: Sequence[Matrix], owned: OwnedBatches, element_bytes: int,
                max_exchange_bytes: int | None, headroom: int | None,
                saved: Sequence[int] | None = None) -> OwnerPlan:
    """`owned` packed into exchanges within each rank's budget (rank_budgets; `saved`: each
    rank's saving over every group it steps, None: this group's)."""
    budgets = rank_budgets(matrices, owned.owners, owned.batches, element_bytes,
                           max_exchange_bytes, headroom, saved)
    return OwnerPlan(owned.owners, owned.batches,
                     exchange_batches(matrices, owned.batches, owned.owners, element_bytes,
                                      budgets), budgets)


def owner_plan(matrices: Sequence[Matrix], element_bytes: int, byte_slack: float | None = None,
               max_exchange_bytes: int | None = MAX_EXCHANGE_BYTES,
               cost: StepCost | None = None) -> OwnerPlan:
    """The owner plan ZeROTensorParallelMuon carries out, and the scale model estimates, for one
    group alone (owned_batches, then packed_plan with its own step_headroom): the step's working
    memory stays within each rank's budget (working_memory; two exchanges in flight)."""
    owned = owned_batches(matrices, element_bytes, byte_slack, max_exchange_bytes, cost)
    return packed_plan(matrices, owned, element_bytes, max_exchange_bytes,
                       step_headroom(matrices, owned.owners, owned.batches, element_bytes))
