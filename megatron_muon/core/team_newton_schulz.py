"""Newton-Schulz of a matrix split over a team (plan/teams.py): each member holds blocks of its
long side (rows of a tall or square matrix, columns of a wide one), and the team orthogonalizes
it together as megatron-core's TensorParallelMuon does a param partitioned along that dim in
tp_mode "distributed": emerging_optimizers' newton_schulz_tp over the team's group (the norm and
each iteration's Gram matrix X X^T summed over it), then get_muon_scale_factor of the whole
matrix's shape times extra_scale_factor. With even blocks held in rank order it is that computation bit for bit;
otherwise it differs from it by the order of those sums (docs/design.md, "Teams")."""

from typing import Any

import torch

from ..compat import upstream


def team_orthogonalize(part: torch.Tensor, whole_shape: tuple[int, int], dim: int, group,
                       settings: dict) -> torch.Tensor:
    """This member's part of the orthogonalized whole matrix, from its `part` of it along `dim`
    (over `group`, the team). `settings`: TensorParallelMuon's arguments."""
    orthogonalized = upstream.newton_schulz_tp(
        part, settings["num_ns_steps"], settings["coefficient_type"], group, partition_dim=dim,
        tp_mode="distributed")
    scale = upstream.get_muon_scale_factor(*whole_shape, mode=settings["scale_mode"])
    return orthogonalized * scale * settings["extra_scale_factor"]


def orthogonalized_by_team(muon: Any, plan: Any, owned: list[int],
                           fulls: list[torch.Tensor]) -> list[torch.Tensor]:
    """The results of the blocks of one team this rank owns (`owned`, in order, and their
    assembled blocks `fulls`): its blocks together are its part of the team's matrix. A team
    whose blocks all landed on this rank holds the whole matrix: orthogonalized as any whole
    one."""
    team = plan.matrices[owned[0]].team
    part = torch.cat(fulls, dim=team.dim) if len(fulls) > 1 else fulls[0]
    group = plan.team_groups.get(team.team)
    if group is None:
        result = muon.orthogonalize_full(plan.param_of(owned[0]), part)
    else:
        result = team_orthogonalize(part, team.whole, team.dim, group,
                                    muon.newton_schulz_settings)
    return list(result.split([full.shape[team.dim] for full in fulls], dim=team.dim))
