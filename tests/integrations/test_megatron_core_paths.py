"""Every optimizer request that is not Muon on Megatron-FSDP goes to megatron-core's own factory:
through megatron_muon's it builds the same optimizer and trains the same model bit for bit, or
fails as megatron-core alone fails, for each optimizer megatron-core offers on Megatron DDP; but
where megatron_muon.fixes.upstream_fixes repairs megatron-core's optimizer (adaptive_muon), which
then trains (its updates: tests/core/test_adaptive_muon.py)."""

import torch
from megatron.core.optimizer import get_megatron_optimizer as megatron_cores_factory

from megatron_muon import get_megatron_optimizer
from megatron_muon.tools.testing import ddp_gpt, init_parallel_state, lm_loss, optimizer_config

NOT_DISTRIBUTED = dict(use_distributed_optimizer=False)
LAYER_WISE = dict(use_layer_wise_distributed_optimizer=True)
# name -> (OptimizerConfig settings, ddp_gpt's settings), as megatron.training sets them for
# --optimizer X [--use-distributed-optimizer] [--bf16] without --use-megatron-fsdp
REQUESTS = {
    "adam": (dict(optimizer="adam", **NOT_DISTRIBUTED), {}),
    "adam, distributed optimizer": (dict(optimizer="adam"), dict(use_distributed_optimizer=True)),
    "sgd": (dict(optimizer="sgd", **NOT_DISTRIBUTED), {}),
    "muon": (dict(optimizer="muon", **NOT_DISTRIBUTED), {}),
    "muon, layer-wise distributed optimizer, bf16": (dict(optimizer="muon", bf16=True, **LAYER_WISE),
                                                     dict(layer_wise=True)),
    "muon, layer-wise distributed optimizer, fp32": (dict(optimizer="muon", **LAYER_WISE),
                                                     dict(layer_wise=True)),
    "adaptive_muon": (dict(optimizer="adaptive_muon", **NOT_DISTRIBUTED), {}),
}
# What megatron-core 0.19.2 (with emerging-optimizers 0.3.0) itself fails with, and why (main's
# TensorParallelAdaptiveMuon steps, with Muon's scale twice: ours differs, repaired):
MEGATRON_CORES_FAILURES = {
    # In fp32 LayerWiseDistributedOptimizer chains raw torch optimizers, so its config is None,
    # and the ChainedOptimizer around it and its Adam part asserts equal configs (in its
    # __init__); in bf16 it wraps them in Float16OptimizerWithFloat16Params, which
    # carry the config.
    "muon, layer-wise distributed optimizer, fp32": "AssertionError()",
    # Its TensorParallelAdaptiveMuon passes its scale mode under a name emerging-optimizers
    # 0.3.0's AdaptiveMuon does not read (in the first step); megatron_muon repairs it.
    "adaptive_muon": "AttributeError(\"'TensorParallelAdaptiveMuon' object has no attribute "
                     "'scale_mode'\")",
}
REPAIRED = {"adaptive_muon"}
STEPS = 2


def _outcome(factory, settings, wrapping, rank):
    """(the optimizer's layout, the trained weights), or the error it raised."""
    model = ddp_gpt(**wrapping)
    try:
        optimizer = factory(optimizer_config(**settings), [model])
        for step in range(STEPS):
            optimizer.zero_grad()
            model.zero_grad_buffer()
            lm_loss(model, step, rank).backward()
            model.finish_grad_sync()
            assert optimizer.step()[0]
    except (AssertionError, AttributeError) as error:
        return repr(error)
    return _layout(optimizer), [p.detach().clone() for p in model.parameters()]


def _layout(optimizer) -> list[str]:
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [type(optimizer).__name__] + [
        f"{type(part).__name__}({type(getattr(part, 'optimizer', part)).__name__})" for part in parts]


def _as_megatron_core_does(rank, world_size):
    init_parallel_state()
    initial = [p.detach().clone() for p in ddp_gpt().parameters()]
    # megatron-core alone first: megatron_muon's factory repairs megatron-core where it must
    # (upstream_fixes), for the rest of the process.
    outcomes = {name: _outcome(megatron_cores_factory, settings, wrapping, rank)
                for name, (settings, wrapping) in REQUESTS.items()}
    for name, (settings, wrapping) in REQUESTS.items():
        expected = outcomes[name]
        got = _outcome(get_megatron_optimizer, settings, wrapping, rank)
        if name in REPAIRED:
            assert not isinstance(got, str), (name, got)
            assert expected == MEGATRON_CORES_FAILURES[name] or not all(
                torch.equal(g, e) for g, e in zip(got[1], expected[1])), (name, expected)
            assert not all(torch.equal(g, p) for g, p in zip(got[1], initial)), f"{name}: not trained"
            continue
        if name in MEGATRON_CORES_FAILURES:
            assert expected == got == MEGATRON_CORES_FAILURES[name], (name, expected, got)
            continue
        assert not isinstance(expected, str), (name, expected)
        assert got[0] == expected[0], name
        assert all(torch.equal(g, e) for g, e in zip(got[1], expected[1])), name
        assert not all(torch.equal(g, p) for g, p in zip(got[1], initial)), f"{name}: not trained"


def test_other_requests_build_and_train_as_megatron_core(distributed):
    distributed(_as_megatron_core_does, 2)
