"""A planned step's figures (estimate.parts' Planned): per rank, Newton-Schulz FLOPs and
seconds, bytes and network seconds; per step, its slowest rank's seconds, collectives and their
latency."""

from ..plan import (newton_schulz_flops, newton_schulz_seconds, owner_traffic, ring_bytes,
                    team_all_reduces, tiered_seconds)
from .parts import ELEMENT_BYTES, Part, Planned


def part_step(part: Part, mode: str, cost, args) -> dict:
    """One part's figures in `mode`: per rank (rank_figures), the seconds of its slowest rank
    (its all-to-alls synchronize the part) with and without the SYRK kernel, its collectives
    and their latency."""
    figures = rank_figures(part, mode, cost, args.ns_steps, args.gram_bytes)
    collectives, latency = collective_latency(part, mode, args.latency_us_per_rank, args.ns_steps)
    return dict(figures=figures, collectives=collectives, latency=latency,
                seconds=max(f["ns_seconds"] + f["network_seconds"] for f in figures),
                syrk_seconds=max(f["syrk_seconds"] + f["network_seconds"] for f in figures))


# The modes whose owners a part planned beside the dense part changes (Part's `base`).
JOINT_MODES = ("owner", "owner-by-bytes", "teams")


def planned_step(planned: Planned, mode: str, cost, args, ranks: int) -> dict:
    """`planned`'s step in `mode`: each rank's figures over the parts it steps (the dense part
    and its expert group's), the step's seconds with and without the SYRK kernel, and the
    collectives and their latency of the dense part and of one expert group (the groups run side
    by side). The parts one after the other (each its slowest rank: its all-to-alls synchronize
    it, the groups side by side), or, where they run interleaved (planned.beside, the owner
    modes), both in rounds: each rank's parts together, its slowest rank's (exact where each
    part is one exchange; with more, a round's scatters wait for its slowest rank in that round,
    which this leaves out)."""
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
    figures = {id(part): part_step(part, mode, cost, args)
               for part in [dense, *experts.values()]}
    per_rank = []
    for r in range(ranks):
        sums = dict(figures[id(dense)]["figures"][r])
        if expert_of:
            part, q = expert_of(r)
            for key, value in figures[id(part)]["figures"][q].items():
                sums[key] += value
        per_rank.append(sums)
    parts = [figures[id(part)] for part in experts.values()]

    def slowest(rank_key, part_key):
        """Together: the slowest rank's `rank_key` seconds and network; apart: the dense part's
        `part_key` (its slowest rank's) and the slowest expert group's."""
        if together:
            return max(f[rank_key] + f["network_seconds"] for f in per_rank)
        return figures[id(dense)][part_key] + max([f[part_key] for f in parts], default=0.0)

    return dict(per_rank=per_rank, together=together,
                seconds=slowest("ns_seconds", "seconds"),
                syrk_seconds=slowest("syrk_seconds", "syrk_seconds"),
                collectives=figures[id(dense)]["collectives"] + max(
                    [f["collectives"] for f in parts], default=0),
                latency=figures[id(dense)]["latency"] + max([f["latency"] for f in parts],
                                                            default=0.0))


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
    matrix in allgather mode, else each exchange's gather and scatter all-to-alls, and the
    all-reduces of the teams of the rank that takes the longest in them
    (plan.team_all_reduces); each costs `us_per_rank` per rank of its group."""
    if mode == "allgather":
        return len(part.matrices), len(part.matrices) * part.world * us_per_rank * 1e-6
    count = 2 * len(part.exchanges)
    teams = team_all_reduces(part.matrices, _owners(part, mode), ns_steps).values()
    slowest = max(teams, default=[], key=lambda calls: sum(size for _, size, _ in calls))
    return (count + len(slowest),
            (count * part.world + sum(size for _, size, _ in slowest)) * us_per_rank * 1e-6)


def _owners(part: Part, mode: str) -> list[int]:
    """The owners `mode` plans: a team Part's owners are ours ("owner")."""
    return part.owners["owner" if mode == "teams" else mode]


def rank_figures(part: Part, mode: str, cost, ns_steps: int, gram_bytes: int = 4) -> list[dict]:
    """Per rank of `part`: Newton-Schulz FLOPs (a team member's: plan.newton_schulz_flops) and
    seconds (and seconds with the SYRK kernel: each owned matrix in its own call, at the plain
    call's rate on the FLOPs it keeps), bytes received and sent over the network: the
    exchange's, and its teams' all-reduces' between nodes (plan.ring_bytes of each Gram matrix,
    `gram_bytes` an element, each way, over the nodes its team is on: part.nodes, else one a
    rank); and its network seconds, those bytes' at the bandwidth and the all-reduces' inside
    nodes at theirs (plan.tiered_seconds)."""
    world, matrices = part.world, part.matrices
    flops = [m.ns_flops(ns_steps) for m in matrices]
    if mode == "allgather":  # every rank gathers every matrix (padded shards) and runs it alone
        per_matrix = sum(cost.call_seconds(m, 1) for m in matrices)
        ns_flops, ns_seconds = [sum(flops)] * world, [per_matrix] * world
        syrk_seconds = [sum(cost.call_seconds(m, 1) * syrk_share(m) for m in matrices)] * world
        moved = sum((m.layout.ranks - 1) * m.layout.max_rows * m.cols * ELEMENT_BYTES
                    for m in matrices if len(m.layout.rows) > 1)
        received = sent = [moved] * world
    else:
        owners = _owners(part, mode)
        ns_flops = newton_schulz_flops(matrices, owners, ns_steps, world)
        syrk_seconds = [0.0] * world
        for matrix, owner in zip(matrices, owners):
            syrk_seconds[owner] += cost.call_seconds(matrix, 1) * syrk_share(matrix)
        # an owner's matrices of one batch: one batched call (plan.newton_schulz_seconds)
        ns_seconds = newton_schulz_seconds(matrices, owners, part.batches, cost)
        received, sent = owner_traffic(matrices, owners, ELEMENT_BYTES)
    network = [max(into, out) / cost.bytes_per_second for into, out in zip(received, sent)]
    for rank, calls in (team_all_reduces(matrices, owners, ns_steps, part.nodes).items()
                        if mode != "allgather" else ()):
        wire = round(sum(ring_bytes(elements * spanned / k, spanned, gram_bytes)
                         for elements, k, spanned in calls))
        received[rank] += wire
        sent[rank] += wire
        network[rank] += sum(tiered_seconds(elements, k, spanned, gram_bytes,
                                            cost.bytes_per_second, part.nodes)
                             for elements, k, spanned in calls)
    return [dict(ns_flops=ns_flops[r], ns_seconds=ns_seconds[r], syrk_seconds=syrk_seconds[r],
                 received=received[r], sent=sent[r], network_seconds=network[r])
            for r in range(world)]
