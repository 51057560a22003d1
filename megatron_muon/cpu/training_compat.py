"""Run megatron.training's and Megatron-Bridge's training loops on a machine without CUDA (CPU,
gloo), on top of cpu/torch_compat.py's Megatron-FSDP layer: tensors Megatron asks for on CUDA made on
CPU, CPU RNG states where CUDA's are saved, gloo process groups, and placeholders for the
GPU-only packages Bridge imports. Nothing here runs when CUDA is available. Every patch goes
through compat/upstream.py, which lists it and can undo it.
"""

import atexit
import datetime
import functools

import torch

from ..compat import upstream
from .torch_compat import applied_once, apply_cpu_compat


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


@applied_once('megatron.training.training.initialize_megatron', needs=apply_cpu_compat)
def apply_megatron_training_compat() -> None:
    """Also make megatron.training's pretrain() run on CPU/gloo; implies apply_cpu_compat().

    Call before pretrain(). Returns True when the patches are (or already were) in place, False
    on a CUDA machine, where nothing is touched (applied_once).
    """
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


@applied_once('megatron.bridge.training.setup.initialize_megatron', needs=apply_cpu_compat)
def apply_bridge_compat() -> None:
    """Make Megatron-Bridge's pretrain() run on CPU/gloo (with cfg.dist.distributed_backend
    'gloo'); implies apply_cpu_compat(). Returns False on a CUDA machine, where nothing is
    touched. megatron_muon.bridge applies it; the stand-ins for the GPU-only packages Bridge
    imports unconditionally (stand_in_for_gpu_only_imports) must come before Bridge's import."""
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


@applied_once('builtins.__import__')
def stand_in_for_gpu_only_imports() -> None:
    """Without CUDA, let those Bridge modules import a placeholder where the package is missing:
    only them (every other importer, such as megatron-core's checks for TransformerEngine, still
    finds it missing), and without adding it to sys.modules. Returns False with CUDA
    (applied_once)."""
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
