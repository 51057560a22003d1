"""Gram Newton-Schulz (--muon-gram-newton-schulz): its iteration against gram-newton-schulz's own
torch path (bit for bit), its fp32 result against standard Newton-Schulz's (within the derived
bound), at `medium` no farther from fp32 standard Newton-Schulz than bf16 standard Newton-Schulz
is, its FLOPs as counted against what runs, where it runs; whole steps on Megatron-FSDP (uneven and
empty shards, W=1, 2 and 4) bit for bit against single-device Muon with the same Newton-Schulz."""

import builtins
import dataclasses
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from emerging_optimizers import utils as eo_utils
from gram_newton_schulz.gram_newton_schulz import _TORCH_BACKEND, _make_compiled_gram
from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon
from torch.utils.flop_counter import FlopCounterMode

from fsdp_models import (ADAPTIVE_KWARGS, MUON_KWARGS, assert_offload_as_planned, full_tensor,
                         make_models, muon_param_groups, reference_optimizers, split_params,
                         step_beside_reference, with_gram_newton_schulz)
from megatron_muon import (ZeROTensorParallelAdaptiveMuon, ZeROTensorParallelMuon,
                           get_megatron_optimizer)
from megatron_muon.compat import upstream
from megatron_muon.compat.newton_schulz_loop import EPS, coefficients
from megatron_muon.core import gram_newton_schulz as gram
from megatron_muon.core.settings import tensor_parallel_muon_settings
from megatron_muon.core.team_newton_schulz import team_orthogonalize
from megatron_muon.observe.collectives import Traffic, observed
from megatron_muon.plan import (GramSchedule, Matrix, RowLayout, TeamBlock, gram_counts,
                                newton_schulz_flops, ns_flops)
from megatron_muon.tools.selftest import _NewtonSchulzClock
from megatron_muon.tools.testing import (TINY, fsdp_gpt, init_parallel_state, lm_loss,
                                         optimizer_config)
from tolerances import ATOL, muon_drift, reordering_error

SETTINGS = dict(coefficient_type="quintic", scale_mode="spectral", extra_scale_factor=1.0)
FIVE = GramSchedule(5)
# The flagships' rectangular shapes scaled down with their aspect kept: Llama-70B's fused fc1
# (1:7) and fc2 (1:3.5), the MoE experts' fc1 (1:1.75), each way round; and a batch of three.
SHAPES = [(64, 448), (448, 64), (128, 448), (448, 128), (128, 224), (224, 128), (3, 32, 112)]


def _input(shape, seed=0, conditioning=None):
    """A random matrix (or batch); with `conditioning`, its singular values spread over that many
    decades, as a momentum's are."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    if conditioning is None:
        return x
    u, s, v = torch.linalg.svd(x, full_matrices=False)
    decay = torch.logspace(0, -conditioning, s.shape[-1])
    return u @ torch.diag_embed(s * decay) @ v


@pytest.mark.parametrize("coefficient_type, restarts", [("quintic", (2,)),
                                                        ("polar_express", (1, 3))])
def test_the_iteration_is_gram_newton_schulzs_bit_for_bit(coefficient_type, restarts):
    """Given the same normalized input and coefficients, gram_iterations is gram-newton-schulz's
    `_make_compiled_gram` on its torch backend, uncompiled, bit for bit, in fp16, the one
    precision it iterates in (on wide matrices, which both iterate as they are: ours transposes
    a tall one as emerging_optimizers does, theirs forms X^T X)."""
    steps = 5
    sets = coefficients(steps, coefficient_type)
    theirs = _make_compiled_gram(_TORCH_BACKEND, sets, list(restarts), EPS, None)
    for shape in [(64, 448), (128, 448), (3, 32, 112)]:
        x = _input(shape).view(-1, *shape[-2:])
        normalized = x / (x.norm(dim=(-2, -1), keepdim=True) + EPS)  # as theirs normalizes
        ours = gram.gram_iterations(normalized.to(torch.float16), sets, restarts)
        assert ours.dtype == torch.float16 and torch.equal(ours, theirs(x))


def _exact(x, steps=5, coefficient_type="quintic"):
    """Standard Newton-Schulz in fp64, as emerging_optimizers' newton_schulz frames it: the
    polynomial both compute, to the rounding neither fp32 evaluation comes near."""
    wide = x if x.size(-2) <= x.size(-1) else x.mT
    X = torch.nn.functional.normalize(wide.double(), p=2, dim=(-2, -1), eps=EPS)
    for a, b, c in coefficients(steps, coefficient_type):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return (X if x.size(-2) <= x.size(-1) else X.mT).float()


@pytest.mark.parametrize("conditioning", [None, 4])
def test_in_fp32_the_update_is_within_the_derived_bound_of_standard_newton_schulz(conditioning):
    """Within gram_newton_schulz.fp32_bound, a worst case (docs/design.md); and as it runs, of the
    order of standard fp32 Newton-Schulz's own rounding: within 10 times its distance from the
    exact polynomial (observed up to 7.1 times on inputs whose singular values spread over 4
    decades, where the Gram matrix squares their spread; a bf16 Gram lies 1000 times farther)."""
    reference = TensorParallelMuon([torch.nn.Parameter(torch.zeros(1, 1))], **SETTINGS)
    ours = gram.scaled_orthogonalize_fn(reference.scaled_orthogonalize_fn, FIVE, "quintic",
                                        _muon_scale)
    with eo_utils.fp32_matmul_precision("highest"):
        for shape in SHAPES:
            x = _input(shape, conditioning=conditioning)
            standard, with_gram = reference.scaled_orthogonalize_fn(x, None), ours(x, None)
            scale = _muon_scale(*shape[-2:])
            own_rounding = (standard - _exact(x) * scale).abs().max()
            difference = (with_gram - standard).abs().max()
            assert 0 < difference <= gram.fp32_bound(shape[-2:], FIVE, SETTINGS), shape
            assert difference <= 10 * own_rounding, (shape, difference, own_rounding)
            # Not standard's own call: the FLOPs say which ran.
            with FlopCounterMode(display=False) as counted:
                ours(x, None)
            count = x.shape[0] if x.ndim == 3 else 1
            assert counted.get_total_flops() == count * FIVE.flops(*shape[-2:]), shape


def _muon_scale(rows, cols):
    return upstream.get_muon_scale_factor(rows, cols, mode="spectral")


def test_at_medium_it_is_no_farther_from_fp32_standard_than_bf16_standard_is():
    """At --muon-fp32-matmul-prec medium standard Newton-Schulz iterates in bf16 and Gram
    Newton-Schulz in fp16 (in bf16 it lies farther: docs/design.md's figures)."""
    for shape in SHAPES:
        for conditioning in (None, 4):
            x = _input(shape, conditioning=conditioning)
            with eo_utils.fp32_matmul_precision("highest"):
                fp32 = upstream.newton_schulz(x, 5, "quintic")
            with eo_utils.fp32_matmul_precision("medium"):
                bf16 = upstream.newton_schulz(x, 5, "quintic")
                fp16_gram = gram.gram_newton_schulz(x, FIVE, "quintic")
            assert (fp16_gram - fp32).abs().max() <= (bf16 - fp32).abs().max(), shape


def test_the_counted_flops_are_those_that_run():
    """GramSchedule.flops and ns_flops against FlopCounterMode, for schedules with one restart,
    two and none; Gram runs only where it counts fewer (never on a square matrix)."""
    for schedule in (FIVE, GramSchedule(5, (1, 3)), GramSchedule(6, ())):
        for shape in [(32, 224), (224, 32), (64, 112), (48, 48)]:
            x = _input(shape)
            with eo_utils.fp32_matmul_precision("highest"):
                with FlopCounterMode(display=False) as counted:
                    gram.gram_newton_schulz(x, schedule, "quintic")
                with FlopCounterMode(display=False) as standard:
                    upstream.newton_schulz(x, schedule.steps, "quintic")
            assert counted.get_total_flops() == schedule.flops(*shape), (schedule, shape)
            assert standard.get_total_flops() == ns_flops(*shape, schedule.steps)
            fewer = schedule.flops(*shape) < ns_flops(*shape, schedule.steps)
            assert schedule.runs_on(*shape) == fewer
    assert not FIVE.runs_on(48, 48) and not FIVE.runs_on(64, 96)  # 1:1.5: as many FLOPs
    assert FIVE.runs_on(64, 112) and FIVE.runs_on(112, 64)
    # The figures: (8r + 28) m^3 against (20r + 10) m^3.
    for r, ratio in ((7, 0.56), (3.5, 0.70), (1.75, 28 / 30)):
        shape = (1024, int(r * 1024))
        assert FIVE.flops(*shape) / ns_flops(*shape, 5) == pytest.approx(ratio)


def test_a_matrix_counts_the_newton_schulz_its_owner_runs():
    """Matrix.ns_flops: Gram's on a row block it runs on, standard's on the others (a QKV
    split's square q block); `steps` scales a Gram matrix's count (FLOPs per iteration)."""
    layout = RowLayout((16, 16))
    qkv = Matrix(layout, 16, row_blocks=(16, 8, 8), gram=FIVE)
    assert qkv.ns_flops(5) == ns_flops(16, 16, 5) + 2 * FIVE.flops(8, 16)
    wide = Matrix(layout, 112, gram=FIVE)
    assert wide.ns_flops(5) == FIVE.flops(32, 112) and wide.ns_flops(1) == FIVE.flops(32, 112) // 5
    assert Matrix(layout, 112).ns_flops(5) == ns_flops(32, 112, 5)


def test_a_restart_outside_the_iterations_is_refused_naming_the_flags():
    with pytest.raises(ValueError, match=r"--muon-gram-restarts \[5\]: each restart an iteration "
                                         r"in \[1, 5\) \(--muon-num-ns-steps 5\)"):
        ZeROTensorParallelMuon([torch.nn.Parameter(torch.zeros(2, 2))], gram_newton_schulz=True,
                               gram_restarts=(5,), **MUON_KWARGS)


def _steps_as_single_device_gram_muon(rank, world_size, strategy, moment2_method=None,
                                      offload=0.0):
    """Six steps of the test net (every Newton-Schulz matrix under Gram: the QKV split's blocks,
    8 x 16 and 4 x 16, each too) on Megatron-FSDP: each weight bit-identical to megatron-core's
    single-device optimizer on the unsharded net with Gram Newton-Schulz routed in the same way;
    the start-up line on rank 0. `offload`: that share of the state in host memory."""
    ref, fsdp = make_models(strategy, world_size)
    ref_opts = reference_optimizers(ref, moment2_method)
    with_gram_newton_schulz(ref_opts[0], scaled=moment2_method is None)
    ref_params = dict(ref.named_parameters())
    matrices, vectors = split_params(fsdp)
    printed = []
    with mock.patch.object(builtins, "print", side_effect=lambda *a, **k: printed.append(a[0])):
        if moment2_method is None:
            muon = ZeROTensorParallelMuon(muon_param_groups(matrices), gram_newton_schulz=True,
                                          offload_fraction=offload, **MUON_KWARGS)
        else:
            muon = ZeROTensorParallelAdaptiveMuon(
                muon_param_groups(matrices), gram_newton_schulz=True, offload_fraction=offload,
                moment2_method=moment2_method, **MUON_KWARGS, **ADAPTIVE_KWARGS)
    lines = [line for line in printed if "--muon-gram-newton-schulz" in line]
    if rank == 0:  # qkv's q block (8 x 16 of 16 x 16: 1:2) runs it; nothing square in the net
        assert lines == [f"megatron-muon: --muon-gram-newton-schulz: {type(muon).__name__}: "
                         "Gram Newton-Schulz on 7 of 7 matrices"], printed
    else:
        assert lines == []
    opts = [muon, torch.optim.Adam(vectors, lr=0.01, foreach=False)]
    names = {id(p): n.removeprefix("module.") for n, p in fsdp.named_parameters()}
    for step in range(6):
        step_beside_reference(fsdp, matrices + vectors, names, ref_params, ref_opts + opts, step,
                              rank)
        worst = max((full_tensor(p, p) - ref_params[names[id(p)]]).abs().max().item()
                    for p in matrices + vectors)
        assert worst == 0, (strategy, world_size, moment2_method, step, worst)
        assert_offload_as_planned(muon, offload, f"gram W={world_size} step {step}")


# W=1, 2 and 4; ZeRO-3, 1 and 2; Muon, NorMuon (its second moment on the owners), AdaMuon (on
# the holders); the state on the device, all of it in host memory, half (W=2's plain Muon and
# W=4's: tests/chain/test_check_interval.py's twins and the self-test's W=4 run).
@pytest.mark.parametrize("world_size, strategy, moment2_method, offload", [
    (1, "optim_grads_params", None, 0.0), (2, "optim", "normuon", 1.0),
    (4, "optim_grads", "adamuon", 0.5)])
def test_on_megatron_fsdp_each_update_is_single_device_gram_muons(distributed, world_size,
                                                                   strategy, moment2_method,
                                                                   offload):
    """(`offload`: --optimizer-cpu-offload's share: the state in host memory between steps.)"""
    distributed(_steps_as_single_device_gram_muon, world_size, strategy, moment2_method, offload)


def _a_gram_step_runs_the_flops_counted(rank, world_size):
    """A GPT whose MLPs and output layer take Gram Newton-Schulz (fc1 128 x 32, fc2 32 x 128,
    64 x 32), its attention's square blocks not, through the factory: the second step's matrix
    products (torch's FlopCounterMode) are what the plan counts for this rank
    (plan.newton_schulz_flops) and what the self-test's clock counts, to the FLOP."""
    init_parallel_state()
    shape = dataclasses.replace(TINY, ffn=4 * TINY.hidden)
    model = fsdp_gpt(shape)
    with mock.patch.object(builtins, "print"):
        optimizer = get_megatron_optimizer(optimizer_config(), [model],
                                           muon_gram_newton_schulz=True)
    (muon,) = optimizer.muon_optimizers
    steps = muon.newton_schulz_settings["num_ns_steps"]
    clock = _NewtonSchulzClock(muon, steps)
    for step in range(2):  # the first creates state
        optimizer.zero_grad()
        lm_loss(model, step, rank, shape).backward()
        model.finish_grad_sync()
        clocked = clock.flops
        with FlopCounterMode(display=False) as counted:
            assert optimizer.step()[0]
    planned = sum(newton_schulz_flops(plan.matrices, plan.owners, steps,
                                      dist.get_world_size(plan.group))[plan.rank]
                  for plan in muon.plans)
    assert counted.get_total_flops() == planned == clock.flops - clocked, (
        counted.get_total_flops(), planned, clock.flops - clocked)
    gram, by_shape, _ = gram_counts(m for plan in muon.plans for m in plan.matrices)
    # fc1 and fc2 of each layer and the output layer (64 x 32); q, k, v and proj are square
    assert (gram, by_shape) == (5, 8), (gram, by_shape)


def test_a_gram_step_runs_the_flops_the_plan_and_the_self_test_count(distributed):
    distributed(_a_gram_step_runs_the_flops_counted, 4)


def _team_gram_as_whole_gram(rank, world_size, dim):
    """A matrix 6 wide and 12 long a member, split over a team of `world_size` along its long side
    (row blocks of a tall one, column blocks of a wide one) under Gram Newton-Schulz: the team's
    part is the whole matrix's Gram Newton-Schulz, within what reordering the Gram matrices'
    fp32 sums changes; three all-reduces (the norm, the Gram matrix at the start and at the
    restart, not one an iteration), the FLOPs Matrix.member_flops counts; at `medium` (fp16)
    within twice the whole matrix's fp16 distance from fp32; without the all-reduces, far off."""
    shape = [12 * world_size, 6][::1 if dim == 0 else -1]
    full = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    block = full.chunk(world_size, dim)[rank]
    group = dist.new_group(list(range(world_size)))
    settings = tensor_parallel_muon_settings({})
    reference = with_gram_newton_schulz(
        TensorParallelMuon([torch.nn.Parameter(torch.zeros(1, 1))], **SETTINGS))
    member = Matrix(RowLayout((block.shape[0],)), block.shape[1], gram=FIVE,
                    team=TeamBlock(0, tuple(full.shape), 0, world_size))
    bound = muon_drift([1.0], full.shape, reordering_error(max(full.shape))) + ATOL
    with eo_utils.fp32_matmul_precision("highest"):
        whole = reference.scaled_orthogonalize_fn(full, None)
        with FlopCounterMode(display=False) as counted, observed(Traffic()) as traffic:
            ours = team_orthogonalize(block, tuple(full.shape), dim, group, settings, FIVE)
        assert counted.get_total_flops() == member.ns_flops(5)
        assert traffic.by_name["allreduce_"] == 1 + FIVE.gram_matrices == 3
        assert member.gram_all_reduces(5) == 2
        part = whole.chunk(world_size, dim)[rank]
        assert (ours - part).abs().max() <= bound
        with mock.patch.object(dist, "all_reduce"):  # each member its own columns alone
            alone = team_orthogonalize(block, tuple(full.shape), dim, group, settings, FIVE)
        assert (alone - part).abs().max() > bound
    with eo_utils.fp32_matmul_precision("medium"):
        fp16 = team_orthogonalize(block, tuple(full.shape), dim, group, settings, FIVE)
        fp16_whole = reference.scaled_orthogonalize_fn(full, None)
    assert (fp16 - part).abs().max() <= 2 * (fp16_whole - whole).abs().max()


@pytest.mark.parametrize("world_size, dim", [(2, 0), (4, 1)])
def test_a_team_under_gram_sums_its_gram_matrix_once_a_restart(distributed, world_size, dim):
    distributed(_team_gram_as_whole_gram, world_size, dim)
