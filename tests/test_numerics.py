"""Phase 2: ZeROTensorParallelMuon on real Megatron-FSDP equals single-device Muon bit for bit."""

import pytest
import torch
from torch.distributed.tensor import DTensor

from fsdp_models import (MUON_KWARGS, STRATEGIES, batch, full_tensor, make_models,
                         reference_optimizers, split_params)
from megatron_muon import ZeROTensorParallelMuon

STEPS = 10


def _train_and_compare(rank, world_size):
    for strategy in STRATEGIES:
        _compare_strategy(rank, world_size, strategy)


def _compare_strategy(rank, world_size, strategy):
    ref, fsdp = make_models(strategy, world_size)
    ref_opts = reference_optimizers(ref)
    ref_params = dict(ref.named_parameters())
    matrices, vectors = split_params(fsdp)
    opts = [ZeROTensorParallelMuon(matrices, **MUON_KWARGS),
            torch.optim.Adam(vectors, lr=0.01, foreach=False)]
    names = {id(p): n for n, p in fsdp.named_parameters()}

    for step in range(STEPS):
        x, y = batch(step, rank)
        torch.nn.functional.mse_loss(fsdp(x), y).backward()
        if not fsdp.model_auto_sync:
            fsdp.finish_grad_sync()
        # The reference sees exactly the gradient the sharded run reduced.
        for p in matrices + vectors:
            name = names[id(p)].removeprefix("module.")
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            ref_params[name].grad = full_tensor(grad, p)
        for opt in ref_opts + opts:
            opt.step()
        fsdp.install_optimized_model_weights()
        fsdp.zero_grad_buffer()
        for opt in ref_opts + opts:
            opt.zero_grad()

        worst = max((full_tensor(p, p) - ref_params[names[id(p)].removeprefix("module.")]).abs().max().item()
                    for p in matrices + vectors)
        assert worst == 0, f"{strategy} W={world_size} step {step}: max |diff| {worst}"

    for p in matrices:
        momentum = opts[0].state[p]["momentum_buffer"]
        assert isinstance(momentum, DTensor) and momentum.placements == p.placements
        assert momentum.to_local().shape == p.to_local().shape
    if rank == 0:
        print(f"{strategy} W={world_size}: max |diff| 0 after {STEPS} steps")


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_matches_single_device_muon_for_every_strategy(distributed, world_size):
    distributed(_train_and_compare, world_size)
