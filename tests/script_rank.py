"""One rank of a training script run as torchrun would run it, in a process that some launcher
forked (tests/conftest.py's gloo pools, tests_gpu/launcher.py's server): no imports of its own,
so that both suites share it without the gloo suite's conftest (which hides CUDA)."""

import os
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_as_torchrun_would(rank, world_size, argv, log_dir):
    """This rank of `torchrun --nproc-per-node world_size argv...` (the launcher has set
    MASTER_ADDR and MASTER_PORT; a gloo pool has joined its group too, which megatron.training
    then adopts); stdout and stderr go to log_dir/<rank>.log."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    os.chdir(REPO)
    log = os.open(f'{log_dir}/{rank}.log', os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    script = str(REPO / argv[0])
    sys.path.insert(0, os.path.dirname(script))
    sys.argv = [script, *argv[1:]]
    try:
        runpy.run_path(script, run_name='__main__')
    except SystemExit as exit:  # --exit-interval ends the run with sys.exit(0)
        if exit.code not in (None, 0):
            raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
