"""How far two fp32 training runs may drift apart when they add the same gradients in another
order (another world size, or the unsharded reference's own reductions): bounds derived from
the arithmetic, not from one machine's observed differences.

A reordered fp32 sum of n terms changes by at most n·u times the sum of their magnitudes
(u = 2^-24), so the two runs' gradients differ by rho = n·u relative to their scale G. Each
optimizer turns that into a parameter difference per step:
- Adam divides elementwise by the RMS gradient √v̂: an element moves by (1 + B)·rho·G/√v̂ of lr,
  and never by more than 2B·lr (B: Adam's largest |m̂/√v̂|). Where the gradient is round-off
  sized (√v̂ ~ rho·G; e.g. the key part of the QKV bias, zero in exact arithmetic) that is a
  full step of either sign: the drift scales with lr per step there, and only there.
- Muon orthogonalizes X/‖X‖_F by Newton-Schulz, whose composite odd polynomial is steepest at 0
  with slope the product of its steps' linear coefficients (~493 for "quintic"): a direction of
  round-off-sized singular value (a gradient of lower rank than its matrix, e.g. the router's,
  whose rows add up to zero) turns 2·rho (normalizing at most doubles it) into that gain times
  it of the update, lr·scale per element at most.
Optimizer state (momentum, Adam's moments) averages gradients: it drifts by 2·rho of its scale.
On top, ATOL and RTOL: the round-off of well-conditioned values, as the tests always allowed.
"""

import math
import sys

import torch
from emerging_optimizers.orthogonalized_optimizers.muon import get_muon_scale_factor

from megatron_muon.compat.newton_schulz_loop import newton_schulz_gain

UNIT_ROUNDOFF = 2.0 ** -24  # fp32
ATOL, RTOL = 1e-6, 1e-5


def reordering_error(terms: int) -> float:
    """rho: the most reordering a sum of `terms` fp32 terms changes it, relative to their scale."""
    return terms * UNIT_ROUNDOFF


def muon_drift(lrs, shape, rho: float, scale_mode: str = "spectral") -> float:
    """Largest elementwise parameter difference after Muon steps with learning rates `lrs`:
    Newton-Schulz's gain (the product's own, which the check interval bounds a team by) on
    twice rho."""
    gain = newton_schulz_gain("quintic", 5)
    return sum(lrs) * get_muon_scale_factor(*shape[-2:], mode=scale_mode) * 2 * gain * rho


def adam_step_bound(step: int, betas=(0.9, 0.999)) -> float:
    """B: Adam's largest |m̂/√v̂| at `step` (Cauchy-Schwarz over the two moving averages' weights)."""
    beta1, beta2 = betas
    first = [(1 - beta1) * beta1 ** (step - s) / (1 - beta1 ** step) for s in range(1, step + 1)]
    second = [(1 - beta2) * beta2 ** (step - s) / (1 - beta2 ** step) for s in range(1, step + 1)]
    return math.sqrt(sum(w1 * w1 / w2 for w1, w2 in zip(first, second)))


def adam_drift(lrs, first_step: int, exp_avg_sq: torch.Tensor, rho: float, betas=(0.9, 0.999)):
    """Elementwise bound after Adam steps first_step, first_step + 1, ... with learning rates
    `lrs`, given one run's second moment after them."""
    last = first_step + len(lrs) - 1
    rms = (exp_avg_sq / (1 - betas[1] ** last)).sqrt()
    relative = rho * rms.max() / rms.clamp(min=torch.finfo(rms.dtype).tiny)
    drift = torch.zeros_like(rms)
    for step, lr in enumerate(lrs, start=first_step):
        bound = adam_step_bound(step, betas)
        drift += lr * torch.clamp((1 + bound) * relative, max=2 * bound)
    return drift


def state_drift(expected: torch.Tensor, rho: float) -> float:
    """Momentum and Adam's moments: averages of gradients (or their squares) that differ by rho."""
    return 2 * rho * expected.abs().max().item()


def assert_within(got: torch.Tensor, expected: torch.Tensor, allowed, what: str) -> None:
    """|got - expected| <= allowed + ATOL + RTOL·|expected|, elementwise."""
    difference = (got - expected).abs()
    excess = difference - (allowed + ATOL + RTOL * expected.abs())
    beyond = int((excess > 0).sum())
    assert beyond == 0, (f"{what}: {beyond} of {got.numel()} elements beyond the bound; greatest "
                         f"|difference| {difference.max().item():.3g}, greatest allowed "
                         f"{(torch.as_tensor(allowed) + ATOL).max().item():.3g}")


def printed_unit(printed: str) -> float:
    """One unit in the last digit of a number as printed: '6.931472E+00' -> 1e-06, '0.695' -> 1e-3."""
    mantissa, _, exponent = printed.lower().partition('e')
    return 10.0 ** (int(exponent or 0) - len(mantissa.partition('.')[2]))


def printed_within(got: str, expected: str, rel: float = 0.0, abs: float = 0.0) -> bool:
    """Whether two printed numbers can be the prints of values within abs + rel·|value| of each
    other. A print lies within half a unit in its last digit of its value, so two values 2e-7
    apart can print as 0.695 and 0.696: the prints may differ by one unit more than the values
    (half of each print's), plus the few ulps of reading them back into floats."""
    a, b = float(got), float(expected)
    units = (printed_unit(got) + printed_unit(expected)) / 2
    allowed = abs + rel * (math.fabs(b) + printed_unit(expected) / 2) + units
    return math.fabs(a - b) <= allowed + 4 * sys.float_info.epsilon * max(math.fabs(a), math.fabs(b))
