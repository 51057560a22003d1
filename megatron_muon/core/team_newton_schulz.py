"""Newton-Schulz of a matrix split over a team (plan/team_split.py): each member holds blocks of its
long side (rows of a tall or square matrix, columns of a wide one), and the team orthogonalizes
it as megatron-core's TensorParallelMuon does a param partitioned along that dim in tp_mode
"distributed" (newton_schulz_tp over the team: the norm and each iteration's Gram matrix summed
over it), scaled by get_muon_scale_factor of the whole shape times extra_scale_factor; bit for
bit with even blocks in rank order, else up to the order of those sums. A member whose part is
shorter than the Gram side applies the Gram matrix twice instead of squaring it
(plan.applies_gram_twice): the same polynomial and collectives (docs/design.md, "Teams"). Under
--muon-gram-newton-schulz a team runs Gram Newton-Schulz, summing its Gram matrix once at the
start and once a restart (team_gram_newton_schulz)."""

from typing import Any

import torch
import torch.distributed as dist
from emerging_optimizers.orthogonalized_optimizers.muon_utils import distributed_normalize_p2

from ..compat import upstream
from ..compat.newton_schulz_loop import (EPS, coefficients, distributed_newton_schulz,
                                         newton_schulz_gain)
from ..plan import GramSchedule, Matrix, applies_gram_twice
from .gram_newton_schulz import gram_iterations


def team_orthogonalize(part: torch.Tensor, whole_shape: tuple[int, int], dim: int, group,
                       settings: dict, gram: GramSchedule | None = None) -> torch.Tensor:
    """This member's part of the orthogonalized whole matrix, from its `part` of it along `dim`
    (over `group`, the team): under Gram Newton-Schulz where `gram` (Matrix.team_gram) is
    given. `settings`: TensorParallelMuon's arguments."""
    steps, coefficient_type = settings["num_ns_steps"], settings["coefficient_type"]
    if gram is not None:
        orthogonalized = team_gram_newton_schulz(part, gram, coefficient_type, group, dim)
    elif applies_gram_twice(min(whole_shape), part.shape[dim]):
        orthogonalized = distributed_newton_schulz(part, steps, coefficient_type, group, dim,
                                                   gram_applied_twice_step)
    else:
        orthogonalized = upstream.newton_schulz_tp(part, steps, coefficient_type, group,
                                                   partition_dim=dim, tp_mode="distributed")
    scale = upstream.get_muon_scale_factor(*whole_shape, mode=settings["scale_mode"])
    return orthogonalized * scale * settings["extra_scale_factor"]


def team_gram_newton_schulz(part: torch.Tensor, schedule: GramSchedule, coefficient_type: str,
                            group, dim: int) -> torch.Tensor:
    """A team member's part of Gram Newton-Schulz of a matrix split over `group` along `dim`, its
    long side (--muon-gram-newton-schulz): as newton_schulz_tp's distributed form frames it
    (the part transposed where split along dim 0, normalized over the team), each Gram matrix of
    the long side summed over the team, one at the start and one a restart; every member
    iterates on the whole Gram matrix itself, and applies Q to its own columns."""
    x = part.mT if dim == 0 else part
    X = distributed_normalize_p2(x, EPS, group)
    if torch.get_float32_matmul_precision() == "medium":
        X = X.to(torch.float16)

    def summed_gram(X: torch.Tensor) -> torch.Tensor:
        R = X @ X.mT
        dist.all_reduce(R, group=group)
        return R

    X = gram_iterations(X.unsqueeze(0), coefficients(schedule.steps, coefficient_type),
                        schedule.restarts, summed_gram).to(torch.float32).squeeze(0)
    return X.mT if dim == 0 else X


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
                                    muon.newton_schulz_settings, plan.matrices[owned[0]].team_gram)
    return list(result.split([full.shape[team.dim] for full in fulls], dim=team.dim))


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
