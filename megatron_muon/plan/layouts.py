"""The matrices Muon orthogonalizes, as the plan sees them: which rows of each the ranks of its
exchange group hold (RowLayout), its width and batch key (Matrix), and the QKV row blocks and
expert splits that make one param several matrices."""

from dataclasses import dataclass, replace
from functools import cached_property
from itertools import accumulate
from typing import Sequence

from .newton_schulz import GramSchedule, matrix_ns_flops


@dataclass(frozen=True)
class RowLayout:
    """Rows of one matrix and the ranks of its exchange group that hold them.

    Megatron-FSDP lays a parameter out contiguously in its bucket and cuts the bucket into equal
    per-shard slices, so shard s holds the rows after those of shards 0..s-1 (possibly none).
    `shard_of[rank]` is the shard a rank holds; several ranks hold the same shard when the matrix
    is also replicated (`no_shard`, or HSDP's replica dim). By default rank r holds shard r.
    """

    rows: tuple[int, ...]
    shard_of: tuple[int, ...] | None = None

    def __post_init__(self):
        if any(r < 0 for r in self.rows):
            raise ValueError(f"negative row count in layout {self.rows}")
        if self.shard_of is None:
            object.__setattr__(self, "shard_of", tuple(range(len(self.rows))))
        if sorted(set(self.shard_of)) != list(range(len(self.rows))):
            raise ValueError(f"ranks hold shards {self.shard_of}, not each of {len(self.rows)} shards")

    @property
    def num_rows(self) -> int:
        return self._starts[-1]

    @property
    def max_rows(self) -> int:
        return max(self.rows, default=0)

    @property
    def ranks(self) -> int:
        return len(self.shard_of)

    def held(self, rank: int) -> int:
        return self.rows[self.shard_of[rank]]

    @cached_property
    def held_by_all(self) -> int:
        """Rows held summed over the ranks (replicas count each time)."""
        return sum(self.rows[shard] for shard in self.shard_of)

    @cached_property
    def _starts(self) -> tuple[int, ...]:
        return (0, *accumulate(self.rows))

    @cached_property
    def nonempty_shards(self) -> tuple[tuple[int, int], ...]:
        """(shard, rows) of the shards holding rows."""
        return tuple((shard, rows) for shard, rows in enumerate(self.rows) if rows)

    @cached_property
    def _holders(self) -> tuple[tuple[int, ...], ...]:
        holders = [[] for _ in self.rows]
        for rank, shard in enumerate(self.shard_of):
            holders[shard].append(rank)
        return tuple(map(tuple, holders))

    def shard_range(self, shard: int) -> tuple[int, int]:
        return self._starts[shard], self._starts[shard + 1]

    def row_range(self, rank: int) -> tuple[int, int]:
        return self.shard_range(self.shard_of[rank])

    def holders(self, shard: int) -> tuple[int, ...]:
        return self._holders[shard]

    def source(self, shard: int, for_rank: int) -> int:
        """The rank `for_rank` takes `shard`'s rows from: the holder in its own replica (the
        replica of a rank is its place among the holders of its shard)."""
        holders = self.holders(shard)
        replica = self.holders(self.shard_of[for_rank]).index(for_rank)
        return holders[min(replica, len(holders) - 1)]

    def piece(self, start: int, stop: int) -> "RowLayout":
        """The layout of rows [start, stop) alone (one expert of a stacked expert weight)."""
        rows = []
        for shard in range(len(self.rows)):
            lo, hi = self.shard_range(shard)
            rows.append(max(0, min(hi, stop) - max(lo, start)))
        return RowLayout(tuple(rows), self.shard_of)

    def local_range(self, rank: int, start: int, stop: int) -> tuple[int, int]:
        """Where rows [start, stop) sit in `rank`'s local rows (an empty range if it has none)."""
        lo, hi = self.row_range(rank)
        first = min(max(start, lo), hi)
        return first - lo, max(first, min(stop, hi)) - lo


def row_layouts(shard_of: Sequence[int], rows_per_rank: Sequence[Sequence[int]],
                num_rows: Sequence[int]) -> list[RowLayout]:
    """Per-matrix layouts from a rank-major table `rows_per_rank[rank][matrix]` and the shard
    each rank holds.

    Each matrix's shards must add up to its row count `num_rows[matrix]`, and the ranks holding
    one shard must hold the same rows: a mismatch means the exchange group is not the one the
    matrix is sharded over.
    """
    num_shards = max(shard_of) + 1
    layouts = []
    for index, (column, expected) in enumerate(zip(zip(*rows_per_rank), num_rows, strict=True)):
        rows = [None] * num_shards
        for shard, count in zip(shard_of, column):
            if rows[shard] not in (None, count):
                raise ValueError(f"matrix {index}: replicas of shard {shard} hold {rows[shard]} "
                                 f"and {count} rows; is the exchange group the data-parallel group?")
            rows[shard] = count
        layout = RowLayout(tuple(rows), tuple(shard_of))
        if layout.num_rows != expected:
            raise ValueError(
                f"matrix {index}: shards hold {layout.rows} rows (sum {layout.num_rows}) "
                f"but the matrix has {expected} rows; is the gather group the shard group?"
            )
        layouts.append(layout)
    return layouts


@dataclass(frozen=True)
class QKVRows:
    """megatron-core's fused QKV weight (SelfAttention.linear_qkv), TP-local: for each query
    group in turn, the q rows of its heads, then its k rows, then its v rows."""

    groups: int
    q_rows: int  # per group
    kv_rows: int  # per group, for k and for v

    @property
    def num_rows(self) -> int:
        return self.groups * (self.q_rows + 2 * self.kv_rows)


def qkv_row_blocks(rows: int, split_shapes: Sequence[int]) -> tuple[int, ...]:
    """Rows of the q, k and v blocks Newton-Schulz sees in a fused QKV matrix of `rows` rows,
    `split_shapes` being the q, k and v rows of one query group."""
    groups = rows // sum(split_shapes)
    return tuple(groups * block for block in split_shapes)


def applies_gram_twice(gram_side: int, long_side: int) -> bool:
    """Whether a team member holding `long_side` of a matrix's long side updates its part X as
    aX + A(bX + cAX) (A = X X^T summed over the team: 6g^2 l FLOPs an iteration) rather than as
    newton_schulz_tp does, aX + (bA + cA A)X (4g^2 l + 2g^3, A A repeated by every member):
    where its part is shorter than the Gram side g, which saves FLOPs and moves no more bytes."""
    return long_side < gram_side


def team_ns_flops(gram_side: int, long_side: int, steps: int) -> int:
    """One team member's Newton-Schulz FLOPs in the distributed form on `long_side` of the whole
    matrix's long side: that share of X X^T and B X, and all of A A, which every member repeats:
    k(4g^2 l + 2g^3), g the Gram side; or, where it applies the Gram matrix twice
    (applies_gram_twice), k 6g^2 l."""
    if applies_gram_twice(gram_side, long_side):
        return steps * 6 * gram_side * gram_side * long_side
    return steps * (4 * gram_side * gram_side * long_side + 2 * gram_side ** 3)


@dataclass(frozen=True)
class TeamBlock:
    """Where a block of a matrix split over a team (plan/team_split.py) sits: the team (the index of
    the whole matrix among its group's matrices), the whole matrix's shape, the block's first
    row or column in it along `dim`, and the team's size (its blocks)."""

    team: int
    whole: tuple[int, int]
    start: int
    size: int

    @property
    def dim(self) -> int:
        """The dim the blocks split, the whole matrix's long side (Newton-Schulz sums its Gram
        matrix over it): rows of a tall or square matrix, columns of a wide one."""
        return 0 if self.whole[0] >= self.whole[1] else 1


@dataclass(frozen=True)
class Nodes:
    """The node (host) of each rank of an exchange group, and what a rank moves a second in an
    all-reduce inside one (NVLink), for teams (owners.TeamRule, teams.tiered_seconds)."""

    of_rank: tuple[int, ...]
    bytes_per_second: float

    @cached_property
    def ranks_on(self) -> dict[int, list[int]]:
        return {node: [r for r, on in enumerate(self.of_rank) if on == node]
                for node in dict.fromkeys(self.of_rank)}

    def fewest(self, k: int) -> int:
        """The fewest nodes that hold k of the group's ranks."""
        held = accumulate(sorted(map(len, self.ranks_on.values()), reverse=True))
        return next(n for n, ranks in enumerate(held, 1) if ranks >= k)


@dataclass(frozen=True)
class Matrix:
    """One matrix to orthogonalize: how its rows are spread, its width, which matrices it may
    share a batched Newton-Schulz with (same shape and same orthogonalization), and, when it is
    orthogonalized in row blocks (QKV split), the total rows of each kind of block. A Muon
    variant's second moment (second_moment.py) may add `state_cols` columns that travel with
    each row to its owner, `returned_state_cols` of them back (a raw gradient's stay there), and
    holds `moment2_cols` elements per row. Under --muon-tp-mode duplicated a tensor-parallel
    matrix is all-gathered before Newton-Schulz: `tp_gather` is (the dim its TP shards tile,
    their number), None where nothing is gathered. A block of a matrix split over a team
    (plan/team_split.py) is a Matrix too, with its `team`. `gathered_ahead`: its gather ran
    inside backward (carrying_momentum), so at the step its holders send nothing. `gram`: its
    owner runs Gram Newton-Schulz on it, or on each of its row blocks, where that costs fewer
    FLOPs (--muon-gram-newton-schulz; plan/newton_schulz.py), None: standard Newton-Schulz."""

    layout: RowLayout
    cols: int
    batch_key: object = None
    row_blocks: tuple[int, ...] | None = None
    state_cols: int = 0
    returned_state_cols: int = 0
    moment2_cols: int = 0
    tp_gather: tuple[int, int] | None = None
    team: TeamBlock | None = None
    gathered_ahead: bool = False
    gram: GramSchedule | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.layout.num_rows, self.cols

    @property
    def gram_side(self) -> int:
        """The side of the Gram matrix X X^T its Newton-Schulz forms: the smaller side, or for a
        team's block the whole matrix's."""
        return min(self.team.whole if self.team else self.shape)

    @property
    def long_side(self) -> int:
        """Its other side: the larger, or for a team's block its part of the whole's long side."""
        return self.shape[self.team.dim] if self.team else max(self.shape)

    def carrying_momentum(self) -> "Matrix":
        """This matrix as the gather inside backward carries it: each row's old momentum beside
        its gradient, to the owner, which forms the update, and the state that comes back (a
        variant's travelling second moment; its raw gradient, where it sends one, is the
        gradient already there): twice the update's columns and the returned state's there,
        what comes back as before."""
        return replace(self, state_cols=self.returned_state_cols + self.cols, gathered_ahead=True)

    @property
    def gather_width(self) -> int:
        """Elements per row an exchange moves to the owner: the update's and the state's."""
        return self.cols + self.state_cols

    @property
    def scatter_width(self) -> int:
        """Elements per row the owner sends back: the update's and the returned state's."""
        return self.cols + self.returned_state_cols

    def ns_flops(self, steps: int) -> int:
        """Its Newton-Schulz FLOPs; a team's block: a member's on its part (member_flops)."""
        if self.team:
            return self.member_flops(self.long_side, steps)
        return sum(matrix_ns_flops(rows, self.cols, steps, self.gram)
                   for rows in self.row_blocks or (self.shape[0],))

    @property
    def team_gram(self) -> GramSchedule | None:
        """A team's block: the Gram schedule its team runs on the whole matrix, where it runs on
        the whole matrix's shape (--muon-gram-newton-schulz); None: standard Newton-Schulz."""
        runs = self.team and self.gram and self.gram.runs_on(*self.team.whole)
        return self.gram if runs else None

    def member_flops(self, long_side: int, steps: int) -> int:
        """A team member's Newton-Schulz FLOPs on `long_side` of the whole matrix's long side:
        Gram's (its products of that part, and the Gram side's, which every member repeats;
        `steps` scales them as matrix_ns_flops does) where its team runs it, else
        team_ns_flops."""
        if self.team_gram:
            return self.team_gram.flops_on(self.gram_side, long_side) * steps // self.gram.steps
        return team_ns_flops(self.gram_side, long_side, steps)

    def gram_all_reduces(self, steps: int) -> int:
        """A team's block: the Gram matrices its team sums over its members in one
        Newton-Schulz call, beside the norm: one an iteration, or under Gram Newton-Schulz one
        at the start and one a restart (GramSchedule.gram_matrices)."""
        return self.team_gram.gram_matrices if self.team_gram else steps

    def bytes_to_owner(self, owner: int, element_bytes: int) -> int:
        """Bytes this matrix moves per step with `owner`: the rows of its other shards in, and the
        result out to every other rank holding rows (replicas included)."""
        layout = self.layout
        held_elsewhere = layout.held_by_all - layout.held(owner)
        rows_in = layout.num_rows - layout.held(owner)
        return (rows_in * self.gather_width + held_elsewhere * self.scatter_width) * element_bytes

    def least_bytes(self, element_bytes: int) -> int:
        """The fewest bytes any owner moves: bytes_to_owner of a rank holding the most rows."""
        layout = self.layout
        return ((layout.num_rows - layout.max_rows) * self.gather_width
                + (layout.held_by_all - layout.max_rows) * self.scatter_width) * element_bytes


def cost_key(matrix: Matrix) -> tuple:
    """Matrices with equal keys take the same Newton-Schulz time (and may share a batch)."""
    return matrix.shape, matrix.batch_key, matrix.row_blocks


def split_matrices(layout: RowLayout, experts: int, cols: int, batch_key=None,
                   row_blocks: tuple[int, ...] | None = None) -> list[tuple[int, Matrix]]:
    """The matrices Muon orthogonalizes in a param of `layout`: the param itself, or each expert
    of a stack of `experts`, with the first of its rows in the param."""
    rows = layout.num_rows // experts
    return [(start, Matrix(layout.piece(start, start + rows), cols, batch_key, row_blocks))
            for start in range(0, layout.num_rows, rows)]


def orthogonalization_key(attrs, splits_qkv: bool, tp_size: int, tp_mode: str) -> tuple | None:
    """Matrices with equal keys (and shapes) are orthogonalized identically and may share one
    batched Newton-Schulz, or be split over a team (teams.can_split); None: orthogonalize alone
    (QKV split, or TP Newton-Schulz over several ranks). Under --muon-tp-mode blockwise a
    TP-local matrix is a matrix of its own to TensorParallelMuon.orthogonalize (no partition dim,
    its scale factor from its own shape), as at TP 1. `attrs`: the param's Megatron tags."""
    if splits_qkv or (tp_size > 1 and tp_mode != "blockwise"):
        return None
    return (getattr(attrs, "partition_dim", None), getattr(attrs, "expert_tp", False))
