"""MuonClip on Megatron-FSDP: after the optimizer's update, the rows megatron-core's clip_qk scales
are scaled in the sharded fp32 main weights, each rank its own rows wherever the shard boundaries
cut the query groups or heads: SelfAttention's fused q/k/v weight per query group, and
multi-latent attention's (Kimi K2's, DeepSeek's) q projection and kv up projection per head.
Equal bit for bit to megatron-core's SelfAttention.clip_qk and MultiLatentAttention.clip_qk on
the unsharded (TP-local) weights with the same logits; the next forward computes with them;
groups and heads under the threshold stay as they were."""

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

from fsdp_models import ForwardReads, full_tensor, global_batch_loss
from megatron_muon import get_megatron_optimizer
from megatron_muon.chain.model_chunks import find_megatron_fsdp, named_main_weights
from megatron_muon.integrations.factory import _held_rows_in
from megatron.core.optimizer.optimizer_config import ParamKey
from megatron_muon.chain.qk_clip import (_self_attentions, observe_max_attention_logits,
                                        take_max_attention_logit)
from megatron_muon.tools.testing import (MLA, MLA_WITHOUT_Q_LORA, TINY, fsdp_gpt, gpt,
                                         init_parallel_state, optimizer_config)

ALPHA = 0.3
FIRES = 0.04  # between the tiny GPT's per-group max logits (0.03 to 0.05) on the first batch
MLA_FIRES = 0.025  # between its MLA heads' (0.018 to 0.040)
NEVER = 100.0  # megatron-core's default threshold
ATTENTIONS = {"MHA": dict(num_query_groups=4), "GQA": dict(num_query_groups=2),
              "MLA": MLA, "MLA without q low rank": MLA_WITHOUT_Q_LORA}
CLIPPED = ("linear_qkv", "linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj")
# (strategy, attention, tensor parallel, threshold)
CASES = {
    2: [("optim_grads_params", "GQA", 1, FIRES), ("no_shard", "MHA", 1, FIRES),
        ("optim_grads_params", "MHA", 1, NEVER), ("optim_grads_params", "MLA", 1, MLA_FIRES),
        ("optim", "MLA without q low rank", 1, MLA_FIRES)],
    4: [("optim_grads_params", "MHA", 1, FIRES), ("no_shard", "GQA", 1, FIRES), ("optim", "GQA", 1, FIRES),
        ("optim_grads_params", "GQA", 2, FIRES), ("optim_grads_params", "MLA", 1, MLA_FIRES),
        ("optim_grads", "MLA without q low rank", 1, MLA_FIRES),
        ("optim_grads_params", "MLA", 2, MLA_FIRES), ("no_shard", "MLA", 1, NEVER)],
}


def _every_case(rank, world_size):
    cuts = [_clipped_as_megatron_core(world_size, *case) for case in CASES[world_size]]
    if world_size == 4:  # some shard boundary fell inside a query group's or a head's rows
        assert any(cuts), cuts


def _clipped_as_megatron_core(world_size, strategy, attention, tensor_parallel, threshold) -> bool:
    init_parallel_state(tensor_parallel=tensor_parallel)
    settings = dict(ATTENTIONS[attention], qk_clip=True, qk_clip_threshold=threshold,
                    qk_clip_alpha=ALPHA)
    case = f"{strategy} {attention} TP={tensor_parallel} threshold={threshold} W={world_size}"
    model = fsdp_gpt(strategy=strategy, **settings)
    reads = ForwardReads(find_megatron_fsdp(model))
    optimizer = get_megatron_optimizer(optimizer_config(), [model])
    clipped_weights = {name: p for name, p in named_main_weights(model)
                       if name.endswith(".weight") and name.split(".")[-2] in CLIPPED}
    updated = _record_after_the_update(optimizer, clipped_weights)

    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    optimizer.zero_grad()
    global_batch_loss(model, 0, dp_rank, dp_size).backward()
    assert optimizer.step()[0]
    clipped = {name: full_tensor(p, p) for name, p in clipped_weights.items()}
    reduced = {name: a.core_attention.current_max_attn_logits
               for _, name, a in _self_attentions([model])}
    take_max_attention_logit([model])  # what megatron.training does after the step
    global_batch_loss(model, 1, dp_rank, dp_size)
    reads.assert_main_weights(f"{case}: forward after the clip")

    unsharded = gpt(**settings)  # this TP rank's partition, whole
    observe_max_attention_logits([unsharded])
    global_batch_loss(unsharded, 0, 0, 1)
    passed, unit_rows = [], {}
    for (_, _, attention), (name, fsdp_logits) in zip(_self_attentions([unsharded]),
                                                      reduced.items()):
        logits = attention.core_attention.current_max_attn_logits
        assert torch.equal(fsdp_logits, logits), case
        weights = {w: updated[f"{name}.{w}.weight"] for w in CLIPPED
                   if f"{name}.{w}.weight" in updated}
        if isinstance(attention, MultiLatentAttention):
            fired = logits > threshold  # per head
            expected = _mla_clip_as_megatron_core(attention, weights, logits)
        else:
            fired = logits.view(attention.num_query_groups_per_partition, -1).amax(dim=1) > threshold
            expected = _clip_as_megatron_core(attention, weights, logits, tensor_parallel)
        passed.append(fired)
        for weight, rows_that_clip in _rows_that_clip(attention).items():
            key = f"{name}.{weight}.weight"
            unit_rows[key] = len(rows_that_clip)
            assert torch.equal(clipped[key], expected[weight]), f"{case} {key}"
            _assert_only_passing_rows_changed(updated[key], clipped[key], fired, rows_that_clip,
                                              f"{case} {key}")
    fired = torch.cat(passed)
    some_fired_some_not = torch.stack([fired.any(), fired.logical_not().any()]).float()
    dist.all_reduce(some_fired_some_not, op=dist.ReduceOp.MAX)  # over the TP ranks' heads too
    if threshold == NEVER:
        assert not fired.any(), case
    else:
        assert some_fired_some_not.tolist() == [1, 1], f"{case}: the data no longer straddles"
    return _cuts_a_group(optimizer, clipped_weights, unit_rows)


def _record_after_the_update(optimizer, weights) -> dict:
    """The full clipped main weights as the optimizer's update leaves them, before the clip."""
    updated, update = {}, optimizer.optimizer.step

    def update_then_record(*args, **kwargs):
        result = update(*args, **kwargs)
        updated.update({name: full_tensor(p, p) for name, p in weights.items()})
        return result

    optimizer.optimizer.step = update_then_record
    return updated


def _clip_as_megatron_core(attention, weights, logits, tensor_parallel):
    """megatron-core's SelfAttention.clip_qk on the whole TP-local q/k/v weight with `logits`. Its
    reshapes take the global projection sizes, which are this rank's only at TP=1 (at TP=2 its
    last view fails): it runs here on a stand-in holding this rank's sizes."""
    tp = attention.world_size
    local = SimpleNamespace(
        config=attention.config, core_attention=SimpleNamespace(current_max_attn_logits=logits),
        linear_qkv=SimpleNamespace(weight=weights["linear_qkv"].clone()),
        num_attention_heads_per_partition=attention.num_attention_heads_per_partition,
        num_query_groups_per_partition=attention.num_query_groups_per_partition,
        query_projection_size=attention.query_projection_size // tp,
        kv_projection_size=attention.kv_projection_size // tp)
    local._clip_linear_qkv = functools.partial(SelfAttention._clip_linear_qkv, local)
    SelfAttention.clip_qk(local)
    if tensor_parallel > 1 and logits.max() > attention.config.qk_clip_threshold:
        attention.core_attention.current_max_attn_logits = logits
        with pytest.raises(RuntimeError, match="must match the size"):
            attention.clip_qk()  # megatron-core 0.19.2's own, on the module
    return {"linear_qkv": local.linear_qkv.weight}


@torch.no_grad()
def _mla_clip_as_megatron_core(attention, weights, logits):
    """megatron-core's MultiLatentAttention.clip_qk itself, on the unsharded module holding the
    updated weights (it takes this TP rank's head count)."""
    for weight, value in weights.items():
        getattr(attention, weight).weight.copy_(value)
    attention.core_attention.current_max_attn_logits = logits
    attention.clip_qk()
    return {weight: getattr(attention, weight).weight.clone() for weight in weights}


def _rows_that_clip(attention) -> dict[str, list[bool]]:
    """For each weight clip_qk scales, whether each row of one query group (SelfAttention) or one
    head (MLA) is scaled when its group or head passes: q and k rows, never v rows."""
    if isinstance(attention, MultiLatentAttention):
        config = attention.config
        q = "linear_q_proj" if config.q_lora_rank is None else "linear_q_up_proj"
        return {q: [True] * (config.qk_head_dim + config.qk_pos_emb_head_dim),
                "linear_kv_up_proj": [True] * config.qk_head_dim + [False] * config.v_head_dim}
    head = TINY.hidden // TINY.heads
    q_rows = attention.num_attention_heads_per_partition // attention.num_query_groups_per_partition
    return {"linear_qkv": [True] * (q_rows * head + head) + [False] * head}


def _assert_only_passing_rows_changed(updated, clipped, passed, rows_that_clip, case):
    """The rows that clip, of the groups or heads that passed, change; nothing else does."""
    rows = len(rows_that_clip)
    assert updated.shape[0] == rows * len(passed), case
    for unit, fired in enumerate(passed.tolist()):
        for row, clips in enumerate(rows_that_clip):
            index = unit * rows + row
            assert torch.equal(updated[index], clipped[index]) != (fired and clips), (case, unit, row)


def _cuts_a_group(optimizer, weights, unit_rows) -> bool:
    """Whether any rank's shard of a clipped weight starts or stops inside a query group's or a
    head's rows (`unit_rows`: each weight's rows per group or head)."""
    held_rows = _held_rows_in(optimizer.chained_optimizers)
    cut = False
    for key, p in weights.items():
        start, stop, _ = held_rows(p)
        cut |= any(row % unit_rows[key] for row in (start, stop))
    flag = torch.tensor([float(cut)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_clip_equals_megatron_cores_on_the_unsharded_weight(distributed, world_size):
    distributed(_every_case, world_size)


class LinearAttention(torch.nn.Module):
    """An attention megatron-core's QK-clip does not know."""


def _refused(model_chunks, match, **factory_kwargs):
    """The factory refuses, before it changes any weight or registers any measurement."""
    def weights():
        return [p.to_local().clone() for chunk in model_chunks for _, p in named_main_weights(chunk)]

    before = weights()
    with pytest.raises(ValueError, match=match):
        get_megatron_optimizer(optimizer_config(), model_chunks, **factory_kwargs)
    assert all(torch.equal(a, b) for a, b in zip(before, weights()))
    assert not any(hasattr(a.core_attention, "current_max_attn_logits")
                   for _, _, a in _self_attentions(model_chunks))


def _refusals(rank, world_size):
    init_parallel_state()
    no_self_attention = fsdp_gpt(qk_clip=True)
    for layer in no_self_attention.module.module.decoder.layers:
        layer.self_attention = LinearAttention()
    _refused([no_self_attention], r"--qk-clip needs megatron-core's self-attention layers .* this "
                                  r"model has none \(its attention: LinearAttention\)")
    unobservable = fsdp_gpt(log_max_attention_logit=True)
    unobservable.module.module.decoder.layers[1].self_attention.core_attention = LinearAttention()
    _refused([unobservable], r"--log-max-attention-logit: the max attention logits of "
                             r"module.module.decoder.layers.1.self_attention.core_attention "
                             r"\(LinearAttention\) cannot be observed")
    gated = fsdp_gpt(qk_clip=True)
    gated.config.attention_output_gate = True  # after the build: the local spec has no gate
    _refused([gated], "TransformerConfig.qk_clip with TransformerConfig.attention_output_gate")
    _refused([fsdp_gpt(qk_clip=True)], "--qk-clip: module.module.decoder.layers.0.self_attention."
             "linear_qkv.weight is not stepped by Muon",
             config_overrides={ParamKey(name="*linear_qkv.weight"): {"optimizer": "adam"}})
    _refused([fsdp_gpt(qk_clip=True, **MLA)], "--qk-clip: module.module.decoder.layers.0."
             "self_attention.linear_kv_up_proj.weight is not stepped by Muon",
             config_overrides={ParamKey(name="*linear_kv_up_proj.weight"): {"optimizer": "adam"}})
    absorbing = fsdp_gpt(qk_clip=True, **MLA)
    absorbing.config.cache_mla_latents = True  # after the build: megatron-core's MLA asserts it
    _refused([absorbing], "TransformerConfig.qk_clip with TransformerConfig.cache_mla_latents")


def test_what_cannot_be_clipped_is_refused_before_training(distributed):
    distributed(_refusals, 2)
