"""Ranks that hold nothing still take part: at W=4 every matrix has fewer rows than ranks, and with
one Megatron-FSDP unit per Linear the last rank holds no row and gets no gradient at all, every
step. Each case finishes within a timeout and equals single-device Muon bit for bit."""

import copy

import pytest
import torch
from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

from conftest import run_distributed
from fsdp_models import MUON_KWARGS, STRATEGIES, full_tensor, fully_shard
from megatron_muon import FSDPMuonChainedOptimizer, ZeROTensorParallelMuon

WORLD_SIZE, STEPS, TIMEOUT_SECONDS = 4, 4, 120
KWARGS = {**MUON_KWARGS, "split_qkv": False}


class Slivers(torch.nn.Module):
    """Matrices of 3, 2, 3 and 6 rows."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 3, bias=False)
        self.b = torch.nn.Linear(3, 2, bias=False)
        self.c = torch.nn.Linear(2, 3, bias=False)
        self.d = torch.nn.Linear(3, 6, bias=False)

    def forward(self, x):
        return self.d(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))))


def _compare(rank, strategy, dist_mode, units):
    torch.manual_seed(0)
    ref = Slivers()
    fsdp = fully_shard(copy.deepcopy(ref), strategy, WORLD_SIZE, units)
    params = list(fsdp.parameters())
    optimizer = FSDPMuonChainedOptimizer(
        ZeROTensorParallelMuon(params, dist_mode=dist_mode, **KWARGS), [fsdp])
    ref_optimizer = TensorParallelMuon(ref.parameters(), **KWARGS)
    for step in range(STEPS):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        fsdp(x).square().mean().backward()
        optimizer.step()  # syncs the gradients, steps, installs the weights
        holds_nothing = all(p.to_local().numel() == 0 and p.grad is None for p in params)
        if strategy != "no_shard" and units == [torch.nn.Linear]:
            assert holds_nothing == (rank == WORLD_SIZE - 1)
        for p, ref_p in zip(params, ref.parameters()):
            ref_p.grad = full_tensor(p.grad if p.grad is not None else torch.zeros_like(p), p)
        ref_optimizer.step()
        optimizer.zero_grad()
        for p, ref_p in zip(params, ref.parameters()):
            assert torch.equal(full_tensor(p, p), ref_p.detach()), (strategy, dist_mode, step)


def _every_case(rank, world_size):
    for strategy in STRATEGIES:
        for dist_mode in ("owner", "allgather"):
            for units in ([torch.nn.Linear], [Slivers]):
                _compare(rank, strategy, dist_mode, units)


@pytest.mark.slow
def test_ranks_holding_nothing_neither_hang_nor_change_the_result():
    run_distributed(_every_case, WORLD_SIZE, timeout=TIMEOUT_SECONDS)
