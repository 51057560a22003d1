"""Working memory: what an owner holds for a matrix, how batches and exchanges fit a budget
(ExchangeMemory), and the default budget, what Muon's state saves against Adam's."""

import math
from typing import Sequence

from .layouts import Matrix
from .traffic import gather_traffic, scatter_traffic

# The most the owner step's working memory (exchanges in flight, Newton-Schulz) holds at once on a
# rank (--muon-max-exchange-bytes), unless one matrix alone needs more; None: what Muon's state
# saves each rank of the exchange group against Adam's (affordable_bytes).
MAX_EXCHANGE_BYTES = None


IN_FLIGHT = 2  # exchanges holding memory at once (exchange.run_overlapped)


def per_exchange_bytes(max_exchange_bytes: int) -> int:
    """What one batch, and one exchange, may hold of the working-memory budget: the exchanges in
    flight share it."""
    return max_exchange_bytes // IN_FLIGHT


def newton_schulz_bytes(matrix: Matrix, element_bytes: int) -> int:
    """What TensorParallelMuon.orthogonalize holds at once for one m x n matrix (m the smaller
    side), its result included: at most 3mn + 2m^2 elements (emerging_optimizers' newton_schulz
    keeps the iterate, X X^T, its polynomial and the next iterate; memory.AllocationTracker
    measured 3mn + m^2 at fp32 on CPU, test_memory checks the bound). Where the matrix is
    all-gathered first (`tp_gather`: newton_schulz_tp's duplicated mode, over one rank too),
    Newton-Schulz runs on the whole matrix, beside the gathered shards and their concatenation,
    each as large as it."""
    shape = list(matrix.shape)
    gathered = 0
    if matrix.tp_gather:
        dim, shards = matrix.tp_gather
        shape[dim] *= shards
        gathered = 2 * math.prod(shape)
    m, n = sorted(shape)
    return (3 * m * n + 2 * m * m + gathered) * element_bytes


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

    def fits(self, batch: Sequence[int], allowed: dict[int, int]) -> bool:
        """Whether every rank `batch` touches would hold at most `allowed[rank]` with it added."""
        added = self._added(batch)
        return all(self.peak(rank, added) <= allowed[rank] for rank in set().union(*added.values()))

    def _largest_with(self, added: dict[str, dict[int, int]]) -> int:
        touched = set().union(*added.values())
        return max([self.largest] + [self.peak(rank, added) for rank in touched])

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
    """Batches packed into exchanges, first fit in order: a batch joins the first exchange where
    every rank stays within `max_bytes` (ExchangeMemory.peak), or, for a rank whose part of one
    batch alone needs more (a matrix too large for the share, on its owner), within that
    batch's part alone: such a batch holds its owner alone in its exchange, beside other owners'
    matrices. An exchange carries all its batches' rows in one collective per direction,
    whatever their shapes; a rank holds at most the larger of `max_bytes` and its largest batch
    alone in each."""
    exchanges: list[list[list[int]]] = []
    memories: list[ExchangeMemory] = []
    floors: list[dict[int, int]] = []  # per exchange, each rank's largest batch alone
    for batch in batches:
        alone = ExchangeMemory(matrices, owners, element_bytes)
        alone.add(batch)
        batch_floor = {rank: alone.peak(rank) for rank in alone.ranks()}
        for batches_in, memory, floor in zip(exchanges, memories, floors):
            allowed = {rank: max(max_bytes, floor.get(rank, 0), batch_floor.get(rank, 0))
                       for rank in batch_floor.keys() | floor.keys()}
            if memory.fits(batch, allowed):
                break
        else:
            batches_in, memory, floor = [], ExchangeMemory(matrices, owners, element_bytes), {}
            exchanges.append(batches_in), memories.append(memory), floors.append(floor)
        batches_in.append(list(batch))
        memory.add(batch)
        for rank, held in batch_floor.items():
            floor[rank] = max(floor.get(rank, 0), held)
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
    a matrix that alone needs more still goes alone on its owner, the floor. At least one
    byte."""
    return max(1, min(state_saved(matrices, element_bytes), default=1))


def exchange_budget(matrices: Sequence[Matrix], element_bytes: int,
                    max_exchange_bytes: int | None) -> int:
    """The working-memory budget a group is planned within: `max_exchange_bytes`, or where it
    is None (the default), affordable_bytes."""
    if max_exchange_bytes is None:
        return affordable_bytes(matrices, element_bytes)
    return max_exchange_bytes
