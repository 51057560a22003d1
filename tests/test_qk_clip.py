"""MuonClip on Megatron-FSDP: after the optimizer's update, the q and k rows of each query group
whose max attention logit passed the threshold are scaled in the sharded fp32 main weights, each
rank its own rows wherever the shard boundaries cut the groups, equal bit for bit to
megatron-core's SelfAttention.clip_qk on the unsharded (TP-local) q/k/v weight with the same
logits; the next forward computes with them; groups under the threshold stay as they were."""

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.attention import SelfAttention

from fsdp_models import ForwardReads, full_tensor
from megatron_muon import get_megatron_optimizer
from megatron_muon.chained import find_megatron_fsdp, named_main_weights
from megatron.core.optimizer.optimizer_config import ParamKey
from megatron_muon.qk_clip import (_self_attentions, observe_max_attention_logits,
                                   take_max_attention_logit)
from megatron_muon.testing import (TINY, fsdp_gpt, global_batch_loss, gpt, init_parallel_state,
                                   optimizer_config)

ALPHA = 0.3
FIRES = 0.04  # between the tiny GPT's per-group max logits (0.03 to 0.05) on the first batch
NEVER = 100.0  # megatron-core's default threshold
# (strategy, query groups (4: MHA, 2: GQA), tensor parallel, threshold)
CASES = {
    2: [("optim_grads_params", 2, 1, FIRES), ("no_shard", 4, 1, FIRES),
        ("optim_grads_params", 4, 1, NEVER)],
    4: [("optim_grads_params", 4, 1, FIRES), ("no_shard", 2, 1, FIRES), ("optim", 2, 1, FIRES),
        ("optim_grads_params", 2, 2, FIRES)],
}


def _every_case(rank, world_size):
    cuts = [_clipped_as_megatron_core(world_size, *case) for case in CASES[world_size]]
    if world_size == 4:  # some shard boundary fell inside a query group's rows
        assert any(cuts), cuts


def _clipped_as_megatron_core(world_size, strategy, groups, tensor_parallel, threshold) -> bool:
    init_parallel_state(tensor_parallel=tensor_parallel)
    settings = dict(num_query_groups=groups, qk_clip=True, qk_clip_threshold=threshold,
                    qk_clip_alpha=ALPHA)
    case = f"{strategy} groups={groups} TP={tensor_parallel} threshold={threshold} W={world_size}"
    model = fsdp_gpt(strategy=strategy, **settings)
    reads = ForwardReads(find_megatron_fsdp(model))
    optimizer = get_megatron_optimizer(optimizer_config(), [model])
    qkv = {name: p for name, p in named_main_weights(model) if name.endswith("linear_qkv.weight")}
    updated = _record_after_the_update(optimizer, qkv)

    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    optimizer.zero_grad()
    global_batch_loss(model, 0, dp_rank, dp_size).backward()
    assert optimizer.step()[0]
    clipped = {name: full_tensor(p, p) for name, p in qkv.items()}
    reduced = {name + ".linear_qkv.weight": a.core_attention.current_max_attn_logits
               for _, name, a in _self_attentions([model])}
    take_max_attention_logit([model])  # what megatron.training does after the step
    global_batch_loss(model, 1, dp_rank, dp_size)
    reads.assert_main_weights(f"{case}: forward after the clip")

    unsharded = gpt(**settings)  # this TP rank's partition, whole
    observe_max_attention_logits([unsharded])
    global_batch_loss(unsharded, 0, 0, 1)
    passed = []
    for (_, _, attention), (name, fsdp_logits) in zip(_self_attentions([unsharded]),
                                                      reduced.items()):
        logits = attention.core_attention.current_max_attn_logits
        assert torch.equal(fsdp_logits, logits), case
        group_max = logits.view(attention.num_query_groups_per_partition, -1).amax(dim=1)
        passed.append(group_max > threshold)
        expected = _clip_as_megatron_core(attention, updated[name], logits)
        assert torch.equal(clipped[name], expected), f"{case} {name}"
        if tensor_parallel > 1 and group_max.max() > threshold:
            with pytest.raises(RuntimeError, match="must match the size"):
                attention.clip_qk()  # megatron-core 0.19.2's own: see _clip_as_megatron_core
        _assert_only_passing_groups_changed(updated[name], clipped[name], group_max > threshold,
                                            f"{case} {name}")
    fired = torch.cat(passed)
    some_fired_some_not = torch.stack([fired.any(), fired.logical_not().any()]).float()
    dist.all_reduce(some_fired_some_not, op=dist.ReduceOp.MAX)  # over the TP ranks' groups too
    if threshold == NEVER:
        assert not fired.any(), case
    else:
        assert some_fired_some_not.tolist() == [1, 1], f"{case}: the data no longer straddles"
    return _cuts_a_group(optimizer, qkv, groups // tensor_parallel)


def _record_after_the_update(optimizer, qkv) -> dict:
    """The full q/k/v main weights as the optimizer's update leaves them, before the clip."""
    updated, update = {}, optimizer.optimizer.step

    def update_then_record(*args, **kwargs):
        result = update(*args, **kwargs)
        updated.update({name: full_tensor(p, p) for name, p in qkv.items()})
        return result

    optimizer.optimizer.step = update_then_record
    return updated


def _clip_as_megatron_core(attention, weight, logits):
    """megatron-core's SelfAttention.clip_qk on the whole TP-local `weight` with `logits`. Its
    reshapes take the global projection sizes, which are this rank's only at TP=1 (at TP=2 its
    last view fails): it runs here on a stand-in holding this rank's sizes."""
    tp = attention.world_size
    local = SimpleNamespace(
        config=attention.config, core_attention=SimpleNamespace(current_max_attn_logits=logits),
        linear_qkv=SimpleNamespace(weight=weight.clone()),
        num_attention_heads_per_partition=attention.num_attention_heads_per_partition,
        num_query_groups_per_partition=attention.num_query_groups_per_partition,
        query_projection_size=attention.query_projection_size // tp,
        kv_projection_size=attention.kv_projection_size // tp)
    local._clip_linear_qkv = functools.partial(SelfAttention._clip_linear_qkv, local)
    SelfAttention.clip_qk(local)
    return local.linear_qkv.weight


def _assert_only_passing_groups_changed(updated, clipped, passed, case):
    """q and k rows of the groups that passed change, nothing else (v rows never)."""
    head = TINY.hidden // TINY.heads
    rows = updated.view(len(passed), -1, updated.shape[-1]).shape[1]
    for group, fired in enumerate(passed.tolist()):
        for start, stop, role in ((0, rows - 2 * head, "q"), (rows - 2 * head, rows - head, "k"),
                                  (rows - head, rows, "v")):
            before = updated[group * rows + start: group * rows + stop]
            after = clipped[group * rows + start: group * rows + stop]
            assert torch.equal(before, after) != (fired and role != "v"), (case, group, role)


def _cuts_a_group(optimizer, qkv, groups_per_rank) -> bool:
    """Whether any rank's shard of a q/k/v weight starts or stops inside a query group."""
    muon = next(part.optimizer for part in optimizer.chained_optimizers
                if hasattr(part.optimizer, "held_rows"))
    cut = False
    for p in qkv.values():
        start, stop, rows = muon.held_rows(p)
        cut |= any(row % (rows // groups_per_rank) for row in (start, stop))
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
    _refused([no_self_attention], r"--qk-clip needs self-attention layers .* this model has none "
                                  r"\(its attention: LinearAttention\)")
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


def test_what_cannot_be_clipped_is_refused_before_training(distributed):
    distributed(_refusals, 2)
