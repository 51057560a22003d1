"""Newton-Schulz of a matrix split over a team (plan/teams.py): each member holds row blocks of a
tall or square matrix, and the team orthogonalizes it together as megatron-core's
TensorParallelMuon does a row-partitioned param (partition_dim 0) in tp_mode "distributed":
emerging_optimizers' newton_schulz_tp over the team's group (the norm and each iteration's Gram
matrix X X^T summed over it), then get_muon_scale_factor of the whole matrix's shape times
extra_scale_factor. With even blocks held in rank order it is that computation bit for bit;
otherwise it differs from it by the order of those sums (docs/design.md, "Teams")."""

from typing import Any

import torch

from ..compat import upstream


def team_orthogonalize(rows: torch.Tensor, whole_shape: tuple[int, int], group,
                       settings: dict) -> torch.Tensor:
    """This member's rows of the orthogonalized whole matrix, from its `rows` of it (over
    `group`, the team). `settings`: TensorParallelMuon's arguments."""
    orthogonalized = upstream.newton_schulz_tp(
        rows, settings["num_ns_steps"], settings["coefficient_type"], group, partition_dim=0,
        tp_mode="distributed")
    scale = upstream.get_muon_scale_factor(*whole_shape, mode=settings["scale_mode"])
    return orthogonalized * scale * settings["extra_scale_factor"]


def orthogonalized_by_team(muon: Any, plan: Any, owned: list[int],
                           fulls: list[torch.Tensor]) -> list[torch.Tensor]:
    """The results of the blocks of one team this rank owns (`owned`, in row order, and their
    assembled rows `fulls`): its blocks together are its rows of the team's matrix. A team whose
    blocks all landed on this rank holds the whole matrix: orthogonalized as any whole one."""
    first = plan.matrices[owned[0]]
    rows = torch.cat(fulls) if len(fulls) > 1 else fulls[0]
    group = plan.team_groups.get(first.team.team)
    if group is None:
        result = muon.orthogonalize_full(plan.param_of(owned[0]), rows)
    else:
        result = team_orthogonalize(rows, (first.team.rows, first.cols), group,
                                    muon.newton_schulz_settings)
    return list(result.split([full.shape[0] for full in fulls]))
