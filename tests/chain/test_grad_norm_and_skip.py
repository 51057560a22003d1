"""The chain's gradient norm is the unsharded model's, clipping acts as on the unsharded model,
and a step with a NaN or an Inf on one rank's shard is skipped on every rank with nothing changed:
decided from the grad norm's reduction where the chain computes one, else by a reduction of our
own.

The gather inside backward (--muon-gather-inside-backward): exchanges whose rows leave for their
owners as Megatron-FSDP reduces each bucket give the very weights the step gives without it, bit
for bit, with the clip on and off, gradient accumulation, and a gradient changed after its rows
left (reduced again, or scaled as --calculate-per-token-loss scales it: the step then gathers
them itself), experts, TP, HSDP, the adaptive variants and teams; the check interval passes on
what the owners formed from what they gathered ahead; a skipped step drops it; the start-up line
names each Muon part and how many of its matrices gather ahead; the exchange gathering ahead
gathers its other matrices at the step, one scatter for all."""

import contextlib
import io

import pytest
import torch
from torch.distributed.tensor import DTensor

from fsdp_models import (GLOBAL_BATCH, every_batch_that_fits_ahead, full_tensor, global_batch_loss,
                         teams_of_two)
from megatron_muon import get_megatron_optimizer
from megatron_muon.chain.chained import FSDPMuonChainedOptimizer
from megatron_muon.chain.model_chunks import named_main_weights
from megatron_muon.chain.qk_clip import take_max_attention_logit
from megatron_muon.observe.collectives import Traffic, observed
from megatron_muon.plan import step_collectives
from megatron_muon.reporting.step_report import step_scalars
from megatron_muon.tools.testing import (TINY, fsdp_gpt, gpt, init_parallel_state, lm_loss,
                                         optimizer_config)
from tolerances import adam_drift, assert_within, muon_drift, reordering_error

CLIP = 0.05  # well below the gradient norm (~1), so every step is clipped
STEPS = 3
GATHER_STEPS = 2  # the second with the first's momentum
REORDERING = reordering_error(GLOBAL_BATCH * TINY.seq)


def _backward(model, step, rank):
    with model.no_sync():  # as Megatron's schedules mark the last micro-batch
        pass
    lm_loss(model, step, rank).backward()
    model.finish_grad_sync()


def _norm_matches_unsharded(rank, world_size, strategy, outer):
    init_parallel_state(replicas=2 if outer else 1)
    model = fsdp_gpt(strategy=strategy, outer_strategy=outer or "no_shard")
    optimizer = get_megatron_optimizer(optimizer_config(clip_grad=1.0), [model])
    _backward(model, 0, rank)
    optimizer.prepare_grads()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [(p.grad if p.grad is not None else torch.zeros_like(p), p) for p in params]
    unsharded = torch.stack([full_tensor(g, p).double().norm() for g, p in grads]).norm().item()
    assert optimizer.get_grad_norm() == pytest.approx(unsharded, rel=1e-6), strategy


@pytest.mark.parametrize("world_size, strategy, outer", [
    (2, "optim_grads_params", None), (2, "no_shard", None), (4, "optim_grads_params", None),
    (4, "optim_grads_params", "no_shard"), (4, "optim_grads_params", "optim")])
def test_grad_norm_is_the_unsharded_models(distributed, world_size, strategy, outer):
    distributed(_norm_matches_unsharded, world_size, strategy, outer)


def _clipping_matches_unsharded(rank, world_size):
    """Muon + Adam on Megatron-FSDP against megatron-core's own Muon + Adam on the unsharded
    model, both clipping to CLIP, on the same global batch: the same norm, and weights that
    differ only as far as adding the gradients in another order can make them (tolerances.py)."""
    init_parallel_state()
    model = fsdp_gpt()
    optimizer = get_megatron_optimizer(optimizer_config(clip_grad=CLIP), [model])
    unsharded = gpt()
    reference = get_megatron_optimizer(
        optimizer_config(clip_grad=CLIP, use_distributed_optimizer=False), [unsharded])
    for step in range(STEPS):
        optimizer.zero_grad()
        reference.zero_grad()
        with model.no_sync():
            pass
        global_batch_loss(model, step, rank, world_size).backward()
        global_batch_loss(unsharded, step, 0, 1).backward()
        _, grad_norm, _ = optimizer.step()
        _, reference_norm, _ = reference.step()
        assert grad_norm > 10 * CLIP and grad_norm == pytest.approx(reference_norm, rel=1e-5)
    expected = dict(unsharded.named_parameters())
    optimizer_of = {p: part.optimizer for part in reference.chained_optimizers
                    for group in part.optimizer.param_groups for p in group["params"]}
    lrs = [reference.param_groups[0]["lr"]] * STEPS
    for name, p in named_main_weights(model):
        ref = expected[name.removeprefix("module.module.")]
        if isinstance(optimizer_of[ref], torch.optim.Adam):
            allowed = adam_drift(lrs, 1, optimizer_of[ref].state[ref]["exp_avg_sq"], REORDERING)
        else:
            allowed = muon_drift(lrs, ref.shape, REORDERING)
        assert_within(full_tensor(p, p), ref.detach(), allowed, name)


@pytest.mark.parametrize("world_size", [2, 4])
def test_clipping_matches_the_unsharded_model(distributed, world_size):
    distributed(_clipping_matches_unsharded, world_size)


def _snapshot(optimizer):
    tensors = [p.to_local() for group in optimizer.param_groups for p in group["params"]]
    for part in optimizer.chained_optimizers:
        for state in part.optimizer.state.values():
            tensors += [v.to_local() if isinstance(v, DTensor) else v
                        for v in state.values() if torch.is_tensor(v)]
    return [t.clone() for t in tensors]


class _WithoutGradNorm:
    """A chain that exposes no grad norm and no step_with_ready_grads (an optimizer from outside
    megatron-core): FSDPMuonChainedOptimizer decides before stepping it, by its own reduction."""

    def __init__(self, chain):
        self.chain = chain

    def step(self):
        return self.chain.step()

    def __getattr__(self, name):
        if name in ("chain", "get_grad_norm", "step_with_ready_grads"):
            raise AttributeError(name)
        return getattr(self.chain, name)


class _StepsWithoutANorm(_WithoutGradNorm):
    """A chain that computes no grad norm in its step (clipping and norm logging off, in a
    megatron-core that then skips it): the decision falls back to our reduction inside it."""

    def get_grad_norm(self):
        return self.chain.get_grad_norm()

    def step_with_ready_grads(self):
        return self.chain.step_with_ready_grads()

    def step(self):
        self.prepare_grads()
        return self.step_with_ready_grads(), None, None


# What wraps the factory's chain. A skipped step issues one all-reduce whichever decides it.
CHAINS = {"megatron-core's": lambda chain: chain, "without a grad norm": _WithoutGradNorm,
          "stepping without a norm": _StepsWithoutANorm}


def _nonfinite_on_one_rank(rank, world_size, dist_mode, value, chain, offload=False,
                           gather=False):
    init_parallel_state()
    model = fsdp_gpt()
    built = get_megatron_optimizer(
        optimizer_config(clip_grad=1.0, optimizer_cpu_offload=offload,
                         optimizer_offload_fraction=1.0), [model], muon_dist_mode=dist_mode,
        muon_owner_choice="bytes" if gather else "time")  # bytes: the same owners every run
    optimizer = FSDPMuonChainedOptimizer(CHAINS[chain](built.optimizer), [model],
                                         gather_inside_backward=gather)
    optimizer.zero_grad()
    _backward(model, 0, rank)
    assert optimizer.step()[0]
    before = _snapshot(optimizer)

    _backward_with_a_nonfinite_on_the_last_rank(model, optimizer, 1, rank, world_size, value)
    if gather:  # gathered ahead at the grad sync, dropped by the skip
        assert any(muon.ahead.started for muon in optimizer.muon_optimizers)
    with observed(Traffic()) as traffic:
        assert optimizer.step() == (False, None, None)
    assert traffic.by_name == {"allreduce_": 1}  # nothing else: no exchange, no param sync
    after = _snapshot(optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, after))

    optimizer.zero_grad()
    _backward(model, 2, rank)
    update_successful, grad_norm, _ = optimizer.step()
    assert update_successful and (chain == "stepping without a norm" or grad_norm > 0)


def _backward_with_a_nonfinite_on_the_last_rank(model, optimizer, step, rank, world_size,
                                                value=float("nan")):
    optimizer.zero_grad()
    _backward(model, step, rank)
    if rank == world_size - 1:  # one element of one rank's shard of a Muon matrix
        grad = next(p.grad.to_local() for group in optimizer.param_groups for p in group["params"]
                    if p.dim() == 2 and p.grad is not None and p.grad.to_local().numel())
        grad.view(-1)[0] = value


@pytest.mark.parametrize("dist_mode, value, chain, offload, gather", [
    ("owner", float("nan"), "megatron-core's", False, True),  # gathered inside backward
    ("allgather", -float("inf"), "megatron-core's", True, False),  # the state in host memory
    ("owner", float("inf"), "without a grad norm", False, False),
    ("owner", float("nan"), "stepping without a norm", False, False)])
def test_a_nan_or_inf_on_one_ranks_shard_skips_the_step_everywhere(distributed, dist_mode, value,
                                                                   chain, offload, gather):
    distributed(_nonfinite_on_one_rank, 2, dist_mode, value, chain, offload, gather)


def _diverged_run_stops(rank, world_size):
    init_parallel_state()
    model = fsdp_gpt()
    optimizer = get_megatron_optimizer(optimizer_config(), [model], muon_max_consecutive_skipped_steps=3)
    for step in range(2):  # two skipped, then a good step starts the count again
        _backward_with_a_nonfinite_on_the_last_rank(model, optimizer, step, rank, world_size)
        assert optimizer.step() == (False, None, None)
    optimizer.zero_grad()
    _backward(model, 2, rank)
    assert optimizer.step()[0]
    assert step_scalars(optimizer)["muon/skipped-steps"] == 2  # what the logs say: all of them
    before = _snapshot(optimizer)
    for step in range(3, 5):
        _backward_with_a_nonfinite_on_the_last_rank(model, optimizer, step, rank, world_size,
                                                    float("inf"))
        assert optimizer.step() == (False, None, None)
    _backward_with_a_nonfinite_on_the_last_rank(model, optimizer, 5, rank, world_size)
    with pytest.raises(RuntimeError, match="3 optimizer steps in a row were skipped: the gradients "
                       "hold NaN or Inf.*--muon-max-consecutive-skipped-steps=3"):
        optimizer.step()  # on every rank: none is left waiting in a collective
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(optimizer)))


def test_a_diverged_run_stops_after_the_consecutive_skipped_steps_limit(distributed):
    distributed(_diverged_run_stops, 2)


def test_the_default_limit_is_megatrons_ten_wherever_the_chain_is_built():
    """The e2e run stops after 3 (its flag); the default, on the command line and in the
    factory, is 10."""
    import argparse
    import inspect

    from megatron_muon.integrations.arguments import add_muon_args

    parsed = add_muon_args(argparse.ArgumentParser()).parse_args([])
    factory_default = inspect.signature(get_megatron_optimizer).parameters[
        "muon_max_consecutive_skipped_steps"].default
    assert parsed.muon_max_consecutive_skipped_steps == factory_default == 10


def _counting_starts(chain) -> list[int]:
    """How many exchanges each step started ahead (wraps each Muon part's start)."""
    counts = [0]
    for muon in chain.muon_optimizers:
        start = muon.ahead.start

        def counted(*args, start=start, **kwargs):
            counts[-1] += 1
            return start(*args, **kwargs)

        muon.ahead.start = counted
    return counts


# A row's `variant`: (OptimizerConfig fields, TransformerConfig settings). MuonClip's threshold
# sits among the tiny GPT's max logits (test_qk_clip.py's FIRES), so it clips some heads.
VARIANTS = {None: ({}, {}), "teams": ({}, {}),
            **{method: (dict(optimizer="adaptive_muon", adaptive_muon_moment2_method=method), {})
               for method in ("namo", "adamuon")},
            "normuon, MuonClip": (
                dict(optimizer="adaptive_muon", adaptive_muon_moment2_method="normuon"),
                dict(num_query_groups=2, qk_clip=True, qk_clip_threshold=0.04, qk_clip_alpha=0.5))}


def _train(rank, strategy, gather, clip, micro_batches, overlap, num_experts, after=None,
           variant=None, sharing=True):
    torch.manual_seed(0)
    config_fields, model_settings = VARIANTS[variant]
    model = fsdp_gpt(strategy=strategy, overlap=overlap, num_experts=num_experts,
                     **model_settings)
    # Unclipped, every step checked (--muon-check-interval 1): the check compares what the owners
    # formed from what they gathered ahead with the whole-matrix reference, or raises.
    config = optimizer_config(clip_grad=clip, **config_fields)
    said = io.StringIO()
    with teams_of_two() if variant == "teams" else contextlib.nullcontext(), \
            contextlib.redirect_stdout(said), every_batch_that_fits_ahead(sharing):
        chain = get_megatron_optimizer(config, [model], muon_owner_choice="bytes",
                                       muon_check_interval=int(not clip),
                                       muon_gather_inside_backward=gather,
                                       muon_max_team_size=2 if variant == "teams" else 1)
    if gather and rank == 0:  # the start-up line, for each Muon part
        lines = [line for line in said.getvalue().splitlines() if "inside-backward" in line]
        assert len(lines) == 1 + bool(num_experts), lines
        assert all(f"({part} params): " in line
                   for line, part in zip(lines, ["dense", "expert"])), lines
        assert ("0 of" in lines[0]) == (variant == "adamuon"), lines
    if variant == "teams":
        assert any(m.team for muon in chain.muon_optimizers for plan in muon.plans
                   for m in plan.matrices)
    if gather and variant != "adamuon":  # the exchanges gathering ahead: the rest at the step?
        assert any(routes is not None for muon in chain.muon_optimizers for plan in muon.plans
                   for routes in plan.routes_at_step) == sharing
    starts = _counting_starts(chain)
    for step in range(GATHER_STEPS):
        chain.zero_grad()
        with model.no_sync():
            for micro_batch in range(micro_batches - 1):
                lm_loss(model, 10 * step + micro_batch, rank).backward()
        lm_loss(model, 10 * step + micro_batches, rank).backward()
        if after == "reduced again":  # a micro-batch outside no_sync after the last
            lm_loss(model, 10 * step + 9, rank).backward()
        if after == "scaled":  # as finalize_model_grads under --calculate-per-token-loss
            model.finish_grad_sync()
            model.scale_gradients(0.5)
        with observed(Traffic()) as traffic:
            chain.step()
        # The plan counts the all-to-alls its step issues (plan.step_collectives), exactly.
        assert traffic.by_name["alltoall_base_"] == sum(
            step_collectives(plan.matrices, plan.owners, [r.batches for r in plan.routes],
                             plan.early if starts[-1] else frozenset())
            for muon in chain.muon_optimizers for plan in muon.plans), traffic.by_name
        starts.append(0)
        if model_settings.get("qk_clip"):  # it clipped, and the next step measures afresh
            assert chain.max_attention_logits.largest > model_settings["qk_clip_threshold"]
            take_max_attention_logit([model])  # as megatron.training does after the step
    return {name: p.to_local().clone() for name, p in named_main_weights(model)}, starts[:-1]


def _same_weights(rank, world_size, strategy, clip, micro_batches, overlap, layout, variant,
                  sharing):
    init_parallel_state(**layout)
    experts = 4 if layout.get("expert_parallel") else None
    expected, _ = _train(rank, strategy, False, clip, micro_batches, overlap, experts,
                         variant=variant)
    got, starts = _train(rank, strategy, True, clip, micro_batches, overlap, experts,
                         variant=variant, sharing=sharing)
    # It ran, every step; but AdaMuon's state is Adam's size: nothing saved to hold rows ahead in,
    # so its plan keeps every gather at the step.
    assert all((count > 0) == (variant != "adamuon") for count in starts), starts
    for name, weight in expected.items():
        assert torch.equal(got[name], weight), (name, (got[name] - weight).abs().max())
    for after in (["reduced again", "scaled"] if world_size == 2 else []):
        changed, _ = _train(rank, strategy, True, clip, 1, overlap, experts, after)
        expected, _ = _train(rank, strategy, False, clip, 1, overlap, experts, after)
        assert all(torch.equal(changed[name], w) for name, w in expected.items()), after


# `variant`: an adaptive Muon's second moment (AdaMuon's on the holders; NorMuon's travelling to
# the owner, with MuonClip; NAMO's with the raw gradient), or "teams": the largest matrix split
# over two ranks. `sharing`: the exchanges gathering ahead gather other matrices at the step too,
# else those are packed apart (fsdp_models.every_batch_that_fits_ahead).
@pytest.mark.parametrize(
    "world_size, strategy, clip, micro_batches, overlap, layout, variant, sharing", [
        (1, "optim_grads_params", CLIP, 1, True, {}, None, True),
        (2, "optim_grads_params", CLIP, 1, True, {}, None, True),
        (2, "optim", 0.0, 2, False, {}, None, False),
        (2, "optim_grads", CLIP, 1, True, {}, "normuon, MuonClip", True),
        (2, "optim_grads_params", CLIP, 2, False, {}, "namo", False),
        (2, "optim_grads_params", CLIP, 1, True, {}, "adamuon", True),
        # The dense part over all 4 ranks, the experts' interleaved beside it over 2.
        (4, "optim_grads", CLIP, 2, True, dict(expert_parallel=2), None, True),
        (4, "optim_grads_params", CLIP, 1, False, dict(tensor_parallel=2), None, False),
        # HSDP: the outer all-reduce.
        (4, "optim_grads_params", CLIP, 2, True, dict(replicas=2), None, True),
        (4, "optim_grads_params", CLIP, 1, True, {}, "teams", False),
    ])
def test_the_weights_are_those_of_the_gather_at_the_step(distributed, world_size, strategy, clip,
                                                          micro_batches, overlap, layout, variant,
                                                          sharing):
    distributed(_same_weights, world_size, strategy, clip, micro_batches, overlap, layout, variant,
                sharing)
