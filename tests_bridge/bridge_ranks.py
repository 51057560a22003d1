"""Every Bridge run of tests_bridge, rank by rank, forked from one server process
(multiprocessing's forkserver) that has imported megatron-muon's Bridge layer and the two
training scripts' imports once: a torchrun launch paid them in every rank (about 30 s of CPU a
process on 2 cores, Bridge's recipes and Hugging Face's models among them), which was most of
`make test-bridge`. Each rank then runs its script as torchrun runs it
(rank_processes.run_as_torchrun_would: the script as __main__, its own process group); the
server itself imports, runs tests/forkserver_warmup.py's one compile, and nothing else. What the
ranks printed is the run's output, as torchrun's is."""

import multiprocessing as mp
from pathlib import Path

import rank_processes

# megatron_muon.bridge first, as each script imports it: on CPU, Bridge's GPU-only imports need
# its stand-ins.
CONTEXT = mp.get_context("forkserver")
SERVER_PRELOAD = ["megatron_muon.bridge", "bridge_pretrain", "bridge_recipe_pretrain",
                  "rank_processes", "torch.distributed.checkpoint", "forkserver_warmup"]
rank_processes.preload(CONTEXT, SERVER_PRELOAD)


def run(script: Path, flags: list[str], processes: int) -> rank_processes.Ended:
    """`script` with `flags` on `processes` ranks. The ranks are not daemonic: Megatron DDP's
    torch_dist checkpoints are written by processes a rank starts."""
    return rank_processes.run_as_torchrun(CONTEXT, [str(script), *flags], processes, daemon=False)
