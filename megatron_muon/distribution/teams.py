"""The process groups of the teams that orthogonalize a split matrix together (plan/teams.py),
created once, at construction."""

from typing import Any, Sequence

import torch.distributed as dist

from ..plan import team_members


def _global_members(draft: Any) -> dict[int, tuple[int, ...]]:
    """{team: the global ranks owning its blocks} of a group's draft plan (plan.team_members:
    the teams whose blocks more than one rank owns)."""
    return {team: tuple(sorted(dist.get_global_rank(draft.group, rank) for rank in ranks))
            for team, ranks in team_members(draft.matrices, draft.owned.owners).items()}


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
