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
    """One matrix to orthogonalize: how its rows are spread, its width, and which matrices it may
    share a batched Newton-Schulz with (same shape and same orthogonalization)."""

    layout: RowLayout
    cols: int
    batch_key: object = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.layout.num_rows, self.cols

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

    Longest-processing-time-first over Newton-Schulz FLOPs: each matrix, largest first, goes to
    the least-loaded rank among those whose extra bytes over the matrix's cheapest owner still fit
    in a budget of `byte_slack` times the layout minimum (so total traffic stays within
    1 + byte_slack of the bound). Matrices split evenly, or small enough, are free to balance.
    """
    if not matrices:
        return []
    world = len(matrices[0].layout.rows)
    budget = byte_slack * layout_min_bytes(matrices, element_bytes)
    load = [0] * world
    owners = [0] * len(matrices)
    flops = [ns_flops(*matrix.shape, steps=1) for matrix in matrices]  # k scales every matrix alike
    order = sorted(range(len(matrices)), key=lambda i: -flops[i])
    for i in order:
        matrix = matrices[i]
        cost = [matrix.bytes_to_owner(r, element_bytes) for r in range(world)]
        cheapest = min(cost)
        affordable = [r for r in range(world) if cost[r] - cheapest <= budget]
        owner = min(affordable, key=lambda r: (load[r], cost[r], r))
        budget -= cost[owner] - cheapest
        load[owner] += flops[i]
        owners[i] = owner
    return owners


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
