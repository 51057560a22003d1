"""Pure layout arithmetic: which rows of each matrix each rank holds, who owns which matrix, what
travels. No communication here."""

import heapq
import math
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate
from typing import Callable, Sequence

# ZeROTensorParallelMuon's defaults, which the scale model plans with too.
BYTE_SLACK = 0.05  # byte-first owners may move this fraction more than the layout's minimum
# The most the owner step's working memory (exchanges in flight, Newton-Schulz) holds at once on a
# rank (--muon-max-exchange-bytes), unless one matrix alone needs more; None: what Muon's state
# saves each rank of the exchange group against Adam's (affordable_bytes).
MAX_EXCHANGE_BYTES = None
IN_FLIGHT = 2  # exchanges holding memory at once (exchange.run_overlapped)


def per_exchange_bytes(max_exchange_bytes: int) -> int:
    """What one batch, and one exchange, may hold of the working-memory budget: the exchanges in
    flight share it."""
    return max_exchange_bytes // IN_FLIGHT


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


def ns_flops(rows: int, cols: int, steps: int) -> int:
    """Newton-Schulz FLOPs of one m x n matrix: k(4m^2 n + 2m^3) with m the smaller side."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


@dataclass(frozen=True)
class Matrix:
    """One matrix to orthogonalize: how its rows are spread, its width, which matrices it may
    share a batched Newton-Schulz with (same shape and same orthogonalization), and, when it is
    orthogonalized in row blocks (QKV split), the total rows of each kind of block. A Muon
    variant's second moment (second_moment.py) may add `state_cols` columns of per-row state
    that travel with each row both ways, and holds `moment2_cols` elements per row."""

    layout: RowLayout
    cols: int
    batch_key: object = None
    row_blocks: tuple[int, ...] | None = None
    state_cols: int = 0
    moment2_cols: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        return self.layout.num_rows, self.cols

    @property
    def width(self) -> int:
        """Elements per row an exchange moves: the update's and the state's that travels."""
        return self.cols + self.state_cols

    def ns_flops(self, steps: int) -> int:
        return sum(ns_flops(rows, self.cols, steps) for rows in self.row_blocks or (self.shape[0],))

    def bytes_to_owner(self, owner: int, element_bytes: int) -> int:
        """Bytes this matrix moves per step with `owner`: the rows of its other shards in, and the
        result out to every other rank holding rows (replicas included)."""
        layout = self.layout
        held_elsewhere = layout.held_by_all - layout.held(owner)
        rows_in = layout.num_rows - layout.held(owner)
        return (rows_in + held_elsewhere) * self.width * element_bytes

    def least_bytes(self, element_bytes: int) -> int:
        """The fewest bytes any owner moves: bytes_to_owner of a rank holding the most rows."""
        layout = self.layout
        return (layout.num_rows + layout.held_by_all - 2 * layout.max_rows) * self.width * element_bytes


def cost_key(matrix: Matrix) -> tuple:
    """Matrices with equal keys take the same Newton-Schulz time (and may share a batch)."""
    return matrix.shape, matrix.batch_key, matrix.row_blocks


def layout_min_bytes(matrices: Sequence[Matrix], element_bytes: int) -> int:
    """The least any exact owner-compute exchange can move (all ranks together): every matrix
    owned by a rank holding most of its rows."""
    return sum(m.least_bytes(element_bytes) for m in matrices)


def gather_traffic(matrix: Matrix, owner: int, element_bytes: int) -> dict[int, list[int]]:
    """{rank: [bytes received, bytes sent]} of assembling one matrix on `owner`: it gets the
    rows it lacks, every shard from one holder (the one in its replica)."""
    layout, row_bytes = matrix.layout, matrix.width * element_bytes
    traffic: dict[int, list[int]] = {}
    for shard, rows in layout.nonempty_shards:
        if shard != layout.shard_of[owner]:
            traffic.setdefault(layout.source(shard, owner), [0, 0])[1] += rows * row_bytes
            traffic.setdefault(owner, [0, 0])[0] += rows * row_bytes
    return traffic


def scatter_traffic(matrix: Matrix, owner: int, element_bytes: int) -> dict[int, list[int]]:
    """{rank: [bytes received, bytes sent]} of returning one matrix's result: the owner sends
    every other rank holding rows (replicas too) its rows."""
    layout, row_bytes = matrix.layout, matrix.width * element_bytes
    traffic: dict[int, list[int]] = {}
    for shard, rows in layout.nonempty_shards:
        for rank in layout.holders(shard):
            if rank != owner:
                traffic.setdefault(rank, [0, 0])[0] += rows * row_bytes
                traffic.setdefault(owner, [0, 0])[1] += rows * row_bytes
    return traffic


def matrix_traffic(matrix: Matrix, owner: int, element_bytes: int) -> dict[int, list[int]]:
    """{rank: [bytes received, bytes sent]} of the ranks one matrix moves bytes for with `owner`:
    gather_traffic and scatter_traffic together."""
    traffic = gather_traffic(matrix, owner, element_bytes)
    for rank, (into, out) in scatter_traffic(matrix, owner, element_bytes).items():
        both = traffic.setdefault(rank, [0, 0])
        both[0] += into
        both[1] += out
    return traffic


def owner_traffic(matrices: Sequence[Matrix], owners: Sequence[int],
                  element_bytes: int) -> tuple[list[int], list[int]]:
    """(bytes received, bytes sent) by each rank in an owner step (matrix_traffic, summed)."""
    world = matrices[0].layout.ranks if matrices else 0
    received, sent = [0] * world, [0] * world
    for matrix, owner in zip(matrices, owners):
        for rank, (into, out) in matrix_traffic(matrix, owner, element_bytes).items():
            received[rank] += into
            sent[rank] += out
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


def whole_matrix_owners(matrices: Sequence[Matrix]) -> list[int]:
    """megatron-core's LayerWiseDistributedOptimizer placement: whole matrices, largest first,
    each to the rank holding the fewest elements so far; where the rows lie plays no part."""
    world = matrices[0].layout.ranks if matrices else 0
    load, owners = [0] * world, [0] * len(matrices)
    for i in sorted(range(len(matrices)), key=lambda i: -math.prod(matrices[i].shape)):
        owners[i] = min(range(world), key=lambda r: (load[r], r))
        load[owners[i]] += math.prod(matrices[i].shape)
    return owners


@dataclass(frozen=True)
class StepCost:
    """What owners chosen by estimated time weigh. `call_seconds(matrix, count)`: the seconds of
    one Newton-Schulz call on `count` matrices shaped and orthogonalized like `matrix` (one batched
    call where they share a batch key); `bytes_per_second`: what a rank sends or receives in the
    owner exchange; `spread`: how far, as a fraction, the measured figures may be from another
    run's (0 for rates given, not measured)."""
    call_seconds: Callable[[Matrix, int], float]
    bytes_per_second: float
    spread: float = 0.0


def newton_schulz_seconds(matrices: Sequence[Matrix], owners: Sequence[int],
                          batches: Sequence[Sequence[int]], cost: StepCost) -> list[float]:
    """Each rank's Newton-Schulz seconds: of each batch, the matrices it owns in one call where
    they share a batch key, else one call each (as ZeROTensorParallelMuon.orthogonalize_owned)."""
    seconds = [0.0] * (matrices[0].layout.ranks if matrices else 0)
    for batch in batches:
        owned: dict[int, list[int]] = {}
        for i in batch:
            owned.setdefault(owners[i], []).append(i)
        for owner, members in owned.items():
            matrix = matrices[members[0]]
            seconds[owner] += (cost.call_seconds(matrix, len(members)) if matrix.batch_key is not None
                               else len(members) * cost.call_seconds(matrix, 1))
    return seconds


def estimated_seconds(matrices: Sequence[Matrix], owners: Sequence[int],
                      batches: Sequence[Sequence[int]], element_bytes: int,
                      cost: StepCost) -> list[float]:
    """Each rank's estimated owner step: its Newton-Schulz seconds plus the larger of the bytes it
    receives and sends over the bandwidth."""
    received, sent = owner_traffic(matrices, owners, element_bytes)
    return [seconds + max(into, out) / cost.bytes_per_second for seconds, into, out
            in zip(newton_schulz_seconds(matrices, owners, batches, cost), received, sent)]


class _Loads:
    """Each rank's estimated seconds while owners are placed or moved: one Newton-Schulz call per
    matrix it owns (StepCost.call_seconds(matrix, 1)) plus the larger of the bytes it receives
    and sends over the bandwidth; and the bytes moved beyond the layout's minimum."""

    # Owners considered for a matrix in a large group: the ranks holding its rows and this many
    # of the least busy; a move off the busiest rank is sought among its this many slowest.
    CANDIDATES = 16

    def __init__(self, matrices: Sequence[Matrix], element_bytes: int, cost: StepCost):
        self.matrices, self.element_bytes, self.cost = matrices, element_bytes, cost
        self.world = matrices[0].layout.ranks
        self.single = [cost.call_seconds(m, 1) for m in matrices]
        self.least_bytes = [m.least_bytes(element_bytes) for m in matrices]
        self.busy = [0.0] * self.world
        self.received, self.sent = [0] * self.world, [0] * self.world
        self.owners: list[int | None] = [None] * len(matrices)
        self.extra_bytes = 0

    def seconds(self, rank: int, change=(0.0, 0, 0)) -> float:
        busy, into, out = change
        return (self.busy[rank] + busy + max(self.received[rank] + into, self.sent[rank] + out)
                / self.cost.bytes_per_second)

    def extra(self, i: int, owner: int | None) -> int:
        """Bytes matrix i moves with `owner` beyond the least it can move (0 unplaced)."""
        if owner is None:
            return 0
        return self.matrices[i].bytes_to_owner(owner, self.element_bytes) - self.least_bytes[i]

    def _share(self, i: int, rank: int, owner: int) -> tuple[float, int, int]:
        """(busy, received, sent) matrix i gives `rank` under `owner`: the owner runs it and gets
        and sends every row it lacks; another holder sends and gets its own rows (from the owner's
        replica's holder, with replicas: not followed here)."""
        layout, row_bytes = self.matrices[i].layout, self.matrices[i].width * self.element_bytes
        if rank == owner:
            return (self.single[i], (layout.num_rows - layout.held(rank)) * row_bytes,
                    (layout.held_by_all - layout.held(rank)) * row_bytes)
        return 0.0, layout.held(rank) * row_bytes, layout.held(rank) * row_bytes

    def move_seconds(self, i: int, owner: int) -> float:
        """The busier of the old and the new owner if matrix i moves to `owner` (the ranks whose
        load the move changes, replicas aside)."""
        old = self.owners[i]

        def after(rank):
            gain = self._share(i, rank, owner)
            loss = (0.0, 0, 0) if old is None else self._share(i, rank, old)
            return self.seconds(rank, tuple(g - l for g, l in zip(gain, loss)))

        return max(after(rank) for rank in {owner, old} - {None})

    def place(self, i: int, owner: int) -> None:
        """Move matrix i to `owner`, every rank's bytes updated exactly (matrix_traffic)."""
        old = self.owners[i]
        self.extra_bytes += self.extra(i, owner) - self.extra(i, old)
        for sign, rank in ((-1, old), (1, owner)):
            if rank is None:
                continue
            self.busy[rank] += sign * self.single[i]
            for q, (into, out) in matrix_traffic(self.matrices[i], rank, self.element_bytes).items():
                self.received[q] += sign * into
                self.sent[q] += sign * out
        self.owners[i] = owner

    def least_busy(self) -> list[int]:
        """All ranks in a small group, else the CANDIDATES least busy."""
        if self.world <= self.CANDIDATES:
            return list(range(self.world))
        return heapq.nsmallest(self.CANDIDATES, range(self.world), key=lambda r: (self.seconds(r), r))

    def best_owner(self, i: int, budget: float, least_busy: list[int], below: float = math.inf):
        """(seconds, extra bytes, rank) of the owner of matrix i, among `least_busy` and the
        ranks holding its rows, that leaves the old and new owner least busy (move_seconds), its
        extra bytes within `budget`, both below `below`; None if no rank does."""
        layout = self.matrices[i].layout
        holders = (r for shard, _ in layout.nonempty_shards for r in layout.holders(shard))
        options = []
        for r in sorted(set(least_busy).union(holders)):
            if r == self.owners[i]:
                continue
            extra = self.extra(i, r) - self.extra(i, self.owners[i])
            if self.extra_bytes + extra > budget:
                continue
            worst = self.move_seconds(i, r)
            if worst < below:
                options.append((worst, extra, r))
        return min(options, default=None)


def _lpt_by_time(matrices: Sequence[Matrix], element_bytes: int, cost: StepCost,
                 budget: float) -> list[int]:
    """Longest-processing-time-first on estimated seconds: each matrix, slowest first, to the
    rank whose choice leaves the ranks it moves bytes for least busy (_Loads.best_owner), extra
    bytes within `budget` (else where it moves the fewest bytes)."""
    loads = _Loads(matrices, element_bytes, cost)
    for i in sorted(range(len(matrices)), key=lambda i: (-loads.single[i], i)):
        best = loads.best_owner(i, budget, loads.least_busy())
        loads.place(i, best[2] if best else min(
            range(loads.world), key=lambda r: matrices[i].bytes_to_owner(r, element_bytes)))
    return loads.owners


def _improved(matrices: Sequence[Matrix], owners: Sequence[int], element_bytes: int,
              cost: StepCost, budget: float) -> list[int]:
    """`owners` with matrices moved off the busiest rank while a move leaves the old and the new
    owner below that rank's seconds, extra bytes within `budget`; at most as many moves as
    matrices (moves are judged on the two owners alone, so a bound keeps replicas' shifts from
    cycling)."""
    loads = _Loads(matrices, element_bytes, cost)
    for i, owner in enumerate(owners):
        loads.place(i, owner)
    owned: list[set[int]] = [set() for _ in range(loads.world)]
    for i, owner in enumerate(owners):
        owned[owner].add(i)
    for _ in range(len(matrices)):
        busiest = max(range(loads.world), key=lambda r: (loads.seconds(r), -r))
        top, least_busy = loads.seconds(busiest), loads.least_busy()
        slowest = heapq.nsmallest(loads.CANDIDATES, owned[busiest], key=lambda i: (-loads.single[i], i))
        moves = [(best, i) for i in slowest
                 for best in [loads.best_owner(i, budget, least_busy, below=top)] if best]
        if not moves:
            return loads.owners
        (_, _, owner), i = min(moves)
        owned[busiest].discard(i)
        owned[owner].add(i)
        loads.place(i, owner)
    return loads.owners


def choose_owners_by_time(matrices: Sequence[Matrix], batches: Sequence[Sequence[int]],
                          element_bytes: int, cost: StepCost,
                          byte_slack: float | None = None) -> list[int]:
    """One owner per matrix, for the shortest estimated step (`estimated_seconds`' busiest
    rank), among: the byte-first owners (choose_owners), whole matrices spread by size
    (whole_matrix_owners), and the byte-first and longest-processing-time-first owners each
    improved by moves off the busiest rank (_improved); the byte-first owners stay unless the
    fastest stays faster with Newton-Schulz or bytes dearer by the rates' spread.
    Extra bytes over the layout's minimum stay within `byte_slack` times it (None: no cap; the
    byte-first owners always qualify); ties go to fewer bytes."""
    if not matrices:
        return []
    minimum = layout_min_bytes(matrices, element_bytes)
    budget = math.inf if byte_slack is None else byte_slack * minimum
    byte_first = choose_owners(matrices, element_bytes, BYTE_SLACK if byte_slack is None
                               else min(byte_slack, BYTE_SLACK))
    candidates = [byte_first, whole_matrix_owners(matrices)] + [
        _improved(matrices, start, element_bytes, cost, budget)
        for start in (byte_first, _lpt_by_time(matrices, element_bytes, cost, budget))]

    def moved(owners):
        return sum(m.bytes_to_owner(o, element_bytes) for m, o in zip(matrices, owners))

    def makespan(owners, weighed=cost):
        return max(estimated_seconds(matrices, owners, batches, element_bytes, weighed))

    # (estimated step, bytes, owners) of each candidate, each estimated once.
    scored = [(makespan(owners), moved(owners), owners) for owners in candidates]
    allowed = [score for score in scored if score[1] - minimum <= budget]
    _, _, fastest = min(allowed, key=lambda score: score[:2])
    # Measured figures may be off by their spread. Newton-Schulz seconds follow one rate (but
    # for shapes apart beyond the noise: measured_cost.seconds_beyond_noise), so an error in it
    # scales every placement's alike; what can reorder two placements is Newton-Schulz against
    # bytes. With no spread (given rates) this is the fastest.
    dearer = 1 + cost.spread
    return fastest if all(
        makespan(fastest, weighed) < makespan(byte_first, weighed)
        for weighed in (_weighed(cost, dearer, 1.0), _weighed(cost, 1.0, dearer))) else byte_first


def _weighed(cost: StepCost, newton_schulz: float, transfer: float) -> StepCost:
    """`cost` with Newton-Schulz `newton_schulz` times and the bytes `transfer` times as long."""
    return StepCost(lambda matrix, count: newton_schulz * cost.call_seconds(matrix, count),
                    cost.bytes_per_second / transfer)


def newton_schulz_bytes(matrix: Matrix, element_bytes: int) -> int:
    """What TensorParallelMuon.orthogonalize holds at once for one m x n matrix (m the smaller
    side), its result included: at most 3mn + 2m^2 elements (emerging_optimizers' newton_schulz
    keeps the iterate, X X^T, its polynomial and the next iterate; memory.AllocationTracker
    measured 3mn + m^2 at fp32 on CPU, test_memory checks the bound)."""
    m, n = sorted(matrix.shape)
    return (3 * m * n + 2 * m * m) * element_bytes


def owner_bytes(matrix: Matrix, element_bytes: int) -> int:
    """The most an owner holds for one matrix of a batch it orthogonalizes: its rows of the
    update, the assembled matrix, its copy in the batched call's input, and what
    newton_schulz_bytes says (the result included)."""
    return 3 * math.prod(matrix.shape) * element_bytes + newton_schulz_bytes(matrix, element_bytes)


def batch_matrices(matrices: Sequence[Matrix], max_bytes: int, element_bytes: int) -> list[list[int]]:
    """Matrices of one batch key (same shape, same orthogonalization) in batches whose owner_bytes
    add up to at most `max_bytes` (at least one matrix each, whoever owns them), in
    first-appearance order."""
    by_key: dict[tuple, list[list[int]]] = {}
    for i, matrix in enumerate(matrices):
        key = (matrix.shape, matrix.batch_key)
        batches = by_key.setdefault(key, [[]])
        if batches[-1] and (len(batches[-1]) + 1) * owner_bytes(matrix, element_bytes) > max_bytes:
            batches.append([])
        batches[-1].append(i)
    return [batch for batches in by_key.values() for batch in batches]


_STAGES = ("local", "gathered", "assembled", "results", "computing", "scattered")


class ExchangeMemory:
    """Bytes each rank holds for one exchange as exchange.owner_exchange runs it, stage by stage:
    its rows of the update (computed when the exchange starts) and the gather's send and receive
    buffers (`started`); the matrices it owns assembled, beside the receive buffer; batch by
    batch, the assembled matrices not yet orthogonalized and the results made so far (together
    at most one full matrix per owned matrix: `results`) beside a batch's call (`computing`: its
    Newton-Schulz, result included, and its batched input); the scatter's send and receive
    buffers beside the results. Built one batch at a time (`add`); `largest`: the most any rank
    holds."""

    def __init__(self, matrices: Sequence[Matrix], owners: Sequence[int], element_bytes: int):
        self.matrices, self.owners, self.element_bytes = matrices, owners, element_bytes
        self.bytes = {stage: {} for stage in _STAGES}  # stage -> {rank: bytes}
        self.largest = 0

    def _added(self, batch: Sequence[int]) -> dict[str, dict[int, int]]:
        """Each touched rank's bytes per stage with `batch` added."""
        eb, added = self.element_bytes, {stage: {} for stage in _STAGES}

        def add(stage, rank, nbytes):
            added[stage][rank] = added[stage].get(rank, self.bytes[stage].get(rank, 0)) + nbytes

        calls: dict[int, list] = {}  # owner -> [Newton-Schulz bytes, input bytes, matrices, state?]
        for i in batch:
            matrix, owner = self.matrices[i], self.owners[i]
            layout, size = matrix.layout, matrix.layout.num_rows * matrix.width * eb
            for shard, rows in layout.nonempty_shards:
                for rank in layout.holders(shard):
                    add("local", rank, rows * matrix.width * eb)
            for stage, traffic in (("gathered", gather_traffic(matrix, owner, eb)),
                                   ("scattered", scatter_traffic(matrix, owner, eb))):
                for rank, (into, out) in traffic.items():
                    add(stage, rank, into + out)
            if layout.held(owner) < layout.num_rows:
                add("assembled", owner, size)
            add("results", owner, size)
            call = calls.setdefault(owner, [0, 0, 0, False])
            call[0] += newton_schulz_bytes(matrix, eb)
            call[1] += math.prod(matrix.shape) * eb
            call[2] += 1
            call[3] |= bool(matrix.state_cols)
        for owner, (newton_schulz, stacked, count, with_state) in calls.items():
            # One matrix runs alone; several are stacked into one batched input first, as is
            # the update part of a matrix assembled with its state.
            call = newton_schulz + (stacked if count > 1 or with_state else 0)
            added["computing"][owner] = max(self.bytes["computing"].get(owner, 0), call)
        return added

    def _largest_with(self, added: dict[str, dict[int, int]]) -> int:
        touched = set().union(*added.values())
        return max([self.largest] + [self.peak(rank, added) for rank in touched])

    def grown(self, batch: Sequence[int]) -> int:
        """`largest` were `batch` added."""
        return self._largest_with(self._added(batch))

    def add(self, batch: Sequence[int]) -> None:
        added = self._added(batch)
        self.largest = self._largest_with(added)
        for stage, counts in added.items():
            self.bytes[stage].update(counts)

    def _get(self, stage: str, rank: int, added=None) -> int:
        if added and rank in added[stage]:
            return added[stage][rank]
        return self.bytes[stage].get(rank, 0)

    def ranks(self) -> set[int]:
        """The ranks holding anything for this exchange."""
        return set().union(*self.bytes.values())

    def started(self, rank: int) -> int:
        return self._get("local", rank) + self._get("gathered", rank)

    def peak(self, rank: int, added=None) -> int:
        local, gathered, assembled, results, computing, scattered = (
            self._get(stage, rank, added) for stage in _STAGES)
        return local + max(gathered + assembled, results + computing, results + scattered)


def exchange_batches(matrices: Sequence[Matrix], batches: Sequence[Sequence[int]],
                     owners: Sequence[int], element_bytes: int,
                     max_bytes: int) -> list[list[list[int]]]:
    """Consecutive batches packed into exchanges, each holding at most `max_bytes` on any rank
    (ExchangeMemory.largest; at least one batch each): an exchange carries all its batches'
    rows in one collective per direction, whatever their shapes."""
    exchanges: list[list[list[int]]] = []
    memory = None
    for batch in batches:
        if memory is None or memory.grown(batch) > max_bytes:
            exchanges.append([])
            memory = ExchangeMemory(matrices, owners, element_bytes)
        exchanges[-1].append(list(batch))
        memory.add(batch)
    return exchanges


def largest_alone(matrices: Sequence[Matrix], owners: Sequence[int], element_bytes: int) -> int:
    """The most any rank holds for one matrix exchanged alone: below it no budget goes."""
    largest = 0
    for i in range(len(matrices)):
        memory = ExchangeMemory(matrices, owners, element_bytes)
        memory.add([i])
        largest = max(largest, memory.largest)
    return largest


def working_memory(matrices: Sequence[Matrix], owners: Sequence[int],
                   exchanges: Sequence[Sequence[Sequence[int]]], element_bytes: int) -> list[int]:
    """Each rank's most bytes held at once by the owner step: an exchange at its peak beside the
    next one started (exchange.run_overlapped keeps two in flight)."""
    held = [0] * (matrices[0].layout.ranks if matrices else 0)
    memories = []
    for batches in exchanges:
        memory = ExchangeMemory(matrices, owners, element_bytes)
        for batch in batches:
            memory.add(batch)
        memories.append(memory)
    for memory, following in zip(memories, memories[1:] + [None]):
        for rank in memory.ranks() | (following.ranks() if following else set()):
            held[rank] = max(held[rank], memory.peak(rank)
                             + (following.started(rank) if following else 0))
    return held


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


def state_saved(matrices: Sequence[Matrix], element_bytes: int) -> list[int]:
    """What Muon's one state element (momentum) per element saves each rank of the group against
    Adam's two (exp_avg, exp_avg_sq), on the rows of the matrices it holds, less a variant's
    second moment (AdaMuon's, as large as Adam's, saves nothing)."""
    saved = [0] * (matrices[0].layout.ranks if matrices else 0)
    for matrix in matrices:
        for rank in range(len(saved)):
            saved[rank] += (matrix.layout.held(rank) * (matrix.cols - matrix.moment2_cols)
                            * element_bytes)
    return saved


def affordable_bytes(matrices: Sequence[Matrix], element_bytes: int) -> int:
    """The default working-memory budget: what Muon's state saves the rank of the group that
    saves least (state_saved), so that no rank's step holds more than Adam's state would have;
    a matrix that alone needs more still goes alone, the floor. At least one byte."""
    return max(1, min(state_saved(matrices, element_bytes), default=1))


def exchange_budget(matrices: Sequence[Matrix], element_bytes: int,
                    max_exchange_bytes: int | None) -> int:
    """The working-memory budget a group is planned within: `max_exchange_bytes`, or where it
    is None (the default), affordable_bytes."""
    if max_exchange_bytes is None:
        return affordable_bytes(matrices, element_bytes)
    return max_exchange_bytes


def owner_plan(matrices: Sequence[Matrix], element_bytes: int, byte_slack: float | None = None,
               max_exchange_bytes: int | None = MAX_EXCHANGE_BYTES,
               cost: StepCost | None = None) -> OwnerPlan:
    """The owner plan ZeROTensorParallelMuon carries out, and the scale model estimates: owners
    by estimated time where `cost` is given (choose_owners_by_time; `byte_slack` caps the extra
    bytes, None: no cap), else fewest bytes first (choose_owners, balancing within `byte_slack`,
    by default BYTE_SLACK). Batches and exchanges keep the step's working memory within
    `max_exchange_bytes` on every rank (working_memory; two exchanges in flight, each within
    half; None: affordable_bytes), except where one matrix alone needs more: it goes alone."""
    share = per_exchange_bytes(exchange_budget(matrices, element_bytes, max_exchange_bytes))
    batches = batch_matrices(matrices, share, element_bytes)
    if cost is None:
        owners = choose_owners(matrices, element_bytes,
                               BYTE_SLACK if byte_slack is None else byte_slack)
    else:
        owners = choose_owners_by_time(matrices, batches, element_bytes, cost, byte_slack)
    return OwnerPlan(owners, batches,
                     exchange_batches(matrices, batches, owners, element_bytes, share))
