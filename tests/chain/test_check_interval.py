"""The check interval (ZeROTensorParallelMuon's check_interval, --muon-check-interval): every N-th
step owner mode also computes each matrix's update as dist_mode="allgather" does and compares;
a corrupted owner result is caught, named, and nothing of that step is applied; off (and between
checks) it adds no collective. At W=2 and W=4 on real Megatron-FSDP, uneven shards and, at W=4,
ranks holding nothing."""

import re
from unittest import mock

import pytest
import torch

from fsdp_models import (ADAPTIVE_KWARGS, MUON_KWARGS, batch, make_models, muon_param_groups,
                         split_params)
from megatron_muon import ZeROTensorParallelAdaptiveMuon, ZeROTensorParallelMuon
from megatron_muon.chain.model_chunks import find_megatron_fsdp, named_main_weights
from megatron_muon.observe.collectives import Traffic, observed

def _muon(world_size, strategy="optim_grads_params", check_interval=0, precision="highest",
          offload_fraction=0.0, gram=False):
    """(`gram`: --muon-gram-newton-schulz, the owners' and the reference's Newton-Schulz.)"""
    _, fsdp = make_models(strategy, world_size)
    matrices, _ = split_params(fsdp)
    names = {p: n for n, p in fsdp.named_parameters()}
    muon = ZeROTensorParallelMuon(muon_param_groups(matrices), check_interval=check_interval,
                                  param_names=names, offload_fraction=offload_fraction,
                                  gram_newton_schulz=gram,
                                  **{**MUON_KWARGS, "fp32_matmul_prec": precision})
    return fsdp, matrices, muon


def _backward(fsdp, step, rank):
    x, y = batch(step, rank)
    torch.nn.functional.mse_loss(fsdp(x), y).backward()
    if not fsdp.model_auto_sync:
        fsdp.finish_grad_sync()


def _counted_step(muon) -> int:
    """How many collectives one step issues on this rank."""
    with observed(Traffic()) as traffic:
        muon.step()
    return traffic.collectives


def _checks(rank, world_size):
    for strategy in ("no_shard", "optim", "optim_grads_params"):
        fsdp, matrices, checked = _muon(world_size, strategy, check_interval=2)
        _, same_matrices, plain = _muon(world_size, strategy)
        for step in range(4):
            _backward(fsdp, step, rank)
            for p, q in zip(matrices, same_matrices):  # the same gradients, unchecked
                q.grad = p.grad
            counted, uncounted = _counted_step(checked), _counted_step(plain)
            assert all(torch.equal(p.to_local(), q.to_local())  # the check changes no update
                       for p, q in zip(matrices, same_matrices)), (strategy, step)
            if step % 2 == 0:  # steps 1 and 3: no check, not one collective more
                assert counted == uncounted, (strategy, step, counted, uncounted)
            else:
                assert counted > uncounted, (strategy, step, counted, uncounted)
            fsdp.zero_grad_buffer()
            checked.zero_grad()
            plain.zero_grad()
    return len(matrices)


def _check_logs_and_costs_nothing_between(rank, world_size):
    import builtins

    printed = []
    with mock.patch.object(builtins, "print", side_effect=lambda *a, **k: printed.append(a[0])):
        matrices = _checks(rank, world_size)
    lines = [line for line in printed if line.startswith("muon check at iteration")]
    if rank != 0:
        assert lines == []
        return
    assert len(lines) == 3 * 2, printed  # 3 strategies, steps 2 and 4
    for line in lines:
        assert re.fullmatch(r"muon check at iteration [24]: max \|owner - reference\| = "
                            rf"0\.000e\+00 over {matrices} matrices", line), line


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_the_check_passes_exact_updates_and_adds_no_collective_between_checks(distributed,
                                                                               world_size):
    distributed(_check_logs_and_costs_nothing_between, world_size)


def _corrupted_owner(rank, world_size, precision="highest", corruption=1e-3, offload=0.0,
                     gram=False):
    fsdp, matrices, muon = _muon(world_size, check_interval=1, precision=precision,
                                 offload_fraction=offload, gram=gram)
    _backward(fsdp, 0, rank)
    before = [p.to_local().clone() for p in matrices]
    owned_results = muon.orthogonalize_owned
    corrupt_rank = muon.plans[0].owners[0]  # a rank that owns a matrix

    corrupted_once = []

    def corrupted(params, fulls, batch_key):
        results = owned_results(params, fulls, batch_key)
        if rank == corrupt_rank and not corrupted_once and results and results[0].numel():
            corrupted_once.append(True)
            results[0] = results[0].clone()
            results[0][0, 0] += corruption  # one element of one owner's result
        return results

    with mock.patch.object(muon, "orthogonalize_owned", side_effect=corrupted):
        with pytest.raises(RuntimeError) as caught:
            muon.step()
    message = str(caught.value)
    assert "muon check at iteration 1: the owner exchange's update differs" in message, message
    assert "nothing of this step was applied" in message
    found = re.search(r"module\.\w+\.weight: shape \(\d+, \d+\), owner rank "
                      rf"{corrupt_rank} of its data-parallel group \(global rank {corrupt_rank}\): "
                      r"max \|owner - reference\| = "
                      r"(\S+) > bound (\S+)", message)
    assert found and message.count("owner rank") == 1, message  # that matrix, and only it
    difference, bound = float(found[1]), float(found[2])
    if precision == "highest":
        assert bound == 0 and difference == pytest.approx(corruption, rel=1e-3), message
    else:  # bf16's own error against fp32 Newton-Schulz, well below the corruption
        assert 0 < bound < corruption / 10 and difference > corruption / 2, message
    # Nothing applied: weights (weight decay included) and momentum as before the step.
    assert all(torch.equal(p.to_local(), b) for p, b in zip(matrices, before))
    assert all(not muon.state[p]["momentum_buffer"].to_local().any() for p in matrices)


@pytest.mark.parametrize("world_size, offload", [(2, 0.0), (4, 1.0)])
def test_a_corrupted_owner_result_is_caught_named_and_nothing_applied(distributed, world_size,
                                                                      offload):
    """(`offload`: the momentum in host memory, restored there.)"""
    distributed(_corrupted_owner, world_size, "highest", 1e-3, offload)


def _bf16_checks(rank, world_size, gram=False):
    fsdp, _, muon = _muon(world_size, check_interval=1, precision="medium", gram=gram)
    for step in range(2):
        _backward(fsdp, step, rank)
        muon.step()  # owner and per-matrix reference within bf16's own error: no raise
        assert muon.last_check.iteration == step + 1
        fsdp.zero_grad_buffer()
        muon.zero_grad()
    _corrupted_owner(rank, world_size, precision="medium", corruption=1.0, gram=gram)


@pytest.mark.parametrize("gram", [False, True], ids=["standard", "gram"])
def test_with_bf16_newton_schulz_the_bound_is_bf16s_own_error(distributed, gram):
    """(`gram`: --muon-gram-newton-schulz, fp16 at `medium`: its reference's distance from its
    own fp32 result.)"""
    distributed(_bf16_checks, 2, gram)


def _gram_checks(rank, world_size):
    """--muon-gram-newton-schulz with a check every step: each passes, exactly (the owners and
    the reference run the same Gram Newton-Schulz), beside an unchecked twin; then a corrupted
    Gram result is caught."""
    fsdp, matrices, checked = _muon(world_size, check_interval=1, gram=True)
    _, twins, plain = _muon(world_size, gram=True)
    _, standard_twins, standard = _muon(world_size)  # what Gram's updates are not
    for step in range(3):
        _backward(fsdp, step, rank)
        for p, q, r in zip(matrices, twins, standard_twins):
            q.grad = r.grad = p.grad
        checked.step()
        plain.step()
        standard.step()
        assert checked.last_check.iteration == step + 1 and checked.last_check.worst == 0
        assert all(torch.equal(p.to_local(), q.to_local()) for p, q in zip(matrices, twins))
        assert not all(torch.equal(p.to_local(), r.to_local())
                       for p, r in zip(matrices, standard_twins))
        fsdp.zero_grad_buffer()
        checked.zero_grad()
    _corrupted_owner(rank, world_size, gram=True)


def test_the_check_passes_gram_newton_schulz_and_catches_a_corrupted_gram_result(distributed):
    """(W=4: the self-test's W=4 run checks Gram in every configuration,
    tests/tools/test_selftest.py.)"""
    distributed(_gram_checks, 2)


def _adaptive_checks(rank, world_size):
    for method in ("normuon", "namo"):  # the owner's second moment; NAMO's return is narrower
        runs = []
        for interval in (1, 0):
            fsdp = make_models("optim_grads_params", world_size)[1]
            matrices = split_params(fsdp)[0]
            runs.append((fsdp, matrices, ZeROTensorParallelAdaptiveMuon(
                muon_param_groups(matrices), moment2_method=method, check_interval=interval,
                **ADAPTIVE_KWARGS, **MUON_KWARGS)))
        (fsdp, matrices, checked), (_, twins, plain) = runs
        for step in range(2):
            _backward(fsdp, step, rank)
            for p, q in zip(matrices, twins):  # the same gradients, unchecked
                q.grad = p.grad
            checked.step()
            plain.step()
            assert checked.last_check.iteration == step + 1 and checked.last_check.worst == 0
            assert all(torch.equal(p.to_local(), q.to_local()) for p, q in zip(matrices, twins))
            assert all(torch.equal(checked.state[p]["moment2_buffer"].to_local(),
                                   plain.state[q]["moment2_buffer"].to_local())
                       for p, q in zip(matrices, twins)), (method, step)
            fsdp.zero_grad_buffer()


def test_the_check_passes_the_adaptive_variants_exact_updates(distributed):
    distributed(_adaptive_checks, 2)


def test_a_negative_check_interval_is_refused():
    with pytest.raises(ValueError, match=r"check_interval \(--muon-check-interval\) must be at "
                                         r"least 0, got -1"):
        ZeROTensorParallelMuon([torch.nn.Parameter(torch.zeros(2, 2))], check_interval=-1,
                               **MUON_KWARGS)


# Through the factory and FSDPMuonChainedOptimizer, on megatron-core GPTs: (strategy, HSDP outer
# strategy or None, expert parallel, tensor parallel, replicas in the log line).
CHAIN_CASES = {
    2: [("no_shard", None, 1, 1, True), ("optim", None, 1, 1, False),
        ("optim_grads_params", None, 1, 1, False)],
    4: [("optim_grads_params", "no_shard", 1, 1, True), ("optim_grads", None, 2, 1, False),
        ("optim", None, 1, 2, False)],
}
CHAIN_LINE = (r"muon check at iteration (\d+): max \|owner - reference\| = 0\.000e\+00 over "
              r"(\d+) matrices; (replicas equal|no replicas); compute weights equal")


def _chain(case, check_interval=2):
    from megatron_muon import get_megatron_optimizer
    from megatron_muon.tools.testing import fsdp_gpt, init_parallel_state, optimizer_config

    strategy, outer, expert_parallel, tensor_parallel, _ = case
    init_parallel_state(expert_parallel=expert_parallel, tensor_parallel=tensor_parallel,
                        replicas=2 if outer else 1)
    model = fsdp_gpt(strategy=strategy, outer_strategy=outer or "no_shard", overlap=True,
                     num_experts=4 if expert_parallel > 1 else None)
    return model, get_megatron_optimizer(optimizer_config(), [model],
                                         muon_check_interval=check_interval)


def _train(model, optimizer, iterations, nan_at=None):
    from megatron.core import parallel_state

    from megatron_muon.tools.testing import lm_loss

    for iteration in range(1, iterations + 1):
        optimizer.zero_grad()
        with model.no_sync():  # as Megatron's schedules mark the last micro-batch
            pass
        loss = lm_loss(model, iteration, parallel_state.get_data_parallel_rank())
        (loss * float("nan") if iteration == nan_at else loss).backward()
        optimizer.step()


def _chain_logs(rank, world_size):
    import builtins

    for case in CHAIN_CASES[world_size]:
        model, optimizer = _chain(case)
        printed = []
        with mock.patch.object(builtins, "print", side_effect=lambda *a, **k: printed.append(a[0])):
            _train(model, optimizer, 5, nan_at=1)  # iteration 1 is skipped and still counts
        optimizer.load_state_dict(optimizer.state_dict())  # iterations go on from the checkpoint
        assert optimizer.iteration == 4, optimizer.iteration  # its successful steps
        lines = [line for line in printed if line.startswith("muon check")]
        if rank != 0:
            assert lines == [], (case, lines)
            continue
        found = [re.fullmatch(CHAIN_LINE, line) for line in lines]
        assert all(found) and [int(m[1]) for m in found] == [2, 4], (case, lines)
        assert all(m[3] == ("replicas equal" if case[4] else "no replicas") for m in found), lines
        assert all(int(m[2]) > 0 for m in found), lines


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_the_chain_logs_each_check_at_megatrons_iteration(distributed, world_size):
    distributed(_chain_logs, world_size)


def _broken_weights(rank, world_size):
    """A param sync that leaves one rank's compute weights stale, and a replica that drifts: each
    stops the run on every rank at the check, naming the param."""
    model, optimizer = _chain(CHAIN_CASES[2][1])  # ZeRO-1: unsharded compute weights
    fsdp = find_megatron_fsdp(model)
    sync = fsdp.start_param_sync

    def stale_on_rank_1(*args, **kwargs):
        sync(*args, **kwargs)
        if rank == 1:
            fsdp.param_and_grad_buffer.parameter_groups[0].model_weight_buffer.data[0] += 1

    with mock.patch.object(fsdp, "start_param_sync", side_effect=stale_on_rank_1):
        _train(model, optimizer, 1)  # no check: nothing noticed
        with pytest.raises(RuntimeError) as caught:
            _train(model, optimizer, 1)
    message = str(caught.value)
    assert message.startswith("muon check at iteration 2: after the param sync"), message
    assert "the compute weights differ from the main weights" in message, message

    model, optimizer = _chain(CHAIN_CASES[2][0])  # no_shard: replicated main weights
    _train(model, optimizer, 1)
    if rank == 1:
        with torch.no_grad():
            output_layer = dict(named_main_weights(model))["module.module.output_layer.weight"]
            output_layer.to_local()[0, 0] += 1
    with pytest.raises(RuntimeError) as caught:
        _train(model, optimizer, 1)
    assert "module.module.output_layer.weight: its replicas differ" in str(caught.value)


def test_stale_compute_weights_and_drifting_replicas_stop_the_run(distributed):
    distributed(_broken_weights, 2)


def test_a_fingerprint_sums_in_chunks_and_shows_a_one_ulp_change(monkeypatch):
    from megatron_muon.chain import weights_check as checks

    weights = torch.randn(1000, 37)
    bits = weights.view(-1).view(torch.int32).long()
    whole = (bits * (torch.arange(bits.numel()) * 2 + 1)).sum() + bits.numel()
    monkeypatch.setattr(checks, "_FINGERPRINT_CHUNK", 100)  # 370 chunks
    assert checks.fingerprint(weights) == whole
    changed = weights.clone()
    changed[5, 3] = torch.nextafter(changed[5, 3], torch.tensor(10.0))
    assert checks.fingerprint(changed) != whole
