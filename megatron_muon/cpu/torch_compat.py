"""Run Megatron-FSDP and megatron-core on a machine without CUDA (CPU, gloo).

Megatron-FSDP schedules its collectives on CUDA streams and events; on CPU every collective is
synchronous, so that bookkeeping can be a no-op (apply_cpu_compat). megatron.training's and
Megatron-Bridge's training loops further ask for CUDA tensors, RNG states and devices
(cpu/training_compat.py). Nothing here runs when CUDA is available; nor does the probe for
emulated bf16 matmuls (bf16_matmul_is_emulated), which chooses the Newton-Schulz precision of the
demo and benchmarks. Every patch goes through compat/upstream.py, which lists it and can undo it.
"""

import contextlib
import dataclasses
import functools
import importlib
import math
import time
from collections.abc import Callable

import torch

from ..compat import upstream


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


def applied_once(marker: str, needs: Callable[[], bool] = lambda: not torch.cuda.is_available()):
    """A part of the CPU layer's apply made idempotent: it returns False where `needs()` says no
    (a CUDA machine, or the part it implies not applied), and nothing is touched; True where its
    patch `marker` is in place already, or once it has patched."""
    def decorate(apply: Callable[[], None]) -> Callable[[], bool]:
        @functools.wraps(apply)
        def applied() -> bool:
            if not needs():
                return False
            if not upstream.is_patched(marker):
                apply()
            return True

        return applied

    return decorate


@applied_once('torch.cuda.Stream')
def apply_cpu_compat() -> None:
    """Patch torch.cuda's stream/event API into no-ops when CUDA is absent, and Megatron-FSDP's
    and megatron-core's CPU gaps (applied_once: True when the patches are, or already were, in
    place; False on a CUDA machine). Each patch is listed, and undone, in
    megatron_muon.compat.upstream.
    """
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
