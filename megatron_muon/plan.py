"""Pure layout arithmetic: which rows of each matrix each rank holds. No communication here."""

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class RowLayout:
    """Rows of one matrix held by each rank of its shard group, in group-rank order.

    Megatron-FSDP lays a parameter out contiguously in its bucket and cuts the bucket into
    equal per-rank slices, so rank r holds the rows after those of ranks 0..r-1 (possibly none).
    """

    rows: tuple[int, ...]

    def __post_init__(self):
        if any(r < 0 for r in self.rows):
            raise ValueError(f"negative row count in layout {self.rows}")

    @property
    def num_rows(self) -> int:
        return sum(self.rows)

    @property
    def max_rows(self) -> int:
        return max(self.rows, default=0)

    def row_range(self, rank: int) -> tuple[int, int]:
        start = sum(self.rows[:rank])
        return start, start + self.rows[rank]


def row_layouts(rows_per_rank: Sequence[Sequence[int]], num_rows: Sequence[int]) -> list[RowLayout]:
    """Per-matrix layouts from a rank-major table `rows_per_rank[rank][matrix]`.

    Each matrix's shards must add up to its row count `num_rows[matrix]`: a mismatch means the
    shard group is not the one the matrix is sharded over.
    """
    layouts = [RowLayout(tuple(column)) for column in zip(*rows_per_rank)]
    for index, (layout, expected) in enumerate(zip(layouts, num_rows, strict=True)):
        if layout.num_rows != expected:
            raise ValueError(
                f"matrix {index}: shards hold {layout.rows} rows (sum {layout.num_rows}) "
                f"but the matrix has {expected} rows; is the gather group the shard group?"
            )
    return layouts


def ns_flops(rows: int, cols: int, steps: int) -> int:
    """Newton-Schulz FLOPs of one m x n matrix: k(4m^2 n + 2m^3) with m the smaller side."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


@dataclass(frozen=True)
class Matrix:
    """One matrix to orthogonalize: how its rows are spread, its width, which matrices it may
    share a batched Newton-Schulz with (same shape and same orthogonalization), and, when it is
    orthogonalized in row blocks (QKV split), the total rows of each kind of block."""

    layout: RowLayout
    cols: int
    batch_key: object = None
    row_blocks: tuple[int, ...] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.layout.num_rows, self.cols

    def ns_flops(self, steps: int) -> int:
        return sum(ns_flops(rows, self.cols, steps) for rows in self.row_blocks or (self.shape[0],))

    def bytes_to_owner(self, owner: int, element_bytes: int) -> int:
        """Bytes this matrix moves per step with `owner`: its other rows in, and back out."""
        return 2 * (self.layout.num_rows - self.layout.rows[owner]) * self.cols * element_bytes


def layout_min_bytes(matrices: Sequence[Matrix], element_bytes: int) -> int:
    """The least any exact owner-compute exchange can move (all ranks together): every matrix
    owned by a rank holding most of its rows."""
    return sum(min(m.bytes_to_owner(r, element_bytes) for r in range(len(m.layout.rows)))
               for m in matrices)


def choose_owners(matrices: Sequence[Matrix], element_bytes: int,
                  byte_slack: float = 0.05) -> list[int]:
    """One owner per matrix: fewest bytes first, Newton-Schulz load balanced second.

    1. Every matrix goes to a rank holding most of its rows (the layout minimum of bytes); where
       several do, longest-processing-time-first on Newton-Schulz FLOPs picks the least loaded.
    2. While the busiest rank can hand a matrix to another rank that then stays below it, the
       move costing the fewest extra bytes per FLOP is made, as long as all extra bytes stay
       within `byte_slack` times the layout minimum (so traffic stays within 1 + byte_slack of
       the bound). Each move lowers the sum of squared loads, so this ends.
    """
    if not matrices:
        return []
    world = len(matrices[0].layout.rows)
    flops = [matrix.ns_flops(steps=1) for matrix in matrices]  # k scales every matrix alike
    cost = [[m.bytes_to_owner(r, element_bytes) for r in range(world)] for m in matrices]
    load = [0] * world
    owners = [0] * len(matrices)
    for i in sorted(range(len(matrices)), key=lambda i: -flops[i]):
        cheapest = min(cost[i])
        owners[i] = min((r for r in range(world) if cost[i][r] == cheapest), key=lambda r: (load[r], r))
        load[owners[i]] += flops[i]

    budget = byte_slack * layout_min_bytes(matrices, element_bytes)
    while True:
        busiest = max(range(world), key=lambda r: (load[r], -r))
        moves = [((cost[i][r] - cost[i][busiest]) / flops[i], -flops[i], i, r)
                 for i in range(len(matrices)) if owners[i] == busiest and flops[i]
                 for r in range(world)
                 if r != busiest and load[r] + flops[i] < load[busiest]
                 and cost[i][r] - cost[i][busiest] <= budget]
        if not moves:
            return owners
        _, _, i, r = min(moves)
        budget -= cost[i][r] - cost[i][busiest]
        load[busiest] -= flops[i]
        load[r] += flops[i]
        owners[i] = r


def batch_matrices(matrices: Sequence[Matrix], max_batch_elements: int) -> list[list[int]]:
    """Matrices of one batch key (same shape, same orthogonalization) in batches of at most
    `max_batch_elements` elements (at least one matrix), in first-appearance order."""
    by_key: dict[tuple, list[list[int]]] = {}
    for i, matrix in enumerate(matrices):
        key = (matrix.shape, matrix.batch_key)
        batches = by_key.setdefault(key, [[]])
        rows, cols = matrix.shape
        if batches[-1] and (len(batches[-1]) + 1) * rows * cols > max_batch_elements:
            batches.append([])
        batches[-1].append(i)
    return [batch for batches in by_key.values() for batch in batches]


def rows_sent(matrices: Sequence[Matrix], owners: Sequence[int], batch: Sequence[int],
              src: int, dst: int) -> list[tuple[int, int, int]]:
    """(matrix, first row, end row) of the rows `src` sends `dst` when gathering `batch` to its
    owners, in batch order; nothing is sent to oneself."""
    if src == dst:
        return []
    return [(i, *matrices[i].layout.row_range(src)) for i in batch
            if owners[i] == dst and matrices[i].layout.rows[src]]
