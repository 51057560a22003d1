"""Defects of released Megatron-FSDP that upstream fixed after megatron-core's last release in our
range, fixed here where the installed copy still has them: megatron-core's own copy and the
standalone megatron-fsdp package. Every target is listed in megatron_muon.upstream.PATCHES;
`megatron_muon.training.uninstall()` undoes them. `apply()` is called by `training.install()`,
`bridge.install(cfg)`, the factory and `standalone.muon_optimizer`, for every optimizer.

One so far, NVIDIA/Megatron-LM issue 6660, fixed upstream by PR 6773 (after 0.19.2): a gradient
buffer whose data-parallel group has one rank (the experts' when expert parallelism spans the
data-parallel ranks, as in DP8/EP8; every buffer at DP=1) is unsharded, so under ZeRO-2/3
(`optim_grads`, `optim_grads_params`) each micro-batch's "reduce" scales the whole accumulated
buffer in place (gradient_reduce_preprocessing): earlier micro-batches are scaled again at every
micro-batch (and with a separate gradient communication dtype, added to themselves). Here such a
buffer accumulates its micro-batches unreduced, as ZeRO-1's does, and is reduced once, at the
grad sync, with an explicit scale: a one-rank reduction carries no premul-sum multiplier.
"""

import dataclasses
import os
import weakref

import torch.distributed as dist

from . import upstream

# Params each pipeline held back since its last grad sync.
_held = weakref.WeakKeyDictionary()


def _reduces_over_one_rank(pipeline, param) -> bool:
    bucket_id = pipeline.buffer.param_to_param_group[param]
    return pipeline.get_fsdp_buffer(bucket_id).data_parallel_group.size() == 1


def _holding_back_one_rank_buffers(reduce_gradients):
    """GradReducePipeline.reduce_gradients, called by the post-backward hooks: params whose
    buffer reduces over one rank are held for the grad sync. (Without overlap_grad_reduce,
    which only ZeRO-1 and no_shard allow, the grad sync reduces every buffer once itself.)"""

    def held_back(self, params, *args, **kwargs):
        params = list(params)
        if self.buffer.ddp_config.overlap_grad_reduce:
            one_rank = {p for p in params if _reduces_over_one_rank(self, p)}
            _held.setdefault(self, set()).update(one_rank)
            params = [p for p in params if p not in one_rank]
        return reduce_gradients(self, params, *args, **kwargs)

    return held_back


def _reducing_held_buffers_first(synchronize_gradient_reduce, reduce_gradients):
    """MegatronFSDP.synchronize_gradient_reduce (finish_grad_sync's first step): the held
    buffers, each holding the sum of its micro-batches' gradients, are scaled once by their
    factor, then reduced through Megatron-FSDP's own path (over one rank, and over DP-Outer under
    HSDP) with no scale of its own and no communication dtype of its own (nothing crosses ranks
    in a one-rank reduction; its closure would add a cast copy to the buffer it came from)."""

    def synchronized(self):
        pipeline = self.grad_reduce_pipeline
        held = _held.pop(pipeline, None)
        if held:
            buckets = {pipeline.buffer.param_to_param_group[p] for p in held}
            buffers = [pipeline.get_fsdp_buffer(bucket_id) for bucket_id in sorted(buckets)]
            factors = [gbuf.gradient_scaling_factor for gbuf in buffers]
            policy = pipeline.buffer.mp_policy
            for gbuf, factor in zip(buffers, factors):
                if factor is not None and factor != 1.0:
                    gbuf.fetch_bucket().data.mul_(factor)
                gbuf.gradient_scaling_factor = None
            pipeline.buffer.mp_policy = dataclasses.replace(policy, grad_comm_dtype=None)
            try:
                reduce_gradients(pipeline, held,
                                 outer_fsdp_group_grad_reduce=self.dist_index.use_hybrid_fsdp)
            finally:
                pipeline.buffer.mp_policy = policy
                for gbuf, factor in zip(buffers, factors):
                    gbuf.gradient_scaling_factor = factor
        return synchronize_gradient_reduce(self)

    return synchronized


def apply() -> list[str]:
    """Apply each fix to each installed copy that has the defect (idempotent); return the copies
    patched, said in one line from the first rank."""
    fixed = []
    for copy in upstream.INSTALLED_MEGATRON_FSDP_COPIES:
        reduce_target, sync_target = (f"{copy}.{target}"
                                      for target in upstream.ONE_RANK_REDUCE_TARGETS)
        if upstream.is_patched(reduce_target) or not upstream.has_one_rank_reduce_defect(copy):
            continue
        reduce_gradients = upstream.current(reduce_target)
        upstream.patch(reduce_target, _holding_back_one_rank_buffers(reduce_gradients))
        upstream.patch(sync_target, _reducing_held_buffers_first(
            upstream.current(sync_target), reduce_gradients))
        fixed.append(copy)
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if fixed and rank == 0:
        print(f"megatron-muon: patched Megatron-FSDP ({', '.join(fixed)}): a gradient buffer "
              f"reduced over one rank (experts at expert parallel = data parallel, or DP=1) is "
              f"reduced once per step at the grad sync, not rescaled at every micro-batch "
              f"(NVIDIA/Megatron-LM#6660, fixed upstream after megatron-core 0.19.2)", flush=True)
    return fixed
