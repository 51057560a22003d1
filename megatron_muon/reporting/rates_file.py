"""The rates a Muon chain measured where it runs, as the scale model's rates file
(benchmarks/scale_model.py --rates FILE, `make scale SCALE_ARGS="--rates FILE"`): each shape's
Newton-Schulz call as the step makes it and the exchange group's all-to-all bandwidth, which
owners by time (the default) measure at construction on every rank, and, timed once beside
them, a matmul's rate and the elementwise steps' (`device_rates`, which the scale model's
--measure-rates times the same way). Written once, by rank 0."""

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..core.muon_math import momentum_update_
from ..observe.measured_cost import median_seconds

RATES_FILE = "megatron_muon_rates.json"


def device_rates(muon: Any, device: torch.device, precision: str) -> dict:
    """A matmul's TFLOP/s (bf16 at `precision` "medium", fp32 otherwise) and the seconds per
    element of torch's AdamW (foreach) and of `muon`'s elementwise step
    (muon_math.momentum_update_ and the update), on `device`."""
    big = device.type == "cuda"
    n = 4096 if big else 1024
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16 if precision == "medium" else None)
    matmul_tflops = 2 * n ** 3 / median_seconds(lambda: a @ a, device) / 1e12
    # 64 MiB a tensor on a GPU (five of them: param, grad, momentum, Adam's two), 16 on a CPU.
    param = torch.nn.Parameter(torch.zeros(1 << 24 if big else 1 << 22, device=device))
    param.grad = torch.randn_like(param)
    adam = torch.optim.AdamW([param], lr=1e-3, foreach=True)
    buffer, group = torch.zeros_like(param), dict(muon.param_groups[0], lr=0.0)

    def muon_elementwise():
        param.data.add_(momentum_update_(muon, param.data, param.grad, buffer, group),
                        alpha=-group["lr"])

    return dict(matmul_tflops=matmul_tflops,
                adam_ns_per_element=median_seconds(adam.step, device) / param.numel() * 1e9,
                muon_elementwise_ns_per_element=median_seconds(muon_elementwise, device)
                / param.numel() * 1e9)


def device_name(device: torch.device) -> str:
    """The device a rates file's figures were measured on, as its `device` says it."""
    return (torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)")


def rates_table(chain: Any) -> dict | None:
    """The scale model's rates from what `chain`'s Muon parts measured at construction (None:
    nothing measured, owners by bytes): Newton-Schulz [GFLOP per call, TFLOP/s] of each shape
    (the mean where shapes' calls have equal FLOPs), the slowest exchange group's all-to-all in
    GB/s (`all_to_all_gbps`: the scale model's --bandwidth-gbps), with teams the slowest send
    inside a node (`node_all_reduce_gbps`: its teams' rate there), and device_rates."""
    muons = chain.muon_optimizers
    measured = [figures for muon in muons for figures in muon.planner.measured]
    if not measured:
        return None
    muon, device = muons[0], muons[0].device()
    by_flops: dict[int, list[float]] = {}  # shapes of equal FLOPs (a matrix and its transpose)
    for points, _ in measured:
        for flops, seconds in points:
            by_flops.setdefault(flops, []).append(seconds)
    calls = sorted((flops, sum(times) / len(times)) for flops, times in by_flops.items())
    bandwidths = [rate for _, rate in measured if rate != float("inf")]
    inside = [rate for muon in muons for rate in muon.planner.node_rates]
    return dict(
        device=device_name(device), measured=time.strftime("%Y-%m-%d"),
        source=f"megatron_muon at construction, {dist.get_world_size()} ranks (owners by time)",
        newton_schulz_precision=muon.fp32_matmul_prec,
        newton_schulz=[[flops / 1e9, flops / seconds / 1e12] for flops, seconds in calls],
        all_to_all_gbps=min(bandwidths) / 1e9 if bandwidths else None,
        **({"node_all_reduce_gbps": min(inside) / 1e9} if inside else {}),
        **device_rates(muon, device, muon.fp32_matmul_prec))


def write_rates(chain: Any, directory: str | Path) -> Path | None:
    """rates_table(chain) as `directory`/RATES_FILE, made and written by rank 0 (the figures
    measured at construction are agreed over the ranks); the path, or None where nothing was
    measured."""
    if not any(muon.planner.measured for muon in chain.muon_optimizers):
        return None
    path = Path(directory) / RATES_FILE
    if dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rates_table(chain), indent=1))
    return path
