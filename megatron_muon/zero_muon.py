"""Muon on Megatron-FSDP's sharded main weights (ZeRO-1/2/3), exact and TP-aware."""

from typing import Any, Literal

import torch
import torch.distributed as dist
from emerging_optimizers import utils as eo_utils
from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon
from torch.distributed.tensor import DTensor, Replicate, Shard

from .exchange import OwnerExchange, all_gather_row_counts, all_gather_rows
from .muon_math import momentum_update_
from .plan import Matrix, batch_matrices, choose_owners, row_layouts

DistMode = Literal["owner", "allgather"]


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


def _tp_local_rows(p: DTensor) -> int:
    """Rows of the matrix the DP shards tile: the TP-local matrix when TP splits dim 0."""
    rows = p.shape[0]
    for mesh_dim, placement in enumerate(p.placements):
        if placement == Shard(0) and mesh_dim != _fsdp_shard_mesh_dim(p):
            rows //= p.device_mesh.size(mesh_dim)
    return rows


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


class _ShardGroupPlan:
    """The sharded matrices of one shard group, their owners and batches, fixed at construction."""

    def __init__(self, params, matrices, owners, batches, group):
        self.params, self.matrices, self.owners, self.group = params, matrices, owners, group
        rank = dist.get_rank(group)
        self.exchanges = [OwnerExchange(matrices, owners, batch, rank, group) for batch in batches]


class ZeROTensorParallelMuon(TensorParallelMuon):
    """megatron-core's TensorParallelMuon for Megatron-FSDP main weights.

    Params are `nn.Parameter(DTensor)` whose rows are sharded unevenly (`Shard(0)`, a rank may
    hold none) or replicated (`no_shard`). Momentum and weight decay run on the local rows; each
    momentum update is assembled into its full matrix and run through TensorParallelMuon's
    orthogonalize (TP Newton-Schulz, QKV split, scale modes); each rank applies its own rows.

    Args:
        dp_group: group over which the `Shard(0)` rows are gathered; by default the group of the
            param's data-parallel shard mesh dim.
        dist_mode: "owner" (default) assembles each matrix on one owner, which alone runs its
            Newton-Schulz and sends the rows back; "allgather" assembles every matrix on every
            rank (each rank repeats all Newton-Schulz work; kept as the reference).
        byte_slack: owner mode may move up to this fraction more than the layout's minimum bytes
            to balance Newton-Schulz work across ranks.
        max_batch_bytes: same-shape matrices are orthogonalized together in batches of at most
            this size; one batch is gathered while the previous one computes.
        **kwargs: TensorParallelMuon's arguments.
    """

    def __init__(self, params, *, dp_group=None, dist_mode: DistMode = "owner",
                 byte_slack: float = 0.05, max_batch_bytes: int = 64 << 20, **kwargs: Any):
        if dist_mode not in ("owner", "allgather"):
            raise ValueError(f"dist_mode must be 'owner' or 'allgather', got {dist_mode!r}")
        super().__init__(params, **kwargs)
        self.dp_group = dp_group
        self.dist_mode = dist_mode
        self._batched_ns_exact: dict[tuple, bool] = {}
        self._replicated: list[DTensor] = []
        self._plans = self._plan(byte_slack, max_batch_bytes)

    def _shard_group(self, p: DTensor):
        mesh_dim = _fsdp_shard_mesh_dim(p)
        if mesh_dim is None:
            return None
        return self.dp_group if self.dp_group is not None else p.device_mesh.get_group(mesh_dim)

    def _plan(self, byte_slack: float, max_batch_bytes: int) -> list[_ShardGroupPlan]:
        """Validate every param, set the replicated ones apart and plan each shard group: its row
        layouts are learned with one collective per group, here at construction, never per step."""
        by_group: dict[Any, list[DTensor]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if not isinstance(p, DTensor):
                    raise TypeError(
                        f"ZeROTensorParallelMuon expects Megatron-FSDP DTensor main weights, got a "
                        f"{type(p).__name__} of shape {tuple(p.shape)}")
                if p.dim() != 2:
                    raise ValueError(f"Muon orthogonalizes 2-D matrices; got shape {tuple(p.shape)}")
                if any(not isinstance(pl, (Shard, Replicate)) for pl in p.placements):
                    raise ValueError(f"unsupported DTensor placements {p.placements}")
                shard_group = self._shard_group(p)
                if shard_group is None:
                    self._replicated.append(p)
                else:
                    by_group.setdefault(shard_group, []).append(p)
        plans = []
        for shard_group, params in by_group.items():
            table = all_gather_row_counts([p.to_local().shape[0] for p in params], shard_group)
            layouts = row_layouts(table, [_tp_local_rows(p) for p in params])
            matrices = [Matrix(layout, p.to_local().shape[1], self._batch_key(p), self._row_blocks(p))
                        for p, layout in zip(params, layouts)]
            element_bytes = params[0].element_size()
            # TP ranks hold equally shaped TP-local matrices laid out alike, so they pick the same
            # owners: TP Newton-Schulz then meets its TP peers on the same matrix.
            owners = choose_owners(matrices, element_bytes, byte_slack)
            batches = batch_matrices(matrices, max_batch_bytes // element_bytes)
            plans.append(_ShardGroupPlan(params, matrices, owners, batches, shard_group))
        return plans

    def _tp_group(self, attrs):
        # As TensorParallelMuon.orthogonalize chooses it.
        if not self.pg_collection:
            return None
        return self.pg_collection.expt_tp if getattr(attrs, "expert_tp", False) else self.pg_collection.tp

    def _splits_qkv(self, attrs) -> bool:
        return self.split_qkv and self.is_qkv_fn(attrs)

    def _row_blocks(self, p) -> tuple[int, ...] | None:
        """Rows of the q, k and v blocks Newton-Schulz sees for a QKV-split param (for its cost)."""
        attrs = _ParamAttributes(p)
        if not self._splits_qkv(attrs):
            return None
        shapes = getattr(attrs, "qkv_split_shapes", None) or self.qkv_split_shapes
        groups = _tp_local_rows(p) // sum(shapes)
        return tuple(groups * rows for rows in shapes)

    def _batch_key(self, p) -> tuple | None:
        """Matrices with equal keys (and shapes) are orthogonalized identically and may share one
        batched Newton-Schulz; None: orthogonalize alone (QKV split, or TP Newton-Schulz)."""
        attrs = _ParamAttributes(p)
        tp_group = self._tp_group(attrs)
        if self._splits_qkv(attrs) or (tp_group is not None and tp_group.size() > 1):
            return None
        return (getattr(attrs, "partition_dim", None), getattr(attrs, "expert_tp", False))

    @torch.no_grad()
    def _init_group(self, group: dict, skip_non_grad_params: bool = True) -> None:
        # Every rank holds momentum for every param, empty where its shard is empty, so state
        # keys agree across ranks (megatron-core's checkpoint init calls this too).
        for p in group["params"]:
            state = self.state[p]
            if len(state) == 0:
                state["momentum_buffer"] = DTensor.from_local(
                    torch.zeros_like(p.to_local()), p.device_mesh, p.placements, run_check=False,
                    shape=p.shape, stride=p.stride())

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("closure is not supported")
        updates, lrs = {}, {}
        for group in self.param_groups:
            self._init_group(group)
            for p in group["params"]:
                # Megatron-FSDP leaves grad=None where a rank's shard is empty.
                local_param = p.to_local()
                local_grad = p.grad.to_local() if p.grad is not None else torch.zeros_like(local_param)
                updates[p] = momentum_update_(
                    self, local_param, local_grad, self.state[p]["momentum_buffer"].to_local(), group)
                lrs[p] = group["lr"]

        def apply(p, rows):
            p.to_local().add_(rows, alpha=-lrs[p])

        with eo_utils.fp32_matmul_precision(self.fp32_matmul_prec):
            self._orthogonalize_all(updates, apply)
        return None

    def _orthogonalize_all(self, updates: dict, apply) -> None:
        """Orthogonalize every param's update and `apply(param, this rank's rows)` as soon as
        each is ready, so finished batches free their buffers."""
        for p in self._replicated:  # every rank has the whole matrix
            apply(p, self.orthogonalize(_ParamAttributes(p), updates[p]))
        for plan in self._plans:
            local = {i: updates[p] for i, p in enumerate(plan.params)}
            if self.dist_mode == "owner":
                self._owner_orthogonalize(plan, local, apply)
            else:
                self._allgather_orthogonalize(plan, local, apply)

    def _allgather_orthogonalize(self, plan: _ShardGroupPlan, local: dict, apply) -> None:
        rank = dist.get_rank(plan.group)
        for i, p in enumerate(plan.params):
            layout = plan.matrices[i].layout
            full = all_gather_rows(local[i], layout, plan.group)
            start, stop = layout.row_range(rank)
            apply(p, self.orthogonalize(_ParamAttributes(p), full)[start:stop])

    def _owner_orthogonalize(self, plan: _ShardGroupPlan, local: dict, apply) -> None:
        """Gather each batch to its owners, orthogonalize there, send the rows back. Double
        buffered: batch i+1's gather runs while batch i computes, and batch i-1's rows are applied
        first, so about two batches' buffers are alive at once. The order of collectives depends
        only on the plan, so every rank issues the same ones."""
        exchanges = plan.exchanges

        def start_gather(index):
            if index < len(exchanges):
                exchanges[index].start_gather({i: local[i] for i in exchanges[index].batch})

        def finish_scatter(index):
            if index >= 0:
                for i, rows in exchanges[index].finish_scatter().items():
                    apply(plan.params[i], rows)

        start_gather(0)
        for current, exchange in enumerate(exchanges):
            start_gather(current + 1)
            finish_scatter(current - 1)
            owned_params = [plan.params[i] for i in exchange.owned]
            batch_key = plan.matrices[exchange.batch[0]].batch_key
            exchange.start_scatter(
                self._orthogonalize_owned(owned_params, exchange.finish_gather(), batch_key))
        finish_scatter(len(exchanges) - 1)

    def _orthogonalize_owned(self, params: list, fulls: list, batch_key) -> list:
        """Newton-Schulz on the full matrices this rank owns in one batch: one batched call where
        that is bit-identical to one call per matrix on this backend, else one call each."""
        if (len(fulls) > 1 and batch_key is not None
                and self._batched_is_exact(params[0], fulls[0].shape, batch_key)):
            return list(self.orthogonalize(_ParamAttributes(params[0]), torch.stack(fulls)).unbind())
        return [self.orthogonalize(_ParamAttributes(p), full) for p, full in zip(params, fulls)]

    def _batched_is_exact(self, p, shape, batch_key) -> bool:
        """Whether batched Newton-Schulz reproduces the per-matrix bits for this shape here: the
        backend may pick other kernels for 3-D input (seen on CPU for 7x13, not for 256x1024).
        Checked once per shape and orthogonalization on random input."""
        key = (tuple(shape), batch_key)
        if key not in self._batched_ns_exact:
            sample = torch.randn((2, *shape), generator=torch.Generator().manual_seed(0))
            attrs = _ParamAttributes(p)
            batched = self.orthogonalize(attrs, sample)
            single = torch.stack([self.orthogonalize(attrs, m) for m in sample])
            self._batched_ns_exact[key] = torch.equal(batched, single)
        return self._batched_ns_exact[key]
