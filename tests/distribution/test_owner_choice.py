"""Owners by estimated time (ZeROTensorParallelMuon's default owner_choice="time"): the rates
measured at construction (measured_cost.measure) are the same on every rank, decide which shapes
run batched, and choose owners that move work but change no result bit."""

import math
import statistics
import time
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from fsdp_models import (MUON_KWARGS, ONE_BATCH, fully_shard, matrices_per_newton_schulz_call,
                         same_shape_linears)
from megatron_muon import ZeROTensorParallelMuon
from megatron_muon.planner import group_planner
from megatron_muon.observe import measured_cost
from megatron_muon.planner.group_planner import GroupPlanner


def _gathered(value):
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _measure_agrees_on_every_ranks_samples(rank, world_size):
    # Rank r's single-matrix call sleeps (r + 1) ms; the batched one 4 ms for 2 matrices.
    runs = [(1, lambda: time.sleep(0.001 * (rank + 1))), (2, lambda: time.sleep(0.004))]
    measured, bytes_per_second = measured_cost.measure(runs, dist.group.WORLD, [None],
                                                       torch.device("cpu"))
    assert all(figures == (measured, bytes_per_second)
               for figures in _gathered((measured, bytes_per_second)))
    single, batched = measured
    # A sleep only overshoots, so the median of every rank's samples is at least the median sleep,
    # and it is not the slowest rank's (r + 1 = W) when ranks differ: asserted at W=4, where it
    # takes 6 of ranks 0 to 2's 15 samples slower than 4 ms to reach rank 3's. At W=2 one slow
    # sample on rank 0 makes the median rank 1's fastest, above 2 ms (it failed so under load).
    assert single.seconds >= 0.001 * (world_size + 1) / 2
    assert world_size < 4 or single.seconds < 0.001 * world_size
    # The ranks' different sleeps are the spread: quartiles 1.75 and 3.25 ms around 2.5 at W=4.
    assert world_size == 1 or single.spread > 0.3
    assert batched.seconds >= 0.002  # per matrix: the call over its count
    assert 0 < bytes_per_second < math.inf if world_size > 1 else bytes_per_second == math.inf


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_measured_figures_are_the_median_of_every_ranks_samples(distributed, world_size):
    distributed(_measure_agrees_on_every_ranks_samples, world_size)


def test_shapes_keep_their_own_rate_only_beyond_the_spread():
    """Newton-Schulz seconds follow FLOPs at the shapes' median rate, except for a shape whose
    rate stands apart by more than its figure's spread."""
    flops = {"a": 100, "b": 400, "c": 100, "d": 100}
    # Rates 100, 80, 50 and 111, their median 90.
    measured = {"a": measured_cost.Measured(1.0, 0.2),    # 11% off: within its spread
                "b": measured_cost.Measured(5.0, 0.3),    # 11% off: within its spread
                "c": measured_cost.Measured(2.0, 0.3),    # 44% off: beyond it
                "d": measured_cost.Measured(0.9, 0.05)}   # 23% off: beyond it
    seconds = measured_cost.seconds_beyond_noise(flops, measured)
    common = statistics.median([100, 80, 50, 100 / 0.9])
    assert seconds == {"a": 100 / common, "b": 400 / common, "c": 2.0, "d": 0.9}


def _measured(batched_seconds, bytes_per_second=1e9, spread=0.0):
    """A stand-in for measured_cost.measure that runs every call (as the real one does) and
    reports 1 s per matrix alone and `batched_seconds` per matrix batched, with `spread`."""
    def measure(runs, group, agree_over, device):
        for _, run in runs:
            run()
        return [measured_cost.Measured(1.0 if count == 1 else batched_seconds, spread)
                for count, _ in runs], bytes_per_second
    return measure


def _batching_follows_the_precision(rank, world_size, batched_faster, precision):
    """At fp32 `highest` same-shape matrices are never batched, however fast the measured
    batched call (megatron-core's bits: batched kernels round otherwise); at bf16 they stay
    batched whatever was measured, so the rounding never follows a measurement. The cost
    follows the call the owner makes."""
    fsdp = same_shape_linears(world_size)
    batched_seconds = 0.5 if batched_faster else 2.0
    with mock.patch.object(group_planner, "measure", _measured(batched_seconds)):
        opt = ZeROTensorParallelMuon(list(fsdp.parameters()), max_exchange_bytes=ONE_BATCH,
                                     **{**MUON_KWARGS, "fp32_matmul_prec": precision})
    batched = precision == "medium"
    assert list(opt.batched_newton_schulz.values()) == ([True] if batched else [])
    (plan,) = opt.plans
    assert plan.cost.call_seconds(plan.matrices[0], 3) == 3 * (batched_seconds if batched else 1.0)
    matrices_per_call = matrices_per_newton_schulz_call(fsdp, opt)
    owned = sum(len(owned) for routes in plan.routes for owned in routes.owned_batches)
    assert sum(matrices_per_call) == owned
    assert (len(matrices_per_call) < owned) == (batched and owned > 1)


@pytest.mark.parametrize("precision", ["highest", "medium"])
@pytest.mark.parametrize("batched_faster", [True, False])
def test_batching_follows_the_precision_not_the_measured_calls(distributed, batched_faster,
                                                               precision):
    distributed(_batching_follows_the_precision, 1, batched_faster, precision)


def _owners_move_work_but_no_bit(rank, world_size):
    """One Megatron-FSDP unit: three of the four matrices sit (mostly) on one rank, which owners
    by bytes leave all three; at a fast network owners by time move one off; the weights after
    two steps are the same bits."""
    params_after = {}
    owners = {}
    for choice in ("time", "bytes"):
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(16, 64, bias=False),
                                     torch.nn.Linear(64, 64, bias=False),
                                     torch.nn.Linear(64, 64, bias=False),
                                     torch.nn.Linear(64, 16, bias=False))
        fsdp = fully_shard(module, "optim_grads_params", world_size, [torch.nn.Sequential])
        with mock.patch.object(group_planner, "measure", _measured(1.0, bytes_per_second=1e15)):
            opt = ZeROTensorParallelMuon(list(fsdp.parameters()), owner_choice=choice, **MUON_KWARGS)
        (plan,) = opt.plans
        owners[choice] = plan.owners
        for step in range(2):
            opt.zero_grad()
            g = torch.Generator().manual_seed(step)
            fsdp(torch.randn(6, 16, generator=g)).square().mean().backward()
            fsdp.finish_grad_sync()
            opt.step()
        params_after[choice] = [p.to_local().clone() for p in fsdp.parameters()]
    # Per rank, matrices owned: by bytes 3 and 1, by time (each measured at 1 s) 2 and 2.
    assert sorted(owners["bytes"].count(r) for r in range(2)) == [1, 3], owners
    assert sorted(owners["time"].count(r) for r in range(2)) == [2, 2], owners
    assert all(torch.equal(a, b) for a, b in zip(params_after["time"], params_after["bytes"]))


def test_owners_by_time_move_work_but_no_result_bit(distributed):
    distributed(_owners_move_work_but_no_bit, 2)
