"""--muon-use-syrk (megatron-core main's flag and meaning): Newton-Schulz through
emerging_optimizers' Triton SYRK kernel, which computes the symmetric products X X^T and A A with
about half their FLOPs. Where it can run, and the orthogonalization that uses it.

The kernel is bf16 (emerging_optimizers' newton_schulz takes it only at `medium`), 2-D (a
batched call refuses it: each matrix is orthogonalized alone), CUDA with Triton >= 3.4 on the GPU
generations emerging_optimizers' Muon vouches for. megatron-core 0.19's TensorParallelMuon has no
`use_syrk` and emerging_optimizers' newton_schulz_tp drops it, so there it runs where a matrix is
whole on its rank (no tensor-parallel partition, or a TP group of one), which
`--muon-tp-mode blockwise` makes of every matrix; a megatron-core whose TensorParallelMuon takes
`use_syrk` runs it in every TP mode itself.
"""

import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..compat import tensor_parallel, upstream
from ..distribution.dtensor_rows import ParamAttributes

FLAG = "--muon-use-syrk"
# TensorParallelMuon's scaled_orthogonalize_fn: (grad, tp_group, partition_dim) -> update.
OrthogonalizeFn = Callable[..., torch.Tensor]
# emerging_optimizers' Muon.__init__ turns use_syrk off elsewhere: "Correctness of Triton kernel
# on SM ... cannot be guaranteed".
SM_VERSIONS = ((8, 0), (9, 0), (10, 0), (10, 3))


def why_it_cannot_run(fp32_matmul_prec: str, tp_mode: str, tp_sizes: Sequence[int],
                      device: torch.device) -> str | None:
    """What stops the kernel here, naming the flag to change, or None. `tp_sizes`: the sizes of
    the tensor-parallel groups the Muon matrices are partitioned over (dense and expert)."""
    if fp32_matmul_prec != "medium":
        return (f"{FLAG} runs a bf16 kernel, which emerging_optimizers' newton_schulz uses only at "
                f"--muon-fp32-matmul-prec medium, not {fp32_matmul_prec}")
    if (not tensor_parallel_muon_takes_syrk() and tp_mode != "blockwise"
            and max(tp_sizes, default=1) > 1):
        return (f"{FLAG} with --muon-tp-mode {tp_mode} under tensor parallelism "
                f"{max(tp_sizes)}: this megatron-core's TensorParallelMuon cannot pass it to the "
                "tensor-parallel Newton-Schulz (emerging_optimizers' newton_schulz_tp drops it); "
                "use --muon-tp-mode blockwise, or a megatron-core with --muon-use-syrk")
    if device.type != "cuda":
        return f"{FLAG} needs CUDA (a Triton kernel); the params are on {device.type}"
    if not has_triton_syrk():
        return f"{FLAG} needs Triton 3.4 or later (emerging_optimizers.triton_kernels)"
    capability = torch.cuda.get_device_capability(device)
    if capability not in SM_VERSIONS:
        return (f"{FLAG}: emerging_optimizers does not vouch for its kernel on SM "
                f"{capability[0]}.{capability[1]} (only {', '.join(f'{a}.{b}' for a, b in SM_VERSIONS)})")
    return None


def has_triton_syrk() -> bool:
    """Whether emerging_optimizers' Triton SYRK kernel can be built here (Triton >= 3.4)."""
    try:
        return bool(importlib.import_module("emerging_optimizers.triton_kernels").HAS_TRITON_340)
    except ImportError:  # no Triton
        return False


def tensor_parallel_muon_takes_syrk() -> bool:
    """Whether megatron-core's TensorParallelMuon runs the SYRK kernel itself, in every TP mode:
    it takes `use_syrk` (megatron-core main's --muon-use-syrk; 0.19 has no such argument) and
    emerging_optimizers' newton_schulz_tp passes it on (0.4 and later; main's TensorParallelMuon
    refuses use_syrk with 0.3, where ours routes it as on 0.19)."""
    from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz_tp
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    return all("use_syrk" in inspect.signature(f).parameters
               for f in (TensorParallelMuon.__init__, newton_schulz_tp))


def _kernel_takes(matrix: torch.Tensor) -> bool:
    """2-D, with both dims multiples of 8: the kernel's tensor descriptors need 16-byte-aligned
    strides (megatron-core main's _syrk_compatible); other matrices take the plain kernel."""
    return matrix.ndim == 2 and matrix.shape[-1] % 8 == 0 and matrix.shape[-2] % 8 == 0


def scaled_orthogonalize_fn(upstream_fn: OrthogonalizeFn, num_ns_steps: int,
                            coefficient_type: str, scale_mode: str,
                            extra_scale_factor: float) -> OrthogonalizeFn:
    """TensorParallelMuon's scaled_orthogonalize_fn (`upstream_fn`) with the SYRK kernel where a
    matrix is whole on this rank: what its closure computes there (newton_schulz, then
    get_muon_scale_factor of the matrix's shape times extra_scale_factor), with use_syrk."""
    def orthogonalize(grad: torch.Tensor, tp_group=None, partition_dim: int | None = None):
        if not (tensor_parallel.newton_schulz_gets_it_whole(tp_group, partition_dim)
                and _kernel_takes(grad)):
            return upstream_fn(grad, tp_group, partition_dim)
        orthogonalized = upstream.newton_schulz(grad, num_ns_steps, coefficient_type, use_syrk=True)
        scale = upstream.get_muon_scale_factor(grad.size(-2), grad.size(-1), mode=scale_mode)
        return orthogonalized * scale * extra_scale_factor

    return orthogonalize


def route_newton_schulz_through_it(muon: Any, settings: dict, upstream_runs_it: bool) -> None:
    """Refuse --muon-use-syrk where the kernel cannot run (before any state), else route a
    ZeROTensorParallelMuon's Newton-Schulz through it where megatron-core's TensorParallelMuon
    does not run it itself (`upstream_runs_it`). `settings`: TensorParallelMuon's arguments."""
    first = muon.param_groups[0]["params"][0]
    tp_groups = {muon.tp_group_of(ParamAttributes(p)) for group in muon.param_groups
                 for p in group["params"]} - {None}
    problem = why_it_cannot_run(muon.fp32_matmul_prec, muon.tp_mode,
                                [g.size() for g in tp_groups], first.to_local().device)
    if problem:
        raise ValueError(f"ZeROTensorParallelMuon: {problem}")
    if not upstream_runs_it:
        muon.scaled_orthogonalize_fn = scaled_orthogonalize_fn(
            muon.scaled_orthogonalize_fn, settings["num_ns_steps"], settings["coefficient_type"],
            settings["scale_mode"], settings["extra_scale_factor"])
