"""Megatron-FSDP's DTensor main weights seen as rows of matrices: which row shard a rank holds,
how many rows the data-parallel shards tile, a local shard as rows, the data-parallel layout,
and Megatron's tags of a param. Shared by the planner, the step and the check."""

import math

import torch
from torch.distributed.tensor import DTensor, Shard

from ..compat import upstream


def data_parallel_dims(p: DTensor) -> list[int]:
    """Mesh dims of Megatron-FSDP's data parallelism (row shards or replicas): all but TP's,
    which Megatron-FSDP's dist index names."""
    tp_dim_name = getattr(getattr(p, "megatron_fsdp_dist_index", None), "tp_dim", None)
    names = p.device_mesh.mesh_dim_names or (None,) * p.device_mesh.ndim
    return [i for i in range(p.device_mesh.ndim) if tp_dim_name is None or names[i] != tp_dim_name]


def shard_index(p: DTensor) -> int:
    """Which row shard of `p` this rank holds, from its mesh coordinate. Rows follow
    megatron_fsdp's chunk order (uneven_dtensor): the shard dim it visits first is the least
    significant. Replicas (no_shard, HSDP's outer dim) hold the same shard."""
    mesh, coordinate = p.device_mesh, p.device_mesh.get_coordinate()
    shard_order = upstream.mesh_shard_order(mesh) or range(mesh.ndim - 1, -1, -1)
    dp_dims = data_parallel_dims(p)
    shard, stride = 0, 1
    for dim in reversed(shard_order):
        if dim in dp_dims and p.placements[dim] == Shard(0):
            shard, stride = shard + coordinate[dim] * stride, stride * mesh.size(dim)
    return shard


def tp_local_rows(p: DTensor) -> int:
    """Rows of the 2-D matrix (3-D stacks: one row per last-dim vector) the data-parallel
    shards tile: the TP-local matrix when TP splits dim 0."""
    rows, dp_dims = p.shape[0], data_parallel_dims(p)
    for mesh_dim, placement in enumerate(p.placements):
        if placement == Shard(0) and mesh_dim not in dp_dims:
            rows //= p.device_mesh.size(mesh_dim)
    return rows * math.prod(p.shape[1:-1])


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D view of a local shard (a stack of expert matrices becomes their rows)."""
    return t.view(-1, t.shape[-1])


def data_parallel_layout(p: DTensor) -> tuple:
    """(mesh dim name, size, placement) of each data-parallel mesh dim."""
    names = p.device_mesh.mesh_dim_names or (None,) * p.device_mesh.ndim
    return tuple((names[dim], p.device_mesh.size(dim), p.placements[dim])
                 for dim in data_parallel_dims(p))


class ParamAttributes:
    """Megatron's tags (is_qkv, partition_dim, expert_tp, ...) of a main-weight param: its own,
    else those of the model param Megatron-FSDP made it from."""

    def __init__(self, param: torch.Tensor) -> None:
        self._param = param

    def __getattr__(self, name):
        try:
            return getattr(self._param, name)
        except AttributeError:
            return getattr(self._param.orig_param, name)


def num_experts(p: torch.Tensor) -> int:
    """The expert matrices a param stacks (`num_stacked_experts`), 1 for a plain matrix."""
    return getattr(ParamAttributes(p), "num_stacked_experts", 1)
