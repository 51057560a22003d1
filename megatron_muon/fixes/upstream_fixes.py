"""Defects of released upstream that upstream fixed, or that megatron-muon fixes, where the
installed version still has them, each decided by reading the installed code or by a cheap probe,
never by a version list. Every target is listed in megatron_muon.compat.upstream.PATCHES;
`megatron_muon.training.uninstall()` undoes them. `apply()` is called by `training.install()`,
`bridge.install(cfg)`, the factory and `standalone.muon_optimizer`, for every optimizer, and says
what it patched in one line each.

1. Megatron-FSDP's one-rank gradient reduce (megatron-core's copy and the standalone package),
   NVIDIA/Megatron-LM issue 6660, fixed upstream by PR 6773 (after 0.19.2): a gradient buffer
   whose data-parallel group has one rank (the experts' when expert parallelism spans the
   data-parallel ranks, as in DP8/EP8; every buffer at DP=1) is unsharded, so under ZeRO-2/3
   (`optim_grads`, `optim_grads_params`) each micro-batch's "reduce" scales the whole accumulated
   buffer in place (gradient_reduce_preprocessing): earlier micro-batches are scaled again at
   every micro-batch (and with a separate gradient communication dtype, added to themselves).
   Here such a buffer accumulates its micro-batches unreduced, as ZeRO-1's does, and is reduced
   once, at the grad sync, with an explicit scale: a one-rank reduction carries no premul-sum
   multiplier.
2. Megatron-FSDP under `average_in_collective` (--ddp-average-in-collective; Megatron-Bridge's
   recipes set it), not reported upstream, in megatron-core 0.19.0-0.19.2's copy and
   megatron-fsdp 0.5-0.6: (a) it computes the experts' scaling factor (expert-DP size / DP size,
   as Megatron DDP) but gradient_reduce_preprocessing then averages without applying it, so
   expert gradients come out DP / expert-DP times Megatron DDP's (2x at W=4, EP=2): here the
   factor is applied before the average, as Megatron DDP applies it; (b) on a model without
   experts it reads the size of an expert group that does not exist, and construction fails:
   here the dense group stands in for it (the experts' factor is then never used).
3. Megatron-FSDP 0.6.1's HFSDP (an outer `optim` strategy: --outer-dp-sharding-strategy optim)
   builds its inner gradient buffer without the data-parallel scaling factor
   (param_and_grad_buffer._create_hfsdp_helper_buffer), so the gradients come out as the sum over
   the data-parallel ranks, not their mean (4x at 2 x 2; with Adam the sweep logged a grad norm
   2.2x Megatron DDP's, and clipped by it): `average_hfsdp_gradients`, called by the factory
   for every optimizer on a Megatron-FSDP model, gives that buffer the main buffer's factor
   (found missing on the model itself, so a no-op once upstream sets it). Not reported upstream.
4. megatron-core 0.19's TensorParallelAdaptiveMuon (`--optimizer adaptive_muon` on Megatron DDP)
   runs TensorParallelMuon's constructor only, so emerging-optimizers' AdaptiveMuon.step finds no
   `scale_mode` and its first step raises (0.20 sets it); and TensorParallelMuon's orthogonalize
   applies Muon's scale, which AdaptiveMuon applies after the second moment (0.19 and 0.20).
   Here Newton-Schulz runs unscaled (TP-aware, as TensorParallelMuon runs it) and the scale comes
   once, after the second moment, by the whole (TP-unsharded) matrix's shape as
   TensorParallelMuon's scale reads it.
5. megatron-core's wheel ships the dataset helper built and no Makefile, so initialize_megatron's
   `compile_helpers()` (make in that folder) exits: `dataset_helper_is_prebuilt()` says where,
   and the installs patch it with `skip_dataset_helper_build` there (a source checkout builds).
"""

import dataclasses
import functools
import importlib
import importlib.machinery
import inspect
import os
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz_tp

from ..compat import tensor_parallel, upstream

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


def _scaled_before_the_average(gradient_reduce_preprocessing):
    """gradient_reduce_preprocessing: under average_in_collective, the gradient scaled by the
    factor first (Megatron DDP's start_grad_sync multiplies by gradient_scaling_factor, then
    reduces with AVG); Megatron-FSDP's own returns AVG and drops it."""

    def preprocessed(grad_data, scaling_factor, ddp_config, *args, **kwargs):
        if ddp_config.average_in_collective and scaling_factor not in (None, 1.0):
            grad_data.mul_(scaling_factor)
        return gradient_reduce_preprocessing(grad_data, scaling_factor, ddp_config, *args, **kwargs)

    return preprocessed


def _dense_group_for_missing_experts(init_fsdp_param_and_grad_buffer):
    """MegatronFSDP._init_fsdp_param_and_grad_buffer: on a model without experts (no expert
    data-parallel group) under average_in_collective, the dense group answers for the expert
    one while the buffers are set up; the experts' factor it yields is never used."""

    def initialized(self):
        index = self.dist_index
        if not self.ddp_config.average_in_collective or \
                index.get_dp_group(is_expert_parallel=True) is not None:
            return init_fsdp_param_and_grad_buffer(self)
        dense_group = index.get_dp_group
        index.get_dp_group = lambda is_expert_parallel=False: dense_group()
        try:
            return init_fsdp_param_and_grad_buffer(self)
        finally:
            del index.get_dp_group

    return initialized


def average_hfsdp_gradients(fsdp_modules) -> None:
    """Give each HFSDP inner gradient buffer without a scaling factor its main buffer's (3.)."""
    for module in fsdp_modules:
        for group in module.param_and_grad_buffer.parameter_groups:
            helper = getattr(group, "hfsdp_helper_gbuf", None)
            if helper is not None and helper.gradient_scaling_factor is None:
                helper.gradient_scaling_factor = group.main_grad_buffer.gradient_scaling_factor


def unscaled_orthogonalize_fn(num_ns_steps: int, coefficient_type: str, tp_mode: str):
    """TensorParallelMuon's scaled_orthogonalize_fn without Muon's scale (its own
    newton_schulz_tp call), for AdaptiveMuon's step, which scales after the second moment."""
    tp_mode = "duplicated" if tp_mode == "blockwise" else tp_mode

    def unscaled(grad, tp_group, partition_dim=None):
        return newton_schulz_tp(grad, steps=num_ns_steps, coefficient_type=coefficient_type,
                                tp_group=tp_group, partition_dim=partition_dim, tp_mode=tp_mode)

    return unscaled


def scale_after_second_moment(optimizer, settings: dict) -> None:
    """What AdaptiveMuon's constructor sets for its step (`scale_mode`, `extra_scale_factor`:
    the scale it applies after the second moment), and Newton-Schulz without the scale; from
    TensorParallelMuon's `settings` (megatron-core's optimizer, or ours)."""
    optimizer.scale_mode = settings["scale_mode"]
    optimizer.extra_scale_factor = settings["extra_scale_factor"]
    optimizer.scaled_orthogonalize_fn = unscaled_orthogonalize_fn(
        settings["num_ns_steps"], settings["coefficient_type"], settings["tp_mode"])


def _adaptive_muon_scaled_once(init):
    """TensorParallelAdaptiveMuon.__init__: megatron-core's, then what AdaptiveMuon's constructor
    sets for its step (`scale_mode`, `extra_scale_factor`), and Newton-Schulz without the scale
    (TensorParallelMuon's own call, TP-aware, minus the scale it applies after)."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        init(*bound.args, **bound.kwargs)
        scale_after_second_moment(self, bound.arguments)

    return __init__


def whole_shape(optimizer, p, shape) -> tuple[int, int]:
    """The shape of the whole matrix a TP shard of `shape` belongs to, as TensorParallelMuon's
    scale reads it (its orthogonalize's TP group and partition dim); `p`: the param's tags."""
    size = list(shape[-2:])
    partition = tensor_parallel.orthogonalize_partition(optimizer.tp_mode,
                                                        optimizer.pg_collection, p)
    if partition is not None:
        partition_dim, tp_group = partition
        size[partition_dim] *= tp_group.size()
    return tuple(size)


def _noting_the_whole_shape(orthogonalize):
    """TensorParallelAdaptiveMuon.orthogonalize, noting the whole matrix's shape for the Muon
    scale AdaptiveMuon.step applies next (it passes the TP shard's)."""

    @functools.wraps(orthogonalize)
    def noted(self, p, grad, **kwargs):
        self.muon_scale_shape = whole_shape(self, p, grad.shape)
        return orthogonalize(self, p, grad, **kwargs)

    return noted


def _scaled_by_the_whole_shape(apply_muon_scale):
    @functools.wraps(apply_muon_scale)
    def scaled(self, update, size_out, size_in):
        shape = getattr(self, "muon_scale_shape", (size_out, size_in))
        return apply_muon_scale(self, update, *shape)

    return scaled


def drops_expert_scale_under_average(copy: str) -> bool:
    """Whether a Megatron-FSDP copy's gradient_reduce_preprocessing drops the scaling factor
    under average_in_collective (2.), by a probe: with the flag and a factor of 0.5 it returns
    ReduceOp.AVG and leaves the gradient as it was. Megatron DDP scales the gradient by the
    factor first (the experts' expert-DP / DP), then averages."""
    buffers = importlib.import_module(f"{copy}.param_and_grad_buffer")
    config = importlib.import_module(f"{copy}.distributed_data_parallel_config")
    grad = torch.ones(1, device="cpu")
    reduce_op = buffers.gradient_reduce_preprocessing(
        grad, 0.5, config.DistributedDataParallelConfig(average_in_collective=True))
    return reduce_op == torch.distributed.ReduceOp.AVG and grad.item() == 1.0


def adaptive_muon_defects() -> list[str]:
    """How megatron-core's TensorParallelAdaptiveMuon fails to step AdaptiveMuon's algorithm
    (4.), by a probe on one 2x2 matrix: its step reads `scale_mode`, which only AdaptiveMuon's
    constructor sets (0.19 runs TensorParallelMuon's alone); its orthogonalize applies Muon's
    scale (here an extra factor of 2), which AdaptiveMuon applies after the second moment (0.19
    and 0.20). Empty where it steps AdaptiveMuon's algorithm."""
    from megatron.core.optimizer.emerging_optimizers import TensorParallelAdaptiveMuon

    class Probe(TensorParallelAdaptiveMuon):
        """A class of its own: torch.optim wraps the step of an optimizer's class when it builds
        the first instance, which should not be megatron-core's class here."""

    identity = torch.eye(2, device="cpu")  # a probe of the code, wherever the run is
    p = torch.nn.Parameter(identity.clone())
    probe = Probe([p], extra_scale_factor=2.0, num_ns_steps=5)
    defects = [] if hasattr(probe, "scale_mode") else [
        "it failed in its first step, scale_mode unset"]
    with torch.no_grad():
        unscaled = upstream.newton_schulz(identity, steps=5)
        if not torch.equal(probe.orthogonalize(p, identity), unscaled):
            defects.append("it scaled in orthogonalize too")
    return defects


def _fix_one_rank_reduce() -> list[str]:
    """The Megatron-FSDP copies patched now."""
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
    return fixed


def _fix_average_in_collective() -> list[str]:
    """The Megatron-FSDP copies patched now. The scale's target is the CPU layer's too
    (megatron_muon.cpu.torch_compat): the probe, not is_patched, tells whether the fix is in."""
    fixed = []
    for copy in upstream.INSTALLED_MEGATRON_FSDP_COPIES:
        scale, dense = (f"{copy}.{target}" for target in (upstream.AVERAGE_SCALE_TARGET,
                                                          upstream.AVERAGE_DENSE_TARGET))
        patched = False
        if drops_expert_scale_under_average(copy):
            upstream.patch(scale, _scaled_before_the_average(upstream.current(scale)))
            patched = True
        if not upstream.is_patched(dense) and upstream.needs_an_expert_group_to_average(copy):
            upstream.patch(dense, _dense_group_for_missing_experts(upstream.current(dense)))
            patched = True
        if patched:
            fixed.append(copy)
    return fixed


def _fix_adaptive_muon() -> list[str]:
    """The defects of TensorParallelAdaptiveMuon patched now (adaptive_muon_defects)."""
    init, orthogonalize, scale = upstream.ADAPTIVE_MUON_TARGETS
    defects = [] if upstream.is_patched(init) else adaptive_muon_defects()
    if defects:
        for target, fixed in ((init, _adaptive_muon_scaled_once),
                              (orthogonalize, _noting_the_whole_shape),
                              (scale, _scaled_by_the_whole_shape)):
            upstream.patch(target, fixed(upstream.current(target)))
    return defects


def apply() -> None:
    """Apply each fix where the installed code has the defect (idempotent); one line each, from
    the first rank."""
    said = []
    copies = _fix_one_rank_reduce()
    if copies:
        said.append(f"patched Megatron-FSDP ({', '.join(copies)}): a gradient buffer reduced over "
                    f"one rank (experts at expert parallel = data parallel, or DP=1) is reduced "
                    f"once per step at the grad sync, not rescaled at every micro-batch "
                    f"(NVIDIA/Megatron-LM#6660, fixed upstream after megatron-core 0.19.2)")
    copies = _fix_average_in_collective()
    if copies:
        said.append(f"patched Megatron-FSDP ({', '.join(copies)}) under "
                    f"--ddp-average-in-collective: the experts' gradient scale (expert-DP / DP) "
                    f"applied before the average, as Megatron DDP does, and a model without "
                    f"experts built (not reported upstream)")
    defects = _fix_adaptive_muon()
    if defects:
        said.append(f"patched megatron-core's TensorParallelAdaptiveMuon (--optimizer "
                    f"adaptive_muon on Megatron DDP): it steps emerging-optimizers' AdaptiveMuon, "
                    f"Muon's scale once after the second moment ({'; '.join(defects)})")
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    for line in said if rank == 0 else ():
        print(f"megatron-muon: {line}", flush=True)


def dataset_helper_is_prebuilt(datasets_dir: Path | None = None) -> bool:
    """The wheel's layout: megatron.core.datasets (or `datasets_dir`) holds the built helper and
    no Makefile."""
    if datasets_dir is None:
        datasets_dir = Path(importlib.import_module("megatron.core.datasets.utils").__file__).parent
    built = any((datasets_dir / f"helpers_cpp{suffix}").exists()
                for suffix in importlib.machinery.EXTENSION_SUFFIXES)
    return built and not (datasets_dir / "Makefile").exists()


def skip_dataset_helper_build():
    """Replaces compile_helpers where the helper is prebuilt (dataset_helper_is_prebuilt)."""


def skip_dataset_helper_build_at(compile_helpers: str) -> None:
    """Where the helper is prebuilt (dataset_helper_is_prebuilt), patch `compile_helpers`, the
    dotted name a training loop calls it by (megatron.training's initialize imports it from its
    module when it runs; Bridge's initialize holds its own copy), with skip_dataset_helper_build:
    a source checkout still builds, and a failed build still stops the run."""
    if dataset_helper_is_prebuilt():
        upstream.patch(compile_helpers, skip_dataset_helper_build)
