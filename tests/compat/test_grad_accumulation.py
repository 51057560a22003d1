"""Gradient accumulation on Megatron-FSDP against Megatron DDP on the same model: several
micro-batches per rank through megatron-core's own schedule (forward_backward_no_pipelining, with
megatron.training's finalize_model_grads and no no_sync_func, as megatron.training sets them
without --overlap-grad-reduce), then the optimizer, iteration after iteration.

Released Megatron-FSDP rescales a gradient buffer reduced over one rank at every micro-batch
under ZeRO-2/3 (NVIDIA/Megatron-LM#6660): the experts' when expert parallelism spans the
data-parallel ranks (EP=2 at W=2, NVIDIA's DP8/EP8 layout), fixes.upstream_fixes corrects
it. TP=2 at W=2 (DP=1: a scale of 1) is a control that agrees with or without the fix; EP=2 at
W=4 (expert groups of two), the other control, is a row of the flag sweep
(benchmarks/sweep.py: every strategy, Adam and Muon, two micro-batches per rank)."""

import dataclasses

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import get_megatron_optimizer as megatron_core_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_muon import get_megatron_optimizer
from megatron_muon.compat import upstream
from megatron_muon.tools.testing import (TINY, ddp_gpt, fsdp_gpt, init_parallel_state, loss_on,
                                         optimizer_config)
from tolerances import RTOL

ITERATIONS = 3
NUM_EXPERTS = 4
LAYOUTS = {  # id: (world size, init_parallel_state's layout, experts)
    "EP2-W2": (2, dict(expert_parallel=2), NUM_EXPERTS),
    "TP2-W2": (2, dict(tensor_parallel=2), None),
}


def _tokens(iteration, micro_batch):
    """A micro-batch fixed by (iteration, data-parallel rank, micro-batch): the same on the
    tensor-parallel ranks of one data-parallel rank, in both runs."""
    g = torch.Generator().manual_seed(
        10_000 * iteration + 100 * parallel_state.get_data_parallel_rank() + micro_batch)
    return torch.randint(0, TINY.vocab, (TINY.micro_batch, TINY.seq), generator=g)


def _forward_step(data_iterator, model):
    loss = loss_on(model, next(data_iterator))
    return loss, lambda output: (output, {"lm loss": output.detach()})


def _train(model, optimizer, micro_batches):
    """(this rank's mean loss, the optimizer's grad norm) of each iteration."""
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = None
    history = []
    for iteration in range(1, ITERATIONS + 1):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        outputs = get_forward_backward_func()(
            forward_step_func=_forward_step, model=[model], num_microbatches=micro_batches,
            data_iterator=iter([_tokens(iteration, m) for m in range(micro_batches)]),
            seq_length=TINY.seq, micro_batch_size=TINY.micro_batch, forward_only=False)
        update_successful, grad_norm, _ = optimizer.step()
        assert update_successful
        loss = torch.stack([output["lm loss"] for output in outputs]).mean().item()
        history.append((loss, grad_norm))
    return history


def _agree_with_megatron_ddp(rank, world_size, layout, optimizer, strategy, micro_batches):
    _, parallel, experts = LAYOUTS[layout]
    config = optimizer_config(optimizer, lr=0.01 if optimizer == "muon" else 1e-3, clip_grad=1.0)
    init_parallel_state(**parallel)
    ddp = ddp_gpt(num_experts=experts)
    reference = _train(ddp, megatron_core_optimizer(
        dataclasses.replace(config, use_distributed_optimizer=False), [ddp]), micro_batches)
    init_parallel_state(**parallel)
    fsdp = fsdp_gpt(strategy=strategy, num_experts=experts)
    sharded = _train(fsdp, get_megatron_optimizer(config, [fsdp]), micro_batches)
    for iteration, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(sharded, reference), 1):
        assert loss == pytest.approx(ref_loss, rel=RTOL, abs=0), (iteration, sharded, reference)
        assert norm == pytest.approx(ref_norm, rel=RTOL, abs=0), (iteration, sharded, reference)


@pytest.mark.parametrize("micro_batches", [2, 4])
@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
@pytest.mark.parametrize("optimizer", ["adam", "muon"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_accumulated_gradients_match_megatron_ddp(distributed, layout, optimizer, strategy,
                                                  micro_batches):
    world_size = LAYOUTS[layout][0]
    distributed(_agree_with_megatron_ddp, world_size, layout, optimizer, strategy, micro_batches)


def test_every_installed_megatron_fsdp_has_the_defect():
    """Every Megatron-FSDP in our ranges has the defect (0.19.x's copy, megatron-fsdp 0.5 and
    0.6), read from its code: the fix applies to each installed copy."""
    for copy in upstream.INSTALLED_MEGATRON_FSDP_COPIES:
        assert upstream.has_one_rank_reduce_defect(copy), copy
