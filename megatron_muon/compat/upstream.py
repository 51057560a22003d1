"""Everything megatron-muon takes from upstream beyond its public API, and every patch it applies.

Private names (torch's, megatron-core's, emerging_optimizers') may be renamed by any release. Each
one is resolved here, once, when megatron_muon is imported: where the installed versions lack some,
the import raises one ImportError naming each package, its installed version, the missing names and
the versions this release supports (compat/versions.py), rather than an AttributeError deep inside
a run. The rest of the package uses the names below; this is the one module of megatron_muon that
names private upstream code (tests/compat/test_upstream.py checks it).

The patches that `megatron_muon.training.install()`, `megatron_muon.bridge.install()` and the CPU
layer (cpu/) apply to torch, megatron.training, Megatron-FSDP and Megatron-Bridge are
listed in PATCHES, each target checked here too (Bridge's when megatron_muon.bridge is imported);
they are applied only through `patch`, `temporarily` and `enter_torch_function_mode` (a
compat/patching.py Patcher over PATCHES), which refuse an unlisted target, and `undo_patches()`
restores what they replaced.
"""

import argparse
import importlib
import importlib.util
import inspect
import sys
import types
from collections.abc import Callable
from typing import Any

from .patching import Patcher, resolve
from .patching import borrow as _borrow
from .patching import borrow_first as _borrow_first
from .patching import missing as _missing
from .versions import cannot_import, unsupported

# Patched only where installed: the standalone Megatron-FSDP (megatron-core uses its own copy).
_OPTIONAL_MODULES = ("megatron_fsdp",)
# Resolved when megatron_muon.bridge is imported, not before: Bridge is an optional extra, and
# importing it without TransformerEngine needs megatron_muon.cpu.torch_compat's stand-ins first.
_BRIDGE = "megatron.bridge."


# torch
flatten_mesh = _borrow(
    "torch.distributed.device_mesh.DeviceMesh._flatten",
    "one process group over a param's several data-parallel mesh dims (HSDP), from the mesh "
    "Megatron-FSDP built, as Megatron-FSDP gets its own")
TorchDispatchMode = _borrow(
    "torch.utils._python_dispatch.TorchDispatchMode",
    "observe.collectives.observed sees every collective a step issues (at its c10d op) without "
    "patching torch.distributed (torch's own CommDebugMode is built on it)")
_borrow("torch.autograd._KinetoEvent.nbytes",
        "the profiler's allocation records ([memory] events, with their bytes and times), which "
        "memory.AllocationTracker reads on CPU from profile.kineto_results")
is_mkldnn_bf16_supported = _borrow(
    "torch.ops.mkldnn._is_mkldnn_bf16_supported",
    "whether this CPU has native bf16 matmuls (else Newton-Schulz runs in fp32 on CPU)")

# megatron-core
# Its Muon family is defined only where its module imported emerging_optimizers: on any
# ImportError (emerging-optimizers 0.5 moved SOAP, which it imports, to legacy_soap) it sets
# this flag and derives them from object instead.
if not resolve("megatron.core.optimizer.emerging_optimizers.HAVE_EMERGING_OPTIMIZERS"):
    raise cannot_import("megatron-core", "emerging-optimizers",
                        "megatron.core.optimizer.emerging_optimizers.HAVE_EMERGING_OPTIMIZERS "
                        "is False: its Muon optimizers, which megatron-muon steps, are undefined")
get_param_groups = _borrow(
    "megatron.core.optimizer._get_param_groups",
    "the param groups (overrides, lr and weight-decay multipliers) megatron-core's factory builds")
get_megatron_optimizer_based_on_param_groups = _borrow(
    "megatron.core.optimizer._get_megatron_optimizer_based_on_param_groups",
    "builds the scalar optimizer (Adam) over Muon's non-matrix params as megatron-core does")
get_qkv_split_shapes = _borrow(
    "megatron.core.optimizer.emerging_optimizers._get_qkv_split_shapes",
    "the q/k/v row counts of a fused QKV weight, as megatron-core's Muon splits it")
megatron_fsdp_parameter_groups = _borrow(
    "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer._get_parameter_groups",
    "Megatron-FSDP's buckets of a model's params, which the scale estimate (estimate) shards as "
    "Megatron-FSDP does")
EMERGING_OPTIMIZERS = _borrow(
    "megatron.core.optimizer.emerging_optimizers._EMERGING_OPTIMIZERS",
    "megatron-core's Muon family: its param overrides (replaced by ours for Megatron-FSDP's main "
    "weights) and its reading of OptimizerConfig into each optimizer's arguments")
eopt_init_state_fn = _borrow(
    "megatron.core.optimizer.emerging_optimizers._eopt_init_state_fn",
    "initializes Muon's state as megatron-core does (checkpoints before the first step)")
is_muon_excluded = _borrow_first(
    ("megatron.core.optimizer.emerging_optimizers._is_muon_excluded",  # main: use_muon=False too
     "megatron.core.optimizer.emerging_optimizers._is_nonlinear_or_embedding"),  # 0.19
    "megatron-core's rule for which params Muon leaves to the scalar optimizer")

# emerging_optimizers
COEFFICIENT_SETS = _borrow(
    "emerging_optimizers.orthogonalized_optimizers.muon_utils._COEFFICIENT_SETS",
    "the Newton-Schulz coefficient types, to refuse an unknown one at construction")
apply_weight_decay_inplace = _borrow(
    "emerging_optimizers.orthogonalized_optimizers.OrthogonalizedOptimizer."
    "_apply_weight_decay_inplace",
    "every weight-decay method of OrthogonalizedOptimizer.step, on each rank's rows")

apply_moment2_normalization = _borrow(
    "emerging_optimizers.orthogonalized_optimizers.adaptive_muon.AdaptiveMuon."
    "_apply_moment2_normalization",
    "AdaptiveMuon's second moment (AdaMuon, NorMuon, NAMO) on a matrix or on a rank's rows of it, "
    "for --optimizer adaptive_muon on Megatron-FSDP")
apply_muon_scale = _borrow(
    "emerging_optimizers.orthogonalized_optimizers.adaptive_muon.AdaptiveMuon._apply_muon_scale",
    "AdaptiveMuon's Muon scale after the second moment, for --optimizer adaptive_muon")

newton_schulz = _borrow(
    "emerging_optimizers.orthogonalized_optimizers.muon_utils.newton_schulz",
    "Newton-Schulz with the Triton SYRK kernel (use_syrk), for --muon-use-syrk where "
    "megatron-core's TensorParallelMuon cannot pass it on")
newton_schulz_tp = _borrow(
    "emerging_optimizers.orthogonalized_optimizers.muon_utils.newton_schulz_tp",
    "Newton-Schulz split over a team of ranks in its \"distributed\" form, as megatron-core's "
    "TensorParallelMuon runs it over a TP group, for --muon-max-team-size")
get_muon_scale_factor = _borrow(
    "emerging_optimizers.orthogonalized_optimizers.get_muon_scale_factor",
    "Muon's scale modes, applied after the SYRK or a team's Newton-Schulz as TensorParallelMuon "
    "applies them")


# Megatron-FSDP: megatron-core's own copy, and the standalone package (optional).
MEGATRON_FSDP_COPIES = ("megatron.core.distributed.fsdp.src.megatron_fsdp", "megatron_fsdp")
INSTALLED_MEGATRON_FSDP_COPIES = tuple(copy for copy in MEGATRON_FSDP_COPIES
                                       if importlib.util.find_spec(copy.partition(".")[0]))

# megatron_fsdp's fully_shard_optimizer, in megatron-core's copy and the standalone package where
# installed: it steps the optimizer once with zero gradients to create Adam's state, then replaces
# its step and zero_grad with wrappers that sync the grads before and install the weights after.
_FULLY_SHARD = [f"{copy}.fully_shard" for copy in INSTALLED_MEGATRON_FSDP_COPIES]
_FULLY_SHARD_WRAPPERS = ("megatron_fsdp_optimizer_step", "megatron_fsdp_optimizer_zero_grad")


def _nested_code(function, name: str) -> types.CodeType:
    """The code object of the function `function` defines under `name`."""
    for constant in inspect.unwrap(function).__code__.co_consts:
        if isinstance(constant, types.CodeType) and constant.co_name == name:
            return constant
    raise AttributeError(name)


_fully_shard_optimizer_codes = {inspect.unwrap(f).__code__ for f in (_borrow(
    f"{module}.fully_shard_optimizer",
    "its construction step (zero gradients, to create Adam's state) is recognised and skipped: "
    "ours creates its own state") for module in _FULLY_SHARD) if f}
_fully_shard_wrapper_codes = {code for code in (_borrow(
    f"{module}.fully_shard_optimizer.<locals>.{name}",
    "its step and zero_grad wrappers are not installed on ours, which syncs and installs itself, "
    "once", get=lambda: _nested_code(resolve(f"{module}.fully_shard_optimizer"), name))
    for module in _FULLY_SHARD for name in _FULLY_SHARD_WRAPPERS) if code}


def is_fully_shard_optimizer_wrapper(method) -> bool:
    """Whether `method` is the step or zero_grad wrapper megatron_fsdp's fully_shard_optimizer
    puts on an optimizer."""
    return getattr(getattr(method, "__func__", method), "__code__", None) in \
        _fully_shard_wrapper_codes


def called_by_fully_shard_optimizer() -> bool:
    """Whether the function calling this one was called by megatron_fsdp's fully_shard_optimizer
    itself (its construction step)."""
    return sys._getframe(2).f_code in _fully_shard_optimizer_codes


# The gather inside backward (chain.backward_gather): where Megatron-FSDP reduces a bucket group
# (each param's gradient shard final after the last micro-batch's), and the clip it replays.
BUCKET_REDUCE_TARGET = "param_and_grad_buffer.GradReducePipeline._bucket_group_gradient_reduce"
CLIP_TARGET = "megatron.core.optimizer.optimizer.clip_grad_by_total_norm_fp32"
clip_grad_by_total_norm_fp32 = _borrow(
    "megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32",
    "an owner clips the whole gradient it gathered inside backward with megatron-core's own clip")


def has_one_rank_reduce_defect(copy: str) -> bool:
    """Whether a Megatron-FSDP copy (MEGATRON_FSDP_COPIES) rescales a gradient buffer reduced
    over one rank at every micro-batch, read from its code (megatron_muon.fixes.upstream_fixes):
    upstream's fix (NVIDIA/Megatron-LM#6773) decides the reduce schedule per buffer
    (MegatronFSDP._reduces_grad_every_backward) and tells gradient_reduce_preprocessing the
    group's size; a copy with neither has the defect."""
    fsdp = importlib.import_module(f"{copy}.megatron_fsdp").MegatronFSDP
    preprocessing = importlib.import_module(f"{copy}.param_and_grad_buffer"
                                            ).gradient_reduce_preprocessing
    return not (hasattr(fsdp, "_reduces_grad_every_backward")
                or "group_size" in inspect.signature(preprocessing).parameters)


def needs_an_expert_group_to_average(copy: str) -> bool:
    """Whether a Megatron-FSDP copy's MegatronFSDP._init_fsdp_param_and_grad_buffer reads the
    expert data-parallel group's size under average_in_collective whether or not the model has
    experts (fixes.upstream_fixes), read from its code: on a dense model that group is
    None, and construction fails (AttributeError: 'NoneType' object has no attribute 'size')."""
    fsdp = importlib.import_module(f"{copy}.megatron_fsdp").MegatronFSDP
    return "get_dp_group(is_expert_parallel=True).size()" in inspect.getsource(
        fsdp._init_fsdp_param_and_grad_buffer)


# Python
_borrow("argparse.ArgumentParser._actions",
        "the parser's arguments, to add 'highest' to Megatron's --muon-fp32-matmul-prec choices",
        get=lambda: argparse.ArgumentParser()._actions)


_borrow("torch._ops.OpOverload._schema",
        "the argument names of a c10d op, to read its process group and tensors by name in "
        "observe.collectives.observed",
        get=lambda: resolve("torch.ops.c10d.allreduce_.default")._schema)


def op_argument_names(op) -> list[str]:
    """The names of a dispatcher op's arguments, in order (OpOverload has no public way)."""
    return [argument.name for argument in op._schema.arguments]


def parser_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The arguments a parser has (argparse has no public way to change one once added)."""
    return parser._actions


def profiler_events(prof) -> list:
    """A finished torch.profiler.profile's raw events (kineto's), allocation records included
    (the public EventList folds them into the ops that allocated)."""
    return prof.profiler.kineto_results.events()


def mesh_shard_order(mesh) -> Any:
    """The order in which Megatron-FSDP shards a mesh's dims: the attribute its
    param_and_grad_buffer sets on the mesh and its uneven_dtensor reads, None where unset."""
    return getattr(mesh, "_shard_order", None)


# Megatron-FSDP's one-rank gradient reduce (fixes.upstream_fixes), in each copy that has
# the defect: the per-micro-batch reduce that holds such buffers back, and the grad sync that
# reduces them once.
ONE_RANK_REDUCE_TARGETS = ("param_and_grad_buffer.GradReducePipeline.reduce_gradients",
                           "megatron_fsdp.MegatronFSDP.synchronize_gradient_reduce")
# Megatron-FSDP under average_in_collective (fixes.upstream_fixes), in each copy that has
# the defect: the gradient scaling its reduce skips, and the buffers' set-up on a dense model.
AVERAGE_SCALE_TARGET = "param_and_grad_buffer.gradient_reduce_preprocessing"
AVERAGE_DENSE_TARGET = "megatron_fsdp.MegatronFSDP._init_fsdp_param_and_grad_buffer"
# megatron-core's TensorParallelAdaptiveMuon (megatron_muon.fixes.upstream_fixes), where it has the
# defect: its constructor, its orthogonalize (noting the whole matrix's shape) and its Muon scale.
ADAPTIVE_MUON = "megatron.core.optimizer.emerging_optimizers.TensorParallelAdaptiveMuon"
ADAPTIVE_MUON_TARGETS = tuple(f"{ADAPTIVE_MUON}.{name}"
                              for name in ("__init__", "orthogonalize", "_apply_muon_scale"))

# Every attribute the patches may replace, and why.
PATCHES = {
    # CPU layer, Megatron-FSDP (megatron_muon.cpu.torch_compat.apply_cpu_compat); inert with CUDA.
    "torch.cuda.Stream": "Megatron-FSDP schedules on CUDA streams: no-ops on CPU",
    "torch.cuda.Event": "Megatron-FSDP orders its collectives with CUDA events: no-ops on CPU",
    "torch.cuda.current_stream": "a no-op stream on CPU",
    "torch.cuda.stream": "a no-op stream context on CPU",
    "torch.cuda.synchronize": "nothing to wait for on CPU",
    "torch.cuda.empty_cache": "no CUDA cache on CPU",
    "torch.cuda.current_device": "device 0 on CPU",
    "torch.Tensor.cuda": "Megatron-FSDP's validate_uneven_dtensor moves a check tensor to CUDA",
    "torch.cuda.device_count": "while Megatron builds its model-parallel groups: it does so only "
                               "when it sees a GPU (temporarily)",
    **{f"torch.distributed.{name}": "gloo's reduce-scatter sums under ReduceOp.AVG (torch 2.8): "
                                    "the sum divided by the group's size, as NCCL averages"
       for name in ("reduce_scatter_tensor", "reduce_scatter")},
    "torch.distributed.all_gather_into_tensor": "synchronous inside Megatron-FSDP's asynchronous "
                                                "coalesced block on CPU (temporarily)",
    **{f"{fsdp}.param_and_grad_buffer.{name}": why
       for fsdp in MEGATRON_FSDP_COPIES
       for name, why in (
           ("_coalescing_manager",
            "gloo's coalesced reduce-scatter corrupted the heap: one collective at a time"),
           ("gradient_reduce_preprocessing",
            "gloo has no PREMUL_SUM: scale, then sum (CPU layer); under average_in_collective, "
            "the scaling factor before the average, as Megatron DDP applies it (upstream fix, "
            "not reported upstream)"))},
    "megatron.core.transformer.dot_product_attention.DotProductAttention.__init__":
        "megatron-core's local attention (CPU's) takes MLA's k_channels/v_channels",
    "megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__":
        "megatron-core's torch norms (CPU's local spec) under --sequence-parallel: their weights "
        "marked sequence_parallel, as TransformerEngine's and apex's norms mark theirs",
    "megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu":
        "the alltoall MoE dispatcher's split sizes as numpy, as on CUDA: gloo's "
        "all_to_all_single refuses tensors",
    # Upstream's fix of released Megatron-FSDP (fixes.upstream_fixes), where it is missing.
    **{f"{fsdp}.{target}": "NVIDIA/Megatron-LM#6660, fixed by #6773 after megatron-core 0.19.2: "
                           "a gradient buffer reduced over one rank is rescaled at every "
                           "micro-batch under ZeRO-2/3; held back, then reduced once at the grad "
                           "sync, explicitly scaled"
       for fsdp in MEGATRON_FSDP_COPIES for target in ONE_RANK_REDUCE_TARGETS},
    **{f"{fsdp}.{AVERAGE_DENSE_TARGET}": "under average_in_collective a model without experts "
                                         "has no expert data-parallel group, whose size Megatron-"
                                         "FSDP reads for the experts' factor: the dense group's "
                                         "then (not reported upstream)"
       for fsdp in MEGATRON_FSDP_COPIES},
    # The gather inside backward (chain.backward_gather), while a chain holds one.
    **{f"{fsdp}.{BUCKET_REDUCE_TARGET}": "each bucket group's reduce issued: its params' rows "
                                         "start toward their Muon owners"
       for fsdp in MEGATRON_FSDP_COPIES},
    CLIP_TARGET: "the clip's arguments recorded per param, for an owner to clip the whole "
                 "gradient it gathered as each holder's rows were clipped",
    # megatron-core's TensorParallelAdaptiveMuon made to step AdaptiveMuon (upstream_fixes).
    **{target: "megatron-core's TensorParallelAdaptiveMuon scales in orthogonalize, and 0.19's "
               "fails in its first step (no scale_mode): Newton-Schulz unscaled, Muon's scale "
               "once after the second moment, by the whole (TP-unsharded) matrix's shape"
       for target in ADAPTIVE_MUON_TARGETS},
    # CPU layer, megatron.training (cpu.training_compat.apply_megatron_training_compat).
    "torch.cuda.get_rng_state": "Megatron saves the CUDA RNG state every step: the CPU one",
    "torch.cuda.set_rng_state": "no CUDA generator to restore on CPU",
    "torch.overrides.TorchFunctionMode": "a mode that creates on CPU what Megatron asks on CUDA",
    "torch.autograd._engine_run_backward": "that mode inside autograd's engine, for backward's "
                                           "tensors",
    "megatron.training.training.build_train_valid_test_data_iterators":
        "keeps the CPU generator dropout draws from as it was, so a resumed run continues it",
    "megatron.training.arguments.get_device_arch_version": "no GPU architecture on CPU",
    "megatron.training.training.initialize_megatron": "with allow_no_cuda",
    "megatron.training.initialize._initialize_distributed": "gloo, and model-parallel groups "
                                                            "without a GPU",
    # install() (megatron_muon.training).
    "megatron.core.datasets.utils.compile_helpers": "the wheel's helper is prebuilt and it ships "
                                                    "no Makefile",
    "megatron.training.arguments.add_megatron_arguments": "--muon-fp32-matmul-prec highest in "
                                                          "every parse",
    "megatron.training.arguments.validate_args": "accepts Muon on Megatron-FSDP, after "
                                                 "validate_muon_args",
    "megatron.training.arguments._print_args": "prints --optimizer muon while validate_args "
                                               "validates it as Adam (temporarily)",
    "megatron.training.checkpointing._load_base_checkpoint": "names a checkpoint without "
                                                             "optimizer state",
    "megatron.training.training.save_checkpoint": "records each file's checksum after a save",
    "megatron.training.training.load_checkpoint": "verifies the checksums before a load",
    "megatron.training.training.clip_qk": "the optimizer's step has clipped: log only",
    "megatron.training.training.training_log": "logs the max attention logit, our step's timers "
                                               "and scalars (the demo: exact values too)",
    "megatron.training.training.get_megatron_optimizer": "megatron_muon's factory",
    # Megatron-Bridge (megatron_muon.bridge.install, and its CPU layer).
    "builtins.__import__": "without CUDA, placeholders for the GPU-only packages Bridge's modules "
                           "import unconditionally (cpu.training_compat.GPU_ONLY_IMPORTS)",
    "megatron.bridge.training.setup.initialize_megatron": "with allow_no_cuda (CPU)",
    "megatron.bridge.training.initialize._set_random_seed": "then a CPU RNG tracker (CPU)",
    "megatron.bridge.training.initialize.compile_helpers": "the wheel's helper is prebuilt and it "
                                                           "ships no Makefile",
    "megatron.bridge.training.train.clip_qk": "the optimizer's step has clipped: log only",
    "megatron.bridge.training.train.training_log": "then our step's timers and scalars",
    "megatron.bridge.training.checkpointing._load_base_checkpoint": "loads a Megatron DDP "
                                                                    "checkpoint into Muon on FSDP",
}
_TORCH_FUNCTION_MODE = "torch.overrides.TorchFunctionMode"


def _check_patch_targets(wanted: Callable[[str], bool]) -> None:
    for target, why in PATCHES.items():
        optional = target.split(".")[0] in _OPTIONAL_MODULES
        if wanted(target) and (not optional or importlib.util.find_spec(target.split(".")[0])):
            _borrow(target, "patched: " + why)


def _raise_if_missing() -> None:
    if _missing:
        raise unsupported(_missing)


# Megatron-Bridge's, resolved by import_bridge().
resolve_checkpoint_iteration = None
DIRECT_ITERATION_DIR = None


def import_bridge() -> None:
    """What megatron_muon.bridge takes from Megatron-Bridge, its patch targets and private names,
    checked as importing megatron_muon checks the rest."""
    global resolve_checkpoint_iteration, DIRECT_ITERATION_DIR
    _check_patch_targets(lambda target: target.startswith(_BRIDGE))
    resolve_checkpoint_iteration = _borrow(
        "megatron.bridge.training.checkpointing._resolve_checkpoint_iteration",
        "which checkpoint Bridge's load reads (its own choice), to verify its checksums first")
    DIRECT_ITERATION_DIR = _borrow(
        "megatron.bridge.training.checkpointing._DIRECT_ITERATION_DIR_SENTINEL",
        "what that choice returns when cfg.checkpoint.load is an iteration's directory")
    _raise_if_missing()


_check_patch_targets(lambda target: not target.startswith(_BRIDGE))
_raise_if_missing()


# The patches, applied only through these, which refuse a target PATCHES does not list.
_patcher = Patcher(PATCHES, "megatron_muon.compat.upstream.PATCHES", _TORCH_FUNCTION_MODE)
current, patch, is_patched = _patcher.current, _patcher.patch, _patcher.is_patched
temporarily, enter_torch_function_mode = _patcher.temporarily, _patcher.enter_torch_function_mode
undo_patches = _patcher.undo
