"""One exchange group's plan from shapes alone: owners, batches and exchanges together."""

from dataclasses import dataclass
from typing import Sequence

from .budget import (MAX_EXCHANGE_BYTES, batch_matrices, exchange_batches, exchange_budget,
                     per_exchange_bytes)
from .layouts import Matrix
from .owners import BYTE_SLACK, StepCost, choose_owners, choose_owners_by_time


@dataclass(frozen=True)
class OwnerPlan:
    """One exchange group's owner step, from shapes alone: each matrix's owner, the batches of
    same-shape matrices orthogonalized together, and the exchanges (lists of consecutive
    batches) that carry them, one collective per direction each."""
    owners: list[int]
    batches: list[list[int]]
    exchanges: list[list[list[int]]]


def owner_plan(matrices: Sequence[Matrix], element_bytes: int, byte_slack: float | None = None,
               max_exchange_bytes: int | None = MAX_EXCHANGE_BYTES,
               cost: StepCost | None = None) -> OwnerPlan:
    """The owner plan ZeROTensorParallelMuon carries out, and the scale model estimates: owners
    by estimated time where `cost` is given (choose_owners_by_time; `byte_slack` caps the extra
    bytes, None: no cap), else fewest bytes first (choose_owners, balancing within `byte_slack`,
    by default BYTE_SLACK). Batches and exchanges keep the step's working memory within
    `max_exchange_bytes` on every rank (working_memory; two exchanges in flight, each within
    half; None: affordable_bytes), except where one matrix alone needs more: it goes alone on
    its owner (exchange_batches)."""
    share = per_exchange_bytes(exchange_budget(matrices, element_bytes, max_exchange_bytes))
    batches = batch_matrices(matrices, share, element_bytes)
    if cost is None:
        owners = choose_owners(matrices, element_bytes,
                               BYTE_SLACK if byte_slack is None else byte_slack)
    else:
        owners = choose_owners_by_time(matrices, batches, element_bytes, cost, byte_slack)
    return OwnerPlan(owners, batches,
                     exchange_batches(matrices, batches, owners, element_bytes, share))
