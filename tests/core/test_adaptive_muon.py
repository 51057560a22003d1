"""--optimizer adaptive_muon on Megatron DDP: megatron-core 0.19's TensorParallelAdaptiveMuon
fails in its first step (emerging-optimizers 0.3's AdaptiveMuon.step reads a `scale_mode` only
AdaptiveMuon's constructor sets) and would scale twice, as 0.20's does (TensorParallelMuon's
orthogonalize scales, then AdaptiveMuon's step). fixes.upstream_fixes repairs it: every update
equals emerging-optimizers' AdaptiveMuon's, bit for bit, for each second-moment method."""

import typing

import pytest
import torch
from emerging_optimizers.orthogonalized_optimizers.adaptive_muon import AdaptiveMuon, Moment2MethodT
from megatron.core.optimizer.emerging_optimizers import TensorParallelAdaptiveMuon

from megatron_muon.compat import upstream
from megatron_muon.fixes import upstream_fixes

SETTINGS = dict(lr=0.02, momentum=0.9, weight_decay=0.01, nesterov=True,
                fp32_matmul_prec="highest", coefficient_type="quintic", num_ns_steps=5,
                scale_mode="spectral", extra_scale_factor=0.5, beta2=0.9, eps=1e-8)
SHAPES = [(12, 8), (6, 10)]  # tall and wide: NorMuon's statistic is per row, then per column
STEPS = 3


@pytest.fixture
def repaired(capsys):
    defects = upstream_fixes.adaptive_muon_defects()
    assert defects
    upstream_fixes.apply()
    # The log names what the installed megatron-core did wrong.
    assert f"once after the second moment ({'; '.join(defects)})" in capsys.readouterr().out
    yield
    upstream.undo_patches()


def _trained(optimizer_class, method, **extra):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    optimizer = optimizer_class(params, moment2_method=method, **SETTINGS, **extra)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("method", typing.get_args(Moment2MethodT))
def test_repaired_tensor_parallel_adaptive_muon_steps_adaptive_muon(repaired, method):
    ours = _trained(TensorParallelAdaptiveMuon, method)
    reference = _trained(AdaptiveMuon, method)
    for got, expected in zip(ours, reference, strict=True):
        assert torch.equal(got, expected), (method, (got - expected).abs().max())
    assert not upstream_fixes.adaptive_muon_defects()


def test_megatron_cores_adaptive_muon_is_wrong_without_the_repair():
    """megatron-core 0.19's fails in its first step (its step reads scale_mode, which it never
    sets); megatron-core main's sets it and steps, with Muon's scale applied twice (in its
    orthogonalize and after the second moment): not AdaptiveMuon's update. The probe finds what
    the installed one does."""
    scaled_twice = "it scaled in orthogonalize too"
    defects = upstream_fixes.adaptive_muon_defects()
    try:
        unrepaired = _trained(TensorParallelAdaptiveMuon, "adamuon")
    except AttributeError as error:
        assert "scale_mode" in str(error)
        assert defects == ["it failed in its first step, scale_mode unset", scaled_twice]
        return
    reference = _trained(AdaptiveMuon, "adamuon")
    assert not any(torch.equal(got, expected) for got, expected in zip(unrepaired, reference))
    assert defects == [scaled_twice]
