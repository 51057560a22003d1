"""Collectives that carry out a row layout: learn it once, gather each matrix's rows."""

import torch
import torch.distributed as dist

from .plan import RowLayout


def all_gather_row_counts(local_rows: list[int], group) -> list[list[int]]:
    """Every rank's local row counts for the same list of matrices, rank-major (one collective)."""
    world = dist.get_world_size(group)
    local = torch.tensor(local_rows, dtype=torch.int64)
    table = torch.empty(world * len(local_rows), dtype=torch.int64)
    dist.all_gather_into_tensor(table, local, group=group)
    return table.view(world, len(local_rows)).tolist()


def all_gather_rows(local: torch.Tensor, layout: RowLayout, group) -> torch.Tensor:
    """The full matrix on every rank from uneven row shards.

    Shards are padded to the largest one because gloo's all_gather rejects unequal sizes; the
    padding is trimmed away after the gather.
    """
    world = len(layout.rows)
    padded = local.new_zeros((layout.max_rows, *local.shape[1:]))
    padded[: local.shape[0]].copy_(local)
    gathered = local.new_empty((world * layout.max_rows, *local.shape[1:]))
    dist.all_gather_into_tensor(gathered, padded, group=group)
    gathered = gathered.view(world, layout.max_rows, *local.shape[1:])
    return torch.cat([gathered[rank, :rows] for rank, rows in enumerate(layout.rows)])
