"""Every rank's verdict of a check agreed on, so that all ranks stop together or none does (the
check interval's: core/owner_check.py; the weights' after the param sync: chain/weights_check.py)."""

import torch
import torch.distributed as dist


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
