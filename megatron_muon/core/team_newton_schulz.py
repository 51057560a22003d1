"""Newton-Schulz of a matrix split over a team (plan/teams.py): each member holds blocks of its
long side (rows of a tall or square matrix, columns of a wide one), and the team orthogonalizes
it together as megatron-core's TensorParallelMuon does a param partitioned along that dim in
tp_mode "distributed": emerging_optimizers' newton_schulz_tp over the team's group (the norm and
each iteration's Gram matrix X X^T summed over it), then get_muon_scale_factor of the whole
matrix's shape times extra_scale_factor. With even blocks held in rank order it is that
computation bit for bit; otherwise it differs from it by the order of those sums
(docs/design.md, "Teams")."""

import math
from typing import Any

import torch
from emerging_optimizers.orthogonalized_optimizers.muon_utils import get_coefficient_iterator

from ..compat import upstream
from ..plan import Matrix


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


def newton_schulz_gain(coefficient_type: str, steps: int) -> float:
    """Newton-Schulz's largest amplification of a change of its normalized input: the slope at 0
    of its composite polynomial (each step's a x + b x^3 + c x^5, b < 0, is steepest there)."""
    coefficients = get_coefficient_iterator(steps, upstream.COEFFICIENT_SETS[coefficient_type],
                                            mode="cycle")
    return math.prod(a for a, _, _ in coefficients)


def reordering_bound(block: Matrix, settings: dict) -> float:
    """The most a team's update may lie from the whole matrix's, elementwise, at fp32: the team
    sums the norm and each Gram matrix over its members, reordering fp32 sums of up to the long
    side's length, which changes them by at most that many units of 2^-24 of their scale;
    normalizing at most doubles that, Newton-Schulz amplifies it at most by its gain
    (newton_schulz_gain), and Muon's scale factor scales the update. `settings`:
    TensorParallelMuon's arguments."""
    rho = max(block.team.whole) * 2.0 ** -24
    gain = newton_schulz_gain(settings["coefficient_type"], settings["num_ns_steps"])
    scale = upstream.get_muon_scale_factor(*block.team.whole, mode=settings["scale_mode"])
    return 2 * gain * rho * scale * settings["extra_scale_factor"]
