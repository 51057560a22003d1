"""The carry-over table (benchmarks/carry_over.py): each change between a save and a load ends as
its row says. The main suite runs the rows marked `suite`; `make carry-over` runs them all
(CARRY_OVER=all) and writes benchmarks/results/carry_over.json and the table in
docs/reliability.md, which test_the_docs_show_the_committed_carry_over holds to each other."""

import os
import re
import tempfile
from pathlib import Path

import pytest

import demo_log
from benchmarks import carry_over
from benchmarks.docs_table import GeneratedTable
from conftest import first_failure
from e2e_harness import DEMO, REPO, script_argv
from e2e_harness import no_idle_workers  # noqa: F401 (an autouse fixture)
from rank_processes import run_as_torchrun_would

pytestmark = pytest.mark.e2e
EVERY_ROW = os.environ.get("CARRY_OVER") == "all"
ROWS = [row for row in carry_over.ROWS if EVERY_ROW or row.suite]
TABLE = GeneratedTable(carry_over.ROWS, REPO / "benchmarks" / "results" / "carry_over.json",
                       REPO / "docs" / "reliability.md", carry_over.TABLE_START,
                       carry_over.TABLE_END, carry_over.markdown_table)


def rank_as_launched(rank, world_size, argv, log_dir):
    """run_as_torchrun_would with the environment the table says its launch sets
    (carry_over.launch_environment)."""
    os.environ.update(carry_over.launch_environment(argv))
    run_as_torchrun_would(rank, world_size, argv, log_dir)


def demo_run(flags: tuple[str, ...], processes: int) -> tuple[str | None, str | None]:
    """The demo trained to ITERATIONS: (the last rank's log, None), or (None, what it raised)."""
    argv = script_argv(DEMO, carry_over.ITERATIONS, (*carry_over.MODEL, *flags))
    with tempfile.TemporaryDirectory(prefix="carry-over-") as log_dir:
        failure = first_failure(rank_as_launched, processes, argv, log_dir, timeout=600,
                                fresh=True)
        if failure:
            return None, failure
        return (Path(log_dir) / f"{processes - 1}.log").read_text(), None


def saving_run(row: carry_over.Row, directory: Path) -> str:
    """The uninterrupted run's log, its checkpoint of SAVED_AT in `directory`."""
    log, failure = demo_run((*row.saved, "--save", str(directory), "--save-interval",
                             str(carry_over.SAVED_AT)), row.saved_world)
    if failure:
        pytest.fail(f"the saving run failed:\n{failure}", pytrace=False)
    return log


def loading_run(row: carry_over.Row, directory: Path) -> tuple[str | None, str | None]:
    """(its log, None), or (None, what it raised) where it stopped."""
    return demo_run((*row.loaded, "--load", str(directory), "--ckpt-step",
                     str(carry_over.SAVED_AT)), row.loaded_world)


def relative_difference(resumed: str, uninterrupted: str, first: int, last: int) -> float:
    """The largest relative difference of the losses and grad norms of iterations first..last
    (the resumed log must hold the iterations from `first` to ITERATIONS, and only these)."""
    demo_log.losses(resumed, first, carry_over.ITERATIONS)
    largest = 0.0
    for key in ("lm loss", "grad norm"):
        got, expected = (demo_log.exact_values(log, key) for log in (resumed, uninterrupted))
        largest = max([largest] + [abs(got[i] - expected[i]) / abs(expected[i])
                                   for i in range(first, last + 1)])
    return largest


def run_row(row: carry_over.Row, directory: Path) -> dict:
    uninterrupted = saving_run(row, directory)
    resumed, failure = loading_run(row, directory)
    refusal = (failure.strip().splitlines()[-1].replace(str(directory), "DIR") if failure
               else None)
    difference = None if failure else relative_difference(
        resumed, uninterrupted, carry_over.SAVED_AT + 1, row.last)
    shows = carry_over.outcome(row, difference, refusal)
    said = not row.says or (failure is not None and re.search(row.says, failure) is not None)
    return {**{field: getattr(row, field) for field in (
                "saved", "loaded", "saved_world", "loaded_world", "expect", "suite",
                "tested_by")},
            "row": row.name, "shows": shows, "as_expected": shows == row.expect and said,
            "relative_difference": difference, "refusal": refusal,
            "failure": failure[-3000:] if failure and shows != row.expect else None}


@pytest.fixture(scope="module")
def results():
    """Each row's result; with CARRY_OVER=all, written to benchmarks/results/carry_over.json in
    the table's order once every row has run, and docs/reliability.md's table from it."""
    yield from TABLE.collecting()


@pytest.mark.skipif(EVERY_ROW, reason="make carry-over writes them once its rows have run")
def test_the_docs_show_the_committed_carry_over():
    """docs/reliability.md's table is the one benchmarks/results/carry_over.json makes, from a
    run of every row of the table as it is now, each ending as its row says."""
    assert TABLE.mismatches() == []


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.name)
def test_a_change_between_save_and_load_ends_as_its_row_says(row, results, tmp_path):
    result = run_row(row, tmp_path)
    results[row.name] = result
    assert result["as_expected"], (f"{row.name}: {result['shows']} (expected {row.expect}), "
                                   f"difference {result['relative_difference']}, said "
                                   f"{result['refusal']}\n{result['failure']}")
