"""How megatron-core's TensorParallelMuon.orthogonalize reads a param's tensor-parallel tags
(`partition_dim`, `expert_tp`) and its process groups: what the planner, the scale model and the
adaptive Muon repair must read as it does. Public tags only; the private names stay in
compat/upstream.py."""

from typing import Any


def tensor_parallel_group(pg_collection, attrs):
    """The TP group megatron-core's TensorParallelMuon.orthogonalize gives a param with these
    tags (the expert TP group for expert weights), None without process groups."""
    if not pg_collection:
        return None
    return pg_collection.expt_tp if getattr(attrs, "expert_tp", False) else pg_collection.tp


def orthogonalized_partition_dim(tp_mode: str, attrs: Any) -> int | None:
    """The partition dim megatron-core's TensorParallelMuon.orthogonalize hands Newton-Schulz for
    a param with these tags, or None where it hands none: blockwise mode, no partition dim (or
    -1)."""
    partition_dim = None if tp_mode == "blockwise" else getattr(attrs, "partition_dim", None)
    return None if partition_dim == -1 else partition_dim


def newton_schulz_gets_it_whole(tp_group, partition_dim: int | None) -> bool:
    """Whether the matrix TensorParallelMuon's scaled_orthogonalize_fn is handed (with this TP
    group and partition dim) is whole on this rank: no partition, or a TP group of one."""
    return partition_dim is None or tp_group is None or tp_group.size() == 1


def orthogonalize_partition(tp_mode: str, pg_collection: Any, attrs: Any) -> tuple[int, Any] | None:
    """(partition dim, TP group) that TensorParallelMuon.orthogonalize hands Newton-Schulz for a
    param with these tags, or None where it hands none (orthogonalized_partition_dim), or where
    there are no process groups."""
    partition_dim = orthogonalized_partition_dim(tp_mode, attrs)
    tp_group = tensor_parallel_group(pg_collection, attrs)
    if partition_dim is None or tp_group is None:
        return None
    return partition_dim, tp_group
