"""The collectives of exchange.py on gloo, with uneven and empty shards."""

import pytest
import torch
import torch.distributed as dist

from megatron_muon.distribution.exchange import (OwnerRoutes, all_gather_ints, all_gather_rows,
                                                 owner_exchange, run_overlapped)
from megatron_muon.observe.collectives import Traffic, observed
from megatron_muon.plan import (ExchangeMemory, Matrix, batch_matrices, choose_owners,
                                exchange_batches, gather_traffic, owner_bytes, row_layouts,
                                scatter_traffic)

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
# width, exchanges mixing both; each row carries 2 columns more to its owner and 1 back (as
# NAMO's raw gradient and moment do).
SHARD_ROWS = [[3, 0, 2, 1, 0], [0, 3, 1, 1, 3], [2, 0, 0, 1, 0], [0, 2, 2, 2, 2]]
LAYOUTS = {"shards": None, "hsdp": (0, 1, 0, 1), "hsdp_inner_replicas": (0, 0, 1, 1),
           "no_shard": (0, 0, 0, 0)}


def _owner_round_trip(rank, world_size, shard_of):
    shard_of = tuple(shard_of or range(world_size))[:world_size]
    rows = [SHARD_ROWS[shard] for shard in shard_of]
    layouts = row_layouts(shard_of, rows, [sum(col) for col in zip(*SHARD_ROWS[:max(shard_of) + 1])])
    matrices = [Matrix(layout, 3 + 2 * (i % 2), state_cols=2, returned_state_cols=1)
                for i, layout in enumerate(layouts)]
    owners = choose_owners(matrices, element_bytes=4)
    # Batches of at most two matrices; the first exchange as large as all batches but the last
    # need beside any one's start (it holds both widths), the last batch in one of its own
    # where it would add more to it.
    batches = batch_matrices(matrices, 2 * owner_bytes(matrices[0], 4), 4)
    all_but_last, alone = ExchangeMemory(matrices, owners, 4), []
    for batch in batches[:-1]:
        all_but_last.add(batch)
    for batch in batches:
        alone.append(ExchangeMemory(matrices, owners, 4))
        alone[-1].add(batch)
    budgets = [all_but_last.peak(r) + max(memory.started(r) for memory in alone)
               for r in range(world_size)]
    exchanges = exchange_batches(matrices, batches, owners, 4, budgets)
    assert exchanges[0] == batches[:-1] or exchanges == [batches], exchanges
    assert any(len({matrices[b[0]].cols for b in batches}) > 1 for batches in exchanges), exchanges
    routes = [OwnerRoutes(matrices, owners, batches, rank) for batches in exchanges]
    orthogonalized, returned = [], {}

    def _sent(i):  # a whole matrix as its rows travel to the owner
        return _full(i, matrices[i].layout.num_rows, matrices[i].gather_width)

    def _result(i):  # an owner's known result, as wide as it travels back
        return 2 * _sent(i)[:, :matrices[i].scatter_width] + 1

    def orthogonalize(owned, fulls):  # what an owner computes: checked, then a known result
        orthogonalized.extend(owned)
        for i, full in zip(owned, fulls):
            assert owners[i] == rank and torch.equal(full, _sent(i)), (rank, i)
        return [_result(i) for i in owned]

    def local(r):
        return {i: _sent(i)[slice(*matrices[i].layout.row_range(rank))].clone() for i in r.batch}

    with observed(Traffic()) as traffic:
        run_overlapped(owner_exchange(r, dist.group.WORLD, local(r), orthogonalize,
                                      returned.__setitem__) for r in routes)
    assert sorted(orthogonalized) == [i for i in range(len(matrices)) if owners[i] == rank]
    assert sorted(returned) == list(range(len(matrices)))
    for i, rows in returned.items():
        start, stop = matrices[i].layout.row_range(rank)
        assert torch.equal(rows, _result(i)[start:stop]), (rank, i)
    # The hook saw what the routes say: one all-to-all per moving direction, their bytes, which
    # are what the plan counts each direction to move.
    moving = [route for r in routes for route in (r.gather, r.scatter) if route.moves]
    assert traffic.by_name == ({"alltoall_base_": len(moving)} if moving else {})
    assert traffic.received_bytes == 4 * sum(sum(route.recv_counts) for route in moving)
    assert traffic.received_bytes == sum(
        moved.get(rank, (0, 0))[0] for matrix, owner in zip(matrices, owners)
        for moved in (gather_traffic(matrix, owner, 4), scatter_traffic(matrix, owner, 4)))
    assert traffic.peak_buffer_bytes > 0 or not moving
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


def test_run_overlapped_keeps_two_exchanges_in_flight():
    """Exchange k+1's gather is issued before exchange k computes, and exchange k is finished
    before exchange k+2 is taken (built, its update rows computed) and gathered: the schedule
    the optimizer's double buffering and its working-memory bound rely on."""
    events = []

    def exchange(k):
        events.append(f"gather{k}")
        yield
        events.append(f"compute{k}")
        yield
        events.append(f"apply{k}")

    def take(k):
        events.append(f"take{k}")
        return exchange(k)

    run_overlapped(take(k) for k in range(4))
    assert events == ["take0", "gather0", "take1", "gather1", "compute0", "apply0", "take2",
                      "gather2", "compute1", "apply1", "take3", "gather3", "compute2", "apply2",
                      "compute3", "apply3"]
    events.clear()
    run_overlapped([exchange(0)])
    assert events == ["gather0", "compute0", "apply0"]


def _observed_collectives(rank, world_size):
    with observed(Traffic()) as traffic:
        dist.all_gather([torch.empty(3) for _ in range(world_size)], torch.ones(3))
        dist.all_gather_into_tensor(torch.empty(4 * world_size), torch.ones(4))
        dist.all_reduce(torch.ones(2))
        dist.barrier()
    assert traffic.by_name == {"allgather_": 1, "_allgather_base_": 1, "allreduce_": 1}
    # From the other ranks: 3 floats each, 4 floats each; a reduction counts no bytes.
    assert traffic.received_bytes == (world_size - 1) * (3 + 4) * 4
    with observed(Traffic()) as alone:  # a one-rank group moves nothing and is not counted
        dist.all_reduce(torch.ones(2), group=dist.new_group([rank], use_local_synchronization=True))
    assert alone.collectives == 0


@pytest.mark.parametrize("world_size", [2, 4])
def test_observed_sees_every_collective_with_the_bytes_it_receives(distributed, world_size):
    distributed(_observed_collectives, world_size)
