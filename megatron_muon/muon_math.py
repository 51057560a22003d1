"""Muon's elementwise part on one local shard (weight decay, momentum, Nesterov) and MuonClip's
factors (QK-clip).

The same operations, in the same order, as emerging_optimizers' OrthogonalizedOptimizer.step and
megatron-core's SelfAttention.clip_qk, so each shard's result is bit-identical to the unsharded
optimizer's rows.
"""

import torch

from . import upstream
from .plan import QKVRows


def momentum_update_(optimizer, param: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor,
                     group: dict) -> torch.Tensor:
    """Apply weight decay (emerging_optimizers' helper, any of its methods) and the momentum EMA
    in place; return the tensor to orthogonalize."""
    upstream.apply_weight_decay_inplace(optimizer, param, grad, group["lr"], group["weight_decay"])
    momentum_buffer.lerp_(grad, 1 - group["momentum"])
    if optimizer.nesterov:
        return grad.lerp(momentum_buffer, group["momentum"])
    return momentum_buffer


def qk_clip_row_factors(max_logits: torch.Tensor, qkv: QKVRows, threshold: float,
                        alpha: float) -> torch.Tensor:
    """MuonClip's factor for each row of the TP-local fused q/k/v weight, as megatron-core's
    SelfAttention.clip_qk computes it: eta = min(1, threshold / m), m the largest max logit of
    the query group's heads; q rows by eta ** alpha, k rows by eta ** (1 - alpha), v rows by 1.
    A group whose m does not pass the threshold keeps eta = 1 (megatron-core's formula would give
    a negative or infinite eta where m <= 0). The powers are taken on megatron-core's shapes: on
    CPU, pow's vectorized and scalar loops can round one ulp apart."""
    grouped = max_logits.view(qkv.groups, -1).amax(dim=1)
    eta = torch.where(grouped > threshold, torch.clamp(threshold / grouped, max=1.0),
                      torch.ones_like(grouped)).view(qkv.groups, 1, 1)
    q = torch.pow(eta.repeat(1, qkv.q_rows, 1), alpha)
    k = torch.pow(eta, 1 - alpha).expand(-1, qkv.kv_rows, -1)
    return torch.cat([q, k, torch.ones_like(k)], dim=1).view(-1)
