"""MuonClip on Megatron-FSDP (megatron-core's --qk-clip and --log-max-attention-logit).

Each self-attention layer's per-head maximum attention logit over a step's micro-batches is kept
where TransformerEngine's attention (>= 2.9) keeps it, `core_attention.current_max_attn_logits`;
on megatron-core's local attention a forward hook records it there. The optimizer's step reduces
all layers' values over the data-parallel ranks in one all-reduce (megatron-core's `clip_qk`
issues one per layer) and, after the update, scales the q and k rows of the heads whose logits
passed the threshold in the sharded fp32 main weights, each rank its own rows, before
Megatron-FSDP installs them for the next forward. Nothing is gathered. The rows are those
megatron-core's clip scales: SelfAttention's fused q/k/v weight (per query group), and
multi-latent attention's q projection and kv up projection (per head).
"""

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

from ..compat import upstream
from ..core.muon_math import mla_kv_row_factors, mla_q_row_factors, qk_clip_row_factors
from ..plan import QKVRows
from .model_chunks import named_main_weights

# The attentions megatron-core's clip_qk clips (megatron.core.optimizer.qk_clip's).
CLIPPED_ATTENTIONS = (SelfAttention, MultiLatentAttention)


def _self_attentions(model_chunks) -> list[tuple[int, str, torch.nn.Module]]:
    return [(index, name, module) for index, chunk in enumerate(model_chunks)
            for name, module in chunk.named_modules() if isinstance(module, CLIPPED_ATTENTIONS)]


def _core_attentions(model_chunks) -> list:
    return [module.core_attention for _, _, module in _self_attentions(model_chunks)]


def observe_max_attention_logits(model_chunks) -> None:
    """Make every local-attention layer record its per-head max logit in each forward."""
    for core_attention in _core_attentions(model_chunks):
        if isinstance(core_attention, DotProductAttention):
            core_attention.current_max_attn_logits = None  # TEDotProductAttention's attribute
            core_attention.scale_mask_softmax.register_forward_hook(
                functools.partial(_record_max_logits, core_attention))


@torch.no_grad()
def _record_max_logits(core_attention, softmax, args, probs):
    """The softmax's input is the scaled QK^T ([b, heads, sq, sk]; `softmax.scale` still to
    apply). Masked positions come out with probability 0, and each row's largest unmasked logit
    with at least 1/sk: the max over positions of positive probability is the max unmasked
    logit, whatever the mask (causal, padding, sliding window) and the kernel (the torch path
    has already filled the masked positions of its input in place)."""
    logits = args[0].detach().float()
    if softmax.scale is not None:
        logits = logits * softmax.scale
    batch_max = logits.masked_fill(probs == 0, float("-inf")).amax(dim=(0, 2, 3))
    current = core_attention.current_max_attn_logits
    core_attention.current_max_attn_logits = (
        batch_max if current is None else torch.maximum(current, batch_max))


def reduce_max_attention_logits(model_chunks, group) -> float:
    """Every layer's per-head max logits, maximum over `group`'s ranks (each tensor-parallel rank
    keeps its own heads), in one all-reduce; the largest, or 0.0 if nothing was recorded."""
    attentions = _recorded(model_chunks)
    if not attentions:
        return 0.0
    stacked = torch.stack([a.current_max_attn_logits for a in attentions])
    dist.all_reduce(stacked, op=dist.ReduceOp.MAX, group=group)
    for attention, reduced in zip(attentions, stacked):
        attention.current_max_attn_logits = reduced
    return stacked.max().item()


def clip_qk_after_the_step(model, log_max_only: bool, upstream_clip_qk: Callable,
                           ours: bool) -> float:
    """A training loop's clip_qk(model, log_max_only) after the optimizer's step
    (megatron.training's and Bridge's). Where our step ran (`ours`) it has reduced the max
    logits and clipped the sharded main weights: what is left is the value to log
    (take_max_attention_logit); elsewhere `upstream_clip_qk`, the loop's own."""
    if not ours:
        return upstream_clip_qk(model, log_max_only)
    return take_max_attention_logit(model if isinstance(model, list) else [model])


def take_max_attention_logit(model_chunks) -> float:
    """The step's largest max logit (already reduced by the step), and start the next step's
    measurement afresh."""
    attentions = _recorded(model_chunks)
    if not attentions:
        return 0.0
    largest = torch.stack([a.current_max_attn_logits for a in attentions]).max().item()
    for attention in attentions:
        attention.current_max_attn_logits = None
    return largest


def _recorded(model_chunks) -> list:
    """The core attentions that hold max logits of this step."""
    return [a for a in _core_attentions(model_chunks)
            if getattr(a, "current_max_attn_logits", None) is not None]


class _ClippedWeight(NamedTuple):
    main_weight: torch.Tensor  # a DTensor: this rank holds rows [start, stop) of its TP-local rows
    start: int
    stop: int
    row_factors: Callable  # (per-head max logits, threshold, alpha) -> a factor per TP-local row


class _ClippedLayer(NamedTuple):
    core_attention: torch.nn.Module
    weights: tuple[_ClippedWeight, ...]


class MaxAttentionLogits:
    """What --log-max-attention-logit and --qk-clip ask of each optimizer step.

    `reduce()` (every step, a skipped one too: its max is logged) all-reduces the layers' per-head
    max logits over `group`; `clip_main_weights()` (after an update, before the weights are
    installed) applies MuonClip where `clip` is given: (layers, threshold, alpha)."""

    def __init__(self, model_chunks, group, clip: tuple[list[_ClippedLayer], float, float] | None):
        self.model_chunks, self.group, self.clip = model_chunks, group, clip
        self.largest = 0.0

    def reduce(self) -> None:
        self.largest = reduce_max_attention_logits(self.model_chunks, self.group)

    @torch.no_grad()
    def clip_main_weights(self) -> None:
        if self.clip is None:
            return
        layers, threshold, alpha = self.clip
        if not self.largest > threshold:
            return  # no head passed the threshold: nothing changes (one host read per step)
        for layer in layers:
            max_logits = layer.core_attention.current_max_attn_logits
            if max_logits is None:
                continue
            for weight in layer.weights:
                local = weight.main_weight.to_local()
                if local.numel():
                    factors = weight.row_factors(max_logits, threshold, alpha)
                    local.mul_(factors[weight.start:weight.stop].unsqueeze(1))


def build_max_attention_logits(model_chunks, group, held_rows) -> MaxAttentionLogits | None:
    """The step's max-logit work the model's config asks for (None: neither flag). Checks that
    every self-attention layer can be observed and, for --qk-clip, clipped, before any state
    changes. `held_rows(main_weight)`: (start, stop, rows), this rank holds rows [start, stop) of
    its TP-local matrix of `rows` rows (ZeROTensorParallelMuon.held_rows; KeyError for a weight
    Muon does not step)."""
    config = model_chunks[0].config
    if not (config.qk_clip or config.log_max_attention_logit):
        return None
    flag = "--qk-clip" if config.qk_clip else "--log-max-attention-logit"
    attentions = _self_attentions(model_chunks)
    if not attentions:
        found = sorted({type(m).__name__ for chunk in model_chunks for m in chunk.modules()
                        if "Attention" in type(m).__name__})
        raise ValueError(f"{flag} needs megatron-core's self-attention layers (SelfAttention, "
                         f"or MultiLatentAttention's); this model has none"
                         + (f" (its attention: {', '.join(found)})" if found else ""))
    for _, name, attention in attentions:
        core = attention.core_attention
        if not (isinstance(core, DotProductAttention) or hasattr(core, "current_max_attn_logits")):
            raise ValueError(
                f"{flag}: the max attention logits of {name}.core_attention "
                f"({type(core).__name__}) cannot be observed; use megatron-core's local attention "
                f"(--transformer-impl local) or TransformerEngine's (>= 2.9)")
    clip = None
    if config.qk_clip:
        main_weights = [dict(named_main_weights(chunk)) for chunk in model_chunks]
        layers = []
        for index, name, attention in attentions:
            weights = tuple(_clipped_weight(f"{name}.{weight}.weight",
                                            main_weights[index][f"{name}.{weight}.weight"], rows,
                                            factors, held_rows)
                            for weight, rows, factors in _clipped_rows(attention))
            layers.append(_ClippedLayer(attention.core_attention, weights))
        clip = (layers, config.qk_clip_threshold, config.qk_clip_alpha)
    observe_max_attention_logits(model_chunks)
    return MaxAttentionLogits(model_chunks, group, clip)


def _clipped_rows(attention) -> list[tuple[str, int, Callable]]:
    """The weights megatron-core's clip_qk scales in `attention`, each as (its name in the
    layer, its TP-local rows, its rows' factors)."""
    config = attention.config
    if isinstance(attention, MultiLatentAttention):
        heads = attention.num_attention_heads_per_partition
        q_weight = "linear_q_proj" if config.q_lora_rank is None else "linear_q_up_proj"
        nope, rope, v = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
        return [(q_weight, heads * (nope + rope),
                 lambda logits, threshold, alpha: mla_q_row_factors(logits, nope, rope,
                                                                    threshold, alpha)),
                ("linear_kv_up_proj", heads * (nope + v),
                 lambda logits, threshold, alpha: mla_kv_row_factors(logits, nope, v,
                                                                     threshold, alpha))]
    groups = attention.num_query_groups_per_partition
    q_rows, kv_rows, _ = upstream.get_qkv_split_shapes(config)  # per group; no output gate
    qkv = QKVRows(groups, q_rows, kv_rows)
    return [("linear_qkv", qkv.num_rows,
             lambda logits, threshold, alpha: qk_clip_row_factors(logits, qkv, threshold, alpha))]


def _clipped_weight(name: str, main_weight, rows: int, row_factors, held_rows) -> _ClippedWeight:
    try:
        start, stop, held = held_rows(main_weight)
    except KeyError:
        raise ValueError(f"--qk-clip: {name} is not stepped by Muon (the optimizer's overrides "
                         f"give it to another optimizer)") from None
    if held != rows:
        raise ValueError(f"--qk-clip: {name} has {held} rows per tensor-parallel rank, not the "
                         f"{rows} megatron-core's clip_qk scales")
    return _ClippedWeight(main_weight, start, stop, row_factors)
