"""Ranks in processes that a launcher forked (tests/conftest.py's gloo pools, tests_gpu/launcher.py's
and tests_bridge/bridge_ranks.py's servers, tests/fake_ranks.py): one rank of a training script
run as torchrun would run it (`run_as_torchrun`: a whole run, as torchrun ends it), `run_ranks`,
which starts ranks and gathers what each returned, and `preload`, what the forkserver they fork
from imports once. No imports of the package, so that the suites share it without the gloo
suite's conftest (which hides CUDA)."""

import functools
import os
import queue
import re
import runpy
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
# How long the other ranks may take to report once one has failed or died. Their own report adds
# nothing to the first failure's (a peer that failed or died leaves them waiting in a collective
# until gloo's timeout, or failing with the lost peer), and a run's ranks are ended after it.
GRACE_SECONDS = 5


def run_as_torchrun_would(rank, world_size, argv, log_dir, stderr_apart=False):
    """This rank of `torchrun --nproc-per-node world_size argv...` (the launcher has set
    MASTER_ADDR and MASTER_PORT; a gloo pool may have joined its group too, which
    megatron.training then adopts); argv is a script and its flags, or `-m module` and its
    flags; stdout and stderr go to log_dir/<rank>.log (stderr to <rank>.err if `stderr_apart`).
    A non-zero exit status is raised as the SystemExit that gave it."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    os.chdir(REPO)
    log = os.open(f'{log_dir}/{rank}.log', os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(os.open(f'{log_dir}/{rank}.err', os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            if stderr_apart else log, 2)
    if argv[0] == '-m':
        module, flags = argv[1], argv[2:]
        sys.argv = [module, *flags]
        run = functools.partial(runpy.run_module, module, run_name='__main__', alter_sys=True)
    else:
        script, flags = str(REPO / argv[0]), argv[1:]
        sys.path.insert(0, os.path.dirname(script))
        sys.argv = [script, *flags]
        run = functools.partial(runpy.run_path, script, run_name='__main__')
    try:
        run()
    except SystemExit as exit:  # --exit-interval ends the run with sys.exit(0)
        if exit.code not in (None, 0):
            raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


class Ended(NamedTuple):
    """A run's end as subprocess.run gives torchrun's: its exit status, what the ranks printed on
    stdout and on stderr (rank by rank; stderr then the first failing rank's traceback)."""
    returncode: int
    stdout: str
    stderr: str


def run_as_torchrun(context, argv: list[str], processes: int, timeout: float = 600,
                    daemon: bool = True) -> Ended:
    """`torchrun --nproc-per-node processes argv...` with each rank forked from `context`'s server
    (run_as_torchrun_would; run_ranks, `daemon` as there). The exit status is the one a rank's
    SystemExit gave, 1 for any other failure, 0."""
    with tempfile.TemporaryDirectory(prefix="ranks-") as log_dir:
        try:
            run_ranks(context, run_as_torchrun_would, processes, argv, log_dir, True,
                      timeout=timeout, daemon=daemon)
            failure, returncode = "", 0
        except RuntimeError as failed:
            failure = str(failed)
            exited = re.search(r"^SystemExit: (\d+)$", failure, re.MULTILINE)
            returncode = int(exited[1]) if exited else 1
        printed = {stream: "".join(log.read_text() for log in (Path(log_dir) / f"{rank}.{stream}"
                                                               for rank in range(processes))
                                   if log.exists())
                   for stream in ("log", "err")}
    return Ended(returncode, printed["log"], printed["err"] + failure)


def preload(context, modules: list[str]) -> None:
    """Have the forkserver of `context` import `modules` before it forks any rank. The server is
    a fresh interpreter that does not take its parent's sys.path (CPython 3.12 and 3.13 pass it
    to forkserver.main, which never sets it) and ignores an ImportError in a preload, so a module
    beside the tests was skipped without a word and imported again in every rank: the folders of
    the repository on sys.path go to the server as PYTHONPATH (set before it starts; the
    processes the tests start inherit it too, harmlessly). So does TORCHINDUCTOR_COMPILE_THREADS
    1: inductor's first compile in a process (megatron-core's jit fusions) would otherwise start
    a pool of compile workers, processes that import torch (and a thread, which a forkserver must
    not have when it forks), in the server and in every rank, torchrun's too (two torchrun runs,
    the demo's loss test when it still ran under torchrun and the killed rank's, took 60 s here
    together with them, 48 s without). It changes where inductor compiles, not what it
    generates."""
    ours = [path for path in sys.path if path.startswith(str(REPO))]
    given = [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(ours + given))
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    context.set_forkserver_preload(modules)


def missing_preloads(rank, world_size, modules: list[str]) -> list[str]:
    """Run in a forked rank: those of `modules` (its server's preloads) it did not inherit."""
    return [name for name in modules if name not in sys.modules]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank, world_size, port, args, results):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        results.put((rank, fn(rank, world_size, *args), None))
    except BaseException:
        results.put((rank, None, f"rank {rank}:\n{traceback.format_exc()}"))
    finally:
        results.close()
        results.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # without a process group's teardown, as conftest's workers leave


def run_ranks(context, fn, world_size: int, *args, timeout: float = 600,
              daemon: bool = True) -> list:
    """fn(rank, world_size, *args)'s result on each of `world_size` ranks, each a process of the
    multiprocessing `context` with MASTER_ADDR and MASTER_PORT set; raises RuntimeError with the
    first rank's failure, or where a rank dies or the ranks do not finish within `timeout` s.
    Ranks that start processes of their own (megatron-core's torch_dist writer does) must not be
    daemonic."""
    results = context.Queue()
    port = free_port()
    procs = [context.Process(target=_rank_main, daemon=daemon,
                             args=(fn, rank, world_size, port, args, results))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    deadline, found, failures = time.monotonic() + timeout, {}, []
    try:
        while len(found) < world_size and time.monotonic() < deadline:
            try:
                rank, value, failure = results.get(timeout=1)
            except queue.Empty:
                if failures or any(not p.is_alive() for r, p in enumerate(procs) if r not in found):
                    deadline = min(deadline, time.monotonic() + GRACE_SECONDS)
                continue
            found[rank] = value
            if failure:
                failures.append(failure)
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    if failures:
        raise RuntimeError(failures[0])
    if len(found) < world_size:
        missing = sorted(set(range(world_size)) - set(found))
        raise RuntimeError(f"ranks {missing} did not finish within {timeout} s (exit codes "
                           f"{[procs[r].exitcode for r in missing]})")
    return [found[rank] for rank in range(world_size)]
