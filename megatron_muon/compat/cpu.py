"""Run Megatron-FSDP and megatron-core on a machine without CUDA (CPU, gloo).

Megatron-FSDP schedules its collectives on CUDA streams and events; on CPU every collective is
synchronous, so that bookkeeping can be a no-op (apply_cpu_compat). megatron.training's pretrain()
further asks for CUDA tensors, RNG states and devices (apply_megatron_training_compat). Nothing
here runs when CUDA is available; nor does the probe for emulated bf16 matmuls
(bf16_matmul_is_emulated), which chooses the Newton-Schulz precision of the demo and benchmarks.
Every patch goes through megatron_muon.compat.upstream, which lists it and can undo it.
"""

import atexit
import contextlib
import dataclasses
import datetime
import functools
import importlib
import math
import time

import torch

from . import upstream


def _complete(*args, **kwargs):
    """A CUDA event or stream operation on CPU, where every operation is complete on return."""


class _Event:
    __init__ = record = wait = synchronize = _complete

    def query(self):
        return True


class _Stream:
    __init__ = wait_stream = wait_event = synchronize = _complete

    def record_event(self, *args, **kwargs):
        return _Event()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Done:
    """The work of a block whose collectives have all completed."""

    def wait(self):
        pass


@contextlib.contextmanager
def _one_by_one(group=None, device=None, async_ops=False):
    """Replaces torch's _coalescing_manager in Megatron-FSDP: the block's collectives run one by
    one, each complete when it returns. gloo's coalesced reduce-scatter, which Megatron-FSDP
    runs in place in backward, killed ranks with heap corruption (seen at W=3 and W=4). The one
    asynchronous block, the parameter all-gather prefetch (always on under ZeRO-3), left gathers
    running after the step, into buckets that later steps or a new model reuse or free: ranks
    hung in the next collective or died in backward's all-gather. On CPU overlap gains nothing."""
    if not async_ops:
        yield None
        return
    all_gather = torch.distributed.all_gather_into_tensor

    def all_gather_now(*args, **kwargs):
        return all_gather(*args, **{**kwargs, "async_op": False})

    with upstream.temporarily('torch.distributed.all_gather_into_tensor', all_gather_now):
        yield _Done()


def _reduce_without_premul_sum(gradient_reduce_preprocessing, grad_data, scaling_factor,
                               ddp_config):
    """gloo has no PREMUL_SUM, which Megatron-FSDP's default gradient_reduce_div_fusion reduces
    with: scale the gradients first and sum, as Megatron-FSDP does with the fusion off."""
    ddp_config = dataclasses.replace(ddp_config, gradient_reduce_div_fusion=False)
    return gradient_reduce_preprocessing(grad_data, scaling_factor, ddp_config)


def _averaging_as_nccl_does(reduce_scatter):
    """torch.distributed.reduce_scatter_tensor (or reduce_scatter): NCCL averages under
    ReduceOp.AVG, gloo's reduce-scatter sums (torch 2.8: 1 and 2 reduce-scattered give 3.0;
    all_reduce gives 1.5), so every Megatron-FSDP run with --ddp-average-in-collective trained on
    gradients W times too large on CPU. On a gloo group: the sum, divided by the group's size."""

    def reduce_scattered(output, input, op=torch.distributed.ReduceOp.SUM, group=None,
                         async_op=False):
        if op != torch.distributed.ReduceOp.AVG or torch.distributed.get_backend(group) != 'gloo':
            return reduce_scatter(output, input, op=op, group=group, async_op=async_op)
        reduce_scatter(output, input, op=torch.distributed.ReduceOp.SUM, group=group)
        output.div_(torch.distributed.get_world_size(group))
        return _Done() if async_op else None

    return reduce_scattered


def _local_attention_taking_mla_channels(init):
    """megatron-core's local attention (DotProductAttention, the spec without TransformerEngine,
    hence CPU's) with the k_channels/v_channels that MultiLatentAttention passes its core
    attention: q.k over k_channels per head (scaled by MLA's softmax_scale, else
    1/sqrt(k_channels)), a context of v_channels per head. Its forward takes both widths from
    the tensors it gets; only the context's final view reads hidden_size_per_partition."""

    def __init__(self, *args, k_channels=None, v_channels=None, softmax_scale=None, **kwargs):
        if softmax_scale is None and k_channels is not None:
            softmax_scale = 1.0 / math.sqrt(k_channels)
        init(self, *args, softmax_scale=softmax_scale, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return __init__


def _torch_norm_under_sequence_parallel(new):
    """megatron-core's local spec (CPU's: no TransformerEngine, no apex) builds torch's LayerNorm
    and RMSNorm through WrappedTorchNorm, which refuses --sequence-parallel (and so every MoE
    layout with tensor parallelism, which megatron-core's MoE layer requires it for).
    TransformerEngine's and apex's norms take it by marking their weights `sequence_parallel`,
    whose gradients finalize_model_grads then all-reduces over the tensor-parallel group
    (_allreduce_non_tensor_model_parallel_grads): torch's norm, its weights marked so."""

    def __new__(cls, config, *args, **kwargs):
        if not config.sequence_parallel:
            return new(cls, config, *args, **kwargs)
        config.sequence_parallel = False
        try:
            norm = new(cls, config, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for weight in norm.parameters():
            weight.sequence_parallel = True
        return norm

    return staticmethod(__new__)


def _split_sizes_as_numpy_on_cpu(move_tensor_to_cpu):
    """megatron-core's alltoall MoE token dispatcher takes its all-to-all split sizes from
    maybe_move_tensor_to_cpu(..., as_numpy=True), which makes a numpy array of a CUDA tensor but
    leaves a CPU tensor a tensor, and gloo's all_to_all_single refuses tensor split sizes
    (TypeError): on CPU, the numpy array it makes on CUDA."""

    def move(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor):
            return tensor.numpy().copy()
        return move_tensor_to_cpu(tensor, as_numpy, record_stream)

    return move


def apply_cpu_compat() -> bool:
    """Patch torch.cuda's stream/event API into no-ops when CUDA is absent; idempotent. Each
    patch is listed, and undone, in megatron_muon.compat.upstream.

    Returns True when the patches are (or already were) in place, False on a CUDA machine.
    """
    if torch.cuda.is_available():
        return False
    if upstream.is_patched('torch.cuda.Stream'):
        return True
    upstream.patch('torch.cuda.Stream', _Stream)
    upstream.patch('torch.cuda.Event', _Event)
    upstream.patch('torch.cuda.current_stream', lambda *args, **kwargs: _Stream())
    upstream.patch('torch.cuda.stream', lambda *args, **kwargs: contextlib.nullcontext())
    upstream.patch('torch.cuda.synchronize', lambda *args, **kwargs: None)
    upstream.patch('torch.cuda.empty_cache', lambda: None)
    upstream.patch('torch.cuda.current_device', lambda: 0)
    upstream.patch('torch.Tensor.cuda', lambda self, *args, **kwargs: self)
    for name in ('reduce_scatter_tensor', 'reduce_scatter'):
        target = f'torch.distributed.{name}'
        upstream.patch(target, _averaging_as_nccl_does(upstream.current(target)))
    # Megatron-FSDP inside megatron-core, which megatron-core uses, and the standalone package
    # (the same code) where it is installed, for models wrapped with it directly.
    for copy in upstream.INSTALLED_MEGATRON_FSDP_COPIES:
        buffers = importlib.import_module(f'{copy}.param_and_grad_buffer')
        upstream.patch(f'{copy}.param_and_grad_buffer._coalescing_manager', _one_by_one)
        upstream.patch(f'{copy}.param_and_grad_buffer.gradient_reduce_preprocessing',
                       functools.partial(_reduce_without_premul_sum,
                                         buffers.gradient_reduce_preprocessing))
    target = 'megatron.core.transformer.dot_product_attention.DotProductAttention.__init__'
    upstream.patch(target, _local_attention_taking_mla_channels(upstream.current(target)))
    target = 'megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu'
    upstream.patch(target, _split_sizes_as_numpy_on_cpu(upstream.current(target)))
    target = 'megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__'
    upstream.patch(target, _torch_norm_under_sequence_parallel(upstream.current(target)))
    return True


def _is_cuda_device(device) -> bool:
    # Megatron names devices as 'cuda', 'cuda:N', torch.device('cuda', N) or a bare index
    # (torch.cuda.current_device()), which torch resolves to CUDA.
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    return isinstance(device, (str, torch.device)) and torch.device(device).type == 'cuda'


class _CudaTensorsOnCpu(torch.overrides.TorchFunctionMode):
    """Create on CPU the tensors Megatron asks for on CUDA; let CPU tensors pass its CUDA checks.

    Megatron and Megatron-FSDP create tensors with device='cuda', torch.cuda.current_device() or
    torch.device('cuda', N) throughout (first in initialize._warmup_jit_function, then training,
    forward_backward_no_pipelining, Timers._get_elapsed_time_all_ranks,
    MegatronOptimizer.has_grad_norm_group, get_grad_norm_fp32, VocabParallelEmbedding.__init__,
    Megatron-FSDP's TemporaryBucketAllocator.allocate...) and move tensors with
    .to(current_device) (MegatronFSDP.__init__, make_fsdp_dtensor through DTensor.from_local).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda_device(kwargs.get('device')):
            kwargs['device'] = 'cpu'
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], 'cpu', *args[2:])
        result = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # clip_grad_by_total_norm_fp32 asserts grad.type() == 'torch.cuda.FloatTensor'.
            return result.replace('torch.', 'torch.cuda.', 1)
        return result


def apply_megatron_training_compat() -> bool:
    """Also make megatron.training's pretrain() run on CPU/gloo; implies apply_cpu_compat().

    Call before pretrain(). Returns True when the patches are (or already were) in place, False
    on a CUDA machine, where nothing is touched.
    """
    if not apply_cpu_compat():
        return False
    if upstream.is_patched('megatron.training.training.initialize_megatron'):
        return True
    import megatron.training.training

    _create_cuda_tensors_on_cpu()
    # On CPU dropout draws from the default generator, which building the data iterators draws
    # from too (each DataLoader iterator takes a seed from it): keep that generator as it was, so
    # that a run resumed from a checkpoint, which restored it before the iterators were built,
    # continues the uninterrupted run's dropout stream.
    build_data_iterators = megatron.training.training.build_train_valid_test_data_iterators

    def build_data_iterators_keeping_the_generator(*args, **kwargs):
        state = torch.get_rng_state()
        try:
            return build_data_iterators(*args, **kwargs)
        finally:
            torch.set_rng_state(state)

    upstream.patch('megatron.training.training.build_train_valid_test_data_iterators',
                   build_data_iterators_keeping_the_generator)
    # arguments.validate_args reads the device's compute capability when Megatron-FSDP is on.
    upstream.patch('megatron.training.arguments.get_device_arch_version', lambda: 0)
    # pretrain() calls initialize_megatron without allow_no_cuda (which then asserts CUDA).
    upstream.patch('megatron.training.training.initialize_megatron',
                   _allowing_no_cuda(megatron.training.training.initialize_megatron))
    target = 'megatron.training.initialize._initialize_distributed'
    upstream.patch(target, functools.partial(_initialize_distributed_on_cpu,
                                             upstream.current(target)))
    return True


def apply_bridge_compat() -> bool:
    """Make Megatron-Bridge's pretrain() run on CPU/gloo (with cfg.dist.distributed_backend
    'gloo'); implies apply_cpu_compat(). Returns False on a CUDA machine, where nothing is
    touched. megatron_muon.bridge applies it; the stand-ins for the GPU-only packages Bridge
    imports unconditionally (stand_in_for_gpu_only_imports) must come before Bridge's import."""
    if not apply_cpu_compat():
        return False
    if upstream.is_patched('megatron.bridge.training.setup.initialize_megatron'):
        return True
    import megatron.bridge.training.initialize
    import megatron.bridge.training.setup

    _create_cuda_tensors_on_cpu()
    # Bridge's setup calls initialize_megatron without allow_no_cuda ("Megatron requires CUDA.").
    upstream.patch('megatron.bridge.training.setup.initialize_megatron',
                   _allowing_no_cuda(megatron.bridge.training.setup.initialize_megatron))
    # Bridge's _set_random_seed builds the CUDA RNG tracker only when it sees a GPU.
    target = 'megatron.bridge.training.initialize._set_random_seed'
    set_random_seed = upstream.current(target)

    def set_random_seed_and_cpu_tracker(*args, **kwargs):
        set_random_seed(*args, **kwargs)
        _use_cpu_rng_tracker()

    upstream.patch(target, set_random_seed_and_cpu_tracker)
    return True


class _Placeholder(type):
    """A stand-in for a package, or anything taken from it: a class (so isinstance against it is
    False) whose every attribute is another placeholder."""

    def __getattr__(cls, name):
        if name.startswith('__'):
            raise AttributeError(name)
        return _Placeholder(f'{cls.__name__}.{name}', (), {})


# GPU-only packages that Megatron-Bridge's modules import unconditionally, and which of its modules
# do: peft.lora_layers (transformer_engine.pytorch, for its LoRA kernels) is imported by Bridge's
# config, training.pretrain and training.inprocess_restart (nvidia_resiliency_ext.inprocess, for
# in-process restart) by its pretrain.
GPU_ONLY_IMPORTS = {
    'transformer_engine': ('megatron.bridge.peft.lora_layers',),
    'nvidia_resiliency_ext': ('megatron.bridge.training.pretrain',
                              'megatron.bridge.training.inprocess_restart'),
}


def stand_in_for_gpu_only_imports() -> bool:
    """Without CUDA, let those Bridge modules import a placeholder where the package is missing:
    only them (every other importer, such as megatron-core's checks for TransformerEngine, still
    finds it missing), and without adding it to sys.modules. Returns False with CUDA."""
    if torch.cuda.is_available():
        return False
    if upstream.is_patched('builtins.__import__'):
        return True
    import builtins

    real_import = builtins.__import__

    def import_with_stand_ins(name, globals=None, locals=None, fromlist=(), level=0):
        try:
            return real_import(name, globals, locals, fromlist, level)
        except ModuleNotFoundError:
            package = name.partition('.')[0]
            importer = (globals or {}).get('__name__')
            if level or importer not in GPU_ONLY_IMPORTS.get(package, ()):
                raise
            # `import a.b as c` and `from a.b import c` both read attributes from what returns.
            top = _Placeholder(package, (), {})
            return top if not fromlist else functools.reduce(
                getattr, name.split('.')[1:], top)

    upstream.patch('builtins.__import__', import_with_stand_ins)
    return True


def _allowing_no_cuda(initialize_megatron):
    return lambda *args, **kwargs: initialize_megatron(*args, **{**kwargs, 'allow_no_cuda': True})


def _create_cuda_tensors_on_cpu() -> None:
    """What every training loop needs on CPU: tensors Megatron asks for on CUDA made on CPU,
    also in backward, and the CPU generator's state where the CUDA one is saved."""
    if upstream.is_patched('torch.cuda.get_rng_state'):
        return
    # RerunStateMachine._save_state saves the CUDA RNG state every step (and _restore_state
    # restores it on a rerun, next to the CPU state it also restores); CPU has no other generator.
    upstream.patch('torch.cuda.get_rng_state', lambda device='cuda': torch.get_rng_state())
    upstream.patch('torch.cuda.set_rng_state', lambda new_state, device='cuda': None)
    mode = _CudaTensorsOnCpu()
    upstream.enter_torch_function_mode(mode)
    # Tensor.backward runs inside the mode's own handler, where the mode is off: re-enter it for
    # autograd's engine, so backward functions create their tensors on CPU too (megatron-core's
    # MoE token dispatcher all-gathers into device=current_device() in backward, in
    # tensor_parallel.mappings._gather_along_first_dim).
    engine_run_backward = upstream.current('torch.autograd._engine_run_backward')

    def engine_run_backward_in_mode(*args, **kwargs):
        with mode:
            return engine_run_backward(*args, **kwargs)

    upstream.patch('torch.autograd._engine_run_backward', engine_run_backward_in_mode)


def _destroy_process_groups():
    """At exit, while the interpreter is whole: megatron.training leaves its groups alive, and
    gloo's threads may still hold work whose tensors Python owns; freeing those during the
    interpreter's finalization aborted ranks after finished runs ("terminate called without an
    active exception"; pytorch/pytorch#179291 describes the mechanism)."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _initialize_distributed_on_cpu(initialize_distributed, *args, **kwargs):
    """Megatron sets up model parallelism only when it sees a GPU (in _initialize_distributed).

    Start the (gloo) process group here, then let Megatron's own code build the model-parallel
    groups with a GPU presented (it only skips process-group setup, already done, and runs mpu
    init).
    """
    from megatron.training import get_args

    megatron_args = get_args()
    if not torch.distributed.is_initialized():
        # gloo whatever --distributed-backend says: NCCL needs GPUs.
        torch.distributed.init_process_group(
            backend='gloo', world_size=megatron_args.world_size,
            rank=megatron_args.rank,
            timeout=datetime.timedelta(minutes=megatron_args.distributed_timeout_minutes))
        atexit.register(_destroy_process_groups)
    with upstream.temporarily('torch.cuda.device_count', lambda: 1):
        initialize_distributed(*args, **kwargs)
    # megatron.training's _set_random_seed builds the CUDA RNG tracker only when it sees a GPU.
    _use_cpu_rng_tracker()


def _use_cpu_rng_tracker() -> None:
    """get_cuda_rng_tracker() would otherwise build a tracker that forks CUDA generators. The
    inference tracker's fork() is a no-op: on CPU, dropout draws from the default generator."""
    from megatron.core.tensor_parallel import random as tensor_parallel_random

    tensor_parallel_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    # A checkpoint whose tracker states are empty is refused at load ("Unable to load rng state",
    # checkpointing.py), and this tracker has no CUDA generator to save. Give it one entry, which
    # its set_states ignores; the CPU generator dropout draws from is saved and restored beside it.
    tensor_parallel_random.get_cuda_rng_tracker().states_ = {"cpu": torch.get_rng_state()}


def bf16_matmul_is_emulated() -> bool:
    """Whether bf16 matrix products run emulated here: no CUDA, and a CPU for which torch has no
    oneDNN bf16 kernels (those need AVX-512 on x86 or BF16 on Arm). Emulated, a 1024x1024 bf16
    matmul took 3.5 s against 35 ms in fp32 on an AMD EPYC (Zen 3, AVX2; one thread), so
    Newton-Schulz at Megatron's default --muon-fp32-matmul-prec medium, which emerging_optimizers
    runs in bf16, is about 100x slower than in fp32 there."""
    if torch.cuda.is_available():
        return False
    return not upstream.is_mkldnn_bf16_supported()


def fast_newton_schulz_precision() -> str:
    """The --muon-fp32-matmul-prec that the demo and the benchmarks run at: Megatron's default,
    medium (bf16 matmuls), but highest (fp32) where bf16 matmuls are emulated."""
    return 'highest' if bf16_matmul_is_emulated() else 'medium'


def matmul_seconds(dtype: torch.dtype, n: int = 512) -> float:
    """Wall time of one n x n matrix product in `dtype` on the CPU, after one warm-up."""
    a = torch.randn(n, n, device="cpu").to(dtype)
    a @ a
    start = time.perf_counter()
    a @ a
    return time.perf_counter() - start
