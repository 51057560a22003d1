"""Teams: a matrix whose Newton-Schulz alone is more than balance allows a rank, split over k
ranks along its long side (its rows: only tall or square matrices for now) and orthogonalized
by them together in the distributed form megatron-core runs over tensor-parallel groups
(newton_schulz_tp's "distributed" mode: each member's rows, the Gram matrix X X^T summed over
the team every iteration). Which matrices, and k (team_sizes); the blocks that stand for a split
matrix in the plan (team_blocks: each a Matrix with its TeamBlock, owned by one member); the
rest of the plan (owners, batches, exchanges) takes the blocks as it takes any matrix, a team's
blocks in one batch. Shapes alone, as the rest of the plan."""

import dataclasses
from typing import Sequence

from .layouts import Matrix, TeamBlock

# A matrix is split only where alone it takes more than this times the balanced share (the
# group's Newton-Schulz FLOPs over its ranks): the bound on the busiest rank.
TEAM_ABOVE = 1.25


def can_split(matrix: Matrix) -> bool:
    """Whether a team may orthogonalize `matrix`: tall or square, orthogonalized whole and
    plainly (no QKV row blocks, no TP Newton-Schulz: batch_key None says either), no second
    moment beside it."""
    rows, cols = matrix.shape
    return (matrix.team is None and matrix.batch_key is not None and matrix.row_blocks is None
            and matrix.tp_gather is None and not matrix.state_cols and not matrix.moment2_cols
            and rows >= cols)


def block_rows(rows: int, k: int) -> list[int]:
    """The rows of each of k blocks: as even as they go, the first ones a row longer."""
    q, r = divmod(rows, k)
    return [q + 1] * r + [q] * (k - r)


def team_blocks(matrix: Matrix, k: int, team: int) -> list[tuple[int, Matrix]]:
    """(first row, block) of `matrix` split over a team of k: k row blocks (block_rows), each
    with its rows' layout, in the batch of its team alone."""
    rows, blocks, start = matrix.shape[0], [], 0
    for count in block_rows(rows, k):
        blocks.append((start, dataclasses.replace(
            matrix, layout=matrix.layout.piece(start, start + count), batch_key=("team", team),
            team=TeamBlock(team, rows, start))))
        start += count
    return blocks


def team_sizes(matrices: Sequence[Matrix], ranks: int, max_team: int) -> list[int]:
    """Each matrix's team size (1: whole on one owner). A matrix that can be split (can_split)
    and alone takes more than TEAM_ABOVE times the balanced share of the group's Newton-Schulz
    FLOPs goes to the smallest team whose largest block is within the share, else to the team
    whose largest block is least (the repeated A A sets a floor), at most `max_team`, the ranks
    and its rows; to none where no team beats it whole. By FLOPs: each iteration's all-reduce of
    the Gram matrix is not weighed yet."""
    flops = [matrix.ns_flops(steps=1) for matrix in matrices]
    share = sum(flops) / max(ranks, 1)
    sizes = []
    for matrix, alone in zip(matrices, flops):
        options = range(2, min(max_team, ranks, matrix.shape[0]) + 1)
        if not options or not can_split(matrix) or alone <= TEAM_ABOVE * share:
            sizes.append(1)
            continue
        largest = {k: team_blocks(matrix, k, 0)[0][1].ns_flops(steps=1) for k in options}
        within = [k for k in options if largest[k] <= share]
        k = within[0] if within else min(options, key=lambda k: (largest[k], k))
        sizes.append(k if largest[k] < alone else 1)
    return sizes


def with_teams(matrices: Sequence[Matrix], ranks: int,
               max_team: int) -> list[tuple[int, int, Matrix]]:
    """(index in `matrices`, first row within it, matrix) of what the plan orthogonalizes: each
    matrix whole, or its blocks where team_sizes splits it (the team named by its index)."""
    planned = []
    for index, (matrix, k) in enumerate(zip(matrices, team_sizes(matrices, ranks, max_team))):
        if k == 1:
            planned.append((index, 0, matrix))
        else:
            planned.extend((index, start, block) for start, block in team_blocks(matrix, k, index))
    return planned
