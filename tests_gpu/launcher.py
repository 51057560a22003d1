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
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import rank_processes  # noqa: E402
from rank_processes import run_as_torchrun_would  # noqa: E402

CONTEXT = mp.get_context("forkserver")  # one server in a process: fake_ranks' too
PRELOAD = ["torch", "torch.distributed.checkpoint", "megatron.training", "megatron_muon.training",
           "megatron_muon.tools.testing", "rank_processes", "fake_ranks", "gpu_ranks"]


def prepare() -> None:
    """What the server imports, and the NVML device count it inherits: before it starts (the
    first process any test starts), not at import (the CPU suite imports tests_gpu for its
    command lines and has its own server)."""
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    rank_processes.preload(CONTEXT, PRELOAD)


def run_ranks(fn, world_size: int, *args, timeout: float = 600) -> list:
    """fn(rank, world_size, *args)'s result on each of `world_size` ranks forked from the server
    (rank_processes.run_ranks)."""
    prepare()
    return rank_processes.run_ranks(CONTEXT, fn, world_size, *args, timeout=timeout)


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
