"""Who owns each matrix: fewest bytes first with Newton-Schulz balanced (choose_owners), or the
shortest estimated step by measured rates (choose_owners_by_time)."""

import heapq
import math
from dataclasses import dataclass
from typing import Callable, Sequence

from .layouts import Matrix, Nodes
from .traffic import layout_min_bytes, matrix_traffic, owner_traffic

# ZeROTensorParallelMuon's defaults, which the scale model plans with too.
BYTE_SLACK = 0.05  # byte-first owners may move this fraction more than the layout's minimum


class TeamRule:
    """Where a team's block may go, in every owner choice (`barred(i, owners, load)`: the ranks
    matrix i may not go to): off its other blocks' ranks (split as planned) and, with `nodes`,
    on their nodes while those have a rank left, else also on the node whose least loaded ranks
    for the rest of the team have the least `load(rank)`: whole nodes, as few as hold it."""

    def __init__(self, matrices: Sequence[Matrix], nodes: Nodes | None = None):
        by_team: dict[int, list[int]] = {}
        for i, matrix in ((i, m) for i, m in enumerate(matrices) if m.team):
            by_team.setdefault(matrix.team.team, []).append(i)
        self.peers = [tuple(j for j in by_team[m.team.team] if j != i) if m.team else ()
                      for i, m in enumerate(matrices)]
        self.nodes = nodes

    def barred(self, i: int, owners: Sequence[int | None],
               load: Callable[[int], float]) -> "_Barred":
        held = {owners[j] for j in self.peers[i] if owners[j] is not None}
        if not self.nodes or not self.peers[i]:
            return _Barred(held)
        ranks_on, left = self.nodes.ranks_on, len(self.peers[i]) + 1 - len(held)
        used = {self.nodes.of_rank[r] for r in held}
        if all(r in held for node in used for r in ranks_on[node]):
            used.add(min((node for node in ranks_on if node not in used), key=lambda node: (
                sum(sorted(map(load, ranks_on[node]))[:left]), node)))
        return _Barred(held, {r for node in used for r in ranks_on[node]})

    def largest_first(self, cost: Sequence[float]) -> list[int]:
        """Matrices by `cost`, largest first, a team's blocks one after another at its largest's."""
        keys = [(-max(cost[j] for j in (i, *p)), min((i, *p)), i) for i, p in enumerate(self.peers)]
        return sorted(range(len(cost)), key=keys.__getitem__)


@dataclass(frozen=True)
class _Barred:
    """Ranks owning a peer, and every rank off the team's nodes (`allowed`: theirs; None: all)."""
    held: set
    allowed: set | None = None

    def __contains__(self, rank: int) -> bool:
        return rank in self.held or (self.allowed is not None and rank not in self.allowed)

    def open(self) -> list[int]:
        """The ranks left on the team's nodes."""
        return sorted(self.allowed - self.held) if self.allowed else []


def choose_owners(matrices: Sequence[Matrix], element_bytes: int, byte_slack: float = 0.05,
                  base: Sequence[float] | None = None, nodes: Nodes | None = None) -> list[int]:
    """One owner per matrix: fewest bytes first, Newton-Schulz load balanced second (a team's
    blocks placed as TeamRule says, on `nodes`), each rank's load starting at `base` (its
    Newton-Schulz FLOPs, one iteration's, in the groups planned before this one; None: 0).

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
    load = list(base) if base else [0] * world
    owners: list = [None] * len(matrices)
    rule = TeamRule(matrices, nodes)
    for i in rule.largest_first(flops):
        blocked = rule.barred(i, owners, load.__getitem__)
        allowed = [r for r in range(world) if r not in blocked]
        cheapest = min(cost[i][r] for r in allowed)
        owners[i] = min((r for r in allowed if cost[i][r] == cheapest), key=lambda r: (load[r], r))
        load[owners[i]] += flops[i]

    budget = byte_slack * layout_min_bytes(matrices, element_bytes)
    while True:
        busiest = max(range(world), key=lambda r: (load[r], -r))
        moves = [((cost[i][r] - cost[i][busiest]) / flops[i], -flops[i], i, r)
                 for i in range(len(matrices)) if owners[i] == busiest and flops[i]
                 for blocked in [rule.barred(i, owners, load.__getitem__)]
                 for r in range(world)
                 if r != busiest and load[r] + flops[i] < load[busiest]
                 and cost[i][r] - cost[i][busiest] <= budget and r not in blocked]
        if not moves:
            return owners
        _, _, i, r = min(moves)
        budget -= cost[i][r] - cost[i][busiest]
        load[busiest] -= flops[i]
        load[r] += flops[i]
        owners[i] = r


def whole_matrix_owners(matrices: Sequence[Matrix], nodes: Nodes | None = None) -> list[int]:
    """megatron-core's LayerWiseDistributedOptimizer placement: whole matrices, largest first,
    each to the rank holding the fewest elements so far; where the rows lie plays no part (teams
    as TeamRule places them)."""
    world = matrices[0].layout.ranks if matrices else 0
    load, owners = [0] * world, [None] * len(matrices)
    rule = TeamRule(matrices, nodes)
    for i in rule.largest_first([math.prod(matrix.shape) for matrix in matrices]):
        blocked = rule.barred(i, owners, load.__getitem__)
        owners[i] = min((r for r in range(world) if r not in blocked), key=lambda r: (load[r], r))
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
                      cost: StepCost, base: Sequence[float] | None = None) -> list[float]:
    """Each rank's estimated owner step: its Newton-Schulz seconds plus the larger of the bytes it
    receives and sends over the bandwidth, after `base` (its seconds in the groups planned
    before this one, whose exchanges run interleaved with this one's; None: 0)."""
    received, sent = owner_traffic(matrices, owners, element_bytes)
    base = base or [0.0] * len(received)
    return [before + seconds + max(into, out) / cost.bytes_per_second for before, seconds, into, out
            in zip(base, newton_schulz_seconds(matrices, owners, batches, cost), received, sent)]


def rank_loads(matrices: Sequence[Matrix], owners: Sequence[int], batches: Sequence[Sequence[int]],
               element_bytes: int, cost: StepCost | None) -> list[float]:
    """Each rank's load in a group's plan, as its owners were chosen by it: its estimated seconds
    (estimated_seconds) with `cost`, else its Newton-Schulz FLOPs of one iteration
    (choose_owners'). The `base` of a group whose exchanges run interleaved with these."""
    if cost is not None:
        return estimated_seconds(matrices, owners, batches, element_bytes, cost)
    load = [0.0] * (matrices[0].layout.ranks if matrices else 0)
    for matrix, owner in zip(matrices, owners):
        load[owner] += matrix.ns_flops(steps=1)
    return load


class _Loads:
    """Each rank's estimated seconds while owners are placed or moved: one Newton-Schulz call per
    matrix it owns (StepCost.call_seconds(matrix, 1)) plus the larger of the bytes it receives
    and sends over the bandwidth; and the bytes moved beyond the layout's minimum."""

    # Owners considered for a matrix in a large group: the ranks holding its rows and this many
    # of the least busy; a move off the busiest rank is sought among its this many slowest.
    CANDIDATES = 16

    def __init__(self, matrices: Sequence[Matrix], element_bytes: int, cost: StepCost,
                 base: Sequence[float] | None = None, nodes: Nodes | None = None):
        self.matrices, self.element_bytes, self.cost = matrices, element_bytes, cost
        self.world = matrices[0].layout.ranks
        self.single = [cost.call_seconds(m, 1) for m in matrices]
        self.least_bytes = [m.least_bytes(element_bytes) for m in matrices]
        self.busy = list(base) if base else [0.0] * self.world
        self.received, self.sent = [0] * self.world, [0] * self.world
        self.owners: list[int | None] = [None] * len(matrices)
        self.rule = TeamRule(matrices, nodes)
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
        matrix, layout, eb = self.matrices[i], self.matrices[i].layout, self.element_bytes
        bytes_in, bytes_out = matrix.gather_width * eb, matrix.scatter_width * eb
        if rank == owner:
            return (self.single[i], (layout.num_rows - layout.held(rank)) * bytes_in,
                    (layout.held_by_all - layout.held(rank)) * bytes_out)
        return 0.0, layout.held(rank) * bytes_out, layout.held(rank) * bytes_in

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
        """(seconds, extra bytes, rank) of the owner of matrix i, among `least_busy`, its rows'
        holders and what its team's nodes leave (TeamRule), that leaves the old and new owner
        least busy (move_seconds), extra bytes within `budget`, both below `below`; else None."""
        layout = self.matrices[i].layout
        holders = (r for shard, _ in layout.nonempty_shards for r in layout.holders(shard))
        options, barred = [], self.rule.barred(i, self.owners, self.seconds)
        for r in sorted(set(least_busy).union(holders, barred.open())):
            if r in barred:
                continue
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
                 budget: float, base: Sequence[float] | None, nodes: Nodes | None) -> list[int]:
    """Longest-processing-time-first on estimated seconds: each matrix, slowest first, to the
    rank whose choice leaves the ranks it moves bytes for least busy (_Loads.best_owner), extra
    bytes within `budget` (else where it moves the fewest bytes)."""
    loads = _Loads(matrices, element_bytes, cost, base, nodes)
    for i in loads.rule.largest_first(loads.single):
        best = loads.best_owner(i, budget, loads.least_busy())
        barred = loads.rule.barred(i, loads.owners, loads.seconds)
        loads.place(i, best[2] if best else min(
            (r for r in range(loads.world) if r not in barred),
            key=lambda r: (matrices[i].bytes_to_owner(r, element_bytes), r)))
    return loads.owners


def _improved(matrices: Sequence[Matrix], owners: Sequence[int], element_bytes: int,
              cost: StepCost, budget: float, base: Sequence[float] | None,
              nodes: Nodes | None) -> list[int]:
    """`owners` with matrices moved off the busiest rank while a move leaves the old and the new
    owner below that rank's seconds, extra bytes within `budget`; at most as many moves as
    matrices (moves are judged on the two owners alone, so a bound keeps replicas' shifts from
    cycling)."""
    loads = _Loads(matrices, element_bytes, cost, base, nodes)
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
                          element_bytes: int, cost: StepCost, byte_slack: float | None = None,
                          base: Sequence[float] | None = None,
                          nodes: Nodes | None = None) -> list[int]:
    """One owner per matrix, for the shortest estimated step (`estimated_seconds`' busiest
    rank), among: the byte-first owners (choose_owners), whole matrices spread by size
    (whole_matrix_owners), and the byte-first and longest-processing-time-first owners each
    improved by moves off the busiest rank (_improved); the byte-first owners stay unless the
    fastest stays faster with Newton-Schulz or bytes dearer by the rates' spread.
    Extra bytes over the layout's minimum stay within `byte_slack` times it (None: no cap; the
    byte-first owners always qualify); ties go to fewer bytes. `base`: each rank's seconds in
    the groups planned before this one, whose exchanges run interleaved with this one's (the
    byte-first owners balance FLOPs and weigh none). Teams go on `nodes` as TeamRule says."""
    if not matrices:
        return []
    minimum = layout_min_bytes(matrices, element_bytes)
    budget = math.inf if byte_slack is None else byte_slack * minimum
    byte_first = choose_owners(matrices, element_bytes, BYTE_SLACK if byte_slack is None
                               else min(byte_slack, BYTE_SLACK), nodes=nodes)
    candidates = [byte_first, whole_matrix_owners(matrices, nodes)] + [
        _improved(matrices, start, element_bytes, cost, budget, base, nodes)
        for start in (byte_first,
                      _lpt_by_time(matrices, element_bytes, cost, budget, base, nodes))]

    def moved(owners):
        return sum(m.bytes_to_owner(o, element_bytes) for m, o in zip(matrices, owners))

    def makespan(owners, weighed=cost):
        return max(estimated_seconds(matrices, owners, batches, element_bytes, weighed, base))

    # (estimated step, bytes, owners) of each candidate, each estimated once.
    scored = [(makespan(owners), moved(owners), owners) for owners in candidates]
    allowed = [score for score in scored if score[1] - minimum <= budget]
    _, _, fastest = min(allowed, key=lambda score: score[:2])
    # Measured figures may be off by their spread. Newton-Schulz seconds follow one rate (but for
    # shapes apart beyond the noise: measured_cost.seconds_beyond_noise), so only Newton-Schulz
    # against bytes can reorder two placements. With no spread (given rates): the fastest.
    dearer = 1 + cost.spread
    return fastest if all(
        makespan(fastest, weighed) < makespan(byte_first, weighed)
        for weighed in (_weighed(cost, dearer, 1.0), _weighed(cost, 1.0, dearer))) else byte_first


def _weighed(cost: StepCost, newton_schulz: float, transfer: float) -> StepCost:
    """`cost` with Newton-Schulz `newton_schulz` times and the bytes `transfer` times as long."""
    return StepCost(lambda matrix, count: newton_schulz * cost.call_seconds(matrix, count),
                    cost.bytes_per_second / transfer)
