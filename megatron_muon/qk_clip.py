"""MuonClip's measurement on megatron-core's local attention (DotProductAttention): each layer's
per-head maximum attention logit over a step's micro-batches, kept where TransformerEngine's
attention keeps it (`core_attention.current_max_attn_logits`), and reduced over the data-parallel
ranks for all layers in one all-reduce (megatron-core's `clip_qk` issues one per layer)."""

import functools

import torch
import torch.distributed as dist
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention


def _core_attentions(model_chunks) -> list:
    return [module.core_attention for chunk in model_chunks for module in chunk.modules()
            if isinstance(module, SelfAttention)]


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
    attentions = [a for a in _core_attentions(model_chunks)
                  if getattr(a, "current_max_attn_logits", None) is not None]
    if not attentions:
        return 0.0
    stacked = torch.stack([a.current_max_attn_logits for a in attentions])
    dist.all_reduce(stacked, op=dist.ReduceOp.MAX, group=group)
    for attention, reduced in zip(attentions, stacked):
        attention.current_max_attn_logits = reduced
    return stacked.max().item()


def forget_max_attention_logits(model_chunks) -> None:
    """Start the next step's measurement afresh."""
    for attention in _core_attentions(model_chunks):
        attention.current_max_attn_logits = None
