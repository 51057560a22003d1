"""The rates owners by estimated time are chosen from (plan.StepCost) and batched Newton-Schulz is
chosen by, measured where the optimizer runs, at construction: Newton-Schulz calls as the step
makes them, and the exchange group's all-to-all bandwidth. The ranks that must choose alike (the
exchange group and its TP peers) agree on the slowest of their figures."""

import math
import time
from typing import Callable

import torch
import torch.distributed as dist

# An all-to-all of this many bytes per rank measures the exchange group's bandwidth.
PROBE_BYTES = 8 << 20


def _seconds(run: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    """Median wall time of `run()` after a warm-up call, its device work included."""
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[repeats // 2]


def _all_to_all_seconds(group, device: torch.device) -> float:
    world = group.size()
    elements = PROBE_BYTES // 4 // world * world
    send = torch.zeros(elements, device=device)
    receive = torch.empty_like(send)
    return _seconds(lambda: dist.all_to_all_single(receive, send, group=group), device)


def measure(runs: list[tuple[int, Callable[[], object]]], group, agree_over: list,
            device: torch.device) -> tuple[list[float], float]:
    """Seconds per matrix of each `(count, run)`, `run()` being one Newton-Schulz call on `count`
    matrices as the step makes it, and `group`'s all-to-all bytes per second (inf on one rank):
    the slowest figures among the ranks of `group` and of each group in `agree_over`, which must
    all pass runs of the same shapes in the same order (they plan the same matrices)."""
    figures = [_seconds(run, device) / count for count, run in runs]
    figures.append(_all_to_all_seconds(group, device) if group.size() > 1 else 0.0)
    agreed = torch.tensor(figures, dtype=torch.float64, device=device)
    for other in [group, *agree_over]:
        if other is not None and other.size() > 1:
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=other)
    *per_matrix, probe_seconds = agreed.tolist()
    world = group.size()
    received = PROBE_BYTES // 4 // world * (world - 1) * 4
    return per_matrix, received / max(probe_seconds, 1e-9) if received else math.inf
