"""Muon's state in host memory between steps (--optimizer-cpu-offload): which matrices' state is
offloaded (Megatron's --optimizer-offload-fraction), what a rank copies each step, and the most
of it the device holds at once during the step. The owner step visits its exchanges in order,
two in flight (budget.IN_FLIGHT): an exchange's state comes to the device while the one before
it computes and goes back when it ends, so the device holds at most two exchanges' worth."""

from dataclasses import dataclass
from typing import Sequence

from .budget import IN_FLIGHT
from .layouts import Matrix


def offloaded(sizes: Sequence[int], fraction: float) -> list[bool]:
    """Which of the states of these sizes (in the order the step visits them) go to host memory:
    as megatron-core's HybridDeviceOptimizer picks params (_get_sub_optimizer_param_groups), each
    while those picked so far hold less than `fraction` of the total; 1.0 offloads every one, 0.0
    none. Sizes of whole matrices, so that every rank picks the same."""
    threshold, picked, chosen = fraction * sum(sizes), 0, []
    for size in sizes:
        chosen.append(picked < threshold)
        picked += size if chosen[-1] else 0
    return chosen


@dataclass(frozen=True)
class OffloadFigures:
    """One rank's optimizer state with offload, in bytes: `host` kept in host memory between
    steps (and copied to the device and back each step: `host` each way), `resident` kept on
    the device throughout (what the fraction leaves there), `streamed` the most offloaded state
    on the device at once during the step."""
    host: int
    resident: int
    streamed: int


# One exchange group as the step visits it: its matrices, its exchanges (each a list of batches
# of matrix indices), and for each rank asked about, its place in the group.
Group = tuple[Sequence[Matrix], Sequence[Sequence[Sequence[int]]], Sequence[int]]


def offload_figures(groups: Sequence[Group], element_bytes: int,
                    fraction: float = 1.0) -> list[OffloadFigures]:
    """OffloadFigures of each rank asked about (the places each group lists), over the exchange
    groups of the step (dense, then experts), the exchanges of each in order: an exchange
    streams the offloaded states of its matrices, and the device holds the largest IN_FLIGHT
    consecutive exchanges' worth at once. Each matrix is visited once, at the ranks holding its
    rows, so the scale model asks about every rank of a flagship model at once."""
    # A rank's state of a matrix: its rows of the momentum and of a variant's second moment
    # (`moment2_cols` elements per row).
    visited = [matrices[i] for matrices, exchanges, _ in groups
               for batches in exchanges for batch in batches for i in batch]
    picks = iter(offloaded([m.layout.num_rows * (m.cols + m.moment2_cols) for m in visited],
                           fraction))
    asked = len(groups[0][2]) if groups else 0
    host, resident = [0] * asked, [0] * asked
    streamed: list[list[int]] = []  # per exchange in step order, each asked rank's bytes
    for matrices, exchanges, places in groups:
        if not matrices:
            continue
        group_ranks = matrices[0].layout.ranks
        group_host, group_resident = [0] * group_ranks, [0] * group_ranks
        for batches in exchanges:
            exchange = [0] * group_ranks
            for i in (i for batch in batches for i in batch):
                matrix, offload = matrices[i], next(picks)
                for shard, rows in matrix.layout.nonempty_shards:
                    nbytes = rows * (matrix.cols + matrix.moment2_cols) * element_bytes
                    for rank in matrix.layout.holders(shard):
                        (group_host if offload else group_resident)[rank] += nbytes
                        exchange[rank] += nbytes if offload else 0
            streamed.append([exchange[place] for place in places])
        for r, place in enumerate(places):
            host[r] += group_host[place]
            resident[r] += group_resident[place]
    in_flight = [max((sum(exchange[r] for exchange in streamed[e:e + IN_FLIGHT])
                      for e in range(len(streamed))), default=0) for r in range(asked)]
    return [OffloadFigures(*figures) for figures in zip(host, resident, in_flight)]
