import pytest

from megatron_muon.plan import RowLayout, row_layouts


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
