"""The check interval's (--muon-check-interval) verdicts: what a check of the owner exchange
found and the error every rank raises together (every rank's verdict agreed on:
distribution.agreement; the weights' own checks after the param sync: chain/weights_check.py)."""

from typing import NamedTuple


class MuonCheckError(RuntimeError):
    """A check of the check interval found a difference; raised on every rank together."""


class CheckResult(NamedTuple):
    """One check of the owner exchange, over every rank: the largest |owner - reference| of
    any element and how many (tensor-parallel-local) matrices were compared."""
    iteration: int
    worst: float
    matrices: int

    def __str__(self):
        return f"max |owner - reference| = {self.worst:.3e} over {self.matrices} matrices"
