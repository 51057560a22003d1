"""plan.offload: what --optimizer-cpu-offload keeps in host memory, copies each step, and holds on
the device at once, from shapes alone."""

import pytest

from megatron_muon.plan import Matrix, RowLayout
from megatron_muon.plan.offload import OffloadFigures, offload_figures, offloaded

F32 = 4


def test_a_rank_offloads_its_rows_of_the_momentum_and_the_second_moment():
    muon = Matrix(RowLayout((3, 0, 5)), 8)
    normuon = Matrix(RowLayout((3, 0, 5)), 8, moment2_cols=1)  # one statistic per row
    for matrix, width in ((muon, 8), (normuon, 9)):
        figures = offload_figures([([matrix], [[[0]]], [0, 1, 2])], F32)
        assert [f.host for f in figures] == [3 * width * F32, 0, 5 * width * F32]


@pytest.mark.parametrize("fraction, picked", [
    (1.0, [True] * 4), (0.0, [False] * 4),
    # HybridDeviceOptimizer's rule: pick while the picked hold less than the share, so the
    # state that crosses it is picked.
    (0.5, [True, True, False, False]), (0.4, [True, True, False, False]),
    (0.3, [True, False, False, False])])
def test_the_offloaded_share_is_picked_as_megatron_cores_hybrid_optimizer_picks(fraction, picked):
    assert offloaded([30, 20, 40, 10], fraction) == picked


def test_the_device_holds_two_exchanges_of_state_at_once():
    # Four matrices of 10 rows x 4 over two ranks (rank 0 holds 6 rows, rank 1 4), in three
    # exchanges: [0, 1] | [2] | [3].
    matrices = [Matrix(RowLayout((6, 4)), 4) for _ in range(4)]
    exchanges = [[[0, 1]], [[2]], [[3]]]
    per_matrix = 6 * 4 * F32
    (figures,) = offload_figures([(matrices, exchanges, [0])], F32)
    # The first two exchanges at once.
    assert figures == OffloadFigures(host=4 * per_matrix, resident=0, streamed=3 * per_matrix)
    # Half of the state stays: the first two matrices go, the other two stay on the device.
    (half,) = offload_figures([(matrices, exchanges, [0])], F32, fraction=0.5)
    assert half == OffloadFigures(host=2 * per_matrix, resident=2 * per_matrix,
                                  streamed=2 * per_matrix)
    # Every rank at once, as each would count itself.
    assert offload_figures([(matrices, exchanges, [0, 1])], F32) == [
        figures, OffloadFigures(host=16 * 4 * F32, resident=0, streamed=12 * 4 * F32)]


def test_each_group_is_counted_at_the_ranks_place_in_it():
    dense = [Matrix(RowLayout((6, 4)), 4)]
    experts = [Matrix(RowLayout((2, 0)), 4), Matrix(RowLayout((0, 2)), 4)]
    # Rank 1 of the dense group is rank 0 of its expert group, rank 0 is rank 1 there (as
    # megatron-core numbers them with expert parallelism 1 here, for the test's sake).
    first, second = offload_figures([(dense, [[[0]]], [1, 0]),
                                     (experts, [[[0]], [[1]]], [0, 1])], F32)
    assert first.host == (4 + 2) * 4 * F32
    assert first.streamed == (4 + 2) * 4 * F32  # the dense exchange beside the first expert one
    assert second == OffloadFigures(host=(6 + 2) * 4 * F32, resident=0, streamed=6 * 4 * F32)


def test_a_rank_that_holds_nothing_offloads_nothing():
    matrices = [Matrix(RowLayout((5, 0)), 4)]
    assert offload_figures([(matrices, [[[0]]], [1])], F32) == [OffloadFigures(0, 0, 0)]
    assert offload_figures([([], [], [0])], F32) == [OffloadFigures(0, 0, 0)]
    assert offload_figures([], F32) == []
