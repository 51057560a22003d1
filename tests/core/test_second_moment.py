"""The adaptive variants' written contract (core/second_moment.py): every variant is one of its
two kinds, says what travels with named columns, and cannot be built without its hooks. The
variants' numbers: tests/core/test_numerics.py (bit-identical to megatron-core's optimizer)."""

import dataclasses

import pytest
import torch

from megatron_muon.core.second_moment import (NAMO, SECOND_MOMENTS, AdaMuon, Columns,
                                              HolderSecondMoment, NorMuon, OwnerSecondMoment,
                                              SecondMoment)
from megatron_muon.plan import Matrix, RowLayout


def test_each_variant_says_what_each_row_holds_and_carries():
    tall, wide = (12, 5), (3, 10)
    assert [(name, type(variant).__mro__[1]) for name, variant in SECOND_MOMENTS.items()] == [
        ("adamuon", HolderSecondMoment), ("normuon", OwnerSecondMoment),
        ("namo", OwnerSecondMoment)]
    # AdaMuon: a moment as large as the param, nothing beside the update.
    assert AdaMuon().held_columns(*tall) == 5 and AdaMuon().columns(*tall) == Columns(5)
    # NorMuon: a row's mean (tall), the wide matrix's column moment laid along its rows.
    assert NorMuon().columns(*tall) == Columns(update=5, grad=0, moment2=1)
    assert NorMuon().columns(*wide) == Columns(update=10, grad=0, moment2=4)
    # NAMO: the raw gradient's rows and one moment column travel to the owner; the moment alone
    # comes back beside the update.
    assert NAMO().columns(*wide) == Columns(update=10, grad=10, moment2=1)
    assert NAMO().columns(*wide).beside == 11
    assert NAMO().columns(*wide).returned == Columns(update=10, grad=0, moment2=1)
    assert NorMuon().columns(*wide).returned == NorMuon().columns(*wide)


def test_the_plan_sizes_each_direction_by_what_it_carries():
    matrix = Matrix(RowLayout((2, 1)), 10)
    namo = NAMO().planned(matrix)
    assert (namo.gather_width, namo.scatter_width, namo.moment2_cols) == (21, 11, 1)
    # Owner 0 receives rank 1's row at 21 columns and returns it at 11, 4 bytes each.
    assert namo.bytes_to_owner(0, 4) == (21 + 11) * 4
    assert AdaMuon().planned(matrix) == dataclasses.replace(matrix, moment2_cols=10)


def test_columns_split_and_return_by_name():
    columns = Columns(update=3, grad=2, moment2=1)
    rows = torch.arange(12.0, device="cpu").view(2, 6)
    update, grad, moment2 = columns.split(rows)
    assert update.tolist() == [[0, 1, 2], [6, 7, 8]] and grad.tolist() == [[3, 4], [9, 10]]
    assert moment2.tolist() == [[5], [11]]
    back = OwnerSecondMoment.returned_rows(update, moment2)
    assert [t.tolist() for t in columns.returned.split(back)] == [
        update.tolist(), [[], []], moment2.tolist()]
    beside = NAMO().travelling(grad, moment2)
    assert torch.equal(beside, rows[:, 3:])
    assert AdaMuon().travelling(grad, moment2) is None


def test_an_owner_variant_keeps_the_moment_that_comes_back():
    columns = NorMuon().columns(4, 3)
    back = torch.arange(16.0, device="cpu").view(4, 4)
    moment2 = torch.zeros(4, 1, device="cpu")
    update = NorMuon().holder_update(None, back, columns, moment2, {}, (4, 3))
    assert torch.equal(update, back[:, :3]) and torch.equal(moment2, back[:, 3:])
    # NAMO's rows come back without the raw gradient's columns.
    columns = NAMO().columns(4, 3).returned
    update = NAMO().holder_update(None, back, columns, moment2, {}, (4, 3))
    assert torch.equal(update, back[:, :3]) and torch.equal(moment2, back[:, 3:])


def test_a_variant_without_its_hooks_is_refused_when_built():
    class Incomplete(OwnerSecondMoment):
        name = "incomplete"

        def held_columns(self, rows, cols):
            return 1

    with pytest.raises(TypeError, match="owner_update"):
        Incomplete()
    with pytest.raises(TypeError):
        SecondMoment()
