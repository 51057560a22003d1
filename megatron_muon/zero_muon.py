"""Muon on Megatron-FSDP's sharded main weights (ZeRO-1/2/3), exact and TP-aware."""

from typing import Any

import torch
import torch.distributed as dist
from emerging_optimizers import utils as eo_utils
from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon
from torch.distributed.tensor import DTensor, Replicate, Shard

from .exchange import all_gather_row_counts, all_gather_rows
from .muon_math import momentum_update_
from .plan import RowLayout, row_layouts


def _fsdp_shard_mesh_dim(p: DTensor) -> int | None:
    """The mesh dim of Megatron-FSDP's row sharding, or None when the param is replicated over DP.

    TP's own placement (named by Megatron-FSDP's dist index) may also be Shard(0); it is not ours.
    """
    dist_index = getattr(p, "megatron_fsdp_dist_index", None)
    tp_dim_name = getattr(dist_index, "tp_dim", None)
    names = p.device_mesh.mesh_dim_names or (None,) * p.device_mesh.ndim
    dims = [i for i, placement in enumerate(p.placements)
            if placement == Shard(0) and (tp_dim_name is None or names[i] != tp_dim_name)]
    if len(dims) > 1:
        raise NotImplementedError(
            f"parameter sharded over several data-parallel mesh dims {p.placements} "
            "(HSDP outer sharding) is not supported yet")
    return dims[0] if dims else None


class _ParamAttributes:
    """Megatron's tags (is_qkv, partition_dim, expert_tp, ...) of a main-weight param: its own,
    else those of the model param Megatron-FSDP made it from."""

    def __init__(self, param):
        self._param = param

    def __getattr__(self, name):
        try:
            return getattr(self._param, name)
        except AttributeError:
            return getattr(self._param.orig_param, name)


class ZeROTensorParallelMuon(TensorParallelMuon):
    """megatron-core's TensorParallelMuon for Megatron-FSDP main weights.

    Params are `nn.Parameter(DTensor)` whose rows are sharded unevenly (`Shard(0)`, a rank may
    hold none) or replicated (`no_shard`). Momentum lives on the local rows with the param's
    placements; each momentum update is gathered into its full matrix over the shard group, run
    through TensorParallelMuon's orthogonalize (TP Newton-Schulz, QKV split, scale modes), and
    this rank's rows are applied.

    Args:
        dp_group: group over which the `Shard(0)` rows are gathered; by default the group of the
            param's data-parallel shard mesh dim.
        **kwargs: TensorParallelMuon's arguments.
    """

    def __init__(self, params, *, dp_group=None, **kwargs: Any):
        super().__init__(params, **kwargs)
        self.dp_group = dp_group
        self._row_layouts = self._learn_row_layouts()

    def _shard_group(self, p: DTensor):
        mesh_dim = _fsdp_shard_mesh_dim(p)
        if mesh_dim is None:
            return None
        return self.dp_group if self.dp_group is not None else p.device_mesh.get_group(mesh_dim)

    def _learn_row_layouts(self) -> dict[torch.Tensor, tuple[RowLayout, Any]]:
        """Validate every param and learn each sharded matrix's row layout: one collective per
        shard group, here at construction, never per step."""
        by_group: dict[Any, list[torch.Tensor]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if not isinstance(p, DTensor):
                    raise TypeError(
                        f"ZeROTensorParallelMuon expects Megatron-FSDP DTensor main weights, got a "
                        f"{type(p).__name__} of shape {tuple(p.shape)}")
                if p.dim() != 2:
                    raise ValueError(f"Muon orthogonalizes 2-D matrices; got shape {tuple(p.shape)}")
                bad = [pl for pl in p.placements if not isinstance(pl, (Shard, Replicate))]
                if bad:
                    raise ValueError(f"unsupported DTensor placements {p.placements}")
                shard_group = self._shard_group(p)
                if shard_group is not None:
                    by_group.setdefault(shard_group, []).append(p)
        layouts = {}
        for shard_group, params in by_group.items():
            table = all_gather_row_counts([p.to_local().shape[0] for p in params], shard_group)
            expected_rows = [self._tp_local_rows(p) for p in params]
            for p, layout in zip(params, row_layouts(table, expected_rows)):
                layouts[p] = (layout, shard_group)
        return layouts

    @staticmethod
    def _tp_local_rows(p: DTensor) -> int:
        """Rows of the matrix the DP shards tile: the TP-local matrix when TP splits dim 0."""
        rows = p.shape[0]
        for mesh_dim, placement in enumerate(p.placements):
            if placement == Shard(0) and mesh_dim != _fsdp_shard_mesh_dim(p):
                rows //= p.device_mesh.size(mesh_dim)
        return rows

    @torch.no_grad()
    def _init_group(self, group: dict, skip_non_grad_params: bool = True) -> None:
        # Every rank holds momentum for every param, empty where its shard is empty, so state
        # keys agree across ranks (megatron-core's checkpoint init calls this too).
        for p in group["params"]:
            state = self.state[p]
            if len(state) == 0:
                state["momentum_buffer"] = self._as_dtensor(torch.zeros_like(p.to_local()), like=p)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("closure is not supported")
        for group in self.param_groups:
            self._init_group(group)
            # Every rank visits every param in the same order: the gathers stay in lockstep even
            # where Megatron-FSDP left grad=None for an empty shard.
            for p in group["params"]:
                local_param = p.to_local()
                local_grad = p.grad.to_local() if p.grad is not None else torch.zeros_like(local_param)
                update = momentum_update_(
                    self, local_param, local_grad, self.state[p]["momentum_buffer"].to_local(), group)
                with eo_utils.fp32_matmul_precision(self.fp32_matmul_prec):
                    orth = self.orthogonalize(p, self._as_dtensor(update, like=p))
                local_param.add_(orth.to_local(), alpha=-group["lr"])
        return None

    @staticmethod
    def _as_dtensor(local: torch.Tensor, like: DTensor) -> DTensor:
        return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                                  shape=like.shape, stride=like.stride())

    def orthogonalize(self, p: torch.Tensor, grad: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Orthogonalize a DTensor update: assemble its full (TP-local) matrix, run
        TensorParallelMuon.orthogonalize on it, and return this rank's rows with grad's
        placements, shape and stride."""
        attrs = _ParamAttributes(p)
        local = grad.to_local()
        if p not in self._row_layouts:
            return self._as_dtensor(super().orthogonalize(attrs, local, **kwargs), like=grad)
        layout, shard_group = self._row_layouts[p]
        full = all_gather_rows(local, layout, shard_group)
        start, stop = layout.row_range(dist.get_rank(shard_group))
        orth = super().orthogonalize(attrs, full, **kwargs)[start:stop]
        return self._as_dtensor(orth, like=grad)
