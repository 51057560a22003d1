"""Comparing printed values (tolerances.printed_within): a print is its value rounded, so two
values within the tolerance may print further apart than it, by up to one unit in the last
printed digit; and no further."""

import pytest

from tolerances import printed_unit, printed_within


def test_a_printed_unit_is_one_in_the_last_printed_digit():
    assert printed_unit("0.695") == pytest.approx(1e-3)
    assert printed_unit("6.931472E+00") == pytest.approx(1e-6)
    assert printed_unit("1.000000E-02") == pytest.approx(1e-8)
    assert printed_unit("12") == 1.0


def test_values_within_the_tolerance_that_print_across_a_rounding_boundary_agree():
    """The grad norms of a checkpoint resumed at another world size: 2e-7 apart, printed with
    3 decimals as 0.695 and 0.696, which binary floats put 1.0000000000000009e-3 apart: more
    than abs=1e-3, the bound the suite used to compare them with."""
    uninterrupted, resumed = 0.6954999, 0.6955001
    printed = f"{uninterrupted:.3f}", f"{resumed:.3f}"
    assert printed == ("0.695", "0.696")
    assert float(printed[1]) - float(printed[0]) > 1e-3  # what pytest.approx(abs=1e-3) refused
    assert printed_within(printed[1], printed[0], abs=1e-5)
    assert printed_within(printed[1], printed[0], rel=1e-5)
    assert printed_within("6.931473E+00", "6.931472E+00")  # equal values never print apart,
    assert printed_within("1.000000E+00", "9.999999E-01")  # but neighbours across a boundary may


def test_prints_further_apart_than_tolerance_and_rounding_allow_do_not_agree():
    assert not printed_within("0.697", "0.695", abs=1e-5)  # values at least 1e-3 apart
    assert not printed_within("0.697", "0.695", rel=1e-5)
    assert not printed_within("6.931474E+00", "6.931472E+00")
    assert not printed_within("6.931600E+00", "6.931472E+00", rel=1e-5)  # 1.8e-5 apart
    assert printed_within("6.931540E+00", "6.931472E+00", rel=1e-5)  # 9.8e-6 apart
