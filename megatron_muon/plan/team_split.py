"""Teams: a matrix whose Newton-Schulz alone is more than balance allows a rank, split over k
ranks along its long side (rows of a tall or square matrix, columns of a wide one), orthogonalized
together in newton_schulz_tp's "distributed" form (the Gram matrix summed over the team each
iteration). Which matrices, and k (team_sizes); the blocks standing for a split matrix
(team_blocks: each a Matrix with its TeamBlock, owned by one member), which the rest of the plan
takes as any matrix, a team's blocks in one batch; what their all-reduces cost."""

import dataclasses
from collections import Counter
from typing import Callable, Sequence

from .layouts import Matrix, Nodes, RowLayout, TeamBlock
from .owners import StepCost

# Nothing is split where every matrix alone costs at most this times the balanced share (the
# group's cost over its ranks): the owner choice balances that well enough (issue 68 holds the
# busiest rank to 1.25x the ideal).
TEAM_ABOVE = 1.25


def can_split(matrix: Matrix) -> bool:
    """Whether a team may orthogonalize `matrix`: orthogonalized whole and plainly (no QKV row
    blocks, no TP Newton-Schulz over several ranks: batch_key None says either), no second
    moment beside it."""
    return (matrix.team is None and matrix.batch_key is not None and matrix.row_blocks is None
            and (matrix.tp_gather or (0, 1))[1] == 1 and not matrix.state_cols
            and not matrix.moment2_cols)


def block_sizes(length: int, k: int) -> list[int]:
    """The length of each of k blocks: as even as they go, the first ones one longer."""
    q, r = divmod(length, k)
    return [q + 1] * r + [q] * (k - r)


def team_blocks(matrix: Matrix, k: int, team: int) -> list[tuple[int, Matrix]]:
    """(first row in `matrix`, block) of `matrix` split over a team of k along its long side
    (block_sizes): row blocks of a tall or square matrix, each with its rows' layout; column
    blocks of a wide one, each with all its rows. Each in the batch of its team alone."""
    blocks, start = [], 0
    dim = TeamBlock(team, matrix.shape, 0, k).dim
    for length in block_sizes(matrix.shape[dim], k):
        if dim == 0:
            shaped = dict(layout=matrix.layout.piece(start, start + length))
        else:
            shaped = dict(cols=length)
        blocks.append((start if dim == 0 else 0, dataclasses.replace(
            matrix, **shaped, batch_key=("team", team),
            team=TeamBlock(team, matrix.shape, start, k))))
        start += length
    return blocks


# What a member's part of a matrix split over k ranks costs (k = 1: the matrix whole), in any unit
# shared by every matrix: `flops_cost` by default; the scale model adds the all-reduces' seconds.
TeamCost = Callable[[Matrix, int], float]


def flops_cost(matrix: Matrix, k: int) -> float:
    """A member's Newton-Schulz FLOPs (one iteration's): the all-reduces not weighed."""
    return matrix.ns_flops(steps=1)


def team_sizes(matrices: Sequence[Matrix], ranks: int, max_team: int,
               cost: TeamCost = flops_cost) -> list[int]:
    """Each matrix's team size (1: whole on one owner), for the shortest step the ranks can
    hold: the least T such that every matrix fits it, whole where it costs at most T alone, else
    over the smallest team whose members each cost at most T (can_split; at most `max_team`,
    the ranks and its long side), and such that the ranks hold it all: the members' and the whole
    matrices' costs add up to at most ranks x T. T by bisection. Nothing is split where every
    matrix alone costs at most TEAM_ABOVE times the balanced share (the group's cost over its
    ranks, every matrix whole): the owner choice balances that well enough."""
    options = {}  # (shape, how it is orthogonalized) -> the least cost a member has by team size
    for matrix in matrices:
        key = _cost_key(matrix)
        if key not in options:
            largest = min(max_team, ranks, max(matrix.shape)) if can_split(matrix) else 1
            options[key] = [cost(matrix, 1)] + [cost(_largest_block(matrix, k), k)
                                                for k in range(2, largest + 1)]
    keys = [_cost_key(matrix) for matrix in matrices]
    share = sum(options[key][0] for key in keys) / max(ranks, 1)
    if max(options[key][0] for key in keys) <= TEAM_ABOVE * share:
        return [1] * len(matrices)

    counts = Counter(keys)

    def sizes(limit: float) -> list[int] | None:
        """The smallest team each matrix fits `limit` in, None where some matrix cannot or the
        ranks cannot hold them all: their costs add up to more than ranks x limit, or more
        parts cost over half the limit than there are ranks (no two of those share one)."""
        found, total, large = {}, 0.0, 0
        for key, count in counts.items():
            k = next((k for k, member in enumerate(options[key], 1) if member <= limit), None)
            if k is None:
                return None
            found[key] = k
            total += count * k * options[key][k - 1]
            large += count * k * (options[key][k - 1] > limit / 2)
        fits = total <= ranks * limit and large <= ranks
        return [found[key] for key in keys] if fits else None

    low, high = share, max(options[key][0] for key in keys)  # all whole: within ranks x high
    for _ in range(40):
        middle = (low + high) / 2
        if sizes(middle) is None:
            low = middle
        else:
            high = middle
    return sizes(high)


def _cost_key(matrix: Matrix) -> tuple:
    """What a matrix's cost, split or whole, depends on: its shape and how it is orthogonalized."""
    return (matrix.shape, matrix.batch_key, matrix.row_blocks, matrix.tp_gather,
            matrix.state_cols, matrix.returned_state_cols, matrix.moment2_cols)


def _largest_block(matrix: Matrix, k: int) -> Matrix:
    """The first (largest) of k blocks, its rows' layout aside (a cost needs its shape alone)."""
    team = TeamBlock(0, matrix.shape, 0, k)
    shape = list(matrix.shape)
    shape[team.dim] = block_sizes(shape[team.dim], k)[0]
    return dataclasses.replace(matrix, layout=RowLayout((shape[0],)), cols=shape[1],
                               batch_key=("team", 0), team=team)


def ring_bytes(elements: int, ranks: int, element_bytes: int) -> float:
    """What each member of a ring all-reduce over `ranks` sends, and receives: 2 (k-1)/k of it."""
    return 2 * (ranks - 1) * elements * element_bytes / ranks


def tiered_seconds(elements: float, k: int, spanned: int, element_bytes: int,
                   bytes_per_second: float, nodes: Nodes | None) -> float:
    """One all-reduce over k ranks on `spanned` nodes, as NCCL's hierarchy runs it: a ring inside
    each node over its k / spanned members (at the nodes' rate), and one between nodes over each
    member's share of the tensor (at `bytes_per_second`); one member a node: a ring (ring_bytes)."""
    here = k / spanned
    inside = ring_bytes(elements, here, element_bytes) / nodes.bytes_per_second if here > 1 else 0
    return inside + ring_bytes(elements / here, spanned, element_bytes) / bytes_per_second


def all_reduce_seconds(block: Matrix, bytes_per_second: float, steps: int, gram_bytes: int,
                       latency: float, nodes: Nodes | None = None) -> float:
    """A team member's all-reduces in one Newton-Schulz call of its `block` (the norm and its
    Gram matrices: `steps` of them, or under Gram Newton-Schulz one a restart and one more,
    Matrix.gram_all_reduces; `gram_bytes` an element, tiered_seconds on the fewest `nodes`
    that hold the team), each with `latency` seconds per rank of the team."""
    k, grams = block.team.size, block.gram_all_reduces(steps)
    spanned = nodes.fewest(k) if nodes else k
    gram = tiered_seconds(block.gram_side ** 2, k, spanned, gram_bytes, bytes_per_second, nodes)
    return grams * gram + (grams + 1) * k * latency


def team_step_cost(cost: StepCost, steps: int, gram_bytes: int, latency: float,
                   seconds_per_flop: float | None = None, nodes: Nodes | None = None) -> StepCost:
    """`cost` with a team's block's call counted whole: its Newton-Schulz (its FLOPs at
    `seconds_per_flop`; None: `cost`'s own call seconds) and its all-reduces
    (all_reduce_seconds, on `nodes`), which the exchange's bytes do not count. Owners by time
    weigh teams' blocks by it, and team_sizes (with k = its blocks) sizes teams by it."""
    def call_seconds(matrix: Matrix, count: int) -> float:
        if not matrix.team:
            return cost.call_seconds(matrix, count)
        ns = (cost.call_seconds(matrix, count) if seconds_per_flop is None
              else count * matrix.ns_flops(steps=1) * seconds_per_flop)
        return ns + all_reduce_seconds(matrix, cost.bytes_per_second, steps, gram_bytes, latency,
                                       nodes)

    return StepCost(call_seconds, cost.bytes_per_second, cost.spread)


def with_teams(matrices: Sequence[Matrix], ranks: int, max_team: int,
               cost: TeamCost = flops_cost) -> list[tuple[int, int, Matrix]]:
    """(index in `matrices`, first row within it, matrix) of what the plan orthogonalizes: each
    matrix whole, or its blocks where team_sizes splits it (the team named by its index; a
    column block's first row is 0)."""
    planned = []
    for index, (matrix, k) in enumerate(zip(matrices, team_sizes(matrices, ranks, max_team,
                                                                  cost))):
        if k == 1:
            planned.append((index, 0, matrix))
        else:
            planned.extend((index, start, block) for start, block in team_blocks(matrix, k, index))
    return planned


def team_members(matrices: Sequence[Matrix], owners: Sequence[int]) -> dict[int, tuple[int, ...]]:
    """{team: the ranks owning its blocks, sorted} for the teams whose blocks more than one rank
    owns (one whose blocks all landed on one rank runs its matrix whole there)."""
    members: dict[int, set[int]] = {}
    for matrix, owner in zip(matrices, owners):
        if matrix.team:
            members.setdefault(matrix.team.team, set()).add(owner)
    return {team: tuple(sorted(ranks)) for team, ranks in members.items() if len(ranks) > 1}


def newton_schulz_flops(matrices: Sequence[Matrix], owners: Sequence[int], steps: int,
                        ranks: int) -> list[int]:
    """Each rank's Newton-Schulz FLOPs as the step runs them: each matrix on its owner
    (Matrix.ns_flops); a team's blocks one call per member, on all its rows of them
    (Matrix.member_flops: their share of X X^T and B X and one A A, or the Gram matrix applied
    twice; under Gram Newton-Schulz its long side's products and the Gram side's)."""
    flops = [0] * ranks
    calls: dict[tuple[int, int], list[Matrix]] = {}
    for matrix, owner in zip(matrices, owners):
        if matrix.team:
            calls.setdefault((owner, matrix.team.team), []).append(matrix)
        else:
            flops[owner] += matrix.ns_flops(steps)
    for (owner, _), blocks in calls.items():
        flops[owner] += blocks[0].member_flops(sum(b.long_side for b in blocks), steps)
    return flops


def team_all_reduces(matrices: Sequence[Matrix], owners: Sequence[int], steps: int,
                     nodes: Nodes | None = None) -> dict[int, list[tuple[int, int, int]]]:
    """{rank: (elements, team size, nodes its members are on) of each all-reduce it takes part
    in}: per team of several members, newton_schulz_tp's norm (one element) and each Gram matrix
    it sums (the whole matrix's Gram side squared; Matrix.gram_all_reduces). Without `nodes`, a
    node each."""
    blocks = {matrix.team.team: matrix for matrix in matrices if matrix.team}
    found: dict[int, list[tuple[int, int, int]]] = {}
    for team, members in team_members(matrices, owners).items():
        k, block = len(members), blocks[team]
        spanned = len({nodes.of_rank[r] for r in members}) if nodes else k
        gram = [(block.gram_side ** 2, k, spanned)] * block.gram_all_reduces(steps)
        for rank in members:
            found.setdefault(rank, []).extend([(1, k, spanned)] + gram)
    return found

