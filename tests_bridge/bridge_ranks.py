"""Every Bridge run of tests_bridge, rank by rank, forked from one server process
(multiprocessing's forkserver) that has imported megatron-muon's Bridge layer and the two
training scripts' imports once: a torchrun launch paid them in every rank (about 30 s of CPU a
process on 2 cores, Bridge's recipes and Hugging Face's models among them), which was most of
`make test-bridge`. Each rank then runs its script as torchrun runs it
(rank_processes.run_as_torchrun_would: the script as __main__, its own process group); the
server itself imports, runs tests/forkserver_warmup.py's one compile, and nothing else. What the
ranks printed is the run's output, as torchrun's is."""

import multiprocessing as mp
import tempfile
from pathlib import Path
from typing import NamedTuple

import rank_processes
from rank_processes import run_as_torchrun_would

# megatron_muon.bridge first, as each script imports it: on CPU, Bridge's GPU-only imports need
# its stand-ins.
CONTEXT = mp.get_context("forkserver")
SERVER_PRELOAD = ["megatron_muon.bridge", "bridge_pretrain", "bridge_recipe_pretrain",
                  "rank_processes", "torch.distributed.checkpoint", "forkserver_warmup"]
rank_processes.preload(CONTEXT, SERVER_PRELOAD)


class Run(NamedTuple):
    """A run's end, as subprocess.run gives torchrun's: 0 or 1, what every rank printed (rank
    by rank), and the first failing rank's traceback."""
    returncode: int
    stdout: str
    stderr: str


def run(script: Path, flags: list[str], processes: int, timeout: float = 600) -> Run:
    """`script` with `flags` on `processes` ranks. The ranks are not daemonic: Megatron DDP's
    torch_dist checkpoints are written by processes a rank starts."""
    argv = [str(script), *flags]
    with tempfile.TemporaryDirectory(prefix="bridge-") as log_dir:
        try:
            rank_processes.run_ranks(CONTEXT, run_as_torchrun_would, processes, argv, log_dir,
                                     timeout=timeout, daemon=False)
            failure = ""
        except RuntimeError as failed:
            failure = str(failed)
        printed = "".join(log.read_text() for log in (Path(log_dir) / f"{rank}.log"
                                                       for rank in range(processes))
                          if log.exists())
    return Run(1 if failure else 0, printed, failure)
