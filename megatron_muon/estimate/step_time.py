"""A planned step's figures (estimate.parts' Planned), charged in the order the step pays them:
each exchange's gather, Newton-Schulz and scatter per rank (exchange_costs), the exchanges in
the order the step's own drivers run them (exchange_order), each rank's time through them with
every all-to-all ending with its group's slowest rank (in_order); per step, its slowest rank's
seconds and where they go, its collectives and their latency."""

from collections.abc import Sequence

from ..distribution.exchange import exchange_rounds, run_overlapped
from ..plan import (gather_traffic, newton_schulz_flops, newton_schulz_seconds, owner_traffic,
                    ring_bytes, scatter_traffic, step_collectives, team_all_reduces,
                    tiered_seconds)
from .parts import ELEMENT_BYTES, Part, Planned

# One exchange's stages as a rank meets them (distribution.exchange.owner_exchange): its gather
# issued; its gather awaited, Newton-Schulz run, its scatter issued; its scatter awaited, its
# rows applied.
GATHER, NEWTON_SCHULZ, SCATTER, APPLIED = "gather", "newton_schulz", "scatter", "applied"
SYRK = "syrk"  # Newton-Schulz with the SYRK kernel, in its place
GROUP = "group"  # each rank's process group in an exchange (in_order)
# An exchange with matrices that gather inside backward (--muon-gather-inside-backward, the
# plan's `early`, in its first `ahead` exchanges): their gather's seconds (GATHER: the rest's, at
# the step), and each rank's share of the last micro-batch's backward still to run once the last
# of their gradients is reduced (BackwardGather starts it then); None: nothing gathered ahead.
GATHER_AHEAD, READY = "gather_ahead", "ready"
# Each rank's figures its exchanges add up (planned_step's per_rank).
TOTALS = ("ns_flops", "ns_seconds", "syrk_seconds", "received", "sent", "network_seconds")
# The modes whose owners a part planned beside the dense part changes (Part's `base`).
JOINT_MODES = ("owner", "owner-by-bytes", "teams")


def exchange_order(exchanges: Sequence[int], together: bool) -> list[tuple[str, int, int]]:
    """(stage, stream, exchange) in the order one rank meets them, stream s (a part's) of
    `exchanges[s]` exchanges, run as the step runs them: each stream by run_overlapped, one after
    another (ZeROTensorParallelMuon.step, parts apart), or `together` in rounds (exchange_rounds:
    planner.interleaving's Interleaved.step). The order is the drivers' own: they run here on
    stand-ins that yield where owner_exchange yields."""
    order = []

    def stand_in(s: int, k: int):
        order.append((GATHER, s, k))
        yield
        order.extend([(NEWTON_SCHULZ, s, k), (SCATTER, s, k)])
        yield
        order.append((APPLIED, s, k))

    def stream(s: int):
        return (stand_in(s, k) for k in range(exchanges[s]))

    if together:
        run_overlapped(exchange_rounds([stream(s) for s in range(len(exchanges))]))
    else:
        for s in range(len(exchanges)):
            run_overlapped(stream(s))
    return order


def in_order(order: Sequence[tuple[str, int, int]], stages: dict, ranks: int,
             newton_schulz: str = NEWTON_SCHULZ, backward: tuple[float, float] = (0.0, 0.0)
             ) -> dict:
    """Each rank's time through `order` (exchange_order), `stages[stream, exchange]` that
    exchange's {stage: each rank's seconds} (Newton-Schulz's as `newton_schulz` says) and, as
    GROUP, each rank's process group in it (absent: one group of every rank). An all-to-all
    starts on a rank when the rank issues it and its collective before has ended (a rank's
    collectives run one after another), and ends with its group's slowest rank's part (none is
    issued in a group where no rank moves anything); Newton-Schulz starts once its gather has
    ended, and the rows are applied once its scatter has. The step's seconds (its slowest
    rank's, from backward's end) and its critical path: the gathers', Newton-Schulz's and the
    scatters' seconds on the chain of stages that ends last, each stage waiting for the one
    that ended latest before it.

    The gathers inside backward (GATHER_AHEAD, where READY) run first, in the order they become
    ready, each once its last gradient is reduced, `backward` = (the last micro-batch's
    backward, seconds; the share of the network Megatron-FSDP's own traffic leaves free in it):
    at that share until backward ends, at the whole network after; only what runs after
    backward's end is on the critical path (as the gather's), and an exchange's Newton-Schulz
    waits for both its gathers."""
    clock, via = [0.0] * ranks, [_NONE] * ranks  # each rank's time, and the path to it
    # When each rank's last collective ended, and the path: before the step, when backward began.
    network = [(-backward[0], _NONE)] * ranks
    ended: dict = {}

    def all_to_all(stage: str, s: int, k: int) -> None:
        """Stage `stage` of exchange (s, k) in each group where a rank moves anything: inside
        backward (GATHER_AHEAD) or at the step."""
        seconds = stages[s, k]
        groups: dict = {}
        for r, group in enumerate(seconds.get(GROUP) or [0] * ranks):
            groups.setdefault(group, []).append(r)
        ends = ended.setdefault((stage, s, k), [(0.0, _NONE)] * ranks)
        for members in groups.values():
            ready = (seconds.get(READY) or [None] * ranks)[members[0]]
            inside = stage == GATHER_AHEAD
            if inside and ready is None or not any((seconds.get(stage) or [0] * ranks)[r]
                                                   for r in members):
                continue
            issued = (-ready * backward[0], _NONE) if inside else None
            starts = [max(issued or (clock[r], via[r]), network[r]) for r in members]
            end, start = max((_finish(start[0], seconds[stage][r], backward[1]), start)
                             for r, start in zip(members, starts))
            exposed = max(end, 0.0) - max(start[0], 0.0)
            for r in members:
                network[r] = ends[r] = (end, _plus(start[1], GATHER if inside else stage,
                                                   exposed))

    for _, s, k in sorted((x for x in order if x[0] == GATHER),
                          key=lambda x: -max(r or 0.0 for r in stages[x[1:]].get(READY)
                                             or [0.0])):
        all_to_all(GATHER_AHEAD, s, k)
    for stage, s, k in order:
        seconds = stages[s, k]
        if stage in (GATHER, SCATTER):
            all_to_all(stage, s, k)
            continue
        awaited = [ended[SCATTER, s, k]] if stage == APPLIED else [
            ended[GATHER, s, k], ended.get((GATHER_AHEAD, s, k), [(0.0, _NONE)] * ranks)]
        for r in range(ranks):
            end = max((ends[r] for ends in awaited), key=lambda e: e[0])
            if end[0] > clock[r]:
                clock[r], via[r] = end
            if stage == NEWTON_SCHULZ:
                clock[r] += seconds[newton_schulz][r]
                via[r] = _plus(via[r], NEWTON_SCHULZ, seconds[newton_schulz][r])
    slowest = max(range(ranks), key=clock.__getitem__)
    return dict(seconds=clock[slowest], **dict(zip(_PATH, via[slowest])))


_PATH = (GATHER, NEWTON_SCHULZ, SCATTER)  # a critical path's seconds, in this order
_NONE = (0.0, 0.0, 0.0)


def _finish(start: float, seconds: float, free: float) -> float:
    """When a collective of `seconds` on the whole network, started at `start` (before 0:
    inside backward), ends: at `free` of the network until backward's end (0), at all of it
    after."""
    if start >= 0:
        return start + seconds
    inside = -start * free  # what it can move before backward ends, in whole-network seconds
    return start + seconds / free if seconds <= inside and free else seconds - inside


def _plus(path: tuple, stage: str, seconds: float) -> tuple:
    return tuple(t + seconds if name == stage else t for name, t in zip(_PATH, path))


def planned_step(planned: Planned, mode: str, cost, args, ranks: int,
                 backward: tuple[float, float] = (0.0, 0.0)) -> dict:
    """`planned`'s step in `mode`: each rank's figures over the parts it steps (the dense part
    and its expert group's: exchange_costs' TOTALS, summed), the step in order (in_order over
    exchange_order: the parts one after the other, or, where they run interleaved
    (planned.beside, the owner modes), in rounds) with the plain and the SYRK Newton-Schulz and
    where the slowest rank's time went (`path`), and the collectives and their latency of the
    dense part and of one expert group (the groups run side by side). Every expert group is
    charged as many exchanges as the one with most (its own, where it has fewer, cost
    nothing). Parts packed `ahead` gather their first exchanges inside `backward` (in_order)
    in the owner mode."""
    together = planned.beside is not None and mode in JOINT_MODES
    dense = planned[0][0]
    if together:
        experts = planned.beside
        expert_of = lambda r: (experts[r % planned.ep], r // planned.ep)  # noqa: E731
    elif len(planned) > 1:
        experts = {None: planned[1][0]}
        expert_of = lambda r: (planned[1][0], planned[1][1](r))  # noqa: E731
    else:
        experts, expert_of = {}, None
    costs = {id(part): exchange_costs(part, mode, cost, args.ns_steps, args.gram_bytes)
             for part in [dense, *experts.values()]}
    streams = [[(costs[id(dense)], lambda r: r)] * ranks]
    if expert_of:
        streams.append([(costs[id(part)], lambda r, q=q: q)
                        for part, q in map(expert_of, range(ranks))])
    counts = [max(len(exchanges) for exchanges, _ in stream) for stream in streams]
    stages = {(s, k): {key: [exchanges[k][key][to_part(r)] if k < len(exchanges)
                             else None if key == READY else 0
                             for r, (exchanges, to_part) in enumerate(stream)]
                       for key in (GATHER_AHEAD, GATHER, NEWTON_SCHULZ, SYRK, SCATTER, READY)
                       + TOTALS}
              for s, stream in enumerate(streams) for k in range(counts[s])}
    for k in range(counts[-1] if expert_of else 0):  # dp_cp rank r: expert group r % EP's
        stages[1, k][GROUP] = [r % planned.ep for r in range(ranks)]
    order = exchange_order(counts, together)
    path, syrk_path = (in_order(order, stages, ranks, key, backward)
                       for key in (NEWTON_SCHULZ, SYRK))
    collectives, latency = zip(*(collective_latency(part, mode, args.latency_us_per_rank,
                                                    args.ns_steps)
                                 for part in [dense, *experts.values()]))
    return dict(per_rank=[{key: sum(exchange[key][r] for exchange in stages.values())
                           for key in TOTALS} for r in range(ranks)],
                together=together, seconds=path.pop("seconds"), path=path,
                syrk_seconds=syrk_path["seconds"],
                collectives=collectives[0] + max(collectives[1:], default=0),
                latency=latency[0] + max(latency[1:], default=0.0))


def syrk_share(matrix) -> float:
    """The share of its Newton-Schulz FLOPs a matrix keeps with emerging-optimizers' SYRK kernel
    (newton_schulz_step_tsyrk): per step X X^T (2m^2 n) and A A (2m^3) are symmetric and cost half,
    B X (2m^2 n) does not: (3m^2 n + m^3) / (4m^2 n + 2m^3), m the smaller side."""
    def flops(m, n, syrk):
        return (3 * m * m * n + m ** 3) if syrk else (4 * m * m * n + 2 * m ** 3)

    blocks = [(min(rows, matrix.cols), max(rows, matrix.cols))
              for rows in matrix.row_blocks or (matrix.shape[0],)]
    return sum(flops(m, n, True) for m, n in blocks) / sum(flops(m, n, False) for m, n in blocks)


def collective_latency(part: Part, mode: str, us_per_rank: float,
                       ns_steps: int = 5) -> tuple[int, float]:
    """One step's collectives of `part` in `mode` and their latency, seconds: an all-gather per
    matrix in allgather mode, else each exchange's gather and scatter all-to-alls (those issued
    at the step: plan.step_collectives), and the
    all-reduces of the teams of the rank that takes the longest in them
    (plan.team_all_reduces); each costs `us_per_rank` per rank of its group."""
    if mode == "allgather":
        return len(part.matrices), len(part.matrices) * part.world * us_per_rank * 1e-6
    count = step_collectives(part.matrices, _owners(part, mode), part.exchanges,
                             part.early if mode == "owner" else frozenset())
    teams = team_all_reduces(part.matrices, _owners(part, mode), ns_steps).values()
    slowest = max(teams, default=[], key=lambda calls: sum(size for _, size, _ in calls))
    return (count + len(slowest),
            (count * part.world + sum(size for _, size, _ in slowest)) * us_per_rank * 1e-6)


def _owners(part: Part, mode: str) -> list[int]:
    """The owners `mode` plans: a team Part's owners are ours ("owner")."""
    return part.owners["owner" if mode == "teams" else mode]


def exchange_costs(part: Part, mode: str, cost, ns_steps: int, gram_bytes: int = 4) -> list[dict]:
    """Per exchange of `part` (allgather mode: one, every matrix gathered to every rank), each
    rank's {stage: seconds} (its gather's and scatter's bytes, the larger of in and out, at the
    bandwidth; its Newton-Schulz, plain and with the SYRK kernel, with its teams' all-reduces,
    which run inside it) and the TOTALS a rank's exchanges add up: Newton-Schulz FLOPs (a team
    member's: plan.newton_schulz_flops) and seconds (an owner's matrices of one batch in one
    call: plan.newton_schulz_seconds; with the SYRK kernel each owned matrix in its own call at
    the plain call's rate on the FLOPs it keeps), bytes received and sent (the teams'
    all-reduces' between nodes too: plan.ring_bytes of each Gram matrix, `gram_bytes` an
    element, each way, over the nodes its team is on: part.nodes, else one a rank), and the
    network's seconds (the all-reduces' inside nodes at theirs: plan.tiered_seconds). Every
    mode's exchanges are the plan's (its owners as `mode` chooses). In the owner mode the
    matrices in `part.early` gather inside backward (GATHER_AHEAD, the rest of their exchange
    at the step): their rows carry the old momentum beside the gradient
    (Matrix.carrying_momentum), and READY is the share of backward left once the gradient of
    their first matrix in the model's order, the last reduced (backward runs from the last
    layer), is reduced, taking the matrices as spread evenly over backward."""
    world, matrices, bandwidth = part.world, part.matrices, cost.bytes_per_second
    if mode == "allgather":  # every rank gathers every matrix (padded shards) and runs it alone
        seconds = sum(cost.call_seconds(m, 1) for m in matrices)
        syrk = sum(cost.call_seconds(m, 1) * syrk_share(m) for m in matrices)
        moved = sum((m.layout.ranks - 1) * m.layout.max_rows * m.cols * ELEMENT_BYTES
                    for m in matrices if len(m.layout.rows) > 1)
        flops = sum(m.ns_flops(ns_steps) for m in matrices)
        return [{GATHER_AHEAD: [0.0] * world, GATHER: [moved / bandwidth] * world,
                 NEWTON_SCHULZ: [seconds] * world,
                 SYRK: [syrk] * world, SCATTER: [0.0] * world, "ns_flops": [flops] * world,
                 "ns_seconds": [seconds] * world, "syrk_seconds": [syrk] * world,
                 "received": [moved] * world, "sent": [moved] * world,
                 "network_seconds": [moved / bandwidth] * world, READY: [None] * world}]
    owners = _owners(part, mode)
    found = []
    for k, batches in enumerate(part.exchanges):
        held = [i for batch in batches for i in batch]
        ms, os = [matrices[i] for i in held], [owners[i] for i in held]
        early = [i for i in held if mode == "owner" and i in part.early]
        figures = {"ns_flops": newton_schulz_flops(ms, os, ns_steps, world),
                   "ns_seconds": newton_schulz_seconds(matrices, owners, batches, cost),
                   "syrk_seconds": [0.0] * world, "received": [0] * world, "sent": [0] * world,
                   READY: [min(early) / len(matrices) if early else None] * world}
        for matrix, owner in zip(ms, os):
            figures["syrk_seconds"][owner] += cost.call_seconds(matrix, 1) * syrk_share(matrix)
        late = [i for i in held if i not in early]
        for stage, direction, moved in ((GATHER_AHEAD, gather_traffic, early),
                                        (GATHER, gather_traffic, late),
                                        (SCATTER, scatter_traffic, held)):
            carried = [matrices[i].carrying_momentum() if stage == GATHER_AHEAD else matrices[i]
                       for i in moved]
            into, out = (owner_traffic(carried, [owners[i] for i in moved], ELEMENT_BYTES,
                                       direction) if moved else ([0] * world, [0] * world))
            figures[stage] = [max(i, o) / bandwidth for i, o in zip(into, out)]
            figures["received"] = [a + b for a, b in zip(figures["received"], into)]
            figures["sent"] = [a + b for a, b in zip(figures["sent"], out)]
        reducing = [0.0] * world  # the teams' all-reduces, inside Newton-Schulz
        for rank, calls in team_all_reduces(ms, os, ns_steps, part.nodes).items():
            wire = round(sum(ring_bytes(elements * spanned / k, spanned, gram_bytes)
                             for elements, k, spanned in calls))
            figures["received"][rank] += wire
            figures["sent"][rank] += wire
            reducing[rank] = sum(tiered_seconds(elements, k, spanned, gram_bytes, bandwidth,
                                                part.nodes) for elements, k, spanned in calls)
        figures[NEWTON_SCHULZ] = [a + b for a, b in zip(figures["ns_seconds"], reducing)]
        figures[SYRK] = [a + b for a, b in zip(figures["syrk_seconds"], reducing)]
        figures["network_seconds"] = [a + g + s + t for a, g, s, t in zip(
            figures[GATHER_AHEAD], figures[GATHER], figures[SCATTER], reducing)]
        found.append(figures)
    return found

