"""tests_gpu starts every process from one launcher (tests_gpu/launcher.py, issue 70: on an H100
it ran past 240 s after 5 of its 11 tests, most of it process starts): held here on CPU, where
its tests skip. Its modules start nothing themselves, and in a fresh interpreter the launcher
runs the demo at W=2 (gloo) having started only its server and multiprocessing's resource
tracker."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import demo_log

pytestmark = pytest.mark.e2e  # a fresh interpreter, as tests_gpu starts
REPO = Path(__file__).resolve().parents[1]
GPU_TESTS = REPO / "tests_gpu"
# What starts a process other than through the launcher's server.
STARTS = {"subprocess", "Popen", "torchrun", "spawn", "system", "execv", "execve", "fork"}

LAUNCHES = """
import json, sys, psutil
sys.path.insert(0, "tests_gpu")
import launcher
argv = ["examples/pretrain_gpt.py", "--train-iters", "2", "--eval-iters", "0",
        "--num-layers", "1", "--hidden-size", "64", "--ffn-hidden-size", "128",
        "--seq-length", "64", "--max-position-embeddings", "64"]
logs = [launcher.script_log(argv, 2)]
print(json.dumps(dict(logs=logs, started=[p.cmdline() for p in psutil.Process().children()])))
"""


def test_tests_gpu_starts_nothing_but_through_its_launcher():
    for module in GPU_TESTS.glob("*.py"):
        tree = ast.parse(module.read_text())
        names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        names |= {alias.name.split(".")[-1] for node in ast.walk(tree)
                  if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
        assert not names & STARTS, (module.name, names & STARTS)
        # get_context: the launcher's forkserver alone
        contexts = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
                    and getattr(node.func, "attr", None) == "get_context"]
        assert all(ast.literal_eval(call.args[0]) == "forkserver" for call in contexts), module
    assert "forkserver" in (REPO / "tests" / "fake_ranks.py").read_text()


def test_the_launcher_runs_the_demo_having_started_its_server_alone():
    run = subprocess.run([sys.executable, "-c", LAUNCHES], cwd=REPO, capture_output=True,
                         text=True, timeout=600,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    found = json.loads(run.stdout.strip().splitlines()[-1])
    for log in found["logs"]:
        assert len(demo_log.losses(log, 1, 2)) == 2, log[-3000:]
    started = [" ".join(cmdline) for cmdline in found["started"]]
    print("\n".join(started))
    assert len(started) == 2 and any("forkserver" in c for c in started) and any(
        "resource_tracker" in c for c in started), started
