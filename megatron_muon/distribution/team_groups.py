"""The process groups of the teams that orthogonalize a split matrix together (plan/team_split.py),
created once, at construction, and the nodes they go on; and every matrix assembled whole on
every rank, a team's as the matrix its blocks make (the check interval's reference)."""

import socket
from collections.abc import Callable, Iterator
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..plan import Nodes, team_members
from .exchange import all_gather_rows


def _global_members(draft: Any) -> dict[int, tuple[int, ...]]:
    """{team: the global ranks owning its blocks} of a group's draft plan (plan.team_members:
    the teams whose blocks more than one rank owns)."""
    return {team: tuple(sorted(dist.get_global_rank(draft.group, rank) for rank in ranks))
            for team, ranks in team_members(draft.matrices, draft.owned.owners).items()}


def group_nodes(group, bytes_per_second: float) -> Nodes:
    """The node (host) of each rank of `group`, numbered in the order they first appear (one
    all_gather_object at construction), for owners to place teams on as few nodes as hold them
    (plan.TeamRule); an all-reduce inside one at `bytes_per_second`."""
    names: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, socket.gethostname(), group=group)
    number = {name: i for i, name in enumerate(dict.fromkeys(names))}
    return Nodes(tuple(number[name] for name in names), bytes_per_second)


def create_team_groups(drafts: Sequence[Any]) -> None:
    """Fill each draft's team_groups with a process group for every team of it this rank is a
    member of. torch's new_group is called by every rank of the world, for every group, in one
    order: the members of every rank's teams are gathered first (one all_gather_object over the
    world), so ranks whose exchange groups planned other teams (another expert-parallel rank's,
    another TP rank's) create the same groups in the same order. At W ranks that is one
    collective and a new_group call per distinct team of the whole job, at construction only
    (NCCL makes a team's communicator at its first collective)."""
    members = [_global_members(draft) for draft in drafts]
    mine = sorted({ranks for teams in members for ranks in teams.values()})
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    me = dist.get_rank()
    groups = {}
    for ranks in sorted({tuple(ranks) for gathered in every for ranks in gathered}):
        group = dist.new_group(list(ranks))
        if me in ranks:
            groups[ranks] = group
    for draft, teams in zip(drafts, members):
        draft.team_groups.update({team: groups[ranks] for team, ranks in teams.items()
                                  if me in ranks})


def whole_results(plan: Any, local: dict[int, torch.Tensor],
                  orthogonalize: Callable[[Any, torch.Tensor], torch.Tensor],
                  ) -> Iterator[tuple[int, torch.Tensor]]:
    """(matrix, its whole result) of each matrix of `plan` (a GroupPlan) in plan order, as
    "allgather" mode computes them: each assembled on every rank from every rank's `local` rows
    of it (all_gather_rows) and `orthogonalize(param, whole)`d; a team's blocks once all have
    come, the matrix they make orthogonalized as one, as on a single device, and cut into the
    blocks again (the check interval's reference)."""
    pending: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for i, matrix in enumerate(plan.matrices):
        full = all_gather_rows(local[i], matrix.layout, plan.group)
        team = matrix.team
        if team is None:
            yield i, orthogonalize(plan.param_of(i), full)
            continue
        blocks = pending.setdefault(team.team, [])
        blocks.append((i, full))
        if len(blocks) == team.size:
            whole = orthogonalize(plan.param_of(i),
                                  torch.cat([block for _, block in blocks], dim=team.dim))
            parts = whole.split([block.shape[team.dim] for _, block in blocks], dim=team.dim)
            yield from zip([j for j, _ in pending.pop(team.team)], parts)
