"""End to end, faults: a diverged run, a rank killed mid-run, a damaged checkpoint and a save
killed half-way each end the demo's run with an error that names what happened, and never load
a bad checkpoint (e2e_harness runs the demo)."""

import itertools
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from e2e_harness import (DEMO, NO_DROPOUT, REPO, SMALL, STRATEGY_ITERATIONS, TORCHRUN, failure_of,
                         run_as_torchrun_would, script_argv, train)
from e2e_harness import no_idle_workers  # noqa: F401 (an autouse fixture)

pytestmark = pytest.mark.e2e


def test_a_diverged_run_stops_with_a_clear_error():
    """--lr 1e6: every step after the first has NaN gradients and is skipped; after
    --muon-max-consecutive-skipped-steps of them in a row (3 here; the default, 10, is checked in
    test_grad_norm_and_skip) the run stops (non-zero exit) instead of training nothing."""
    failure = failure_of(*SMALL, '--lr', '1e6', '--muon-max-consecutive-skipped-steps', '3',
                         iterations=STRATEGY_ITERATIONS)
    assert ('RuntimeError: 3 optimizer steps in a row were skipped: the gradients hold NaN or Inf'
            in failure), failure


def _worker_pid(launcher_pid: int, local_rank: int) -> int:
    """The pid of torchrun's worker process with this LOCAL_RANK."""
    for entry in Path('/proc').iterdir():
        try:
            parent = int((entry / 'stat').read_text().rsplit(')', 1)[1].split()[1])
            environ = (entry / 'environ').read_bytes().split(b'\0')
        except (OSError, ValueError, IndexError):
            continue
        if parent == launcher_pid and f'LOCAL_RANK={local_rank}'.encode() in environ:
            return int(entry.name)
    raise LookupError(f'no worker with LOCAL_RANK={local_rank} under pid {launcher_pid}')


def test_a_rank_killed_mid_run_ends_the_job_naming_it():
    """SIGKILL to the last rank at iteration 5 of 30: torchrun ends the whole job within 60 s
    with a non-zero exit and names the lost rank; no rank is left waiting for it (at W=4: three
    ranks that could wait, where W=2 leaves one)."""
    processes = 4
    launch = subprocess.Popen(
        [str(TORCHRUN), '--standalone', '--nproc-per-node', str(processes),
         *script_argv(DEMO, 30, SMALL)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, 'OMP_NUM_THREADS': '1'})
    lines, at_iteration_5 = [], threading.Event()

    def read():
        for line in launch.stdout:
            lines.append(line)
            if re.search(r' iteration\s+5/', line):
                at_iteration_5.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert at_iteration_5.wait(timeout=300), ''.join(lines[-50:])
        victim = processes - 1
        os.kill(_worker_pid(launch.pid, victim), signal.SIGKILL)
        killed_at = time.monotonic()
        returncode = launch.wait(timeout=120)
        ended_after = time.monotonic() - killed_at
    finally:
        launch.kill()
    reader.join(timeout=10)
    log = ''.join(lines)
    print(f'W={processes}: the job ended {ended_after:.1f} s after the kill, exit code {returncode}')
    assert returncode != 0 and ended_after < 60, (returncode, ended_after, log[-3000:])
    assert re.search(rf'rank\s*: {victim} \(local_rank: {victim}\)\s*exitcode\s*: -9', log), log[-3000:]


def _damaged_copy(checkpoints: Path, tmp_path: Path, damage) -> Path:
    """A copy of `checkpoints` whose latest checkpoint's files `damage` has changed."""
    copy = tmp_path / 'damaged'
    shutil.copytree(checkpoints, copy)
    latest = (copy / 'latest_checkpointed_iteration.txt').read_text().strip()
    damage(copy / f'iter_{int(latest):07d}')
    return copy


def _truncate(checkpoint: Path):
    shard = checkpoint / '__1_0.distcp'
    os.truncate(shard, shard.stat().st_size // 2)


def _flip_bytes(checkpoint: Path):
    shard = checkpoint / '__0_0.distcp'
    data = bytearray(shard.read_bytes())
    for offset in (len(data) // 3, len(data) // 2, len(data) // 2 + 17):
        data[offset] ^= 0x5A
    shard.write_bytes(data)


@pytest.mark.parametrize('damage, found', [
    (_truncate, r'__1_0\.distcp: \d+ bytes, \d+ when saved \(truncated or overwritten\)'),
    (_flip_bytes, r'__0_0\.distcp: contents differ from the save \(CRC-32 \w+, \w+ when saved\)')])
def test_a_damaged_checkpoint_is_refused_naming_the_file(strategy_runs, tmp_path, damage, found):
    """Sizes and CRC-32s recorded at save are verified before --load reads anything (a truncated
    shard gave a bare EOFError, flipped bytes loaded silently and trained on NaN)."""
    strategy_runs('muon', 'optim_grads_params')
    damaged = _damaged_copy(strategy_runs.checkpoints, tmp_path, damage)
    failure = failure_of(*SMALL, *NO_DROPOUT, '--load', str(damaged),
                         iterations=STRATEGY_ITERATIONS + 2)
    assert re.search(rf'RuntimeError: the checkpoint \S+ is damaged; nothing was loaded:\n.*{found}',
                     failure), failure


def _run_killing_rank_1_in_its_second_save(rank, world_size, argv, log_dir):
    """`run_as_torchrun_would`, but rank 1 dies (SIGKILL) having written half of its files of
    the second checkpoint."""
    from torch.distributed.checkpoint import FileSystemWriter

    write_data, saves = FileSystemWriter.write_data, itertools.count(1)

    def write_half_then_die(self, plan, planner):
        written = write_data(self, plan, planner)
        if rank == 1 and next(saves) == 2:
            written.wait()
            for shard in Path(self.path).glob(f'__{rank}_*.distcp'):
                os.truncate(shard, shard.stat().st_size // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        return written

    FileSystemWriter.write_data = write_half_then_die
    run_as_torchrun_would(rank, world_size, argv, log_dir)


def test_a_save_killed_half_way_is_never_the_checkpoint_loaded(tmp_path):
    """Rank 1 dies writing the checkpoint of iteration 4: the run fails, Megatron's tracker still
    names iteration 2 (it is written after every rank has finished), and --load resumes there."""
    flags = (*SMALL, '--save', str(tmp_path), '--save-interval', '2')
    failure_of(*flags, iterations=6, run_rank=_run_killing_rank_1_in_its_second_save,
               retry_lost_peer=False)
    assert (tmp_path / 'latest_checkpointed_iteration.txt').read_text().strip() == '2'
    assert (tmp_path / 'iter_0000004').is_dir()  # what the killed save left
    train(*flags, '--load', str(tmp_path), iterations=6, logged=(3, 6))
