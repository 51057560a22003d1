"""`python -m megatron_muon.selftest` as a user runs it on a cluster: a table with every
configuration the world size allows, each exact (0 with fp32 Newton-Schulz) and passed, with its
peak memory, exit status 0; a corrupted owner result makes its configuration fail and the run
exit 1 (run with --optimizer adaptive_muon); a configuration past the time limit stops the run
with status 2, named, as torchrun reports it (torchrun on gloo); --rates-dir writes the rates
measured at construction for the scale model. The first two run each rank as torchrun would,
forked from the suite's server (rank_processes: torchrun's ranks paid megatron-core's imports,
four times over at W=4); the third is torchrun's own launch."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import conftest
from rank_processes import Ended, run_as_torchrun

from megatron_muon.reporting.rates_file import RATES_FILE
from megatron_muon.estimate.parts import Rates

pytestmark = pytest.mark.e2e  # torchrun, as a user runs it

REPO = Path(__file__).resolve().parents[2]
CONFIGURATIONS = {
    2: ["no_shard (no_shard)", "ZeRO-1 (optim)", "ZeRO-2 (optim_grads)",
        "ZeRO-3 (optim_grads_params)", "ZeRO-2, EP=2 (4 experts)"],
}
CONFIGURATIONS[4] = CONFIGURATIONS[2] + ["ZeRO-3, TP=2", "HSDP: 2 replicas of ZeRO-3"]
ROW = re.compile(r"^(?P<name>\S.*?)\s+(?P<diff>\S+)\s+(?P<result>pass|FAIL)\b(?P<figures>.*)$",
                 re.MULTILINE)


def selftest(world_size: int, *flags: str) -> subprocess.CompletedProcess:
    """torchrun's launch of the self-test."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(world_size), "-m", "megatron_muon.selftest", *flags],
        cwd=REPO, capture_output=True, text=True, timeout=600)


def selftest_in_forked_ranks(world_size: int, *flags: str) -> Ended:
    """The self-test's ranks as torchrun would run them, forked from the suite's server without
    a process group (the self-test starts its own). The other modules' idle gloo workers would
    take CPU from it (conftest)."""
    conftest.close_pools()
    return run_as_torchrun(conftest.SERVER, ["-m", "megatron_muon.selftest", *flags], world_size)


def rows(stdout: str) -> dict:
    return {m["name"]: m for m in ROW.finditer(stdout) if m["name"] != "configuration"}


# The user's model in Megatron's flags: a SwiGLU MoE with grouped queries, at TP = EP = 2.
MODEL_FLAGS = ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
               "--num-query-groups", "2", "--vocab-size", "256", "--swiglu", "--num-experts", "4",
               "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2")
ESTIMATE = re.compile(r"^ +(\d+) +(\d+) +(\d+)" + r" +(\S+)" * 6 + "$", re.MULTILINE)


def test_every_configuration_is_exact_and_passes(tmp_path):
    """At W=4, every configuration W=2 runs and those W=4 adds (the run at W=2: the next test);
    with --rates-dir, the first configuration's measured rates written as the scale model's
    rates file and said in a line; with the user's model in Megatron's flags, its estimated step
    at W, 4 W and 16 W (estimate; tests/plan/test_scale_model.py holds the estimate to a
    run's plan) in the layout the flags give. With --muon-gram-newton-schulz: every
    configuration's owners and check run Gram Newton-Schulz where it runs (the run at W=2 runs
    without it), and the estimate has its column."""
    run = selftest_in_forked_ranks(4, "--rates-dir", str(tmp_path), "--muon-gram-newton-schulz",
                                   *MODEL_FLAGS)
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr[-4000:]}"
    assert re.search(r"^estimated optimizer step of your model \(TP 2\), .* on its 6 shapes",
                     run.stdout, re.MULTILINE), run.stdout
    estimates = [m.groups() for m in ESTIMATE.finditer(run.stdout)]
    assert [tuple(map(int, row[:3])) for row in estimates] == [(4, 2, 2), (16, 8, 2),
                                                                (64, 32, 2)], run.stdout
    assert re.search(r"--muon-fp32-matmul-prec highest --muon-gram-newton-schulz; ", run.stdout)
    for row in estimates:
        adam_ms, muon_ms, busiest, teams_ms, teams_busiest, gram_ms = map(float, row[3:])
        assert adam_ms > 0 and muon_ms > 0 and teams_ms > 0 and gram_ms > 0, row
        assert busiest >= 1 and teams_busiest >= 1, row
    said = re.findall(r"^  rates measured at construction: Newton-Schulz \S+ TFLOP/s, all-to-all "
                      r"\S+ GB/s, matmul \S+ TFLOP/s; written to (\S+) ", run.stdout, re.MULTILINE)
    assert said == [str(tmp_path / RATES_FILE)], run.stdout
    rates = Rates(json.loads((tmp_path / RATES_FILE).read_text()))
    assert rates.all_to_all_gbps > 0 and rates.newton_schulz_seconds(1e9) > 0
    table = rows(run.stdout)
    assert list(table) == CONFIGURATIONS[4], run.stdout
    for name, row in table.items():
        assert row["result"] == "pass" and float(row["diff"]) == 0.0, (name, row[0])
        step_ms, tflops, received, peak_mib = row["figures"].split()
        assert float(step_ms) > 0 and float(tflops) > 0, (name, row[0])
        assert int(received.replace(",", "")) >= 0, (name, row[0])
        assert float(peak_mib) > 0, (name, row[0])
    assert re.search(r"^self-test passed$", run.stdout, re.MULTILINE), run.stdout


def test_a_corrupted_owner_result_fails_its_configuration_and_the_run():
    """With --optimizer adaptive_muon (NorMuon, its second moment on the owners): the other
    configurations pass, exact."""
    run = selftest_in_forked_ranks(2, "--corrupt", "--optimizer", "adaptive_muon",
                   "--adaptive-muon-moment2-method", "normuon")
    assert run.returncode == 1, f"{run.stdout}\n{run.stderr[-4000:]}"
    assert "--optimizer adaptive_muon (normuon)" in run.stdout, run.stdout
    table = rows(run.stdout)
    assert list(table) == CONFIGURATIONS[2], run.stdout
    first, *others = CONFIGURATIONS[2]
    assert table[first]["result"] == "FAIL", run.stdout
    assert all(table[name]["result"] == "pass" and float(table[name]["diff"]) == 0.0
               for name in others), run.stdout
    assert re.search(r"muon check at iteration 2: the owner exchange's update differs .*\n  "
                     r"module\.module\.\S+\.weight: shape \(\d+, \d+\), owner rank \d", run.stdout)
    assert run.stdout.rstrip().endswith(f"self-test FAILED: {first}"), run.stdout


def test_a_configuration_past_the_time_limit_stops_the_run_named():
    run = selftest(2, "--time-limit", "0.5")
    assert run.returncode != 0
    assert "'no_shard (no_shard)' ran past 0.5 s (--time-limit)" in run.stderr, run.stderr[-4000:]
    assert re.search(r"exitcode\s*: 2", run.stderr), run.stderr[-4000:]
