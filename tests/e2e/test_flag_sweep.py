"""The flag sweep (benchmarks/sweep.py): each row's flag on Megatron-FSDP against Megatron DDP on
the same model and data, ending as its table says. The main suite runs the rows marked `suite`;
`make sweep` runs them all (SWEEP=all) and writes benchmarks/results/sweep.json and the table in
docs/flags.md, which test_the_docs_show_the_committed_sweep holds to each other."""

import json
import os

import pytest
from conftest import close_pools, run_distributed

from benchmarks import sweep
from benchmarks.docs_table import GeneratedTable
from megatron_muon.compat import upstream
from megatron_muon.fixes import upstream_fixes

EVERY_ROW = os.environ.get("SWEEP") == "all"
ROWS = [row for row in sweep.ROWS if EVERY_ROW or row.suite]
# Run by layout (megatron-core's groups are built once per layout and process); the results are
# written in the table's order.
RUN_ORDER = sorted(ROWS, key=lambda row: row.parallel_layout)
# Rows one pool of processes runs before fresh ones take over: every model Megatron-FSDP builds
# makes process groups (its device mesh), whose gloo threads torch never ends; a W=4 rank held
# over a thousand of them after a hundred rows, and spent its time there.
ROWS_PER_POOL = 8
_run_in_pool = {"layout": None, "rows": 0}
TABLE = GeneratedTable(sweep.ROWS, sweep.REPO / "benchmarks" / "results" / "sweep.json",
                       sweep.REPO / "docs" / "flags.md", sweep.TABLE_START, sweep.TABLE_END,
                       sweep.markdown_table)


def _run_row(rank, world_size, row, path):
    result = sweep.run_row(row)
    if rank == 0:
        path.write_text(json.dumps(result))


@pytest.fixture(scope="module")
def results():
    """Each row's result; with SWEEP=all, written to benchmarks/results/sweep.json in the
    table's order once every row has run, and docs/flags.md's table from it."""
    yield from TABLE.collecting()


@pytest.mark.skipif(EVERY_ROW, reason="make sweep writes them once its rows have run")
def test_the_docs_show_the_committed_sweep():
    """docs/flags.md's table is the one benchmarks/results/sweep.json makes, and that sweep ran
    every row of the table as it is now, each ending as its row says."""
    assert TABLE.mismatches() == []


@pytest.mark.parametrize("row", RUN_ORDER, ids=lambda row: row.name)
def test_flag_ends_as_its_row_says(distributed, results, row, tmp_path):
    if _run_in_pool["layout"] != row.layout or _run_in_pool["rows"] == ROWS_PER_POOL:
        close_pools()
        _run_in_pool.update(layout=row.layout, rows=0)
    _run_in_pool["rows"] += 1
    path = tmp_path / "result.json"
    distributed(_run_row, row.world_size, row, path)
    result = results[row.name] = json.loads(path.read_text())
    assert result["shows"] == row.shows, json.dumps(result, indent=1)
    if row.expect == "refused":
        assert row.refused_flag in result["fsdp"]["refusal"], result["fsdp"]["refusal"]


def _probe_installed_copies(rank, world_size):
    for copy in upstream.INSTALLED_MEGATRON_FSDP_COPIES:
        assert upstream_fixes.drops_expert_scale_under_average(copy), copy
        assert upstream.needs_an_expert_group_to_average(copy), copy
    upstream_fixes.apply()
    for copy in upstream.INSTALLED_MEGATRON_FSDP_COPIES:
        assert not upstream_fixes.drops_expert_scale_under_average(copy), copy


def test_every_installed_megatron_fsdp_has_the_average_in_collective_defects():
    """megatron-core 0.19's copy and megatron-fsdp 0.5/0.6 drop the experts' scale under
    average_in_collective (a probe of gradient_reduce_preprocessing) and read an expert group a
    dense model lacks (its code); once fixed, the probe finds the scale applied. In processes of
    their own: nothing patched them before."""
    run_distributed(_probe_installed_copies, 1, fresh=True)
