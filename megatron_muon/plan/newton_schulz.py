"""Newton-Schulz's FLOPs, standard and Gram, and where Gram Newton-Schulz runs
(--muon-gram-newton-schulz): per shape, only where it costs fewer FLOPs than standard
Newton-Schulz. The optimizer's step (core/gram_newton_schulz.py) and every count of the plan,
the scale model and the self-test ask `GramSchedule.runs_on`, so what is counted is what runs.

Gram Newton-Schulz (gram-newton-schulz's `_make_compiled_gram`) iterates on the m x m Gram matrix
R = X X^T of the normalized input (m the short side, n the long one) and touches the long side at
the start (R: 2m^2 n), at each restart (X <- Q X and R <- X X^T: 4m^2 n) and at the end (Q X:
2m^2 n). Each iteration forms Z = bR + cR^2 (2m^3), Q <- aQ + QZ (2m^3; Q = Z + aI, no product,
at the first iteration and at a restart), and the next R from R and Z (2 products, 4m^3), except
before a restart and after the last. Five iterations with a restart at the third: (8r + 28) m^3
for n = r m, against standard's (20r + 10) m^3: fewer where r > 1.5."""

from dataclasses import dataclass


@dataclass(frozen=True)
class GramSchedule:
    """Gram Newton-Schulz's iterations: `steps` (num_ns_steps) and the iterations that restart
    from the long side (gram-newton-schulz's `gram_newton_schulz_reset_iterations`, each in
    [1, steps))."""

    steps: int
    restarts: tuple[int, ...] = (2,)

    def products(self) -> tuple[int, int]:
        """(its products on the long side, 2m^2 n FLOPs each: the Gram matrices and Q X at the
        start, at each restart and at the end; its products of m x m matrices, 2m^3 each)."""
        restarts = set(self.restarts)
        gram_side = 0
        for i in range(self.steps):
            gram_side += 1 if i == 0 or i in restarts else 2  # Z = bR + cR^2; Q <- aQ + QZ
            if i < self.steps - 1 and i + 1 not in restarts:
                gram_side += 2  # the next R from R and Z
        return 2 + 2 * len(restarts), gram_side

    def flops(self, rows: int, cols: int) -> int:
        """Gram Newton-Schulz's FLOPs on one rows x cols matrix."""
        return self.flops_on(min(rows, cols), max(rows, cols))

    def flops_on(self, gram_side: int, long_side: int) -> int:
        """Its FLOPs on `long_side` of a matrix whose Gram matrix is gram_side x gram_side: a
        whole matrix's, or a team member's on its part (the Gram side's products repeated by
        every member)."""
        long_products, gram_products = self.products()
        return 2 * gram_side * gram_side * (long_products * long_side + gram_products * gram_side)

    @property
    def gram_matrices(self) -> int:
        """The Gram matrices of the long side it forms: at the start and at each restart (a
        team sums each over its members: its all-reduces beside the norm's)."""
        return 1 + len(self.restarts)

    def runs_on(self, rows: int, cols: int) -> bool:
        """Whether the step runs Gram Newton-Schulz on a rows x cols matrix: where it costs fewer
        FLOPs than standard Newton-Schulz (never on a square one)."""
        return self.flops(rows, cols) < ns_flops(rows, cols, self.steps)


def ns_flops(rows: int, cols: int, steps: int) -> int:
    """Standard Newton-Schulz's FLOPs on one rows x cols matrix: k(4m^2 n + 2m^3), m the smaller
    side (emerging_optimizers' newton_schulz_step: X X^T, A A, B X)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


def matrix_ns_flops(rows: int, cols: int, steps: int, gram: GramSchedule | None) -> int:
    """The FLOPs of the Newton-Schulz the step runs on a rows x cols matrix: Gram's where `gram`
    runs on it, else standard's. For a Gram matrix `steps` scales its schedule's count (callers
    that pass 1 weigh matrices by their FLOPs per iteration)."""
    if gram is not None and gram.runs_on(rows, cols):
        return gram.flops(rows, cols) * steps // gram.steps
    return ns_flops(rows, cols, steps)


def gram_counts(matrices) -> tuple[int, int, int]:
    """Of the matrices Newton-Schulz runs on (`matrices`, plan.Matrix; a QKV split's blocks
    each): how many run Gram Newton-Schulz, how many standard by their shape (Gram would cost as
    many FLOPs or more), how many standard for having no schedule (a TP partition)."""
    gram = by_shape = without = 0
    for matrix in matrices:
        for rows in matrix.row_blocks or (matrix.shape[0],):
            if matrix.gram is None:
                without += 1
            elif matrix.gram.runs_on(rows, matrix.cols):
                gram += 1
            else:
                by_shape += 1
    return gram, by_shape, without


def refusal(schedule: GramSchedule) -> str | None:
    """What is wrong with a schedule, naming the flags; None where it is one the step runs."""
    bad = [r for r in schedule.restarts if not 1 <= r < schedule.steps]
    if bad or len(set(schedule.restarts)) != len(schedule.restarts):
        return (f"--muon-gram-restarts {list(schedule.restarts)}: each restart an iteration in "
                f"[1, {schedule.steps}) (--muon-num-ns-steps {schedule.steps}), none twice")
    return None
