"""emerging_optimizers' Newton-Schulz over a process group (newton_schulz_tp in tp_mode
"distributed") with its iteration step as an argument: upstream's newton_schulz hard-codes
newton_schulz_step, and a team member that applies the Gram matrix twice
(core/team_newton_schulz.py) runs its own step in the same loop. Written as emerging-optimizers
0.3's newton_schulz is; with upstream's step it gives newton_schulz_tp bit for bit
(tests/core/test_teams.py holds it there). Beside it, what every Newton-Schulz of ours reads of
upstream's coefficients: each iteration's (a, b, c) in newton_schulz's order, and their gain."""

import math

import torch
from emerging_optimizers.orthogonalized_optimizers.muon_utils import (
    distributed_normalize_p2, get_coefficient_iterator, newton_schulz_step)

from .upstream import COEFFICIENT_SETS

# The coefficient types newton_schulz iterates with "repeat_last" (the others "cycle"), its eps.
_REPEAT_LAST, EPS = ("polar_express", "cans", "deepseekv4"), 1e-7


def coefficients(steps: int, coefficient_type: str) -> list[tuple[float, float, float]]:
    """Each iteration's (a, b, c), as newton_schulz iterates a coefficient type's set."""
    mode = "repeat_last" if coefficient_type in _REPEAT_LAST else "cycle"
    return list(get_coefficient_iterator(steps, COEFFICIENT_SETS[coefficient_type], mode=mode))


def distributed_newton_schulz(part: torch.Tensor, steps: int, coefficient_type: str, group,
                              dim: int, step=newton_schulz_step) -> torch.Tensor:
    """newton_schulz_tp(part, steps, coefficient_type, group, dim, tp_mode="distributed"): the
    part transposed where split along dim 0, normalized over `group`, each iteration in bf16 at
    matmul precision "medium", each by `step` (newton_schulz_step's signature)."""
    x = part.mT if dim == 0 else part
    X = distributed_normalize_p2(x, EPS, group)
    if torch.get_float32_matmul_precision() == "medium":
        X = X.to(torch.bfloat16)
    for a, b, c in coefficients(steps, coefficient_type):
        X = step(X, a, b, c, tp_group=group)
    X = X.to(torch.float32)
    return X.mT if dim == 0 else X


def newton_schulz_gain(coefficient_type: str, steps: int) -> float:
    """Newton-Schulz's largest amplification of a change of its normalized input: the slope at 0
    of its composite polynomial (each step's a x + b x^3 + c x^5, b < 0, is steepest there)."""
    return math.prod(a for a, _, _ in coefficients(steps, coefficient_type))
