"""Working memory: what an owner holds for a matrix, how batches and exchanges fit a budget
(ExchangeMemory), and the default budget, what Muon's state saves against Adam's."""

import math
from typing import Sequence

from .layouts import Matrix
from .traffic import gather_traffic, scatter_traffic

# The most the owner step's working memory (exchanges in flight, Newton-Schulz) holds at once on a
# rank (--muon-max-exchange-bytes), unless its batches alone need more; None: what Muon's state
# saves each rank against Adam's, plus what the step must exceed that by anyway (rank_budgets).
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
    each as large as it. A team's block (plan/team_split.py): its rows beside the whole matrix's
    Gram side (Matrix.gram_side). Where Gram Newton-Schulz runs on it (Matrix.gram): 3mn + 5m^2
    (the iterate, the next one at a restart or the end, the result; R, Q, Z, R Z, the next R:
    measured so at fp32, test_memory checks the bound)."""
    shape = list(matrix.shape)
    gathered = 0
    if matrix.tp_gather:
        dim, shards = matrix.tp_gather
        shape[dim] *= shards
        gathered = 2 * math.prod(shape)
    m, n = (matrix.gram_side, matrix.long_side) if matrix.team else sorted(shape)
    runs_gram = matrix.team_gram if matrix.team else (
        matrix.gram and matrix.gram.runs_on(*matrix.shape))
    squares = 5 if runs_gram else 2
    return (3 * m * n + squares * m * m + gathered) * element_bytes


def owner_bytes(matrix: Matrix, element_bytes: int) -> int:
    """The most an owner holds for one matrix of a batch it orthogonalizes: its rows of the
    update, the assembled matrix, its copy in the batched call's input, and what
    newton_schulz_bytes says (the result included)."""
    return 3 * math.prod(matrix.shape) * element_bytes + newton_schulz_bytes(matrix, element_bytes)


def batch_matrices(matrices: Sequence[Matrix], max_bytes: int, element_bytes: int) -> list[list[int]]:
    """Matrices of one batch key (same shape, same orthogonalization) in batches whose owner_bytes
    add up to at most `max_bytes` (at least one matrix each, whoever owns them), in
    first-appearance order; the blocks of a team (plan/team_split.py) in one batch, whatever their
    bytes: its members orthogonalize it together, in one exchange."""
    by_key: dict[tuple, list[list[int]]] = {}
    for i, matrix in enumerate(matrices):
        key = (matrix.team.team,) if matrix.team else (matrix.shape, matrix.batch_key)
        batches = by_key.setdefault(key, [[]])
        if (batches[-1] and not matrix.team
                and (len(batches[-1]) + 1) * owner_bytes(matrix, element_bytes) > max_bytes):
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
    buffers beside the results. A matrix gathered inside backward (Matrix.gathered_ahead): only
    its owner holds rows and a receive buffer (what GatheredAhead keeps), its holders sent
    theirs. Built one batch at a time (`add`); `largest`: the most any rank holds."""

    def __init__(self, matrices: Sequence[Matrix], owners: Sequence[int], element_bytes: int):
        self.matrices, self.owners, self.element_bytes = matrices, owners, element_bytes
        self.bytes = {stage: {} for stage in _STAGES}  # stage -> {rank: bytes}
        self.batches: list[list[int]] = []
        self.largest = 0

    def added(self, batch: Sequence[int]) -> dict[str, dict[int, int]]:
        """Each touched rank's bytes per stage with `batch` added (what `peak` and `started`
        take as `added`)."""
        eb, added = self.element_bytes, {stage: {} for stage in _STAGES}

        def add(stage, rank, nbytes):
            added[stage][rank] = added[stage].get(rank, self.bytes[stage].get(rank, 0)) + nbytes

        calls: dict[int, list] = {}  # owner -> [Newton-Schulz bytes, input bytes, matrices, state?]
        for i in batch:
            matrix, owner = self.matrices[i], self.owners[i]
            layout = matrix.layout
            for shard, rows in layout.nonempty_shards:
                for rank in layout.holders(shard):
                    if rank == owner or not matrix.gathered_ahead:
                        add("local", rank, rows * matrix.gather_width * eb)
            for stage, traffic in (("gathered", gather_traffic(matrix, owner, eb)),
                                   ("scattered", scatter_traffic(matrix, owner, eb))):
                sent = stage == "scattered" or not matrix.gathered_ahead
                for rank, (into, out) in traffic.items():
                    add(stage, rank, into + out * sent)
            if layout.held(owner) < layout.num_rows:
                add("assembled", owner, layout.num_rows * matrix.gather_width * eb)
            add("results", owner, layout.num_rows * matrix.scatter_width * eb)
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

    def add(self, batch: Sequence[int]) -> None:
        added = self.added(batch)
        self.largest = self._largest_with(added)
        for stage, counts in added.items():
            self.bytes[stage].update(counts)
        self.batches.append(list(batch))

    def _get(self, stage: str, rank: int, added=None) -> int:
        if added and rank in added[stage]:
            return added[stage][rank]
        return self.bytes[stage].get(rank, 0)

    def ranks(self) -> set[int]:
        """The ranks holding anything for this exchange."""
        return set().union(*self.bytes.values())

    def started(self, rank: int, added=None) -> int:
        return self._get("local", rank, added) + self._get("gathered", rank, added)

    def peak(self, rank: int, added=None) -> int:
        local, gathered, assembled, results, computing, scattered = (
            self._get(stage, rank, added) for stage in _STAGES)
        return local + max(gathered + assembled, results + computing, results + scattered)


def exchange_batches(matrices: Sequence[Matrix], batches: Sequence[Sequence[int]],
                     owners: Sequence[int], element_bytes: int, budgets: Sequence[int],
                     apart: int | None = None) -> list[list[list[int]]]:
    """Batches packed into exchanges, first fit in order: a batch joins the first exchange where
    every rank r it touches stays within `budgets[r]` with two exchanges in flight
    (working_memory's count: an exchange at its peak beside the next one started, the one
    before at its peak beside this one started); the last exchange keeps room for the largest
    start of any batch still to come, so that one opening an exchange after it fits. A batch
    that joins none opens the next exchange. With every budget at least alone_working's,
    every rank's working memory stays within its budget. An exchange carries all its batches'
    rows in one collective per direction, whatever their shapes. `apart`: the batches from
    this one on join none of the exchanges those before opened (the gather inside backward's,
    packed apart)."""
    alone = _alone(matrices, owners, batches, element_bytes)
    memories: list[ExchangeMemory] = []
    opened = 0  # the first exchange the next batch may join
    for j, (batch, later) in enumerate(zip(batches, _later_starts(alone))):
        opened = len(memories) if j == apart else opened
        for k in range(opened, len(memories)):
            if _fits(memories, k, memories[k].added(batch), later, budgets):
                memories[k].add(batch)
                break
        else:
            memories.append(ExchangeMemory(matrices, owners, element_bytes))
            memories[-1].add(batch)
    return [memory.batches for memory in memories]


def _fits(memories: Sequence[ExchangeMemory], k: int, added: dict, later: dict[int, int],
          budgets: Sequence[int]) -> bool:
    """Whether every rank exchange k touches with `added` stays within its budget at the
    exchange's peak beside the next one started (the last: beside `later`, the largest start
    still to come), and at the one before's peak beside this one started."""
    memory = memories[k]
    before = memories[k - 1] if k > 0 else None
    after = memories[k + 1] if k + 1 < len(memories) else None
    for rank in set().union(*added.values()):
        following = after.started(rank) if after else later.get(rank, 0)
        if memory.peak(rank, added) + following > budgets[rank]:
            return False
        if before and before.peak(rank) + memory.started(rank, added) > budgets[rank]:
            return False
    return True


def _alone(matrices: Sequence[Matrix], owners: Sequence[int], batches: Sequence[Sequence[int]],
           element_bytes: int) -> list[ExchangeMemory]:
    """Each batch exchanged alone."""
    alone = []
    for batch in batches:
        alone.append(ExchangeMemory(matrices, owners, element_bytes))
        alone[-1].add(batch)
    return alone


def _later_starts(alone: Sequence[ExchangeMemory]) -> list[dict[int, int]]:
    """For each batch, {rank: the largest start of any batch after it}."""
    later, largest = [], {}
    for memory in reversed(alone):
        later.append(dict(largest))
        for rank in memory.ranks():
            largest[rank] = max(largest.get(rank, 0), memory.started(rank))
    return later[::-1]


def fewest_exchanges(matrices: Sequence[Matrix], owners: Sequence[int],
                     batches: Sequence[Sequence[int]], element_bytes: int,
                     budgets: Sequence[int]) -> int:
    """A lower bound on the exchanges `budgets` allow these batches: an exchange's peak on a
    rank is at least the sum of its batches' bytes on it in the stages that add up across
    batches (update rows and the gather's buffers beside the assembled matrices; update rows,
    results and the scatter's buffers), so a rank needs at least that sum over all batches,
    over its budget, exchanges. At least one where there are batches."""
    sums: dict[int, list[int]] = {}
    for memory in _alone(matrices, owners, batches, element_bytes):
        for rank in memory.ranks():
            local, gathered, assembled, results, _, scattered = (
                memory.bytes[stage].get(rank, 0) for stage in _STAGES)
            totals = sums.setdefault(rank, [0, 0])
            totals[0] += local + gathered + assembled
            totals[1] += local + results + scattered
    return max([1 if batches else 0] + [math.ceil(max(totals) / budgets[rank])
                                        for rank, totals in sums.items()])


def largest_alone(matrices: Sequence[Matrix], owners: Sequence[int], element_bytes: int) -> int:
    """The most any rank holds for one matrix exchanged alone: below it no budget goes."""
    return max([0] + [memory.largest for memory in
                      _alone(matrices, owners, [[i] for i in range(len(matrices))], element_bytes)])


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


def batches_ahead(matrices: Sequence[Matrix], owners: Sequence[int],
                  batches: Sequence[Sequence[int]], element_bytes: int,
                  saved: Sequence[int]) -> list[bool]:
    """Which batches may gather inside backward, in order: each whose owners still hold, with it,
    at most what Muon's state saves them against Adam's (`saved`). From its gather until the
    step an owner holds its owned matrices whole, momentum beside gradient
    (Matrix.carrying_momentum), during backward, where a run's peak is."""
    held = [0] * (matrices[0].layout.ranks if matrices else 0)
    chosen = []
    for batch in batches:
        adds: dict[int, int] = {}
        for i in batch:
            parts = matrices[i].carrying_momentum()
            adds[owners[i]] = (adds.get(owners[i], 0)
                               + parts.layout.num_rows * parts.gather_width * element_bytes)
        fits = all(held[rank] + more <= saved[rank] for rank, more in adds.items())
        for rank, more in adds.items() if fits else ():
            held[rank] += more
        chosen.append(fits)
    return chosen


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


def batch_bytes(matrices: Sequence[Matrix], element_bytes: int,
                max_exchange_bytes: int | None) -> int:
    """What one batch's owner_bytes may add up to (batch_matrices): half of a budget the user
    set (two exchanges in flight share it), by default the largest matrix's, so that batching
    never makes a call need more than the largest matrix alone. At least one byte."""
    if max_exchange_bytes is not None:
        return max(1, per_exchange_bytes(max_exchange_bytes))
    return max([1] + [owner_bytes(matrix, element_bytes) for matrix in matrices])


def alone_working(matrices: Sequence[Matrix], owners: Sequence[int],
                  batches: Sequence[Sequence[int]], element_bytes: int) -> list[int]:
    """Each rank's working memory with its batches exchanged alone: each at its peak beside the
    largest start of any batch after it (what first fit may place next to it): what its own
    batches need, which no budget goes below."""
    held = [0] * (matrices[0].layout.ranks if matrices else 0)
    alone = _alone(matrices, owners, batches, element_bytes)
    for memory, later in zip(alone, _later_starts(alone)):
        for rank in memory.ranks():
            held[rank] = max(held[rank], memory.peak(rank) + later.get(rank, 0))
    return held


def step_headroom(matrices: Sequence[Matrix], owners: Sequence[int],
                  batches: Sequence[Sequence[int]], element_bytes: int) -> int:
    """How far the step must go above what Muon's state saves a rank in this group, on the rank
    where that is furthest, with every batch exchanged alone (alone_working less state_saved):
    0 where every rank's saving holds its batches alone."""
    return max([0] + [need - kept for need, kept in
                      zip(alone_working(matrices, owners, batches, element_bytes),
                          state_saved(matrices, element_bytes))])


def rank_budgets(matrices: Sequence[Matrix], owners: Sequence[int],
                 batches: Sequence[Sequence[int]], element_bytes: int,
                 max_exchange_bytes: int | None, headroom: int | None,
                 saved: Sequence[int] | None = None,
                 reserved: Sequence[int] | None = None) -> list[int]:
    """Each rank's working-memory budget, two exchanges in flight, never below what the rank's
    own batches need alone (alone_working): `max_exchange_bytes`; or by default what Muon's
    state saves the rank (`saved`: over every exchange group it steps, as they run one after
    the other; None: state_saved, this group's) plus `headroom`, the most the step must exceed
    a rank's saving anyway (step_headroom), and a rank whose batches alone need more than its
    saving holds them and its saving besides; `headroom` None (the state offloaded: device
    memory first): the saving.

    Megatron-FSDP cuts every bucket into equal shards, so ranks differ at rest by what Muon's
    state saves them: by default no rank's peak goes above Adam's state at rest plus the most
    one rank's batches need alone, and where every rank's saving holds its batches alone
    (headroom 0), every rank's step stays within its saving.

    `reserved`: what each rank holds beside this group's exchanges, another group's working
    memory where their exchanges run interleaved (planner.interleaving), taken off its
    budget (its batches alone still fit)."""
    alone = alone_working(matrices, owners, batches, element_bytes)
    if max_exchange_bytes is not None:
        budgets = [max_exchange_bytes] * len(alone)
    elif headroom is None:
        budgets = state_saved(matrices, element_bytes) if saved is None else list(saved)
    else:
        saved = state_saved(matrices, element_bytes) if saved is None else saved
        budgets = [kept + max(headroom, need if need > kept else 0)
                   for kept, need in zip(saved, alone)]
    reserved = reserved or [0] * len(alone)
    return [max(1, budget - held, need) for budget, held, need in zip(budgets, reserved, alone)]
