"""--muon-gram-newton-schulz: Gram Newton-Schulz (Dao-AILab's gram-newton-schulz) in place of
standard Newton-Schulz, on each matrix whole on its rank whose shape it costs fewer FLOPs for
(plan.GramSchedule.runs_on: rectangular ones; never square).

The same polynomial as emerging_optimizers' newton_schulz, evaluated on the m x m Gram matrix of
the normalized input (docs/design.md, "Gram Newton-Schulz"): megatron-core's coefficient sets in
newton_schulz's order, its normalization and eps, its transpose to the wide side; the iteration
is gram-newton-schulz's (`_make_compiled_gram` on its torch backend), operation for operation, so
given the same normalized input and coefficients the two agree bit for bit
(tests/core/test_gram_newton_schulz.py). At --muon-fp32-matmul-prec `medium`, where newton_schulz
iterates in bf16, it iterates in fp16, as gram-newton-schulz does: its products of the Gram matrix
with itself need fp16's finer mantissa to stay as close to fp32 Newton-Schulz as bf16 standard
Newton-Schulz is, and the restarts keep Q's entries far inside fp16's range.
"""

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from ..compat import upstream
from ..compat.newton_schulz_loop import EPS, coefficients, newton_schulz_gain
from ..compat.tensor_parallel import newton_schulz_gets_it_whole
from ..plan import GramSchedule

# TensorParallelMuon's scaled_orthogonalize_fn: (grad, tp_group, partition_dim) -> update.
OrthogonalizeFn = Callable[..., torch.Tensor]


def gram_newton_schulz(x: torch.Tensor, schedule: GramSchedule,
                       coefficient_type: str) -> torch.Tensor:
    """Gram Newton-Schulz of `x` (2-D, or a batch of same-shape matrices), fp32 in and out, as
    emerging_optimizers' newton_schulz(x, schedule.steps, coefficient_type) frames it."""
    transpose = x.size(-2) > x.size(-1)
    if transpose:
        x = x.mT
    X = torch.nn.functional.normalize(x, p=2, dim=(-2, -1), eps=EPS)
    if torch.get_float32_matmul_precision() == "medium":
        X = X.to(torch.float16)
    batch = X if X.ndim == 3 else X.unsqueeze(0)
    X = gram_iterations(batch, coefficients(schedule.steps, coefficient_type),
                        schedule.restarts).to(torch.float32).view(x.shape)
    return X.mT if transpose else X


def gram_iterations(X: torch.Tensor, coefficients: Sequence[tuple[float, float, float]],
                    restarts: Sequence[int],
                    gram_of: Callable[[torch.Tensor], torch.Tensor] = lambda X: X @ X.mT
                    ) -> torch.Tensor:
    """gram-newton-schulz's iteration on a batch of normalized wide matrices X (b x m x n, m <=
    n): R = X X^T, each iteration Z = bR + cR^2 and Q <- aQ + QZ (Q = Z + aI at the first and
    at a restart), R <- (aI + Z) R (aI + Z) from R and Z; a restart X <- Q X, R <- X X^T; at the
    end Q X. In X's dtype. `gram_of(X)`: X X^T (a team's member sums it over the team: X is its
    columns of the whole)."""
    restarts = set(restarts)
    R = gram_of(X)
    eye = torch.eye(R.size(-1), device=X.device, dtype=X.dtype)
    eye = eye.unsqueeze(0).expand(R.size(0), -1, -1).contiguous()
    Q = None
    for i, (a, b, c) in enumerate(coefficients):
        if i in restarts:
            X = Q @ X
            R = gram_of(X)
        Z = torch.baddbmm(R, R, R, alpha=c, beta=b)
        Q = Z + a * eye if i == 0 or i in restarts else torch.baddbmm(Q, Q, Z, beta=a)
        if i < len(coefficients) - 1 and i + 1 not in restarts:
            RZ = torch.baddbmm(R, R, Z, beta=a)
            R = torch.baddbmm(RZ, Z, RZ, beta=a)
    return Q @ X


def scaled_orthogonalize_fn(upstream_fn: OrthogonalizeFn, schedule: GramSchedule,
                            coefficient_type: str,
                            scale: Callable[[int, int], float]) -> OrthogonalizeFn:
    """TensorParallelMuon's scaled_orthogonalize_fn (`upstream_fn`: megatron-core's, the SYRK
    kernel's or an adaptive variant's unscaled one) with Gram Newton-Schulz times `scale(rows,
    cols)` where a matrix is whole on this rank (no TP partition handed to Newton-Schulz, or a TP
    group of one) and `schedule` runs on its shape; `upstream_fn` elsewhere."""
    def orthogonalize(grad: torch.Tensor, tp_group=None, partition_dim: int | None = None):
        rows, cols = grad.shape[-2:]
        if not (newton_schulz_gets_it_whole(tp_group, partition_dim)
                and schedule.runs_on(rows, cols)):
            return upstream_fn(grad, tp_group, partition_dim)
        return gram_newton_schulz(grad, schedule, coefficient_type) * scale(rows, cols)

    return orthogonalize


class RoutedMuon(Protocol):
    """What route_newton_schulz_through_it reads and sets of a ZeROTensorParallelMuon."""

    gram: GramSchedule | None
    scaled_orthogonalize_fn: OrthogonalizeFn


def route_newton_schulz_through_it(muon: RoutedMuon, settings: dict, scaled: bool) -> None:
    """With --muon-gram-newton-schulz (`muon.gram`), a ZeROTensorParallelMuon's Newton-Schulz
    through Gram Newton-Schulz where it runs (scaled_orthogonalize_fn), scaled as
    TensorParallelMuon's orthogonalize scales a whole matrix (get_muon_scale_factor times
    extra_scale_factor), or not (`scaled` False: AdaptiveMuon scales after its second moment).
    `settings`: TensorParallelMuon's arguments."""
    if muon.gram is None:
        return

    def scale(rows: int, cols: int) -> float:
        if not scaled:
            return 1.0
        return (upstream.get_muon_scale_factor(rows, cols, mode=settings["scale_mode"])
                * settings["extra_scale_factor"])

    muon.scaled_orthogonalize_fn = scaled_orthogonalize_fn(
        muon.scaled_orthogonalize_fn, muon.gram, settings["coefficient_type"], scale)


def fp32_bound(shape: tuple[int, int], schedule: GramSchedule, settings: dict) -> float:
    """The most Gram Newton-Schulz's update of a `shape` matrix may lie from standard
    Newton-Schulz's, elementwise, both in fp32 (docs/design.md, "Gram Newton-Schulz"): the two
    evaluate one polynomial of the normalized input, so they differ by their roundings only. An
    fp32 sum of K terms errs by at most K units of 2^-24 of its terms' scale, which the iterates'
    spectral norms (at most 1 after the normalization) bound; every sum is a change of the
    normalized input that Newton-Schulz amplifies at most by its gain (newton_schulz_gain).
    Standard Newton-Schulz sums n (X X^T), m (A A) and m (B X) terms an iteration; Gram sums n
    for each Gram matrix of the long side, m for each product of m x m matrices and for each
    Q X (m the short side, n the long one). Normalizing at most doubles it, and Muon's scale
    factor scales the update. `settings`: TensorParallelMuon's arguments."""
    m, n = min(shape), max(shape)
    grams, gram_side = schedule.gram_matrices, schedule.products()[1]
    standard = schedule.steps * (n + 2 * m)
    gram = grams * n + (gram_side + grams) * m  # as many Q X: at each restart and at the end
    gain = newton_schulz_gain(settings["coefficient_type"], schedule.steps)
    scale = upstream.get_muon_scale_factor(*shape, mode=settings["scale_mode"])
    return 2 * gain * (standard + gram) * 2.0 ** -24 * scale * settings["extra_scale_factor"]
