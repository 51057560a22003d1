"""The check interval's (--muon-check-interval) verdicts: what a check of the owner exchange
found, the error every rank raises together, and every rank's verdict agreed on (the weights'
own checks after the param sync: step/weights_check.py)."""

from typing import NamedTuple

import torch
import torch.distributed as dist


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


def agree_on_every_rank(worst: float, count: int, failures: list[str],
                        device: torch.device) -> tuple[float, int, list[str]]:
    """(the largest `worst`, the sum of `count`, every rank's `failures`) over all ranks, so all
    stop together or none does (tensor- and expert-parallel ranks check different matrices).
    Two reductions; the failures travel only when some rank has one. `device`: the default
    process group's (the params' CUDA device under NCCL)."""
    figures = torch.tensor([worst, float(bool(failures))], dtype=torch.float64, device=device)
    total = torch.tensor([count], dtype=torch.int64, device=device)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    dist.all_reduce(total)
    everyone = failures
    if figures[1].item():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, failures)
        everyone = [failure for rank_failures in gathered for failure in rank_failures]
    return figures[0].item(), int(total.item()), everyone
