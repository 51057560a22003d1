"""Muon's elementwise part on one local shard (weight decay, momentum, Nesterov) and MuonClip's
factors (QK-clip).

The same operations, in the same order, as emerging_optimizers' OrthogonalizedOptimizer.step and
megatron-core's SelfAttention.clip_qk and MultiLatentAttention.clip_qk, so each shard's result is
bit-identical to the unsharded optimizer's rows.
"""

from typing import Any

import torch

from ..compat import upstream
from ..plan import QKVRows


def momentum_update_(optimizer: Any, param: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor,
                     group: dict) -> torch.Tensor:
    """Apply weight decay (emerging_optimizers' helper, any of its methods) and the momentum EMA
    in place; return the tensor to orthogonalize."""
    upstream.apply_weight_decay_inplace(optimizer, param, grad, group["lr"], group["weight_decay"])
    return momentum_and_nesterov_(optimizer, grad, momentum_buffer, group)


def momentum_and_nesterov_(optimizer: Any, grad: torch.Tensor, momentum_buffer: torch.Tensor,
                           group: dict) -> torch.Tensor:
    """The momentum EMA in place, and the tensor to orthogonalize: what follows weight decay.
    An owner forms a matrix's update with it from the old momentum and the gradient its holders
    sent (the gather inside backward), where weight decay leaves the gradient alone."""
    momentum_buffer.lerp_(grad, 1 - group["momentum"])
    if optimizer.nesterov:
        return grad.lerp(momentum_buffer, group["momentum"])
    return momentum_buffer


def weight_decay_leaves_the_gradient(optimizer: Any) -> bool:
    """Whether weight decay never changes a gradient (every method but "l2" with a nonzero decay,
    emerging_optimizers' WeightDecayMixin), so an owner can form the update without the
    param's rows."""
    return getattr(optimizer, "weight_decay_method", "l2") != "l2" or all(
        group["weight_decay"] == 0.0 for group in optimizer.param_groups)


def _eta(max_logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """MuonClip's eta per entry of `max_logits`, as megatron-core's clip_qk computes it: min(1,
    threshold / m), but 1 where m does not pass the threshold (megatron-core's formula would give
    a negative or infinite eta where m <= 0)."""
    return torch.where(max_logits > threshold, torch.clamp(threshold / max_logits, max=1.0),
                       torch.ones_like(max_logits))


def qk_clip_row_factors(max_logits: torch.Tensor, qkv: QKVRows, threshold: float,
                        alpha: float) -> torch.Tensor:
    """MuonClip's factor for each row of the TP-local fused q/k/v weight, as megatron-core's
    SelfAttention.clip_qk computes it: eta of m, the largest max logit of the query group's
    heads; q rows by eta ** alpha, k rows by eta ** (1 - alpha), v rows by 1. The powers are
    taken on megatron-core's shapes: on CPU, pow's vectorized and scalar loops can round one ulp
    apart."""
    eta = _eta(max_logits.view(qkv.groups, -1).amax(dim=1), threshold).view(qkv.groups, 1, 1)
    q = torch.pow(eta.repeat(1, qkv.q_rows, 1), alpha)
    k = torch.pow(eta, 1 - alpha).expand(-1, qkv.kv_rows, -1)
    return torch.cat([q, k, torch.ones_like(k)], dim=1).view(-1)


def mla_q_row_factors(max_logits: torch.Tensor, nope_rows: int, rope_rows: int, threshold: float,
                      alpha: float) -> torch.Tensor:
    """MuonClip's factor for each row of MLA's TP-local q projection (linear_q_up_proj, or
    linear_q_proj without a q low rank), as MultiLatentAttention._clip_q_proj_weight computes it:
    per head, its no-rope rows by eta ** alpha and its rope rows by eta (the rope part of k is
    one for all heads and is not clipped, so q's rope part takes the head's whole eta)."""
    eta = _eta(max_logits, threshold).view(-1, 1, 1)
    nope = torch.pow(eta, alpha).expand(-1, nope_rows, -1)
    return torch.cat([nope, eta.expand(-1, rope_rows, -1)], dim=1).view(-1)


def mla_kv_row_factors(max_logits: torch.Tensor, k_rows: int, v_rows: int, threshold: float,
                       alpha: float) -> torch.Tensor:
    """MuonClip's factor for each row of MLA's TP-local kv up projection (linear_kv_up_proj), as
    MultiLatentAttention._clip_kv_proj_weight computes it: per head, its k rows by
    eta ** (1 - alpha), its v rows by 1."""
    eta = _eta(max_logits, threshold).view(-1, 1, 1)
    k = torch.pow(eta, 1 - alpha).expand(-1, k_rows, -1)
    return torch.cat([k, torch.ones_like(eta).expand(-1, v_rows, -1)], dim=1).view(-1)
