import pytest

from megatron_muon.distribution.exchange import OwnerRoutes
import random

from megatron_muon.plan import (ExchangeMemory, Matrix, OwnedBatches, RowLayout, StepCost,
                                batch_matrices, choose_owners, choose_owners_by_time, final_first,
                                estimated_seconds, exchange_batches, gather_segments,
                                layout_min_bytes, newton_schulz_bytes, ns_flops, owner_bytes,
                                owner_plan, owner_traffic, packed_beside, packed_plan,
                                qkv_row_blocks, rank_loads, row_layouts, scatter_segments,
                                whole_matrix_owners, working_memory)
from megatron_muon.plan.budget import (alone_working, batches_ahead, fewest_exchanges,
                                       rank_budgets, state_saved, step_headroom)
from megatron_muon.plan.owner_plan import _packed, step_collectives


def test_row_ranges_follow_rank_order_and_allow_empty_shards():
    layout = RowLayout((0, 3, 0, 2))
    assert [layout.row_range(r) for r in range(4)] == [(0, 0), (0, 3), (3, 3), (3, 5)]
    assert layout.num_rows == 5 and layout.max_rows == 3


def test_row_layouts_transposes_the_rank_major_table():
    layouts = row_layouts([0, 1], [[4, 0], [3, 2]], num_rows=[7, 2])
    assert layouts == [RowLayout((4, 3)), RowLayout((0, 2))]


def test_row_layouts_of_replicas_name_the_shard_each_rank_holds():
    # HSDP: 2 replicas x 2 shards, the group's ranks in shard-minor order.
    layouts = row_layouts([0, 1, 0, 1], [[4, 0], [3, 2], [4, 0], [3, 2]], num_rows=[7, 2])
    assert layouts == [RowLayout((4, 3), (0, 1, 0, 1)), RowLayout((0, 2), (0, 1, 0, 1))]
    assert [layouts[0].row_range(r) for r in range(4)] == [(0, 4), (4, 7), (0, 4), (4, 7)]
    with pytest.raises(ValueError, match="replicas of shard 1 hold 2 and 1 rows"):
        row_layouts([0, 1, 0, 1], [[4, 0], [3, 2], [4, 0], [3, 1]], num_rows=[7, 2])


def test_row_layouts_rejects_shards_that_do_not_tile_the_matrix():
    with pytest.raises(ValueError, match="matrix 1: shards hold \\(0, 2\\) rows"):
        row_layouts([0, 1], [[4, 0], [3, 2]], num_rows=[7, 3])


def test_negative_rows_are_rejected():
    with pytest.raises(ValueError):
        RowLayout((1, -1))


def _matrix(rows, cols=8, key=None):
    return Matrix(RowLayout(tuple(rows)), cols, key)


def test_ns_flops_uses_the_smaller_side():
    assert ns_flops(4, 10, steps=5) == 5 * (4 * 16 * 10 + 2 * 64) == ns_flops(10, 4, steps=5)


def test_owner_is_the_rank_holding_most_rows_when_bytes_are_at_stake():
    matrices = [_matrix((1, 6, 1)), _matrix((0, 0, 5)), _matrix((3, 1, 0))]
    owners = choose_owners(matrices, element_bytes=4, byte_slack=0.0)
    assert owners == [1, 2, 0]
    moved = sum(m.bytes_to_owner(o, 4) for m, o in zip(matrices, owners))
    assert moved == layout_min_bytes(matrices, 4) == 2 * (2 + 0 + 1) * 8 * 4


def _flop_time(bytes_per_second, flops_per_second=1e9):
    """A StepCost whose Newton-Schulz time is FLOPs at one rate."""
    return StepCost(lambda m, count: count * m.ns_flops(5) / flops_per_second, bytes_per_second)


def _makespan(matrices, owners, cost):
    return max(estimated_seconds(matrices, owners, batch_matrices(matrices, 1 << 30, 4), 4, cost))


def _moved(matrices, owners):
    return sum(m.bytes_to_owner(o, 4) for m, o in zip(matrices, owners))


def test_owners_by_time_move_work_off_the_rank_holding_it_only_when_bytes_are_cheap():
    # Every matrix is held whole on rank 0: fewest bytes leaves rank 0 all Newton-Schulz work.
    matrices = [_matrix((64, 0), cols=64) for _ in range(4)]
    batches = batch_matrices(matrices, 1 << 30, 4)
    slow_network, fast_network = _flop_time(1e3), _flop_time(1e12)
    assert choose_owners_by_time(matrices, batches, 4, slow_network) == [0, 0, 0, 0]
    owners = choose_owners_by_time(matrices, batches, 4, fast_network)
    assert sorted(owners) == [0, 0, 1, 1]
    assert _makespan(matrices, owners, fast_network) < 0.6 * _makespan(matrices, [0] * 4, fast_network)


def test_owners_by_time_leave_byte_first_only_for_a_gain_that_outlasts_the_rates_spread():
    # As above: all four matrices on rank 0, or two of them moved to rank 1 (2 T of Newton-Schulz
    # saved for 2 B of bytes over the bandwidth). With B = T / 1.5, the move gains with bytes up
    # to 1.5 times dearer: kept at spread 0.4, not at 0.6. On a fast network the move is
    # Newton-Schulz alone, which every placement's rate error scales alike: kept at any spread.
    matrices = [_matrix((64, 0), cols=64) for _ in range(4)]
    batches = batch_matrices(matrices, 1 << 30, 4)
    seconds = _flop_time(1e12).call_seconds(matrices[0], 1)  # T
    per_matrix = 64 * 64 * 4
    bandwidth = per_matrix * 1.5 / seconds
    for spread, network, owners in ((0.4, bandwidth, [0, 0, 1, 1]), (0.6, bandwidth, [0] * 4),
                                    (0.9, 1e15, [0, 0, 1, 1])):
        cost = StepCost(_flop_time(1e12).call_seconds, network, spread)
        assert sorted(choose_owners_by_time(matrices, batches, 4, cost)) == owners, spread
    # Without the spread the move is estimated faster on both networks.
    for network in (bandwidth, 1e15):
        moved = StepCost(_flop_time(1e12).call_seconds, network)
        assert _makespan(matrices, [0, 0, 1, 1], moved) < _makespan(matrices, [0] * 4, moved)


def test_owners_by_time_keep_bytes_within_the_cap():
    matrices = [_matrix((64, 0), cols=64) for _ in range(4)] + [_matrix((32, 32), cols=64)]
    batches = batch_matrices(matrices, 1 << 30, 4)
    minimum = layout_min_bytes(matrices, 4)
    for slack in (0.0, 0.5, 1.0, 2.0):
        owners = choose_owners_by_time(matrices, batches, 4, _flop_time(1e12), byte_slack=slack)
        assert _moved(matrices, owners) - minimum <= slack * minimum
    assert owner_plan(matrices, 4, byte_slack=0.0, cost=_flop_time(1e12)).owners[:4] == [0] * 4


def test_owners_by_time_are_never_slower_than_byte_first_or_whole_matrix_owners():
    """On random uneven layouts (empty shards, replicas), networks and caps: the chosen owners'
    estimated step is at most that of the byte-first owners and, where it fits the cap, of the
    whole-matrix placement; and equal inputs give equal owners (ranks must agree)."""
    rng = random.Random(0)
    improved = 0
    for _ in range(150):
        world = rng.choice([2, 3, 4, 8, 24])
        shard_of = tuple(r % (world // 2) for r in range(world)) if world % 2 == 0 and rng.random() < 0.3 else None
        shards = len(set(shard_of)) if shard_of else world
        matrices = []
        for _ in range(rng.randint(1, 16)):
            rows = [rng.choice([0, 0, 5, 17, 64]) for _ in range(shards)]
            rows[0] += 0 if sum(rows) else 3
            matrices.append(Matrix(RowLayout(tuple(rows), shard_of), rng.choice([16, 64, 128]),
                                   rng.choice([None, "k"])))
        batches = batch_matrices(matrices, 1 << 30, 4)
        assert all(m.least_bytes(4) == min(m.bytes_to_owner(r, 4) for r in range(world))
                   for m in matrices)
        cost = _flop_time(rng.choice([1e5, 1e7, 1e9, 1e11]))
        slack = rng.choice([None, 0.0, 0.05, 1.0])
        owners = choose_owners_by_time(matrices, batches, 4, cost, slack)
        assert owners == choose_owners_by_time(matrices, batches, 4, cost, slack)
        minimum = layout_min_bytes(matrices, 4)
        assert slack is None or _moved(matrices, owners) - minimum <= slack * minimum
        byte_first = choose_owners(matrices, 4, 0.05 if slack is None else min(slack, 0.05))
        assert _makespan(matrices, owners, cost) <= _makespan(matrices, byte_first, cost)
        whole = whole_matrix_owners(matrices)
        if slack is None or _moved(matrices, whole) - minimum <= slack * minimum:
            assert _makespan(matrices, owners, cost) <= _makespan(matrices, whole, cost)
        improved += _makespan(matrices, owners, cost) < _makespan(matrices, byte_first, cost)
    assert improved > 20  # the choice is not byte-first's everywhere


def test_whole_matrix_owners_spread_elements_largest_first():
    matrices = [_matrix((8, 0), cols=8), _matrix((4, 0), cols=8), _matrix((2, 2), cols=8),
                _matrix((0, 3), cols=8)]
    # 64, 32, 32, 24 elements; the last goes to rank 0 (tied on 64) though rank 1 holds it.
    assert whole_matrix_owners(matrices) == [0, 1, 1, 0]


def test_evenly_split_matrices_are_balanced_longest_first():
    # Every rank holds the same rows of each matrix: owners cost the same bytes, so LPT decides.
    matrices = [_matrix((4, 4), cols=8), _matrix((2, 2), cols=8), _matrix((2, 2), cols=8),
                _matrix((1, 1), cols=8)]
    owners = choose_owners(matrices, element_bytes=4)
    assert owners == [0, 1, 1, 1]


def test_slack_lets_a_little_traffic_buy_balance():
    # Both matrices sit mostly on rank 0; with no slack rank 0 does all the Newton-Schulz work.
    matrices = [_matrix((7, 1), cols=8), _matrix((7, 1), cols=8)]
    assert choose_owners(matrices, element_bytes=4, byte_slack=0.0) == [0, 0]
    min_bytes = layout_min_bytes(matrices, 4)
    owners = choose_owners(matrices, element_bytes=4, byte_slack=3.0)
    assert sorted(owners) == [0, 1]
    moved = sum(m.bytes_to_owner(o, 4) for m, o in zip(matrices, owners))
    assert moved <= (1 + 3.0) * min_bytes


def test_ranks_can_own_nothing():
    matrices = [_matrix((5, 0, 0, 0)), _matrix((0, 3, 0, 0)), _matrix((4, 0, 0, 0))]
    owners = choose_owners(matrices, element_bytes=4)
    assert owners == [0, 1, 0]


def test_owners_count_each_ranks_load_in_the_group_planned_beside():
    """Four equal matrices, half of each on either rank: apart, two each; beside a group whose
    exchanges keep rank 0 busy for three of them (`base`), rank 1 takes at least three, by bytes
    (FLOPs balanced) and by time, and the estimated step counts the base."""
    matrices = [_matrix((16, 16), cols=32) for _ in range(4)]
    batches = batch_matrices(matrices, 1 << 30, 4)
    cost = _flop_time(1e15)
    per_matrix, seconds = matrices[0].ns_flops(steps=1), cost.call_seconds(matrices[0], 1)
    assert sorted(choose_owners(matrices, 4, byte_slack=1.0)) == [0, 0, 1, 1]
    assert sorted(choose_owners_by_time(matrices, batches, 4, cost)) == [0, 0, 1, 1]
    by_bytes = choose_owners(matrices, 4, byte_slack=1.0, base=[3 * per_matrix, 0])
    by_time = choose_owners_by_time(matrices, batches, 4, cost, base=[3 * seconds, 0.0])
    assert by_bytes.count(1) >= 3 and by_time.count(1) >= 3
    busiest = max(estimated_seconds(matrices, by_time, batches, 4, cost, [3 * seconds, 0.0]))
    assert busiest == pytest.approx(4 * seconds, rel=1e-3)
    assert rank_loads(matrices, by_bytes, batches, 4, None) == [
        by_bytes.count(r) * per_matrix for r in range(2)]


def test_packed_beside_another_groups_exchanges_fits_the_budget_apart_or_says_not():
    """Packed to run interleaved with another group's exchanges, of which each rank holds
    `reserved`: within each rank's budget less that, and each rank told whether both fit the
    budget it has apart (else they run apart: planner.interleaving)."""
    matrices = [_matrix((2, 2)), _matrix((1, 1), cols=4), _matrix((2, 2), key="x")]
    owned = OwnedBatches([0, 1, 0], [[0], [1], [2]])
    apart = packed_plan(matrices, owned, 4, None, headroom=0, saved=[10 ** 6] * 2)
    held = working_memory(matrices, owned.owners, apart.exchanges, 4)
    plan, fits = packed_beside(matrices, owned, 4, None, 0, [10 ** 6] * 2, [10 ** 6 - held[0], 0])
    assert fits == [True, True] and plan.budgets == [held[0], 10 ** 6]
    assert working_memory(matrices, owned.owners, plan.exchanges, 4)[0] <= held[0]
    plan, fits = packed_beside(matrices, owned, 4, None, 0, [10 ** 6] * 2, [10 ** 6, 0])
    assert fits == [False, True]  # rank 0's own batches alone need more than it has left
    assert plan.budgets[0] == alone_working(matrices, owned.owners, owned.batches, 4)[0]


def test_batches_group_same_shape_and_key_and_respect_the_size_bound():
    matrices = [_matrix((2, 2)), _matrix((1, 1)), _matrix((2, 2)), _matrix((2, 2), key="qkv"),
                _matrix((2, 2))]
    assert batch_matrices(matrices, 1 << 30, element_bytes=4) == [[0, 2, 4], [1], [3]]
    two = 2 * owner_bytes(matrices[0], 4)
    assert batch_matrices(matrices, two, element_bytes=4) == [[0, 2], [4], [1], [3]]
    assert batch_matrices(matrices, two - 1, element_bytes=4) == [[0], [2], [4], [1], [3]]


def test_exchange_memory_counts_each_stage_of_an_owner_exchange():
    # A 5x8 matrix, rows (2, 3, 0), owned by rank 1; 4-byte elements: 32 bytes a row.
    matrix = Matrix(RowLayout((2, 3, 0)), 8)
    memory = ExchangeMemory([matrix], [1], element_bytes=4)
    memory.add([0])
    newton_schulz = newton_schulz_bytes(matrix, 4)
    assert newton_schulz == (3 * 5 * 8 + 2 * 5 * 5) * 4
    # The owner: its 3 update rows, then the matrix assembled (the call's input), beside
    # Newton-Schulz, result included (one matrix: no batched input).
    assert memory.peak(1) == 3 * 32 + 160 + newton_schulz == memory.largest
    # Rank 0: its 2 update rows, sent in the gather, then received back in the scatter.
    assert memory.peak(0) == 2 * 32 + 2 * 32
    assert memory.started(1) == 3 * 32 + 2 * 32
    assert memory.peak(2) == memory.started(2) == 0
    # Two such matrices in one batch on one owner are stacked into one batched input first.
    pair = ExchangeMemory([matrix, matrix], [1, 1], element_bytes=4)
    pair.add([0, 1])
    assert pair.peak(1) == 2 * 3 * 32 + 2 * 160 + (2 * newton_schulz + 2 * 160)


def _packed_memory(matrices, owners, exchange):
    memory = ExchangeMemory(matrices, owners, element_bytes=4)
    for batch in exchange:
        memory.add(batch)
    return memory


def test_exchanges_pack_batches_within_each_ranks_budget_two_in_flight():
    matrices = [_matrix((2, 2)), _matrix((1, 1), cols=4), _matrix((2, 2), key="x")]
    owners, batches = [0, 1, 0], [[0], [1], [2]]

    def most(*exchanges):  # each rank's working memory with these exchanges
        return working_memory(matrices, owners, list(exchanges), 4)

    two_then_one = most([[0], [1]], [[2]])
    assert max(two_then_one) < max(most([[0], [1], [2]]))
    assert exchange_batches(matrices, batches, owners, 4, two_then_one) == [[[0], [1]], [[2]]]
    # All three in one exchange: the budget holds them, and, while the last batch is still to
    # come, the first two beside its start (room for it to open an exchange of its own).
    together, third = most([[0], [1], [2]]), _packed_memory(matrices, owners, [[2]])
    first_two = _packed_memory(matrices, owners, [[0], [1]])
    roomy = [max(most_held, first_two.peak(rank) + third.started(rank))
             for rank, most_held in enumerate(together)]
    assert exchange_batches(matrices, batches, owners, 4, roomy) == [[[0], [1], [2]]]
    assert exchange_batches(matrices, batches, owners, 4, together) != [[[0], [1], [2]]]
    # A batch over its budget still gets an exchange of its own.
    assert exchange_batches(matrices, batches, owners, 4, [1, 1]) == [[[0]], [[1]], [[2]]]
    # Two exchanges in flight: the first at its peak beside the second started.
    first, second = _packed_memory(matrices, owners, [[0], [1]]), _packed_memory(
        matrices, owners, [[2]])
    assert two_then_one == [max(first.peak(rank) + second.started(rank), second.peak(rank))
                            for rank in range(2)]


def test_packing_keeps_every_rank_within_its_budget_on_random_layouts():
    """First fit with two in flight, the last exchange keeping room for what may open the next:
    on random uneven layouts and batches, every batch goes once, and every rank's working
    memory stays within its budget, whatever it adds to what its batches need alone."""
    rng = random.Random(1)
    for _ in range(60):
        world = rng.choice([2, 3, 4])
        matrices = [_matrix([rng.choice([0, 0, 1, 3, 6]) for _ in range(world - 1)] + [1],
                            cols=rng.choice([4, 8])) for _ in range(rng.randint(2, 9))]
        owners = choose_owners(matrices, element_bytes=4)
        batches = batch_matrices(matrices, rng.choice([1, 1000, 4000]), 4)
        alone = alone_working(matrices, owners, batches, 4)
        budgets = [need + rng.choice([0, 0, 40, 400, 4000]) for need in alone]
        exchanges = exchange_batches(matrices, batches, owners, 4, budgets)
        assert sorted(b for exchange in exchanges for b in exchange) == sorted(batches)
        held = working_memory(matrices, owners, exchanges, 4)
        assert all(h <= budget for h, budget in zip(held, budgets)), (held, budgets)
        assert 1 <= fewest_exchanges(matrices, owners, batches, 4, budgets) <= len(exchanges)
        if all(budget >= max(held) * 3 for budget in budgets):
            assert len(exchanges) == 1


def test_the_gather_inside_backward_packs_its_batches_first_within_each_owners_saving():
    """packed_plan with `ahead`: the batches that gather inside backward (`early`), the first of
    those that may (batches_ahead, over the batches in the order their gradients become final:
    final_first), come first, in that order, and the rest after them, first fit: joining their
    exchanges (each one's scatter carries all; its gather at the step only the rest) or apart,
    whichever leaves the step fewer collectives, then more ahead; each owner holds them whole,
    momentum beside gradient, within what Muon's state saves it; the step issues no more
    collectives than without any ahead (step_collectives), and where one more batch ahead would
    keep that too, none is left out; every batch goes once and every rank's working memory,
    the batches ahead counted twice as wide where they travel, stays within its budget. Without
    `ahead` the packing is first fit over every batch, as before."""
    rng = random.Random(2)
    some_ahead = some_left = 0
    ways = {True: 0, False: 0}  # packed apart, and sharing: each chosen somewhere
    for _ in range(60):
        world = rng.choice([2, 4])
        matrices = [_matrix([rng.choice([0, 1, 3, 6]) for _ in range(world - 1)] + [1],
                            cols=rng.choice([4, 8])) for _ in range(rng.randint(2, 12))]
        owned = OwnedBatches(choose_owners(matrices, element_bytes=4),
                             batch_matrices(matrices, rng.choice([1, 1000]), 4))
        plain = packed_plan(matrices, owned, 4, None, headroom=0)
        assert plain.ahead == 0 and plain.exchanges == exchange_batches(
            matrices, owned.batches, owned.owners, 4, plain.budgets)
        plan = packed_plan(matrices, owned, 4, None, headroom=0, ahead=True)
        candidates = final_first(owned.batches)
        chosen = batches_ahead(matrices, owned.owners, candidates, 4, state_saved(matrices, 4))
        fitting = [batch for batch, ahead in zip(candidates, chosen) if ahead]
        early = [batch for batch in fitting if batch[0] in plan.early]
        assert early == fitting[:len(early)]  # a prefix, in that order
        assert plan.early == {i for batch in early for i in batch}
        steps = step_collectives(matrices, owned.owners, plain.exchanges)
        assert step_collectives(matrices, owned.owners, plan.exchanges, plan.early) <= steps
        if early:
            way = next(apart for apart in (True, False) if _packed(
                matrices, owned, 4, None, 0, None, None, early, apart) == plan)
            ways[way] += 1
            if len(early) < len(fitting):  # one more ahead would add a collective at the step
                more = _packed(matrices, owned, 4, None, 0, None, None,
                               fitting[:len(early) + 1], way)
                assert step_collectives(matrices, owned.owners, more.exchanges,
                                        more.early) > steps
                some_left += 1
        # First fit opens them in that order, the first `ahead` exchanges.
        assert [min(b) for b in early] == sorted((min(b) for b in early), reverse=True)
        assert all(any(batch in early for batch in exchange)
                   for exchange in plan.exchanges[:plan.ahead])
        assert not any(batch in early for exchange in plan.exchanges[plan.ahead:]
                       for batch in exchange)
        assert sorted(b for exchange in plan.exchanges for b in exchange) == sorted(owned.batches)
        held = [0] * world
        for i in plan.early:
            held[owned.owners[i]] += matrices[i].layout.num_rows * 2 * matrices[i].cols * 4
        assert all(h <= kept for h, kept in zip(held, state_saved(matrices, 4))), held
        counted = [m.carrying_momentum() if i in plan.early else m  # counted as they travel
                   for i, m in enumerate(matrices)]
        memory = working_memory(counted, owned.owners, plan.exchanges, 4)
        assert all(h <= budget for h, budget in zip(memory, plan.budgets)), (memory, plan)
        some_ahead += bool(early)
    assert some_ahead > 10 and some_left > 0 and all(ways.values()), (some_ahead, some_left,
                                                                       ways)


def test_a_matrix_too_large_for_its_owners_saving_goes_alone_on_it_beside_other_owners():
    """Each rank's budget never goes below what its own batches need alone: a matrix needing
    more than its owner's saving holds that owner alone in its exchange (state offloaded:
    budgets are the savings), while other owners' matrices travel in the same exchange; a
    second such matrix on the same owner takes the next. By default the owner also keeps its
    saving besides, and every rank gets the headroom the busiest one needs anyway."""
    big = Matrix(RowLayout((8, 0, 0, 0)), 8)
    matrices = [big, Matrix(RowLayout((0, 0, 2, 0)), 8), Matrix(RowLayout((0, 0, 0, 2)), 8), big]
    owners, batches = [0, 2, 3, 0], [[0], [1], [2], [3]]
    saved, alone = state_saved(matrices, 4), alone_working(matrices, owners, batches, 4)
    offloaded = rank_budgets(matrices, owners, batches, 4, None, headroom=None)
    assert offloaded == [max(1, s, need) for s, need in zip(saved, alone)]
    assert offloaded[0] == alone[0] > saved[0]
    exchanges = exchange_batches(matrices, batches, owners, 4, offloaded)
    assert exchanges == [[[0], [1], [2]], [[3]]]
    held = working_memory(matrices, owners, exchanges, 4)
    assert all(h <= budget for h, budget in zip(held, offloaded))

    headroom = step_headroom(matrices, owners, batches, 4)
    assert headroom == max(need - s for s, need in zip(saved, alone)) > 0
    budgets = rank_budgets(matrices, owners, batches, 4, None, headroom)
    assert budgets[0] == saved[0] + alone[0]
    assert budgets[2:] == [s + headroom for s in saved[2:]]
    # A budget the user sets is every rank's, raised to what a rank's batches need alone.
    assert rank_budgets(matrices, owners, batches, 4, 10, headroom) == [
        max(10, need) for need in alone]


def test_gather_segments_list_the_rows_a_rank_sends_each_owner():
    matrices = [_matrix((2, 3, 0)), _matrix((1, 0, 4)), _matrix((0, 2, 2))]
    owners = [1, 2, 2]
    batch = [0, 1, 2]
    assert gather_segments(matrices, owners, batch, src=0, dst=1) == [(0, 0, 2)]
    assert gather_segments(matrices, owners, batch, src=0, dst=2) == [(1, 0, 1)]
    assert gather_segments(matrices, owners, batch, src=1, dst=2) == [(2, 0, 2)]
    assert gather_segments(matrices, owners, batch, src=2, dst=2) == []
    # Results go back the way the rows came.
    assert scatter_segments(matrices, owners, batch, src=1, dst=0) == [(0, 0, 2)]
    assert scatter_segments(matrices, owners, batch, src=2, dst=1) == [(2, 0, 2)]


def test_replicas_gather_inside_their_replica_and_all_get_the_result():
    # 2 replicas x 2 shards; rank 2 (replica 1, shard 0) owns the matrix.
    matrix = Matrix(RowLayout((3, 2), (0, 1, 0, 1)), 8)
    assert [gather_segments([matrix], [2], [0], src, 2) for src in range(4)] == [[], [], [], [(0, 3, 5)]]
    assert [scatter_segments([matrix], [2], [0], 2, dst) for dst in range(4)] == [
        [(0, 0, 3)], [(0, 3, 5)], [], [(0, 3, 5)]]
    # In: 2 rows; out: the 3 + 2 + 2 rows the other ranks hold.
    assert matrix.bytes_to_owner(2, 4) == (2 + 7) * 8 * 4


def test_replicated_matrices_are_spread_over_the_replicas():
    # no_shard: every rank holds every row; owning costs the same everywhere, so LPT spreads.
    matrices = [Matrix(RowLayout((6,), (0, 0, 0)), 8) for _ in range(4)]
    assert choose_owners(matrices, element_bytes=4) == [0, 1, 2, 0]
    assert matrices[0].bytes_to_owner(1, 4) == 2 * 6 * 8 * 4
    assert gather_segments(matrices, [1, 1, 1, 1], [0], src=0, dst=1) == []


def test_pieces_cut_a_stacked_expert_weight_into_its_experts():
    # 3 experts of 4 rows over 3 ranks holding 5, 0 and 7 rows: expert 1 straddles ranks 0 and 2.
    layout = RowLayout((5, 0, 7))
    assert [layout.piece(s, s + 4).rows for s in (0, 4, 8)] == [(4, 0, 0), (1, 0, 3), (0, 0, 4)]
    assert [layout.local_range(0, s, s + 4) for s in (0, 4, 8)] == [(0, 4), (4, 5), (5, 5)]
    assert [layout.local_range(2, s, s + 4) for s in (0, 4, 8)] == [(0, 0), (0, 3), (3, 7)]
    assert layout.local_range(1, 4, 8) == (0, 0)


def test_row_blocks_cost_what_newton_schulz_runs_on():
    # A QKV matrix of 2 groups x (q 4, k 2, v 2) rows is orthogonalized as 8x16, 4x16, 4x16 blocks.
    assert qkv_row_blocks(16, (4, 2, 2)) == (8, 4, 4)
    qkv = Matrix(RowLayout((10, 6)), 16, row_blocks=(8, 4, 4))
    assert qkv.ns_flops(5) == ns_flops(8, 16, 5) + 2 * ns_flops(4, 16, 5)
    assert Matrix(RowLayout((10, 6)), 16).ns_flops(5) == ns_flops(16, 16, 5)


@pytest.mark.parametrize("layouts, owners", [
    ([RowLayout((2, 3, 0)), RowLayout((1, 0, 4)), RowLayout((0, 2, 2)), RowLayout((5, 0, 0))], [1, 2, 2, 0]),
    ([RowLayout((3, 2), (0, 1, 0, 1)), RowLayout((0, 4), (0, 1, 0, 1))], [2, 1]),  # HSDP replicas
    ([RowLayout((6,), (0, 0, 0))] * 2, [1, 2]),  # no_shard
])
def test_owner_traffic_is_what_each_rank_routes(layouts, owners):
    """Per rank, the bytes owner_traffic counts are those the exchange's routes carry, and a
    direction moves something exactly when some rank's route is not empty."""
    matrices = [Matrix(layout, 8) for layout in layouts]
    batch = list(range(len(matrices)))
    world = layouts[0].ranks
    routes = [OwnerRoutes(matrices, owners, [batch], rank) for rank in range(world)]
    received, sent = owner_traffic(matrices, owners, element_bytes=4)
    assert received == [4 * (sum(r.gather.recv_counts) + sum(r.scatter.recv_counts)) for r in routes]
    assert sent == [4 * (sum(r.gather.send_counts) + sum(r.scatter.send_counts)) for r in routes]
    assert sum(sent) == sum(m.bytes_to_owner(o, 4) for m, o in zip(matrices, owners))
    for direction in ("gather", "scatter"):
        moving = any(any(getattr(r, direction).recv_counts) for r in routes)
        assert all(getattr(r, direction).moves == moving for r in routes)
    # Nothing moves when every owner holds its matrix whole and alone.
    alone = [Matrix(RowLayout((0, 5, 0)), 8)]
    assert not OwnerRoutes(alone, [1], [[0]], 0).gather.moves
    assert not OwnerRoutes(alone, [1], [[0]], 0).scatter.moves




def test_newton_schulz_on_a_gathered_matrix_counts_the_whole_matrix_and_its_copies():
    """--muon-tp-mode duplicated: newton_schulz_tp all-gathers the TP shards (here 2 of 3x8 rows
    along dim 0) and runs Newton-Schulz on the whole 6x8 matrix, beside the shards and their
    concatenation."""
    local = Matrix(RowLayout((3,)), 8)
    gathered = Matrix(RowLayout((3,)), 8, tp_gather=(0, 2))
    assert newton_schulz_bytes(local, 4) == (3 * 3 * 8 + 2 * 3 * 3) * 4
    assert newton_schulz_bytes(gathered, 4) == (3 * 6 * 8 + 2 * 6 * 6 + 2 * 6 * 8) * 4
