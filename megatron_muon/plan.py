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
