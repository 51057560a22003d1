import pytest

from megatron_muon.plan import (Matrix, RowLayout, batch_matrices, choose_owners, layout_min_bytes,
                                ns_flops, row_layouts, rows_sent)


def test_row_ranges_follow_rank_order_and_allow_empty_shards():
    layout = RowLayout((0, 3, 0, 2))
    assert [layout.row_range(r) for r in range(4)] == [(0, 0), (0, 3), (3, 3), (3, 5)]
    assert layout.num_rows == 5 and layout.max_rows == 3


def test_row_layouts_transposes_the_rank_major_table():
    layouts = row_layouts([[4, 0], [3, 2]], num_rows=[7, 2])
    assert layouts == [RowLayout((4, 3)), RowLayout((0, 2))]


def test_row_layouts_rejects_shards_that_do_not_tile_the_matrix():
    with pytest.raises(ValueError, match="matrix 1: shards hold \\(0, 2\\) rows"):
        row_layouts([[4, 0], [3, 2]], num_rows=[7, 3])


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


def test_batches_group_same_shape_and_key_and_respect_the_size_bound():
    matrices = [_matrix((2, 2)), _matrix((1, 1)), _matrix((2, 2)), _matrix((2, 2), key="qkv"),
                _matrix((2, 2))]
    assert batch_matrices(matrices, max_batch_elements=1000) == [[0, 2, 4], [1], [3]]
    assert batch_matrices(matrices, max_batch_elements=2 * 32) == [[0, 2], [4], [1], [3]]


def test_rows_sent_lists_the_rows_a_rank_sends_each_owner():
    matrices = [_matrix((2, 3, 0)), _matrix((1, 0, 4)), _matrix((0, 2, 2))]
    owners = [1, 2, 2]
    batch = [0, 1, 2]
    assert rows_sent(matrices, owners, batch, src=0, dst=1) == [(0, 0, 2)]
    assert rows_sent(matrices, owners, batch, src=0, dst=2) == [(1, 0, 1)]
    assert rows_sent(matrices, owners, batch, src=1, dst=2) == [(2, 0, 2)]
    assert rows_sent(matrices, owners, batch, src=2, dst=2) == []


def test_row_blocks_cost_what_newton_schulz_runs_on():
    # A QKV matrix of 2 groups x (q 4, k 2, v 2) rows is orthogonalized as 8x16, 4x16, 4x16 blocks.
    qkv = Matrix(RowLayout((10, 6)), 16, row_blocks=(8, 4, 4))
    assert qkv.ns_flops(5) == ns_flops(8, 16, 5) + 2 * ns_flops(4, 16, 5)
    assert Matrix(RowLayout((10, 6)), 16).ns_flops(5) == ns_flops(16, 16, 5)
