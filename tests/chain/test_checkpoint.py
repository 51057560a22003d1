"""Checkpoints in Megatron's fsdp_dtensor format (DCP): a resumed run continues bit-identically,
and a checkpoint saved at one world size loads at another with the optimizer state intact."""

import copy

import pytest
import torch
from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_experts_in_state_dict
from torch.distributed.tensor import DTensor

from conftest import run_distributed
from fsdp_models import (GLOBAL_BATCH, ForwardReads, every_batch_that_fits_ahead, full_tensor,
                         global_batch_loss, load_checkpoint, save_checkpoint)
from megatron_muon import get_megatron_optimizer
from megatron_muon.chain.model_chunks import find_megatron_fsdp, named_main_weights
from megatron_muon.tools.testing import TINY, fsdp_gpt, init_parallel_state, optimizer_config
from tolerances import adam_drift, assert_within, muon_drift, reordering_error, state_drift

CASES = {  # name: (sharding strategy, Muon dist mode, experts over expert-parallel 2,
    #                 --optimizer adaptive_muon's moment2 method or None for muon)
    "zero3": ("optim_grads_params", "owner", None, None),
    "zero3-allgather": ("optim_grads_params", "allgather", None, None),
    "zero2": ("optim_grads", "owner", None, None),
    "zero1": ("optim", "owner", None, None),
    "no_shard": ("no_shard", "owner", None, None),
    "experts": ("optim_grads_params", "owner", 4, None),
    # The second moment: NorMuon's a few columns per row (its wide matrices' column moment laid
    # along their rows, resharded with them); AdaMuon's is shaped like the params, as momentum.
    "normuon-zero3": ("optim_grads_params", "owner", None, "normuon"),
}
RESHARDED = ["zero3", "experts", "normuon-zero3"]
# From W=4 the experts case stands for ZeRO-3's too: its dense matrices are ZeRO-3's, Muon's (the
# third of the W=4 save and the W=2 load: 20 of their 50 s on 2 cores).
RESHARDED_FROM_W4 = ["experts", "normuon-zero3"]
SAVED_AT, LAST = 3, 6
LR = optimizer_config().lr
# At another world size the gradients add in another order (tolerances.py).
REORDERING = reordering_error(GLOBAL_BATCH * TINY.seq)


def _build(case, gather_inside_backward=False):
    strategy, dist_mode, num_experts, moment2_method = CASES[case]
    init_parallel_state(expert_parallel=2 if num_experts else 1)
    model = fsdp_gpt(strategy=strategy, num_experts=num_experts)
    adaptive = {"optimizer": "adaptive_muon", "adaptive_muon_moment2_method": moment2_method}
    optimizer = get_megatron_optimizer(
        optimizer_config(clip_grad=1.0, weight_decay=0.1, **(adaptive if moment2_method else {})),
        [model], muon_dist_mode=dist_mode, muon_gather_inside_backward=gather_inside_backward)
    return model, optimizer


def _train(model, optimizer, steps, rank, world_size, reads=None):
    """Train `steps`; with `reads`, check that each forward reads the main weights."""
    for step in steps:
        optimizer.zero_grad()
        loss = global_batch_loss(model, step, rank, world_size)
        if reads:
            reads.assert_main_weights(f"{model.ddp_config.data_parallel_sharding_strategy}: forward of step {step}")
        loss.backward()
        assert optimizer.step()[0]


def _tensors(model, optimizer):
    """Every param and optimizer-state tensor under a name that is the same at every world size
    (global expert names), with the param it is laid out like. Adam's step counts only where
    this rank's shard is non-empty: Adam never steps an empty one."""
    num_experts = model.config.num_moe_experts
    names = {p: n for n, p in handle_experts_in_state_dict(dict(named_main_weights(model)),
                                                           num_experts).items()}
    for part in optimizer.chained_optimizers:
        for group in part.optimizer.param_groups:
            for p in group["params"]:
                yield names[p], p, p
                for key, value in sorted(part.optimizer.state[p].items()):
                    if key != "step" or p.to_local().numel():
                        yield f"{names[p]}.{key}", value, p


def _local_tensors(model, optimizer):
    return {name: (t.to_local() if isinstance(t, DTensor) else t).detach().clone()
            for name, t, _ in _tensors(model, optimizer)}


def _whole_tensors(model, optimizer):
    """Collective over the ranks: every rank must hold the same state keys."""
    return {name: full_tensor(t, p) if isinstance(t, DTensor) else t.detach().clone()
            for name, t, p in _tensors(model, optimizer)}


def _snapshot(model, optimizer):
    return {"local": _local_tensors(model, optimizer), "whole": _whole_tensors(model, optimizer)}


def _assert_every_rank_holds_the_same_state_keys(optimizer, world_size):
    """As saving's per-DTensor collectives need; Adam alone would hold state only for the
    non-empty shards."""
    state = optimizer.sharded_state_dict({})
    keys = sorted((section, name, key) for section in ("state", "muon")
                  for name, param_state in state[section].items() for key in param_state)
    every_ranks = [None] * world_size
    torch.distributed.all_gather_object(every_ranks, keys)
    assert all(k == keys for k in every_ranks)


def _run_and_save(rank, world_size, cases, tmp):
    """Train steps 1..LAST, saving at SAVED_AT; record the state there and at the end."""
    for case in cases:
        model, optimizer = _build(case)
        _train(model, optimizer, range(1, SAVED_AT + 1), rank, world_size)
        save_checkpoint(model, optimizer, f"{tmp}/{case}-w{world_size}")
        if CASES[case][2] is None:  # with expert parallelism ranks hold different experts
            _assert_every_rank_holds_the_same_state_keys(optimizer, world_size)
        at_save = _snapshot(model, optimizer)
        _train(model, optimizer, range(SAVED_AT + 1, LAST + 1), rank, world_size)
        torch.save({"saved": at_save, "last": _snapshot(model, optimizer)},
                   f"{tmp}/{case}-w{world_size}-rank{rank}.pt")


def _records(tmp, case, world_size):
    return [torch.load(f"{tmp}/{case}-w{world_size}-rank{r}.pt") for r in range(world_size)]


def _whole(records, when):
    return {name: t for record in records for name, t in record[when]["whole"].items()}


@pytest.fixture(scope="module")
def saved_at_w2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("w2")
    run_distributed(_run_and_save, 2, list(CASES), str(tmp))
    return tmp


@pytest.fixture(scope="module")
def saved_at_w4(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("w4")
    run_distributed(_run_and_save, 4, RESHARDED_FROM_W4, str(tmp))
    return tmp


def _assert_preparing_a_load_changes_nothing(model, optimizer):
    """Building the state dict to load into creates the missing (empty-shard) state and takes no
    step: params, momentum, moments and steps stay as they were."""
    before = _local_tensors(model, optimizer)
    optimizer.sharded_state_dict({}, is_loading=True)
    after = _local_tensors(model, optimizer)
    assert before.keys() <= after.keys()
    assert all(torch.equal(after[name], t) for name, t in before.items())


def _assert_a_checkpoint_without_a_params_state_is_refused(model, optimizer):
    state = optimizer.sharded_state_dict({})
    first, *rest = state["muon"]
    before = _local_tensors(model, optimizer)
    with pytest.raises(KeyError, match=f"no optimizer state for .*{first}"):
        optimizer.load_state_dict({**state, "muon": {name: state["muon"][name] for name in rest},
                                   "step": torch.tensor(99)})
    after = _local_tensors(model, optimizer)
    assert all(torch.equal(after[name], t) for name, t in before.items())


def _resume_bit_identical(rank, world_size, tmp):
    """Each case saved without --muon-gather-inside-backward resumes with it (where the case
    allows it; it saves nothing of its own) and continues as the uninterrupted run."""
    for case in CASES:
        with every_batch_that_fits_ahead():
            model, optimizer = _build(case, gather_inside_backward=True)
        ahead = sum(plan.ahead for muon in optimizer.muon_optimizers for plan in muon.plans)
        assert (ahead > 0) == ("allgather" not in case), (case, ahead)
        reads = ForwardReads(find_megatron_fsdp(model))
        _train(model, optimizer, [1], rank, world_size)  # state to be replaced, not kept
        _assert_preparing_a_load_changes_nothing(model, optimizer)
        _assert_a_checkpoint_without_a_params_state_is_refused(model, optimizer)
        load_checkpoint(model, optimizer, f"{tmp}/{case}-w{world_size}")
        # The first forward after the load reads the loaded weights, though this process had
        # gathered ZeRO-1/2's compute weights before.
        _train(model, optimizer, range(SAVED_AT + 1, LAST + 1), rank, world_size, reads)
        expected = _records(tmp, case, world_size)[rank]["last"]["local"]
        got = _local_tensors(model, optimizer)
        assert got.keys() == expected.keys(), case
        for name in expected:
            assert torch.equal(got[name], expected[name]), (case, name)


@pytest.mark.slow
def test_resume_continues_bit_identically_for_every_strategy(saved_at_w2):
    run_distributed(_resume_bit_identical, 2, str(saved_at_w2))


def _prepared_load_without_checkpoint_trains_as_from_scratch(rank, world_size):
    """megatron.training builds the state dict to load into before it finds that --load holds no
    checkpoint, then trains from scratch: the state that preparing created (moments, step count)
    must be what a fresh optimizer starts from."""
    for case in CASES:
        fresh = _local_tensors(*_trained(_build(case), rank, world_size))
        model, optimizer = _build(case)
        optimizer.sharded_state_dict({}, is_loading=True)
        prepared = _local_tensors(*_trained((model, optimizer), rank, world_size))
        # Preparing also gave Adam state for the shards where this rank holds nothing.
        assert fresh.keys() <= prepared.keys(), case
        assert all(prepared[name].numel() == 0 for name in prepared.keys() - fresh.keys()), case
        for name in fresh:
            assert torch.equal(prepared[name], fresh[name]), (case, name)


def _trained(model_and_optimizer, rank, world_size):
    _train(*model_and_optimizer, range(1, 3), rank, world_size)
    return model_and_optimizer


@pytest.mark.slow
def test_a_load_that_finds_no_checkpoint_trains_as_from_scratch():
    run_distributed(_prepared_load_without_checkpoint_trains_as_from_scratch, 2)


OPTIMIZER_STATE = (".momentum_buffer", ".moment2_buffer", ".exp_avg", ".exp_avg_sq", ".step")


def _torch_state_dict_round_trip(rank, world_size):
    """chain.load_state_dict(chain.state_dict()), torch's pair, restores the optimizer's state
    exactly (what tools outside megatron.training call)."""
    for case in CASES:
        model, optimizer = _build(case)
        _train(model, optimizer, [1, 2], rank, world_size)
        saved = copy.deepcopy(optimizer.state_dict())
        at_save = {name: t for name, t in _local_tensors(model, optimizer).items()
                   if name.endswith(OPTIMIZER_STATE)}
        _train(model, optimizer, [3], rank, world_size)
        optimizer.load_state_dict(saved)
        restored = _local_tensors(model, optimizer)
        assert at_save and all(torch.equal(restored[name], t) for name, t in at_save.items()), case
        assert int(optimizer.state_dict()["step"]) == 2, case


def test_torch_state_dict_round_trips_exactly():
    run_distributed(_torch_state_dict_round_trip, 2)


def _resume_resharded(rank, world_size, tmp, saved_world_size, cases):
    for case in cases:
        records = _records(tmp, case, saved_world_size)
        model, optimizer = _build(case)
        load_checkpoint(model, optimizer, f"{tmp}/{case}-w{saved_world_size}")
        loaded, saved = _whole_tensors(model, optimizer), _whole(records, "saved")
        for name, t in loaded.items():  # params, momentum, Adam's moments and steps
            assert torch.equal(t, saved[name]), (case, name)
        _train(model, optimizer, range(SAVED_AT + 1, LAST + 1), rank, world_size)
        last, expected = _whole_tensors(model, optimizer), _whole(records, "last")
        for name, t in last.items():
            assert_within(t, expected[name], _allowed_drift(name, expected), f"{case} {name}")


def _allowed_drift(name, expected):
    """What training steps SAVED_AT + 1 .. LAST at another world size may change (tolerances.py)."""
    lrs = [LR] * (LAST - SAVED_AT)
    if f"{name}.exp_avg_sq" in expected:
        return adam_drift(lrs, SAVED_AT + 1, expected[f"{name}.exp_avg_sq"], REORDERING)
    if f"{name}.momentum_buffer" in expected:
        return muon_drift(lrs, expected[name].shape, REORDERING)
    if name.endswith(".step"):
        return 0
    return state_drift(expected[name], REORDERING)


@pytest.mark.slow
def test_checkpoint_from_two_ranks_resumes_on_four(saved_at_w2):
    run_distributed(_resume_resharded, 4, str(saved_at_w2), 2, RESHARDED)


@pytest.mark.slow
def test_checkpoint_from_four_ranks_resumes_on_two(saved_at_w4):
    run_distributed(_resume_resharded, 2, str(saved_at_w4), 4, RESHARDED_FROM_W4)
