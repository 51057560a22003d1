"""Newton-Schulz of a matrix split over a team (plan/team_split.py): each member holds blocks of its
long side (rows of a tall or square matrix, columns of a wide one), and the team orthogonalizes
it as megatron-core's TensorParallelMuon does a param partitioned along that dim in tp_mode
"distributed" (newton_schulz_tp over the team: the norm and each iteration's Gram matrix summed
over it), scaled by get_muon_scale_factor of the whole shape times extra_scale_factor; bit for
bit with even blocks in rank order, else up to the order of those sums. A member whose part is
shorter than the Gram side applies the Gram matrix twice instead of squaring it
(plan.applies_gram_twice): the same polynomial and collectives (docs/design.md, "Teams")."""

import math
from typing import Any

import torch
import torch.distributed as dist
from ..compat import upstream
from ..compat.newton_schulz_loop import coefficients, distributed_newton_schulz
from ..plan import Matrix, applies_gram_twice


def team_orthogonalize(part: torch.Tensor, whole_shape: tuple[int, int], dim: int, group,
                       settings: dict) -> torch.Tensor:
    """This member's part of the orthogonalized whole matrix, from its `part` of it along `dim`
    (over `group`, the team). `settings`: TensorParallelMuon's arguments."""
    steps, coefficient_type = settings["num_ns_steps"], settings["coefficient_type"]
    if applies_gram_twice(min(whole_shape), part.shape[dim]):
        orthogonalized = distributed_newton_schulz(part, steps, coefficient_type, group, dim,
                                                   gram_applied_twice_step)
    else:
        orthogonalized = upstream.newton_schulz_tp(part, steps, coefficient_type, group,
                                                   partition_dim=dim, tp_mode="distributed")
    scale = upstream.get_muon_scale_factor(*whole_shape, mode=settings["scale_mode"])
    return orthogonalized * scale * settings["extra_scale_factor"]


def gram_applied_twice_step(X: torch.Tensor, a: float, b: float, c: float,
                            tp_group) -> torch.Tensor:
    """emerging_optimizers' newton_schulz_step, aX + (bA + cA A)X with A = X X^T summed over
    `tp_group`, computed as aX + A(bX + cAX): no A A, so 6m^2 r FLOPs for X's m rows and r
    columns instead of 4m^2 r + 2m^3."""
    A = X @ X.mT
    dist.all_reduce(A, group=tp_group)
    # Each sum in one addmm, as newton_schulz_step forms B: in bf16 a separate bX + c(AX), two
    # large terms of opposite sign, would round each before they cancel.
    return torch.addmm(X, A, torch.addmm(X, A, X, beta=b, alpha=c), beta=a)


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
    return math.prod(a for a, _, _ in coefficients(steps, coefficient_type))


def reordering_bound(block: Matrix, settings: dict) -> float:
    """The most a team's update may lie from the whole matrix's, elementwise, at fp32: the team
    sums the norm and each Gram matrix over its members, reordering fp32 sums of up to the long
    side's length (a member applying the Gram matrix twice associates sums of the Gram side's
    length otherwise), which changes them by at most that many units of 2^-24 of their scale;
    normalizing at most doubles that, Newton-Schulz amplifies it at most by its gain
    (newton_schulz_gain), and Muon's scale factor scales the update. `settings`:
    TensorParallelMuon's arguments."""
    rho = max(block.team.whole) * 2.0 ** -24
    gain = newton_schulz_gain(settings["coefficient_type"], settings["num_ns_steps"])
    scale = upstream.get_muon_scale_factor(*block.team.whole, mode=settings["scale_mode"])
    return 2 * gain * rho * scale * settings["extra_scale_factor"]
