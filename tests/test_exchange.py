"""The collectives of exchange.py on gloo, with uneven and empty shards."""

import pytest
import torch
import torch.distributed as dist

from megatron_muon.exchange import OwnerExchange, all_gather_ints, all_gather_rows
from megatron_muon.plan import Matrix, batch_matrices, choose_owners, exchange_batches, row_layouts

ROWS = [[3, 0, 5], [0, 0, 1], [2, 4, 0], [0, 1, 1]]  # rows[rank][matrix]


def _gather(rank, world_size):
    rows = [r[:] for r in ROWS[:world_size]]
    table = all_gather_ints(rows[rank], dist.group.WORLD, torch.device("cpu"))
    assert table == rows
    layouts = row_layouts(range(world_size), table, [sum(col) for col in zip(*rows)])
    for matrix, layout in enumerate(layouts):
        full = torch.arange(layout.num_rows * 3, dtype=torch.float32).view(-1, 3)
        start, stop = layout.row_range(rank)
        gathered = all_gather_rows(full[start:stop].clone(), layout, dist.group.WORLD)
        assert torch.equal(gathered, full), f"matrix {matrix}"


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_gather_rows_reassembles_uneven_and_empty_shards(distributed, world_size):
    distributed(_gather, world_size)


def _full(matrix_index, rows, cols):
    return torch.arange(rows * cols, dtype=torch.float32).view(rows, cols) + 1000 * matrix_index


# Rows of 5 matrices per shard (more matrices than ranks, not a multiple of W), and which shard
# each rank holds: plain shards, HSDP (2 replicas x 2 shards, the replica dim outermost or
# innermost) and no_shard (every rank holds every row). Widths 3, 5, 3, 5, 3: batches of one
# width, exchanges mixing both.
SHARD_ROWS = [[3, 0, 2, 1, 0], [0, 3, 1, 1, 3], [2, 0, 0, 1, 0], [0, 2, 2, 2, 2]]
LAYOUTS = {"shards": None, "hsdp": (0, 1, 0, 1), "hsdp_inner_replicas": (0, 0, 1, 1),
           "no_shard": (0, 0, 0, 0)}


def _owner_round_trip(rank, world_size, shard_of):
    shard_of = tuple(shard_of or range(world_size))[:world_size]
    rows = [SHARD_ROWS[shard] for shard in shard_of]
    layouts = row_layouts(shard_of, rows, [sum(col) for col in zip(*SHARD_ROWS[:max(shard_of) + 1])])
    matrices = [Matrix(layout, 3 + 2 * (i % 2)) for i, layout in enumerate(layouts)]
    owners = choose_owners(matrices, element_bytes=4)
    exchanges = exchange_batches(matrices, batch_matrices(matrices, max_batch_elements=2 * 5 * 3),
                                 max_elements=3 * 5 * 5)
    assert any(len({matrices[b[0]].cols for b in batches}) > 1 for batches in exchanges), exchanges
    for batches in exchanges:
        exchange = OwnerExchange(matrices, owners, batches, rank, dist.group.WORLD)
        batch = exchange.batch
        local = {}
        for i in batch:
            start, stop = matrices[i].layout.row_range(rank)
            local[i] = _full(i, *matrices[i].shape)[start:stop].clone()
        exchange.start_gather(local)
        owned = exchange.finish_gather()
        assert [i for i in batch if owners[i] == rank] == exchange.owned
        for i, full in zip(exchange.owned, owned):
            assert torch.equal(full, _full(i, *matrices[i].shape))
        exchange.start_scatter([2 * full + 1 for full in owned])
        returned = exchange.finish_scatter()
        assert sorted(returned) == sorted(batch)
        for i in batch:
            start, stop = matrices[i].layout.row_range(rank)
            expected = 2 * _full(i, *matrices[i].shape)[start:stop] + 1
            assert torch.equal(returned[i], expected), (rank, i)
    if len(set(shard_of)) < world_size:  # replicas split the Newton-Schulz work
        assert len(set(owners)) == world_size, owners
    elif world_size == 4:  # a rank that owns nothing still takes part
        assert len(set(owners)) < world_size, owners


@pytest.mark.parametrize("world_size,layout", [(2, "shards"), (4, "shards"), (2, "no_shard"),
                                               (4, "no_shard"), (4, "hsdp"),
                                               (4, "hsdp_inner_replicas")])
def test_owner_exchange_round_trip_with_uneven_empty_and_replicated_shards(distributed, world_size,
                                                                          layout):
    distributed(_owner_round_trip, world_size, LAYOUTS[layout])
