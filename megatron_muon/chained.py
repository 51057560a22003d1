"""The optimizer Megatron's training loop steps: Megatron-FSDP's step contract around the
inner Muon + Adam chain."""

import functools

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def find_megatron_fsdp(chunk):
    """The MegatronFSDP inside a model chunk (megatron-core's FullyShardedDataParallel wraps it as
    `.module`), or None. Duck-typed: megatron_fsdp and megatron-core each ship a MegatronFSDP."""
    while chunk is not None:
        if hasattr(chunk, "install_optimized_model_weights") and hasattr(chunk, "finish_grad_sync"):
            return chunk
        chunk = getattr(chunk, "module", None)
    return None


class FSDPMuonChainedOptimizer:
    """Steps Megatron-FSDP models the way `megatron_fsdp.fully_shard_optimizer` does, for a chain.

    `step()`: `finish_grad_sync()` on each chunk unless it auto-syncs or something (Megatron's
    `finalize_model_grads`) already synced it since the last step, then the inner optimizer, then
    `install_optimized_model_weights()` once per chunk, after every inner part has updated its
    main weights. Everything else is the inner optimizer's.
    """

    def __init__(self, optimizer, model_chunks):
        fsdp_models = [find_megatron_fsdp(chunk) for chunk in model_chunks]
        missing = [i for i, m in enumerate(fsdp_models) if m is None]
        if not model_chunks or missing:
            raise ValueError(
                f"FSDPMuonChainedOptimizer needs Megatron-FSDP model chunks; chunks {missing} of "
                f"{len(model_chunks)} are not wrapped by Megatron-FSDP (use --use-megatron-fsdp)")
        self.optimizer = optimizer
        self.model_chunks = list(model_chunks)
        self._fsdp_models = fsdp_models
        self._synced = set()
        for index, chunk in enumerate(self.model_chunks):
            self._record_grad_syncs(index, chunk)

    def _record_grad_syncs(self, index, chunk):
        # finalize_model_grads calls chunk.finish_grad_sync(); remember it so the grads are
        # never reduced twice.
        sync = chunk.finish_grad_sync

        @functools.wraps(sync)
        def finish_grad_sync(*args, **kwargs):
            result = sync(*args, **kwargs)
            self._synced.add(index)
            return result

        chunk.finish_grad_sync = finish_grad_sync

    def step(self, *args, **kwargs):
        for index, (chunk, fsdp) in enumerate(zip(self.model_chunks, self._fsdp_models)):
            if index not in self._synced and not fsdp.model_auto_sync:
                chunk.finish_grad_sync()
        self._synced.clear()
        if self._any_rank_has_nonfinite_grads():
            return False, None, None  # as Megatron's optimizers report a skipped step
        result = self.optimizer.step(*args, **kwargs)
        update_successful = result[0] if isinstance(result, tuple) else True
        if update_successful:
            for fsdp in self._fsdp_models:
                fsdp.install_optimized_model_weights()
        return result

    def _any_rank_has_nonfinite_grads(self) -> bool:
        """Whether a NaN or Inf is in any rank's gradient shard. Reduced over every rank, so all
        skip the step together (a rank skipping alone would leave the others waiting in its
        collectives) and parameters, momentum and Adam's moments stay as they were."""
        nonfinite = []  # one flag tensor per grad: a single host sync below, not one per param
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                grad = p.grad if p.grad is not None else getattr(p, "main_grad", None)
                if grad is not None:
                    grad = grad.to_local() if isinstance(grad, DTensor) else grad
                    nonfinite.append(torch.isfinite(grad).all().logical_not())
        flag = torch.zeros(1, device="cuda" if torch.cuda.is_available() else "cpu")
        if nonfinite:
            flag[0] = torch.stack(nonfinite).any()
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def zero_grad(self, *args, **kwargs):
        self.optimizer.zero_grad(*args, **kwargs)
        for fsdp in self._fsdp_models:
            fsdp.zero_grad_buffer()

    def __getattr__(self, name):
        # Only reached for names not set on the wrapper: param_groups, state_dict, get_lr, ...
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)
