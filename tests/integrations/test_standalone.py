"""Muon for a plain PyTorch or Hugging Face model sharded by Megatron-FSDP's fully_shard_model
outside Megatron (megatron_muon.standalone): which parameters go to Muon and which to AdamW,
decided from the module and said at start; every step bit-identical (fp32 Newton-Schulz) to
single-device Muon + AdamW on the unsharded model, in the weights the next forward reads, at W=1,
2 and 4, for a Llama-shaped module with a fused q/k/v projection and for tiny Hugging Face Llama
and Qwen3 models built from their configs (no download); a DCP checkpoint resumes exactly."""

import contextlib
import copy
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import \
    preprocess_state_dict_for_uneven_dtensor
from megatron.core.optimizer.emerging_optimizers import TensorParallelAdaptiveMuon, TensorParallelMuon

from fsdp_models import (MEGATRON_FSDP, STRATEGIES, ForwardReads, fully_shard, full_tensor,
                         with_gram_newton_schulz)
from megatron_muon.fixes import upstream_fixes
from megatron_muon.front_ends.placement import place
from megatron_muon.observe.phases import TIMERS
from megatron_muon.plan import gram_counts
from megatron_muon.front_ends.standalone import muon_optimizer
from megatron_muon.standalone import step_report
from megatron_muon.tools.testing import hugging_face_model
from tolerances import ATOL, RTOL

VOCAB, HIDDEN, QKV_ROWS = 40, 24, (8, 4, 4)  # q, k, v rows per query group; 2 groups
MUON = dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.01)
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
STEPS = 3
# The level-2 timers, which add up to the step's ("muon-step"'s).
PHASES = [name for name, level in TIMERS.values() if level == 2]


class Layer(torch.nn.Module):
    """A Llama-shaped layer with a fused q/k/v projection (as some Hugging Face models have)."""

    def __init__(self):
        super().__init__()
        self.input_layernorm = torch.nn.RMSNorm(HIDDEN)
        self.qkv_proj = torch.nn.Linear(HIDDEN, 2 * sum(QKV_ROWS), bias=False)
        self.o_proj = torch.nn.Linear(2 * QKV_ROWS[2], HIDDEN, bias=False)
        self.post_attention_layernorm = torch.nn.RMSNorm(HIDDEN)
        self.gate_proj = torch.nn.Linear(HIDDEN, 36, bias=False)
        self.up_proj = torch.nn.Linear(HIDDEN, 36, bias=True)
        self.down_proj = torch.nn.Linear(36, HIDDEN, bias=False)

    def forward(self, h):
        qkv = self.qkv_proj(self.input_layernorm(h)).view(*h.shape[:-1], 2, sum(QKV_ROWS))
        q, k, v = qkv.split(QKV_ROWS, dim=-1)
        h = h + self.o_proj((torch.tanh(q[..., :QKV_ROWS[1]] * k) * v).flatten(-2))
        x = self.post_attention_layernorm(h)
        return h + self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class TinyLM(torch.nn.Module):
    def __init__(self, tied: bool = False):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = torch.nn.ModuleList([Layer(), Layer()])
        self.norm = torch.nn.RMSNorm(HIDDEN)
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, tokens):
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.norm(h))


MATRICES = [f"layers.{i}.{name}.weight" for i in range(2)
            for name in ("qkv_proj", "o_proj", "gate_proj", "up_proj", "down_proj")]


def test_hidden_linear_weights_go_to_muon_the_rest_to_adamw():
    placement = place(TinyLM())
    assert set(placement.muon) == set(MATRICES)
    assert set(placement.adamw) == {"embed_tokens.weight", "lm_head.weight", "norm.weight"} | {
        f"layers.{i}.{name}" for i in range(2) for name in
        ("input_layernorm.weight", "post_attention_layernorm.weight", "up_proj.bias")}
    lines = placement.describe()
    assert lines[0].startswith("Muon (10): layers.0.qkv_proj.weight, ") and lines[1].startswith(
        "AdamW (9): embed_tokens.weight, ")


def test_the_output_head_is_adamws_however_it_is_named_or_tied():
    model = TinyLM()
    model.proj_out, model.lm_head = model.lm_head, None  # named otherwise, the model says which
    assert "proj_out.weight" in place(model).muon
    model.get_output_embeddings = lambda: model.proj_out  # Hugging Face's way of saying it
    assert "proj_out.weight" in place(model).adamw
    tied = place(TinyLM(tied=True))
    assert "embed_tokens.weight" in tied.adamw and set(tied.muon) == set(MATRICES)


@pytest.mark.parametrize("kind", ["Llama", "Qwen3"])
def test_a_hugging_face_models_placement(kind):
    """Its MLP is as wide as its vocabulary here: width does not make a head."""
    placement = place(tiny_hugging_face_model(kind)[0])
    layers = [f"model.layers.{i}." for i in range(2)]
    assert placement.muon == tuple(f"{layer}{name}.weight" for layer in layers for name in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= set(
        placement.adamw)
    assert all(name.endswith("norm.weight") for name in set(placement.adamw) - {
        "model.embed_tokens.weight", "lm_head.weight"})


def test_names_override_the_rule_and_fused_projections_split():
    placement = place(TinyLM(), muon=("lm_head.weight",), adamw=("layers.*.down_proj.weight",),
                      qkv_splits={"*.qkv_proj.weight": QKV_ROWS})
    assert "lm_head.weight" in placement.muon and "layers.1.down_proj.weight" in placement.adamw
    assert placement.qkv_splits == {f"layers.{i}.qkv_proj.weight": QKV_ROWS for i in range(2)}
    assert "layers.0.qkv_proj.weight (q/k/v rows per group [8, 4, 4])" in placement.describe()[0]


@pytest.mark.parametrize("settings, refusal", [
    (dict(muon=("layers.0.q_proj.weight",)), "muon pattern 'layers.0.q_proj.weight' matches no"),
    (dict(muon=("norm.weight",)), r"norm.weight \(shape \(24,\)\) goes to Muon but is not a 2-D"),
    (dict(muon=("lm_head.weight",), adamw=("lm_*",)), "lm_head.weight matches both"),
    (dict(qkv_splits={"*.o_proj.weight": (8, 4, 4)}), r"layers.0.o_proj.weight has 24 rows, not "
     r"whole q/k/v groups of \[8, 4, 4\] rows"),
    (dict(adamw=("*.qkv_proj.weight",), qkv_splits={"*.qkv_proj.weight": QKV_ROWS}),
     "qkv_splits pattern"),
])
def test_what_muon_cannot_step_is_refused_naming_the_parameter(settings, refusal):
    with pytest.raises(ValueError, match=refusal):
        place(TinyLM(), **settings)


def _reference(model, placement, moment2_method=None, gram=False):
    """Single-device Muon (with `moment2_method`: megatron-core's adaptive Muon, repaired) +
    AdamW on the unsharded model, with the same placement; `gram`: its Newton-Schulz routed as
    gram_newton_schulz=True routes ours."""
    params = dict(model.named_parameters())
    for name, rows in placement.qkv_splits.items():
        params[name].is_qkv, params[name].qkv_split_shapes = True, list(rows)
    muon_class, variant = TensorParallelMuon, {}
    if moment2_method:
        upstream_fixes.apply()
        muon_class, variant = TensorParallelAdaptiveMuon, {"moment2_method": moment2_method}
    muon = muon_class([params[n] for n in placement.muon], **MUON, **variant,
                      fp32_matmul_prec="highest", split_qkv=True,
                      is_qkv_fn=lambda p: getattr(p, "is_qkv", False))
    if gram:
        with_gram_newton_schulz(muon, scaled=not moment2_method)
    return params, [muon, torch.optim.AdamW([params[n] for n in placement.adamw], **ADAMW,
                                            foreach=True)]


def _tokens(step, rank):
    return torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(100 * step + rank))


def _loss(model, tokens):
    logits = model(tokens)
    logits = getattr(logits, "logits", logits)  # a Hugging Face model's output
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(1).flatten())


def tiny_hugging_face_model(kind):
    """A tiny Llama or Qwen3 from its config (no download) and its Megatron-FSDP units (the
    decoder layer): 4 heads of 6 (2 key-value heads), so that Megatron-FSDP cuts its matrices
    unevenly; Qwen3 adds per-head q and k norms. Its MLP is as wide as its vocabulary."""
    model, layer = hugging_face_model(
        kind, vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=6, max_position_embeddings=32)
    return model, [layer]


# name -> (the model and its Megatron-FSDP units, the fused projections' splits)
MODELS = {
    "fused-qkv": (lambda: (TinyLM(), [torch.nn.Linear, torch.nn.Embedding]),
                  {"*.qkv_proj.weight": QKV_ROWS}),
    "hf-llama": (lambda: tiny_hugging_face_model("Llama"), {}),
    "hf-qwen3": (lambda: tiny_hugging_face_model("Qwen3"), {}),
}


def _built(world_size, strategy, model_name, package="megatron-core", wrapped=False,
           moment2_method=None, offload=False, report_interval=0, gram=False):
    """(an unsharded copy of the model as built, the model on `package`'s fully_shard_model, our
    optimizer), `wrapped`: then given to that package's fully_shard_optimizer; `offload` and
    `report_interval`: the optimizer's."""
    build, qkv_splits = MODELS[model_name]
    torch.manual_seed(0)
    module, units = build()
    unsharded = copy.deepcopy(module)
    model = fully_shard(module, strategy, world_size, units, package=package)
    optimizer = muon_optimizer(model, **MUON, adamw_lr=ADAMW["lr"], adamw_betas=ADAMW["betas"],
                               adamw_eps=ADAMW["eps"], adamw_weight_decay=ADAMW["weight_decay"],
                               qkv_splits=qkv_splits, fp32_matmul_prec="highest",
                               moment2_method=moment2_method, offload=offload,
                               report_interval=report_interval,
                               **({"gram_newton_schulz": True} if gram else {}))
    if wrapped:
        assert MEGATRON_FSDP[package].fully_shard_optimizer(optimizer) is optimizer
    return unsharded, model, optimizer


def _count_calls(model, *names) -> dict:
    """How often each of the model's methods `names` runs, from now on."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        def counted(*args, _method=getattr(model, name), _name=name, **kwargs):
            calls[_name] += 1
            return _method(*args, **kwargs)
        setattr(model, name, counted)
    return calls


def steps_match_single_device(rank, reference, model, optimizer, qkv_splits, case, wrap=None,
                              moment2_method=None, gram=False):
    """STEPS steps of our `optimizer` on `model` (on Megatron-FSDP; `reference`: the unsharded
    model as built), each bit-identical to single-device Muon + AdamW fed the same reduced
    gradients, the next forward reading the weights, and one install per step. `wrap`: applies
    fully_shard_optimizer to the optimizer (megatron_fsdp's, or Automodel's recipe around it), as
    one would before training: then its construction also changes nothing, and each step syncs
    the gradients once (the model's own post-backward sync, fully_shard_model's default)."""
    calls = _count_calls(model, "finish_grad_sync", "install_optimized_model_weights")
    if wrap:  # counted from before it
        assert wrap(optimizer) is optimizer
        assert calls == {"finish_grad_sync": 0, "install_optimized_model_weights": 0}, calls
    ref_params, ref_optimizers = _reference(reference, place(reference, qkv_splits=qkv_splits),
                                            moment2_method, gram)
    main_weights = dict(model.param_and_grad_buffer.optimizer_named_parameters)
    reads = ForwardReads(model)
    for step in range(STEPS):
        loss = _loss(model, _tokens(step, rank))
        if step:  # this forward read what the last step made
            reads.assert_main_weights(f"{case} step {step}")
        calls.update(dict.fromkeys(calls, 0))
        loss.backward()
        if not wrap:
            model.finish_grad_sync()  # the caller's sync: the step does not sync again
        for name, p in main_weights.items():  # the reference steps on the gradient we reduced
            ref_params[name].grad = full_tensor(p.grad if p.grad is not None
                                                else torch.zeros_like(p), p)
        optimizer.step()
        optimizer.zero_grad()
        for ref_optimizer in ref_optimizers:
            ref_optimizer.step()
            ref_optimizer.zero_grad()
        differ = [name for name, p in main_weights.items()
                  if not torch.equal(full_tensor(p, p), ref_params[name].detach())]
        assert not differ, f"{case} step {step}: {differ} differ"
        assert calls["install_optimized_model_weights"] == 1, (case, step, calls)
        if wrap:
            assert calls["finish_grad_sync"] == 1, (case, step, calls)


def _matches_single_device(rank, world_size, strategy, model_name, package="megatron-core",
                           wrapped=False, moment2_method=None, offload=False, gram=False):
    """`wrapped`: with `package`'s fully_shard_optimizer around ours; `moment2_method`: adaptive
    Muon's; `offload`: the state in host memory between steps; `gram`: gram_newton_schulz=True
    (its matrices take it: asserted)."""
    reference, model, optimizer = _built(world_size, strategy, model_name, package,
                                         moment2_method=moment2_method, offload=offload,
                                         gram=gram)
    if gram:
        (muon,) = optimizer.muon_optimizers
        assert gram_counts(m for plan in muon.plans for m in plan.matrices)[0] > 0
    steps_match_single_device(
        rank, reference, model, optimizer, MODELS[model_name][1],
        f"{moment2_method or 'muon'} {model_name} {strategy} W={world_size} {package}"
        f"{' wrapped' * wrapped} offload={offload}",
        MEGATRON_FSDP[package].fully_shard_optimizer if wrapped else None, moment2_method, gram)


@pytest.mark.parametrize("world_size, strategy, model_name, moment2_method, offload", [
    (2, "optim_grads_params", "hf-llama", "normuon", False),
    (2, "optim", "fused-qkv", "adamuon", True), (4, "optim_grads_params", "fused-qkv", "normuon", 0.5)])
def test_adaptive_muon_steps_are_single_device_adaptive_muon(distributed, world_size, strategy,
                                                             model_name, moment2_method, offload):
    """muon_optimizer(..., moment2_method=...): --optimizer adaptive_muon outside Megatron;
    muon_optimizer(..., offload=...): the state (all, or half) in host memory between steps."""
    distributed(_matches_single_device, world_size, strategy, model_name, "megatron-core", False,
                moment2_method, offload)


def test_gram_newton_schulz_steps_are_single_device_gram_muons(distributed):
    """muon_optimizer(..., gram_newton_schulz=True) (Automodel's muon_kwargs too): each step
    single-device Muon's with the same Gram route, bit for bit (the adaptive variants':
    tests/core/test_gram_newton_schulz.py)."""
    distributed(_matches_single_device, 2, "optim_grads_params", "hf-llama", "megatron-core",
                False, None, False, True)


needs_standalone = pytest.mark.skipif(
    not MEGATRON_FSDP["megatron-fsdp"],
    reason="the megatron-fsdp package is not installed (pip install 'megatron-muon[fsdp]')")


# (2, "optim_grads_params", "fused-qkv"): test_a_timed_step_reports_its_phases_and_scalars's.
@pytest.mark.parametrize("world_size, strategy, model_name", [
    (1, "optim_grads_params", "fused-qkv"), (2, "no_shard", "fused-qkv"), (2, "optim", "fused-qkv"),
    pytest.param(4, "optim", "fused-qkv", marks=pytest.mark.slow),
    (4, "optim_grads_params", "fused-qkv"),
    *[(2, strategy, "hf-llama") for strategy in STRATEGIES],
    *[pytest.param(4, strategy, "hf-llama", marks=pytest.mark.slow)
      for strategy in ("no_shard", "optim", "optim_grads")],
    (4, "optim_grads_params", "hf-llama"), (2, "optim_grads_params", "hf-qwen3"),
    pytest.param(4, "optim_grads_params", "hf-qwen3", marks=pytest.mark.slow)])
def test_every_step_is_single_device_muon_and_adamw(distributed, world_size, strategy, model_name):
    distributed(_matches_single_device, world_size, strategy, model_name)


@needs_standalone
@pytest.mark.parametrize("world_size, strategy, model_name, wrapped", [
    (2, "optim_grads_params", "fused-qkv", False),
    pytest.param(4, "optim", "fused-qkv", False, marks=pytest.mark.slow),
    (2, "optim_grads_params", "hf-llama", False), (2, "optim_grads_params", "fused-qkv", True),
    pytest.param(4, "optim_grads_params", "fused-qkv", True, marks=pytest.mark.slow),
    (2, "optim", "hf-qwen3", True)])
def test_the_standalone_package_with_or_without_fully_shard_optimizer(
        distributed, world_size, strategy, model_name, wrapped):
    distributed(_matches_single_device, world_size, strategy, model_name, "megatron-fsdp", wrapped)


def test_fully_shard_optimizer_of_megatron_cores_copy_too(distributed):
    distributed(_matches_single_device, 2, "optim_grads_params", "fused-qkv", "megatron-core", True)


def _accumulates_over_a_one_rank_group(rank, world_size, package):
    """HSDP of 2 replicas of 1 shard: each replica's shard group has one rank, whose buffers
    released Megatron-FSDP rescaled at every micro-batch under ZeRO-3 (upstream_fixes, 1.)."""
    upstream_fixes.apply()
    build, _ = MODELS["fused-qkv"]
    torch.manual_seed(0)
    module, units = build()
    reference = copy.deepcopy(module)
    model = fully_shard(module, "optim_grads_params", world_size, units, outer="no_shard",
                        package=package)
    model.set_model_auto_sync(False)
    for micro_batch in range(MICRO_BATCHES):  # the replicas reduce together after the last one
        with model.no_sync() if micro_batch < MICRO_BATCHES - 1 else contextlib.nullcontext():
            _loss(model, _tokens(micro_batch, rank)).backward()
    model.finish_grad_sync()
    for other in range(world_size):  # the mean over the replicas of their micro-batches' sum
        for micro_batch in range(MICRO_BATCHES):
            (_loss(reference, _tokens(micro_batch, other)) / world_size).backward()
    references = dict(reference.named_parameters())
    for name, p in model.param_and_grad_buffer.optimizer_named_parameters:
        torch.testing.assert_close(full_tensor(p.grad, p), references[name].grad, rtol=RTOL,
                                   atol=ATOL, msg=lambda why, name=name: f"{name}: {why}")


MICRO_BATCHES = 3


@pytest.mark.parametrize("package", [
    "megatron-core", pytest.param("megatron-fsdp", marks=pytest.mark.skipif(
        not MEGATRON_FSDP["megatron-fsdp"], reason="megatron-fsdp is not installed"))])
def test_micro_batches_accumulate_over_a_one_rank_group(distributed, package):
    """Outside Megatron too (fully_shard_model, megatron_fsdp's own no_sync and
    finish_grad_sync), gradients accumulated over micro-batches on a one-rank group are
    Megatron DDP's: the mean over the replicas of each replica's sum."""
    distributed(_accumulates_over_a_one_rank_group, 2, package)


def dcp_model_state_dict(model):
    """The model's state dict (Megatron-FSDP's main weights), each uneven DTensor given its chunk
    for DCP (megatron_fsdp's preprocess_state_dict_for_uneven_dtensor)."""
    return preprocess_state_dict_for_uneven_dtensor(model.state_dict())


def _dcp_checkpoint(model, optimizer):
    """What a script saves and loads with DCP: the model's and the optimizer's state dicts; and
    what it does once DCP has loaded them in place."""
    state = preprocess_state_dict_for_uneven_dtensor(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict()})

    def loaded():
        model.install_optimized_model_weights()  # the weights the next forward reads
        optimizer.load_state_dict(state["optimizer"])

    return state, loaded


def _train(model, optimizer, steps, rank):
    for step in steps:
        _loss(model, _tokens(step, rank)).backward()
        optimizer.step()
        optimizer.zero_grad()


def resumes_exactly(rank, build, checkpoint, path, case):
    """Two steps of build()'s (model, optimizer), a DCP checkpoint of `checkpoint(model,
    optimizer)` ((state dict, what to do once it is loaded)), two more steps; then a model and
    optimizer built anew load it and take the same two steps: their weights must be the
    uninterrupted run's bit for bit."""
    model, optimizer = build()
    _train(model, optimizer, range(2), rank)
    dcp.save(checkpoint(model, optimizer)[0], checkpoint_id=path)
    _train(model, optimizer, range(2, 4), rank)
    uninterrupted = {name: full_tensor(p, p)
                     for name, p in model.param_and_grad_buffer.optimizer_named_parameters}

    model, optimizer = build()  # as a new process would
    state, loaded = checkpoint(model, optimizer)
    dcp.load(state, checkpoint_id=path)  # in place, into the main weights and the state
    loaded()
    _train(model, optimizer, range(2, 4), rank)
    differ = [name for name, p in model.param_and_grad_buffer.optimizer_named_parameters
              if not torch.equal(full_tensor(p, p), uninterrupted[name])]
    assert not differ, f"{case}: resumed weights differ: {differ}"


def _resumes_exactly(rank, world_size, strategy, model_name, path, package="megatron-core",
                     wrapped=False, offload=False):
    """`wrapped`: the optimizer's state dict goes through fully_shard_optimizer's DCP hook;
    `offload`: saved and loaded with the state in host memory."""
    resumes_exactly(rank, lambda: _built(world_size, strategy, model_name, package, wrapped,
                                         offload=offload)[1:],
                    _dcp_checkpoint, path, f"{model_name} {strategy} W={world_size} {package}")


@pytest.mark.parametrize("world_size, strategy, model_name, offload", [
    (2, "optim_grads_params", "fused-qkv", False), (2, "optim", "fused-qkv", True),
    (4, "optim_grads_params", "fused-qkv", False), (2, "optim_grads_params", "hf-llama", False)])
def test_a_dcp_checkpoint_resumes_exactly(distributed, tmp_path, world_size, strategy, model_name,
                                          offload):
    distributed(_resumes_exactly, world_size, strategy, model_name, str(tmp_path / "checkpoint"),
                "megatron-core", False, offload)


@needs_standalone
@pytest.mark.parametrize("world_size, wrapped", [
    (2, False), (2, True), pytest.param(4, True, marks=pytest.mark.slow)])
def test_the_standalone_packages_dcp_checkpoint_resumes_exactly(distributed, tmp_path, world_size,
                                                                 wrapped):
    distributed(_resumes_exactly, world_size, "optim_grads_params", "fused-qkv",
                str(tmp_path / "checkpoint"), "megatron-fsdp", wrapped)


@pytest.mark.e2e
def test_the_example_trains_a_hugging_face_model_and_its_loss_falls():
    """examples/train_hf_fully_shard.py as its docstring runs it: torchrun, 2 processes, CPU."""
    repo = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2",
         "examples/train_hf_fully_shard.py", "--steps", "40"],
        cwd=repo, capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    assert "Muon (14): model.layers.0.self_attn.q_proj.weight" in run.stdout
    assert "AdamW (7): model.embed_tokens.weight" in run.stdout
    first, last = map(float, re.search(r"loss (\S+) -> (\S+)", run.stdout).groups())
    assert last < first - 1.5, (first, last)


def _reports_its_steps(rank, world_size):
    reference, model, optimizer = _built(world_size, "optim_grads_params", "fused-qkv",
                                         offload=True, report_interval=2)
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("megatron_muon").addHandler(handler)
    logging.getLogger("megatron_muon").setLevel(logging.INFO)
    # Timed, every step is still single-device Muon's, bit for bit.
    steps_match_single_device(rank, reference, model, optimizer, MODELS["fused-qkv"][1], "timed")
    report = step_report(optimizer)
    phases = [name for name in PHASES if f"{name}-time" in report]
    # no check interval here; the state offloaded: its copies timed apart from the update's
    assert set(phases) == set(PHASES) - {"muon-check"}, report
    # Disjoint phases nested in the step: at most its time (how much of it they cover, 96% here,
    # is a figure for the docs: a test holds no timing).
    assert sum(report[f"{name}-time"] for name in phases) <= report["muon-step-time"], report
    assert report["muon/collectives"] > 0 and report["muon/skipped-steps"] == 0
    # every second step, on rank 0: STEPS = 3, so step 2's
    assert [line.split(":")[0] for line in logged] == ["muon step 2"] * (rank == 0), logged
    assert all("muon-step-time" in line and "muon/bytes-received" in line for line in logged)


def test_a_timed_step_reports_its_phases_and_scalars(distributed):
    """muon_optimizer(..., report_interval=N) (Automodel's config field of that name too): each
    step timed in Megatron's phases by the optimizer itself (with offload=True, the state's
    copies too), step_report(optimizer) with the last step's times and scalars, every N-th
    step's logged on rank 0."""
    distributed(_reports_its_steps, 2)


@pytest.mark.parametrize("offload", [1.5, -0.5])
def test_an_offload_share_outside_0_to_1_is_refused(offload):
    with pytest.raises(ValueError, match=r"muon_optimizer: offload must be True, False or a "
                                         r"fraction in \[0, 1\]"):
        muon_optimizer(torch.nn.Linear(2, 2), offload=offload)
