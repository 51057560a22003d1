"""Every process tests_gpu starts, from one launcher: multiprocessing's forkserver, started once
with torch, megatron and megatron_muon imported, forks each rank of each run (the demo's ranks
as torchrun would run them, a team's two ranks, the offloaded state's one, the fake process
group's). On an H100 a torchrun launch paid its imports twice (the launcher's and the rank's)
and tests_gpu ran past 240 s after 5 of its 11 tests, most of it process starts.

The server imports and nothing else: no CUDA (torch's NVML device count, not the driver's, which
would leave every forked rank without CUDA), no process group; each rank sets its device and
joins its own group, as a fresh torchrun rank would. The forkserver and multiprocessing's
resource tracker are the only processes this starts anew (tests/test_gpu_launches.py counts
them on CPU)."""

import multiprocessing as mp
import os
import queue
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from script_rank import run_as_torchrun_would  # noqa: E402

CONTEXT = mp.get_context("forkserver")  # one server in a process: fake_ranks' too
PRELOAD = ["torch", "torch.distributed.checkpoint", "megatron.training", "megatron_muon.training",
           "megatron_muon.tools.testing", "script_rank", "fake_ranks", "gpu_ranks"]
# How long the other ranks may take to report once one has failed or died.
GRACE_SECONDS = 15


def prepare() -> None:
    """What the server imports, and the NVML device count it inherits: before it starts (the
    first process any test starts), not at import (the CPU suite imports tests_gpu for its
    command lines and has its own server)."""
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    CONTEXT.set_forkserver_preload(PRELOAD)


def _free_port() -> int:
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


def run_ranks(fn, world_size: int, *args, timeout: float = 600) -> list:
    """fn(rank, world_size, *args)'s result on each of `world_size` ranks, each forked from the
    server with MASTER_ADDR and MASTER_PORT set; raises with the first rank's failure, or if a
    rank dies or the ranks do not finish within `timeout` seconds."""
    prepare()
    results = CONTEXT.Queue()
    port = _free_port()
    procs = [CONTEXT.Process(target=_rank_main, daemon=True,
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


def script_log(argv: list[str], processes: int, timeout: float = 900) -> str:
    """What the last rank of `argv` (a script and its flags, run as torchrun runs it on
    `processes` ranks) printed: Megatron logs the iterations there. A failure says what each
    rank printed last."""
    with tempfile.TemporaryDirectory(prefix="gpu-") as log_dir:
        logs = [Path(log_dir) / f"{rank}.log" for rank in range(processes)]
        try:
            run_ranks(run_as_torchrun_would, processes, argv, log_dir, timeout=timeout)
        except RuntimeError as failure:
            printed = "\n".join(f"rank {rank} printed:\n{log.read_text()[-3000:]}"
                                for rank, log in enumerate(logs) if log.exists())
            raise RuntimeError(f"{failure}\n{printed}") from None
        return logs[-1].read_text()
