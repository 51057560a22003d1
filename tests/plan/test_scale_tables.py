"""docs/scale-model.md's generated tables are the committed `make scale` run's
(benchmarks/results/scale.json, made with benchmarks.scale_tables.SCALE_RUN's arguments):
`python -m benchmarks.scale_tables` writes them."""

import json

from benchmarks.scale_tables import HEADLINE, PAGE, RESULTS, SCALE_RUN, page_with_tables


def test_the_pages_scale_tables_are_the_committed_runs():
    run = json.loads(RESULTS.read_text())
    page = PAGE.read_text()
    assert page_with_tables(page, run["results"]) == page, (
        "docs/scale-model.md's tables are not scale.json's: python -m benchmarks.scale_tables")
    # The run the tables name: its rows, and the step charged in order (issue 83).
    assert {(r["model"], r["tensor_parallel"]) for r in run["results"]} >= set(HEADLINE)
    assert {r["world"] for r in run["results"]} == {256, 1024, 2048}
    assert any("charged in the order the code runs it" in note for note in run["assumptions"])
    assert f'make scale SCALE_ARGS="{SCALE_RUN}"' in " ".join(page.split())
