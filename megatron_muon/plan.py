"""Pure layout arithmetic: which rows of each matrix each rank holds, who owns which matrix, what
travels. No communication here."""

from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate
from typing import Sequence

# ZeROTensorParallelMuon's defaults, which the scale model plans with too.
BYTE_SLACK = 0.05  # owners may move this fraction more than the layout's minimum bytes
MAX_BATCH_BYTES = 64 << 20  # a batch of same-shape matrices, and an exchange, at most this size


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
        """Bytes this matrix moves per step with `owner`: the rows of its other shards in, and the
        result out to every other rank holding rows (replicas included)."""
        layout = self.layout
        held_elsewhere = layout.held_by_all - layout.held(owner)
        rows_in = layout.num_rows - layout.held(owner)
        return (rows_in + held_elsewhere) * self.cols * element_bytes


def layout_min_bytes(matrices: Sequence[Matrix], element_bytes: int) -> int:
    """The least any exact owner-compute exchange can move (all ranks together): every matrix
    owned by a rank holding most of its rows."""
    return sum(min(m.bytes_to_owner(r, element_bytes) for r in range(m.layout.ranks))
               for m in matrices)


def owner_traffic(matrices: Sequence[Matrix], owners: Sequence[int],
                  element_bytes: int) -> tuple[list[int], list[int]]:
    """(bytes received, bytes sent) by each rank in an owner step: each owner gets the rows it
    lacks, every shard from one holder (the one in its replica), and sends the result rows to
    every other rank holding some."""
    world = matrices[0].layout.ranks if matrices else 0
    received, sent = [0] * world, [0] * world
    for matrix, owner in zip(matrices, owners):
        layout, row_bytes = matrix.layout, matrix.cols * element_bytes
        for shard, rows in enumerate(layout.rows):
            if rows and shard != layout.shard_of[owner]:
                sent[layout.source(shard, owner)] += rows * row_bytes
                received[owner] += rows * row_bytes
        for rank in range(world):
            if rank != owner and layout.held(rank):
                received[rank] += layout.held(rank) * row_bytes
                sent[owner] += layout.held(rank) * row_bytes
    return received, sent


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
    world = matrices[0].layout.ranks
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


def exchange_batches(matrices: Sequence[Matrix], batches: Sequence[Sequence[int]],
                     max_elements: int) -> list[list[list[int]]]:
    """Consecutive batches packed into exchanges of at most `max_elements` elements (at least
    one batch each): an exchange carries all its batches' rows in one collective per direction,
    whatever their shapes."""
    exchanges, size = [], 0
    for batch in batches:
        elements = sum(matrices[i].shape[0] * matrices[i].cols for i in batch)
        if exchanges and size + elements <= max_elements:
            exchanges[-1].append(list(batch))
            size += elements
        else:
            exchanges.append([list(batch)])
            size = elements
    return exchanges


def gather_segments(matrices: Sequence[Matrix], owners: Sequence[int], batch: Sequence[int],
                    src: int, dst: int) -> list[tuple[int, int, int]]:
    """(matrix, first row, end row) of the rows `src` sends `dst` to assemble the batch matrices
    `dst` owns, in batch order: each shard the owner lacks comes from one holder, the one in the
    owner's replica."""
    segments = []
    for i in batch:
        layout = matrices[i].layout
        shard = layout.shard_of[src]
        if (owners[i] == dst and layout.held(src) and shard != layout.shard_of[dst]
                and layout.source(shard, dst) == src):
            segments.append((i, *layout.row_range(src)))
    return segments


def gather_moves(matrices: Sequence[Matrix], owners: Sequence[int], batch: Sequence[int]) -> bool:
    """Whether gathering the batch moves any rows: some owner lacks rows of its matrix."""
    return any(matrices[i].layout.held(owners[i]) < matrices[i].layout.num_rows for i in batch)


def scatter_moves(matrices: Sequence[Matrix], owners: Sequence[int], batch: Sequence[int]) -> bool:
    """Whether scattering the batch's results moves any rows: a rank besides some matrix's owner
    holds rows of it."""
    return any(matrices[i].layout.held_by_all > matrices[i].layout.held(owners[i]) for i in batch)


def scatter_segments(matrices: Sequence[Matrix], owners: Sequence[int], batch: Sequence[int],
                     src: int, dst: int) -> list[tuple[int, int, int]]:
    """(matrix, first row, end row) of the result rows `src` sends `dst`: every rank gets its own
    rows of each batch matrix from the matrix's owner."""
    if src == dst:
        return []
    return [(i, *matrices[i].layout.row_range(dst)) for i in batch
            if owners[i] == src and matrices[i].layout.held(dst)]


def split_matrices(layout: RowLayout, experts: int, cols: int, batch_key=None,
                   row_blocks: tuple[int, ...] | None = None) -> list[tuple[int, Matrix]]:
    """The matrices Muon orthogonalizes in a param of `layout`: the param itself, or each expert
    of a stack of `experts`, with the first of its rows in the param."""
    rows = layout.num_rows // experts
    return [(start, Matrix(layout.piece(start, start + rows), cols, batch_key, row_blocks))
            for start in range(0, layout.num_rows, rows)]


def orthogonalization_key(attrs, splits_qkv: bool, tp_size: int) -> tuple | None:
    """Matrices with equal keys (and shapes) are orthogonalized identically and may share one
    batched Newton-Schulz; None: orthogonalize alone (QKV split, or TP Newton-Schulz).
    `attrs`: the param's Megatron tags."""
    if splits_qkv or tp_size > 1:
        return None
    return (getattr(attrs, "partition_dim", None), getattr(attrs, "expert_tp", False))


@dataclass(frozen=True)
class OwnerPlan:
    """One exchange group's owner step, from shapes alone: each matrix's owner, the batches of
    same-shape matrices orthogonalized together, and the exchanges (lists of consecutive
    batches) that carry them, one collective per direction each."""
    owners: list[int]
    batches: list[list[int]]
    exchanges: list[list[list[int]]]


def owner_plan(matrices: Sequence[Matrix], element_bytes: int, byte_slack: float = BYTE_SLACK,
               max_batch_bytes: int = MAX_BATCH_BYTES) -> OwnerPlan:
    """The owner plan ZeROTensorParallelMuon carries out, and the scale model estimates."""
    max_elements = max_batch_bytes // element_bytes
    batches = batch_matrices(matrices, max_elements)
    return OwnerPlan(choose_owners(matrices, element_bytes, byte_slack), batches,
                     exchange_batches(matrices, batches, max_elements))
