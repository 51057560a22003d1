"""Muon's elementwise part on one local shard: weight decay, momentum, Nesterov.

The same operations, in the same order, as emerging_optimizers' OrthogonalizedOptimizer.step, so
each shard's result is bit-identical to the unsharded optimizer's rows.
"""

import torch


def momentum_update_(optimizer, param: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor,
                     group: dict) -> torch.Tensor:
    """Apply weight decay (emerging_optimizers' helper, any of its methods) and the momentum EMA
    in place; return the tensor to orthogonalize."""
    optimizer._apply_weight_decay_inplace(param, grad, group["lr"], group["weight_decay"])
    momentum_buffer.lerp_(grad, 1 - group["momentum"])
    if optimizer.nesterov:
        return grad.lerp(momentum_buffer, group["momentum"])
    return momentum_buffer
