"""The collectives of exchange.py on gloo, with uneven and empty shards."""

import pytest
import torch
import torch.distributed as dist

from megatron_muon.exchange import all_gather_row_counts, all_gather_rows
from megatron_muon.plan import row_layouts

ROWS = [[3, 0, 5], [0, 0, 1], [2, 4, 0], [0, 1, 1]]  # rows[rank][matrix]


def _gather(rank, world_size):
    rows = [r[:] for r in ROWS[:world_size]]
    table = all_gather_row_counts(rows[rank], dist.group.WORLD)
    assert table == rows
    layouts = row_layouts(table, [sum(col) for col in zip(*rows)])
    for matrix, layout in enumerate(layouts):
        full = torch.arange(layout.num_rows * 3, dtype=torch.float32).view(-1, 3)
        start, stop = layout.row_range(rank)
        gathered = all_gather_rows(full[start:stop].clone(), layout, dist.group.WORLD)
        assert torch.equal(gathered, full), f"matrix {matrix}"


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_gather_rows_reassembles_uneven_and_empty_shards(distributed, world_size):
    distributed(_gather, world_size)
