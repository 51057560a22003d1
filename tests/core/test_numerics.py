"""Phase 2: ZeROTensorParallelMuon on real Megatron-FSDP equals single-device Muon bit for bit."""

import itertools
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from fsdp_models import (ADAPTIVE_KWARGS, MUON_KWARGS, ONE_BATCH, QKV_SPLIT, STRATEGIES,
                         assert_offload_as_planned, batch, full_tensor, make_models,
                         matrices_per_newton_schulz_call, muon_param_groups,
                         reference_optimizers, same_shape_linears, split_params,
                         step_beside_reference)
from megatron_muon import ZeROTensorParallelMuon
from megatron_muon.core import second_moment
from megatron_muon.compat import upstream
from megatron_muon.core.zero_adaptive_muon import ZeROTensorParallelAdaptiveMuon
from megatron_muon.observe.collectives import Traffic, observed

STEPS = 6


# Each case its own test: every strategy x dist mode x Megatron-FSDP unit at W=1, 2 and 4 (the
# module's worker pool of each world size runs them all, conftest). At W=4 only the owner mode on
# per-Linear units (every matrix crosses shard boundaries) is in make test-fast; the other W=4
# cases, `slow`, it runs at W=1 and 2.
DIST_MODES = ("owner", "allgather")
UNITS = {True: "units", False: "one_unit"}


def _case(strategy, dist_mode, unit_modules, world_size):
    slow = world_size == 4 and (dist_mode, unit_modules) != ("owner", True)
    return pytest.param(strategy, dist_mode, unit_modules, world_size,
                        id=f"{strategy}-{dist_mode}-{UNITS[unit_modules]}-W{world_size}",
                        marks=pytest.mark.slow if slow else ())


CASES = [_case(strategy, dist_mode, unit_modules, world_size) for world_size in (1, 2, 4)
         for strategy in STRATEGIES for dist_mode in DIST_MODES for unit_modules in UNITS]


def _compare(rank, world_size, strategy, dist_mode, unit_modules, outer=None,
             main_params_dtype=torch.float32, moment2_method=None, muon_class=None,
             offload_fraction=0.0):
    """Megatron-FSDP buckets per Linear (unit_modules: every matrix crosses shard boundaries) or
    the whole model as one unit (most matrices sit whole on one rank); HSDP with `outer`;
    --optimizer adaptive_muon with `moment2_method`; that share of the state in host memory
    between steps with `offload_fraction`."""
    ref, fsdp = make_models(strategy, world_size, unit_modules, outer, main_params_dtype)
    if main_params_dtype is None:  # the layout the case names
        assert all(group.main_weight_buffer is None
                   for group in fsdp.param_and_grad_buffer.parameter_groups)
    ref_opts = reference_optimizers(ref, moment2_method)
    ref_params = dict(ref.named_parameters())
    matrices, vectors = split_params(fsdp)
    case = (f"{strategy} outer={outer} {dist_mode} units={unit_modules} W={world_size} "
            f"main_params_dtype={main_params_dtype} moment2_method={moment2_method}")
    if moment2_method is None:
        muon = ZeROTensorParallelMuon(muon_param_groups(matrices), dist_mode=dist_mode,
                                      offload_fraction=offload_fraction, **MUON_KWARGS)
    else:
        muon = (muon_class or ZeROTensorParallelAdaptiveMuon)(
            muon_param_groups(matrices), dist_mode=dist_mode, moment2_method=moment2_method,
            offload_fraction=offload_fraction, **MUON_KWARGS, **ADAPTIVE_KWARGS)
    opts = [muon, torch.optim.Adam(vectors, lr=0.01, foreach=False)]
    names = {id(p): n.removeprefix("module.") for n, p in fsdp.named_parameters()}

    for step in range(STEPS):
        step_beside_reference(fsdp, matrices + vectors, names, ref_params, ref_opts + opts, step,
                              rank)
        worst = max((full_tensor(p, p) - ref_params[names[id(p)]]).abs().max().item()
                    for p in matrices + vectors)
        assert worst == 0, f"{case} step {step}: max |diff| {worst}"
        assert_offload_as_planned(muon, offload_fraction, case)

    for p in matrices:
        momentum = opts[0].state[p]["momentum_buffer"]
        assert isinstance(momentum, DTensor) and momentum.placements == p.placements
        assert momentum.to_local().shape == p.to_local().shape
        if moment2_method is not None:  # sharded as the main weights are, its rows beside theirs
            moment2 = opts[0].state[p]["moment2_buffer"]
            assert isinstance(moment2, DTensor) and moment2.placements == p.placements
            assert moment2.to_local().shape[0] == p.to_local().shape[0]
            reference = ref_opts[0].state[ref_params[names[id(p)]]]
            assert _as_reference_moment2(full_tensor(moment2, p), reference["moment2_buffer"])
    if rank == 0:
        print(f"{case}: max |diff| 0 after {STEPS} steps")


# The state in host memory between steps (core/state_offload.py: the step works on a copy of
# each matrix's rows of it, copied back), every update still single-device Muon's: Muon and the
# adaptive variants (NorMuon's state travels with the rows, AdaMuon's stays), uneven and empty
# shards at W=2 and 4, no_shard and ZeRO-1 beside ZeRO-3, allgather mode; all of the state, or
# half (--optimizer-offload-fraction 0.5: some params' state stays on the device).
OFFLOAD_CASES = [
    pytest.param(strategy, dist_mode, world_size, method, fraction,
                 id=f"{method or 'muon'}-{strategy}-{dist_mode}-W{world_size}-{fraction}")
    for strategy, dist_mode, world_size, method, fraction in (
        ("optim_grads_params", "owner", 1, None, 1.0),
        ("optim_grads_params", "owner", 2, None, 0.5), ("optim", "owner", 2, "normuon", 1.0),
        ("no_shard", "allgather", 2, None, 1.0), ("optim_grads_params", "owner", 4, None, 1.0),
        ("optim_grads_params", "owner", 4, "adamuon", 0.5),
        ("optim_grads", "owner", 4, "normuon", 1.0))]


@pytest.mark.parametrize("strategy, dist_mode, world_size, method, fraction", OFFLOAD_CASES)
def test_offloaded_state_matches_single_device_muon(distributed, strategy, dist_mode, world_size,
                                                    method, fraction):
    distributed(_compare, world_size, strategy, dist_mode, True, None, torch.float32, method,
                None, fraction)


def _as_reference_moment2(ours: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether our whole second moment is AdaptiveMuon's: the same tensor, or NorMuon's [1, cols]
    of a wide matrix laid along its rows (second_moment.NorMuon), the rest zero padding."""
    if ours.shape == reference.shape:
        return torch.equal(ours, reference)
    flat = ours.reshape(-1)
    return (torch.equal(flat[:reference.numel()], reference.reshape(-1))
            and not flat[reference.numel():].any())


def _inner_boundaries(p) -> set[int]:
    """Rows at which the shards of a row-sharded matrix meet (none for replicated ones)."""
    if not any(placement == Shard(0) for placement in p.placements):
        return set()
    held = [None] * dist.get_world_size()
    dist.all_gather_object(held, p.to_local().shape[0])
    return {b for b in itertools.accumulate(held) if 0 < b < p.shape[0]}


@pytest.mark.parametrize("strategy, dist_mode, unit_modules, world_size", CASES)
def test_matches_single_device_muon(distributed, strategy, dist_mode, unit_modules, world_size):
    distributed(_compare, world_size, strategy, dist_mode, unit_modules)


# --megatron-fsdp-main-params-dtype auto on a fp32 model: Megatron-FSDP keeps no main weight
# buffer, the optimizer steps its shards of the compute weights' buffer and
# install_optimized_model_weights copies nothing (what the forward then reads:
# test_compute_weights).
@pytest.mark.parametrize("strategy, world_size", [
    pytest.param(strategy, world_size, id=f"{strategy}-W{world_size}")
    for world_size, strategies in ((2, STRATEGIES), (4, ("optim", "optim_grads_params")))
    for strategy in strategies])
def test_compute_weights_as_main_weights_match_single_device_muon(distributed, strategy,
                                                                   world_size):
    distributed(_compare, world_size, strategy, "owner", True, None, None)


def _qkv_boundaries_of_the_cases(rank, world_size):
    """The QKV matrix's shard boundaries in the cases above (the layout is Megatron-FSDP's, the
    same under either dist mode and at every step)."""
    boundaries = set()
    for strategy in STRATEGIES:
        for unit_modules in UNITS:
            _, fsdp = make_models(strategy, world_size, unit_modules)
            boundaries |= _inner_boundaries(fsdp.module.qkv.weight)
    # The QKV split is exercised with FSDP shard boundaries inside a head group, and on them.
    group_rows = sum(QKV_SPLIT)
    assert any(b % group_rows for b in boundaries), boundaries
    assert any(b % group_rows == 0 for b in boundaries), boundaries


def test_the_cases_cut_the_qkv_matrix_inside_and_between_head_groups(distributed):
    distributed(_qkv_boundaries_of_the_cases, 4)


# HSDP at W=4: 2 replicas x 2 shards. Megatron-FSDP shards the outer dim only under ZeRO-3.
HSDP_CASES = [("no_shard", "optim"), ("no_shard", "optim_grads"), ("no_shard", "optim_grads_params"),
              ("optim", "optim_grads_params")]


@pytest.mark.parametrize("outer, strategy, dist_mode", [  # allgather: slow, as at W=4 above
    pytest.param(outer, strategy, dist_mode, id=f"{outer}-{strategy}-{dist_mode}",
                 marks=pytest.mark.slow if dist_mode == "allgather" else ())
    for outer, strategy in HSDP_CASES for dist_mode in DIST_MODES])
def test_hsdp_matches_single_device_muon(distributed, outer, strategy, dist_mode):
    distributed(_compare, 4, strategy, dist_mode, True, outer)


# --optimizer adaptive_muon: each update bit-identical to megatron-core's TensorParallelAdaptiveMuon
# (repaired) on the unsharded model; ZeRO-3 with owners at W=1, 2 and 4, the other strategies at
# W=2 for NorMuon (whose state travels with the rows), and allgather mode, the one-unit layout
# (W=2) and HSDP (W=4). NAMO's state travels as NorMuon's, its raw gradient to the owner only:
# ZeRO-3, HSDP and allgather mode (the check interval's reference).
MOMENT2_METHODS = ("adamuon", "normuon")
ADAPTIVE_CASES = [
    pytest.param(strategy, "owner", True, None, world_size, method,
                 id=f"{method}-{strategy}-owner-units-W{world_size}")
    for world_size, strategies in ((1, STRATEGIES[-1:]), (2, STRATEGIES), (4, STRATEGIES[-1:]))
    for strategy in strategies for method in ("adamuon", "normuon", "namo")
    if strategy == STRATEGIES[-1] or method == "normuon"]
ADAPTIVE_CASES += [
    pytest.param(strategy, dist_mode, unit_modules, outer, world_size, method,
                 id=f"{method}-{outer or ''}{'-' if outer else ''}{strategy}-{dist_mode}-"
                    f"{UNITS[unit_modules]}-W{world_size}")
    for strategy, dist_mode, unit_modules, outer, world_size in (
        ("optim_grads_params", "allgather", True, None, 2),
        ("optim_grads", "owner", False, None, 2),
        ("optim_grads_params", "owner", True, "optim", 4))
    for method in MOMENT2_METHODS]
ADAPTIVE_CASES.append(pytest.param("optim_grads_params", "owner", True, "optim", 4, "namo",
                                   id="namo-optim-optim_grads_params-owner-units-W4"))
ADAPTIVE_CASES.append(pytest.param("optim_grads_params", "allgather", True, None, 2, "namo",
                                   id="namo-optim_grads_params-allgather-units-W2"))


@pytest.mark.parametrize("strategy, dist_mode, unit_modules, outer, world_size, method",
                         ADAPTIVE_CASES)
def test_adaptive_muon_matches_single_device_adaptive_muon(distributed, strategy, dist_mode,
                                                          unit_modules, outer, world_size, method):
    distributed(_compare, world_size, strategy, dist_mode, unit_modules, outer, torch.float32,
                method)


class RowsOnlyNorMuon(second_moment.HolderSecondMoment):
    """NorMuon on each rank's rows alone, as if its statistics needed no whole matrix: the
    column means of a wide matrix and the Frobenius-norm match over a part of it."""

    name = "normuon"
    held_columns = second_moment.NorMuon.held_columns

    def holder_update(self, optimizer, rows, columns, moment2, group, whole_shape):
        if not rows.numel():
            return rows
        tall = rows.shape[0] >= rows.shape[1]
        moments = optimizer.__dict__.setdefault("rows_only_moments", {})
        moment = moments.setdefault(moment2.data_ptr(), rows.new_zeros(
            (rows.shape[0], 1) if tall else (1, rows.shape[1])))
        update = upstream.apply_moment2_normalization(optimizer, rows, moment, group["beta2"],
                                                      group["eps"])
        return upstream.apply_muon_scale(optimizer, update, *whole_shape)


def _rows_only_normuon_differs(rank, world_size):
    with mock.patch.dict(second_moment.SECOND_MOMENTS, normuon=RowsOnlyNorMuon()):
        with pytest.raises(AssertionError, match=r"step 0: max \|diff\|"):
            _compare(rank, world_size, "optim_grads_params", "owner", True, None, torch.float32,
                     "normuon")


def test_normuon_on_a_partial_matrix_fails_the_comparison(distributed):
    """The comparison above catches NorMuon's statistic taken over a rank's rows where the whole
    matrix is needed (W=2: the wide 9x40 and 3x9 matrices are split across the ranks)."""
    distributed(_rows_only_normuon_differs, 2)


# (strategy, HSDP's outer strategy, dist mode, how often each matrix is orthogonalized at W=4)
NEWTON_SCHULZ_CASES = [(strategy, outer, "owner", 1) for strategy, outer in
                       (("optim_grads_params", None), ("no_shard", None),
                        ("optim_grads_params", "no_shard"), ("optim_grads_params", "optim"))]
NEWTON_SCHULZ_CASES.append(("optim_grads_params", None, "allgather", 4))


def _count_newton_schulz(rank, world_size, cases):
    import megatron.core.optimizer.emerging_optimizers as core_muon

    calls = []
    newton_schulz_tp = core_muon.newton_schulz_tp

    def counted(x, *args, **kwargs):
        calls.append(x.shape[0] if x.dim() == 3 else 1)
        return newton_schulz_tp(x, *args, **kwargs)

    with mock.patch.object(core_muon, "newton_schulz_tp", counted):
        _count_each_case(rank, world_size, calls, cases)


def _count_each_case(rank, world_size, calls, cases):
    for strategy, outer, dist_mode, expected_repeats in cases:
        _, fsdp = make_models(strategy, world_size, outer=outer)
        matrices, _ = split_params(fsdp)
        opt = ZeROTensorParallelMuon(matrices, dist_mode=dist_mode, **MUON_KWARGS)
        for step in range(2):
            x, y = batch(step, rank)
            torch.nn.functional.mse_loss(fsdp(x), y).backward()
            if not fsdp.model_auto_sync:
                fsdp.finish_grad_sync()
            calls.clear()  # each step's own: the batching choice ran at construction
            opt.step()
            fsdp.zero_grad_buffer()
            # The QKV matrix is orthogonalized as three blocks.
            per_step = torch.tensor(sum(calls))
            dist.all_reduce(per_step)
            assert per_step.item() == expected_repeats * (len(matrices) + 2), (
                strategy, outer, dist_mode, step, per_step)


@pytest.mark.parametrize("case", [
    pytest.param(case, id="-".join(filter(None, (case[1], case[0], case[2]))))
    for case in NEWTON_SCHULZ_CASES])
def test_owner_mode_runs_each_newton_schulz_once_across_ranks_and_replicas(distributed, case):
    distributed(_count_newton_schulz, 4, [case])


def _count_traffic(rank, world_size, layouts):
    for unit_modules in layouts:
        _, fsdp = make_models("optim_grads_params", world_size, unit_modules)
        matrices, _ = split_params(fsdp)
        opt = ZeROTensorParallelMuon(matrices, byte_slack=0.0, **MUON_KWARGS)
        # The bound, from megatron_fsdp's own chunk metadata: every row not on the rank holding
        # most of its matrix travels to that rank and back.
        expected = 0
        for p in matrices:
            held = [None] * world_size
            dist.all_gather_object(held, p.to_local().shape[0])
            expected += 2 * (p.shape[0] - max(held)) * p.shape[1] * p.element_size()
        x, y = batch(0, rank)
        torch.nn.functional.mse_loss(fsdp(x), y).backward()
        fsdp.finish_grad_sync()
        with observed(Traffic()) as traffic:
            opt.step()
        received = torch.tensor(traffic.received_bytes)
        dist.all_reduce(received)
        assert received.item() == expected, (unit_modules, received.item(), expected)
        exchanges = sum(len(plan.routes) for plan in opt.plans)
        assert traffic.by_name.keys() <= {"alltoall_base_"}
        assert traffic.collectives <= 2 * exchanges
        whole_on_owner = [m.layout.held(o) == m.layout.num_rows
                          for plan in opt.plans for m, o in zip(plan.matrices, plan.owners)]
        if not unit_modules:  # one bucket: some matrices sit whole on their owner and move nothing
            assert any(whole_on_owner), whole_on_owner


@pytest.mark.parametrize("unit_modules", UNITS, ids=UNITS.values())
def test_owner_mode_moves_exactly_the_layout_minimum(distributed, unit_modules):
    distributed(_count_traffic, 4, [unit_modules])


def _batching_under_bf16_matmuls(rank, world_size):
    """With `medium` (bf16 matmuls, Megatron's default) an owner's same-shape matrices go through
    one batched Newton-Schulz each batch, with no per-shape exactness check (docs/design.md,
    "Library"); owners by bytes here, nothing measured (owners by time: test_owner_choice)."""
    fsdp = same_shape_linears(world_size)
    opt = ZeROTensorParallelMuon(list(fsdp.parameters()), owner_choice="bytes",
                                 max_exchange_bytes=ONE_BATCH,
                                 **{**MUON_KWARGS, "fp32_matmul_prec": "medium"})
    matrices_per_call = matrices_per_newton_schulz_call(fsdp, opt)
    owned_batches = sum(1 for plan in opt.plans for routes in plan.routes
                        for owned in routes.owned_batches if owned)
    assert len(matrices_per_call) == owned_batches, (matrices_per_call, owned_batches)
    assert all(opt.batched_newton_schulz.values())  # bf16: batched, no bit-identity probe
    total = torch.tensor([sum(matrices_per_call), max(matrices_per_call, default=0)])
    dist.all_reduce(total[:1])
    dist.all_reduce(total[1:], op=dist.ReduceOp.MAX)
    assert total.tolist()[0] == 4 and total.tolist()[1] > 1, total


def test_bf16_newton_schulz_batches_same_shape_matrices(distributed):
    distributed(_batching_under_bf16_matmuls, 2)
