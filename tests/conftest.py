"""Distributed tests on gloo. A test's function runs on every rank of a pool of worker processes,
one pool per test module and world size: process start-up, imports and the process group are
paid once per module and world size, not once per test. Modules do not share processes: what one
leaves in its processes (megatron-core's process groups, megatron.training's CPU layer, which
slows every torch call) stays out of the others'; when a module of tests ends, its pools close.
(Idle workers are not free: every gloo process group keeps a thread that polls its sockets every
10 ms, and torch never ends it.)"""

import atexit
import gc
import os
import queue
import sys
import time
import traceback
import warnings
from importlib.metadata import PackageNotFoundError, version

import pytest
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from rank_processes import GRACE_SECONDS, free_port, preload  # noqa: E402
# This suite is gloo on CPU everywhere, also on a machine with GPUs (where it would otherwise
# build its models on CUDA and start several ranks on one GPU): CUDA stays hidden from it and
# from every process it starts. It says so first, also under -q.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
UPSTREAM_PACKAGES = ("torch", "megatron-core", "emerging-optimizers", "megatron-fsdp")

# `make test-fast` runs the suite without the tests marked e2e or slow (-m "not e2e and not slow").
MARKERS = {
    "e2e": "runs a training script end to end: the demo, torchrun, a Megatron-LM-style script",
    "slow": "not e2e, but 5 s or more on 2 CPU cores, or a W=4 case of a sweep whose other "
            "cases cover it (make test-fast leaves it out)",
}


def pytest_configure(config):
    for name, description in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {description}")


def pytest_addoption(parser):
    parser.addoption("--largest-world-size", type=int, default=None, metavar="N",
                     help="deselect the cases parametrized by a world_size above N (make "
                          "test-lowest: 2, the W=4 cases running the upstream calls of their "
                          "W=2 cases)")


def pytest_collection_modifyitems(config, items):
    largest = config.getoption("--largest-world-size")
    if largest is None:
        return
    kept, wider = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        world_size = callspec.params.get("world_size", 0) if callspec else 0
        (wider if world_size > largest else kept).append(item)
    config.hook.pytest_deselected(items=wider)
    items[:] = kept


@pytest.fixture(scope="session")
def strategy_runs(tmp_path_factory):
    """e2e_harness.strategy_runs: the demo's runs by optimizer and strategy, each run once for
    every e2e module that compares with them."""
    from e2e_harness import strategy_runs

    return strategy_runs(tmp_path_factory.mktemp("uninterrupted"))


def _installed(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:  # megatron-fsdp, an optional range
        return "not installed"


def pytest_sessionstart(session):
    from megatron_muon.cpu.torch_compat import bf16_matmul_is_emulated, fast_newton_schulz_precision

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("gloo on CPU: CUDA_VISIBLE_DEVICES='' hides any GPU from these tests")
        reporter.write_line("versions: " + ", ".join(
            f"{package} {_installed(package)}" for package in UPSTREAM_PACKAGES))
        emulated = "emulates bf16 matmuls" if bf16_matmul_is_emulated() else "has native bf16 matmuls"
        reporter.write_line(
            f"Newton-Schulz: this CPU {emulated}, so `make demo` and the benchmarks run "
            f"--muon-fp32-matmul-prec {fast_newton_schulz_precision()}, as does the e2e test of "
            f"the demo's default; the other tests name theirs: highest (fp32), medium where "
            f"bf16 is the subject")

# Megatron-FSDP's gloo collectives in backward sometimes lose a rank before any optimizer code
# runs, and the others then lose their peer (once in 3 clean-clone CI runs of 99 tests, at W=4;
# at W=3 as heap corruption). Such a run is repeated once, in fresh processes; any other
# failure, a hang included, is final.
PEER_LOST = ("Connection reset by peer", "Connection closed by peer")
# Workers fork from one server process that has imported these once: each worker started with
# "spawn" paid 6-10 s of CPU for the same imports. The server only imports (no patches, no
# threads, no process group), so every worker still starts as a fresh interpreter would; the
# last, forkserver_warmup, does once what each rank of a training run would do in its process.
SERVER = mp.get_context("forkserver")
SERVER_PRELOAD = ["megatron_muon.tools.testing", "megatron_muon.front_ends.megatron_lm",
                  "fsdp_models", "torch.distributed.checkpoint", "forkserver_warmup"]
preload(SERVER, SERVER_PRELOAD)


def _serve(rank, world_size, port, tasks, results):
    """A worker: join the gloo group once, then run each task's function on this rank."""
    import faulthandler

    import torch
    import torch.distributed as dist

    from megatron_muon.cpu.torch_compat import apply_cpu_compat

    apply_cpu_compat()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    # Megatron-FSDP collects garbage whenever it builds a model: with the imports and what the
    # earlier tests left frozen, a collection scans only the current test's objects.
    gc.freeze()
    while (task := tasks.get()) is not None:
        fn, args, timeout = task
        # A rank still running shortly before the test gives up prints where it is stuck.
        faulthandler.dump_traceback_later(max(timeout - 10, 1), exit=False)
        try:
            fn(rank, world_size, *args)
        except BaseException:
            results.put((rank, f"rank {rank}:\n{traceback.format_exc()}"))
            # Leave at once: the other ranks lose their peer and fail now, not at the deadline.
            _leave(1, results)
        faulthandler.cancel_dump_traceback_later()
        gc.collect()
        gc.freeze()
        results.put((rank, None))
    # Without gloo's teardown: once, after all assertions had passed, it aborted a rank
    # ("terminate called without an active exception").
    _leave(0, results)


def _leave(code, results):
    # The processes a rank started (megatron-core's torch_dist writer's workers) end with it:
    # os._exit skips the interpreter's exit, which would have ended them.
    for child in mp.active_children():
        child.kill()
    results.close()
    results.join_thread()  # what was put reaches the parent
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _Pool:
    """`world_size` gloo ranks in worker processes, running one function at a time on all."""

    def __init__(self, world_size, daemon=True):
        self.world_size = world_size
        self.results = SERVER.Queue()
        self.tasks = [SERVER.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [SERVER.Process(target=_serve,
                                     args=(r, world_size, port, self.tasks[r], self.results),
                                     daemon=daemon) for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, fn, args, timeout):
        """The first failure of running fn(rank, world_size, *args) on every rank, or None."""
        for tasks in self.tasks:
            tasks.put((fn, args, timeout))
        deadline = time.monotonic() + timeout  # for all ranks together
        finished, failures = set(), []
        while len(finished) < self.world_size:
            if failures or self._dead(finished):
                deadline = min(deadline, time.monotonic() + GRACE_SECONDS)
            try:
                rank, failure = self.results.get(timeout=max(min(1.0, deadline - time.monotonic()), 0.01))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    break
                continue
            finished.add(rank)
            if failure:
                failures.append(failure)
        if failures:
            return failures[0]
        dead = self._dead(finished)
        if dead:
            return f"ranks {dead} died (exit codes {[self.procs[r].exitcode for r in dead]})"
        if len(finished) < self.world_size:
            return (f"{self.world_size - len(finished)} of {self.world_size} ranks did not finish "
                    f"within {timeout}s (deadlock?)")
        return None

    def _dead(self, finished):
        return [r for r, p in enumerate(self.procs) if r not in finished and not p.is_alive()]

    def close(self):
        for tasks in self.tasks:
            tasks.put(None)
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()


_pools: dict[tuple[str, int], _Pool] = {}  # by test module and world size


def close_pools(keep=lambda key: False):
    """Close the worker pools (but those whose key `keep` accepts)."""
    for key in [key for key in _pools if not keep(key)]:
        _pools.pop(key).close()


atexit.register(close_pools)


def run_distributed(fn, world_size: int, *args, timeout: float = 300, fresh: bool = False):
    """Run fn(rank, world_size, *args) on world_size gloo ranks; fail with the first failure."""
    failure = first_failure(fn, world_size, *args, timeout=timeout, fresh=fresh)
    if failure:
        pytest.fail(failure, pytrace=False)


def first_failure(fn, world_size: int, *args, timeout: float = 300, fresh: bool = False,
                  retry_lost_peer: bool = True) -> str | None:
    """Run fn(rank, world_size, *args) on world_size gloo ranks; the first failure, or None.

    The ranks are the pool of fn's module for this world size, so fn must leave nothing behind
    that the module's next test could trip over (restore what it patches); `fresh` runs it in
    processes of its own instead. A pool in which a run failed is discarded. A run in which a
    rank lost its peer runs once more unless `retry_lost_peer` is False (a test that kills one)."""
    failure = _run_once(fn, world_size, args, timeout, fresh)
    if retry_lost_peer and failure and any(sign in failure for sign in PEER_LOST):
        warnings.warn(f"a rank lost its gloo peer; running again. First run:\n{failure}")
        failure = _run_once(fn, world_size, args, timeout, fresh)
    return failure


def _run_once(fn, world_size, args, timeout, fresh):
    key = (fn.__module__, world_size)
    close_pools(keep=lambda other: other[0] == key[0])  # the other modules' tests are done
    # A fresh pool's ranks may start processes (megatron-core's torch_dist writer does), which
    # a daemonic one may not; close() still ends them.
    pool = _Pool(world_size, daemon=False) if fresh else _pools.pop(key, None) or _Pool(world_size)
    failure = pool.run(fn, args, timeout)
    if failure or fresh:
        pool.close()
    else:
        _pools[key] = pool
    return failure


@pytest.fixture
def distributed():
    return run_distributed
