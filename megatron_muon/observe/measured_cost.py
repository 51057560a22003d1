"""The rates owners by estimated time are chosen from (plan.StepCost) and batched Newton-Schulz is
chosen by, measured where the optimizer runs, at construction: Newton-Schulz calls as the step
makes them, and the exchange group's all-to-all bandwidth. Every rank of the exchange group times
every figure REPEATS times; the figure is the median of all those samples and its spread their
interquartile range over it, the same on every rank (the ranks that must choose alike, the
exchange group and its TP peers, then agree on the larger of their figures)."""

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Hashable

import torch
import torch.distributed as dist

from ..plan import Nodes

# An all-to-all of this many bytes per rank measures the exchange group's bandwidth.
PROBE_BYTES = 8 << 20
# Timed rounds of every figure on each rank, after a warm-up round.
REPEATS = 5


@dataclass(frozen=True)
class Measured:
    """A measured duration: the median of every rank's samples, and their interquartile range
    over that median (how far one run's figure may be from another's)."""
    seconds: float
    spread: float


def _samples(runs: list[Callable[[], object]], device: torch.device) -> list[list[float]]:
    """Wall times of each of `runs`, their device work included: REPEATS rounds of one call of
    each after a warm-up round, so that a slow spell of the machine falls on all of them alike
    (and shows in each one's spread) instead of on whichever ran then."""
    times: list[list[float]] = [[] for _ in runs]
    for round_ in range(REPEATS + 1):
        for run, figure in zip(runs, times):
            start = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if round_:
                figure.append(time.perf_counter() - start)
    return times


def median_seconds(run: Callable[[], object], device: torch.device) -> float:
    """The median wall time of one call of `run` on this rank, its device work included
    (_samples' rounds)."""
    return statistics.median(_samples([run], device)[0])


def _all_to_all_samples(group, device: torch.device) -> list[float]:
    world = group.size()
    elements = PROBE_BYTES // 4 // world * world
    send = torch.zeros(elements, device=device)
    receive = torch.empty_like(send)
    (samples,) = _samples([lambda: dist.all_to_all_single(receive, send, group=group)], device)
    return samples


def measure(runs: list[tuple[int, Callable[[], object]]], group: dist.ProcessGroup | None,
            agree_over: list[dist.ProcessGroup | None],
            device: torch.device) -> tuple[list[Measured], float]:
    """Seconds per matrix of each `(count, run)`, `run()` being one Newton-Schulz call on `count`
    matrices as the step makes it, and `group`'s all-to-all bytes per second (inf on one rank),
    from the samples of every rank of `group`; the ranks of each group in `agree_over` take the
    larger figures. All must pass runs of the same shapes in the same order (they plan the same
    matrices)."""
    samples = [[seconds / count for seconds in figure]
               for (count, _), figure in zip(runs, _samples([run for _, run in runs], device))]
    samples.append(_all_to_all_samples(group, device) if group.size() > 1 else [0.0] * REPEATS)
    local = torch.tensor(samples, dtype=torch.float64, device=device)
    every = [torch.empty_like(local) for _ in range(group.size())]
    dist.all_gather(every, local, group=group)  # equal sizes on every rank: gloo takes it
    quartiles = torch.quantile(torch.cat(every, dim=1),
                               torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64, device=device),
                               dim=1)
    spread = (quartiles[2] - quartiles[0]) / quartiles[1].clamp_min(1e-12)
    agreed = torch.stack([quartiles[1], spread])
    for other in agree_over:
        if other is not None and other.size() > 1:
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=other)
    (*seconds, probe_seconds), (*spreads, _) = agreed.tolist()
    world = group.size()
    received = PROBE_BYTES // 4 // world * (world - 1) * 4
    return ([Measured(s, spread) for s, spread in zip(seconds, spreads)],
            received / max(probe_seconds, 1e-9) if received else math.inf)


def node_bytes_per_second(group: dist.ProcessGroup, nodes: Nodes, device: torch.device,
                          agree_over: list[dist.ProcessGroup | None]) -> float | None:
    """What a rank moves a second to another rank of its node: PROBE_BYTES sent between the
    first two ranks of `group` on one of its `nodes`, the median of REPEATS after a warm-up,
    the slowest figure for every rank of the group and of each group in `agree_over` (TP peers
    plan alike, as measure's figures); None where no node holds two of its ranks. Inside a
    node the link is the same for an all-reduce (NVLink: a ring's bus bandwidth is each GPU's
    link), so teams take it for their all-reduces there."""
    pair = next((ranks[:2] for ranks in nodes.ranks_on.values() if len(ranks) > 1), None)
    if pair is None:
        return None
    me, seconds = dist.get_rank(group), torch.zeros(1, dtype=torch.float64, device=device)
    if me in pair:
        buffer = torch.zeros(PROBE_BYTES // 4, device=device)
        peer = dist.get_global_rank(group, pair[1 - pair.index(me)])
        move = dist.send if me == pair[0] else dist.recv
        seconds[0] = median_seconds(lambda: move(buffer, peer, group=group), device)
    for agreeing in [group, *agree_over]:
        if agreeing is not None and agreeing.size() > 1:
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=agreeing)
    return PROBE_BYTES / max(seconds.item(), 1e-9)


def seconds_beyond_noise(flops: dict[Hashable, int],
                         measured: dict[Hashable, Measured]) -> dict[Hashable, float]:
    """Seconds per matrix of each shape: its measured seconds where its FLOP rate stands apart
    from the shapes' median rate by more than its spread, else its FLOPs at that median rate.
    Newton-Schulz time follows FLOPs until a shape is measurably faster or slower per FLOP (small
    matrices on a GPU); on a machine whose ranks' speed wanders (a shared VM: one core ran the
    same 256x256 call in 6 ms, then in 11), per-shape figures within the noise would only move
    owners off a FLOP balance."""
    rates = {key: flops[key] / max(m.seconds, 1e-12) for key, m in measured.items()}
    common = statistics.median(rates.values())
    return {key: m.seconds if abs(rates[key] / common - 1) > m.spread else flops[key] / common
            for key, m in measured.items()}
