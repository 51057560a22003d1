"""End to end: examples/pretrain_gpt.py trains the demo GPT with megatron.training at W=2, and at
W=4 with experts, tensor parallelism, HSDP and HFSDP; a script laid out like Megatron-LM's own
pretrain_gpt.py trains with only the README's additions.

One test launches the demo with torchrun, as `make demo` does. The others run each rank of a
script as torchrun would (its environment variables, the script as __main__) in a fresh process
forked from the suite's server, which has imported torch and megatron once: a torchrun launch
spent about half of its 15 s in the same imports, over again in every process."""

import functools
import itertools
import os
import re
import shutil
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import demo_log
from conftest import close_pools, first_failure, run_distributed
from tolerances import RTOL, printed_within

REPO = Path(__file__).resolve().parents[1]
DEMO = 'examples/pretrain_gpt.py'
TORCHRUN = Path(sys.executable).with_name('torchrun')
ITERATIONS = 25
COMPARED_ITERATIONS = 4  # the loss of iteration 4 is the first to see the third update
# Newton-Schulz in fp32 on every machine: the comparisons below allow fp32 reordering
# (tolerances.py), which bf16 matmuls would round up into differences of their own. The demo's
# own choice of precision (bf16 where bf16 matmuls are native) is the first test's.
FP32_NEWTON_SCHULZ = ('--muon-fp32-matmul-prec', 'highest')


@pytest.fixture(autouse=True, scope="module")
def no_idle_workers():
    """The other modules' idle gloo workers would take CPU from these runs (conftest)."""
    close_pools()


def torchrun_log(*flags: str, iterations: int = ITERATIONS) -> str:
    """Launch the demo with torchrun at W=2, as `make demo` does (its own precision); return
    its log."""
    run = subprocess.run(
        [str(TORCHRUN), '--standalone', '--nproc-per-node', '2', DEMO, '--train-iters',
         str(iterations), '--eval-iters', '0', *flags],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert run.returncode == 0, f'training failed:\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}'
    return run.stdout


def torchrun(*flags: str, iterations: int = ITERATIONS) -> list[float]:
    """The training losses of torchrun_log's run."""
    return demo_log.losses(torchrun_log(*flags, iterations=iterations), 1, iterations)


def _run_as_torchrun_would(rank, world_size, argv, log_dir):
    """This rank of `torchrun --nproc-per-node world_size argv...` (the pool's worker has set
    MASTER_ADDR/MASTER_PORT and joined the gloo group, which megatron.training then adopts);
    stdout and stderr go to log_dir/<rank>.log."""
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


def train(*flags: str, iterations: int = ITERATIONS, processes: int = 2,
          logged: tuple[int, int] | None = None) -> list[float]:
    """Run the demo on `processes` ranks; return the training losses it computed (iterations
    `logged`, first and last: 1 to `iterations` unless the run resumes or exits early)."""
    first, last = logged or (1, iterations)
    return demo_log.losses(training_log(*flags, iterations=iterations, processes=processes),
                           first, last)


def _argv(script: str, iterations: int, flags) -> list[str]:
    return [script, '--train-iters', str(iterations), '--eval-iters', '0', *FP32_NEWTON_SCHULZ,
            *flags]


def training_log(*flags: str, iterations: int, processes: int = 2, script: str = DEMO) -> str:
    """What the last rank, where Megatron logs the iterations, printed."""
    argv = _argv(script, iterations, flags)
    with tempfile.TemporaryDirectory(prefix='e2e-') as log_dir:
        run_distributed(_run_as_torchrun_would, processes, argv, log_dir, timeout=600, fresh=True)
        return (Path(log_dir) / f'{processes - 1}.log').read_text()


def failure_of(*flags: str, iterations: int, processes: int = 2,
               run_rank=_run_as_torchrun_would, retry_lost_peer: bool = True) -> str:
    """Run the demo (each rank as `run_rank` runs it), which must stop with an error; what the
    failing rank raised."""
    with tempfile.TemporaryDirectory(prefix='e2e-') as log_dir:
        failure = first_failure(run_rank, processes, _argv(DEMO, iterations, flags), log_dir,
                                timeout=600, fresh=True, retry_lost_peer=retry_lost_peer)
    assert failure, 'the run did not stop with an error'
    return failure


def assert_loss_falls(losses: list[float]) -> None:
    # Untrained: ~ln(1024) = 6.9; the corpus's floor is ~1.1 (examples/synthetic_data.py).
    first, last = losses[0], sum(losses[-3:]) / 3
    assert first > 6.5 and last < first - 1.0, losses


def test_muon_on_megatron_fsdp_loss_falls():
    """The default: --optimizer muon through megatron_muon.training's switch and factory, at the
    demo's own Newton-Schulz precision (the suite's header says which), with the check interval:
    every 10th iteration's updates also computed whole and compared, and the compute weights
    checked after the param sync (and found equal: a failed check stops the run)."""
    log = torchrun_log('--optimizer', 'muon', '--muon-check-interval', '10')
    assert_loss_falls(demo_log.losses(log, 1, ITERATIONS))
    checks = re.findall(r'^muon check at iteration (\d+): max \|owner - reference\| = \S+ over '
                        r'\d+ matrices; no replicas; compute weights equal$', log, re.MULTILINE)
    assert checks == ['10', '20'], checks


# A smaller GPT than the demo's for the comparisons below: they test the sharding, not the model.
SMALL = ('--num-layers', '2', '--hidden-size', '64', '--ffn-hidden-size', '256',
         '--seq-length', '64', '--max-position-embeddings', '64')
NO_DROPOUT = ('--hidden-dropout', '0', '--attention-dropout', '0')
STRATEGIES = ('no_shard', 'optim', 'optim_grads', 'optim_grads_params')
STRATEGY_ITERATIONS = 10


@pytest.fixture(scope='module')
def strategy_runs(tmp_path_factory):
    """The demo's losses by optimizer and sharding strategy (dropout off), each run once for the
    tests below. Muon's ZeRO-3 run also saves a checkpoint every 3 iterations into
    `strategy_runs.checkpoints`: the uninterrupted run the resume tests compare with
    (`strategy_runs.log`: its log), and logs its max attention logits."""
    checkpoints = tmp_path_factory.mktemp('uninterrupted')

    @functools.cache
    def log(optimizer, strategy):
        saves = (('--save', str(checkpoints), '--save-interval', '3', '--log-max-attention-logit')
                 if (optimizer, strategy) == ('muon', 'optim_grads_params') else ())
        return training_log(*SMALL, *NO_DROPOUT, '--optimizer', optimizer,
                            '--data-parallel-sharding-strategy', strategy, *saves,
                            iterations=STRATEGY_ITERATIONS)

    def losses(optimizer, strategy):
        return demo_log.losses(log(optimizer, strategy), 1, STRATEGY_ITERATIONS)

    losses.log, losses.checkpoints = log, checkpoints
    return losses


@pytest.mark.parametrize('optimizer', ['muon', 'adam'])
def test_every_sharding_strategy_trains_alike(strategy_runs, optimizer):
    """no_shard and ZeRO-1/2/3 compute the same training: every forward reads the weights the
    last step made (under ZeRO-1/2 only after the step's param sync), so the losses agree up to
    fp32 round-off. megatron-core's Adam on Megatron-FSDP is the comparison for Muon's chain."""
    zero3 = strategy_runs(optimizer, 'optim_grads_params')
    for strategy in STRATEGIES:
        losses = strategy_runs(optimizer, strategy)
        assert losses == pytest.approx(zero3, rel=RTOL, abs=0), (strategy, losses, zero3)
    assert zero3[-1] < zero3[0] - 0.1, zero3


def test_muon_on_zero3_matches_muon_on_the_unsharded_model(strategy_runs):
    """Megatron DDP with megatron-core's own Muon holds every matrix whole; the losses may differ
    only by fp32 round-off (the gradient reductions add in another order)."""
    sharded = strategy_runs('muon', 'optim_grads_params')
    unsharded = train(*SMALL, *NO_DROPOUT, '--optimizer', 'muon', '--no-use-megatron-fsdp',
                      '--ckpt-format', 'torch_dist', iterations=STRATEGY_ITERATIONS)
    assert sharded == pytest.approx(unsharded, rel=RTOL, abs=0), (sharded, unsharded)


# What the Megatron-LM-style script is told, as its user would: the demo's GPT and optimizer
# settings without the demo's defaults, megatron-core's mock data, and what megatron-core without
# apex or TransformerEngine needs on any machine (a torch LayerNorm, no gradient-accumulation
# fusion). The jit fusions would compile with torch.compile, which on CPU takes seconds. The ranks
# run in the suite's (daemonic) worker processes, which may not start DataLoader workers.
MEGATRON_LM_STYLE_RUN = (
    *SMALL, *NO_DROPOUT, '--num-attention-heads', '4', '--micro-batch-size', '4',
    '--mock-data', '--vocab-size', '1024', '--transformer-impl', 'local',
    '--optimizer', 'muon', '--lr', '3e-3', '--use-megatron-fsdp', '--ckpt-format', 'fsdp_dtensor',
    '--log-interval', '1', '--eval-interval', str(STRATEGY_ITERATIONS), '--num-workers', '0',
    '--no-persist-layer-norm', '--no-gradient-accumulation-fusion',
    '--no-bias-gelu-fusion', '--no-bias-dropout-fusion')


def test_megatron_lm_style_script_trains_with_muon_on_every_sharding_strategy():
    """tests/megatron_lm_style_pretrain_gpt.py parses its own arguments and calls pretrain() as
    Megatron-LM's script does; with install() and add_muon_args chained into its provider (the
    README's two additions) it trains, and every strategy computes the same training. Such a
    script logs only Megatron's rounded losses: compared as prints (tolerances.printed_within)."""
    iterations = list(range(1, STRATEGY_ITERATIONS + 1))
    runs = {}
    for strategy in STRATEGIES:
        log = training_log(*MEGATRON_LM_STYLE_RUN, '--data-parallel-sharding-strategy', strategy,
                           iterations=STRATEGY_ITERATIONS,
                           script='tests/megatron_lm_style_pretrain_gpt.py')
        runs[strategy] = demo_log.printed_values(log, 'lm loss')
        assert sorted(runs[strategy]) == iterations, log[-3000:]
    zero3 = runs['optim_grads_params']
    for strategy, losses in runs.items():
        assert all(printed_within(losses[i], zero3[i], rel=RTOL) for i in iterations), (
            strategy, losses, zero3)
    assert float(zero3[STRATEGY_ITERATIONS]) < float(zero3[1]) - 0.3, zero3


PARALLELISMS = {
    'experts': ('--num-experts', '4', '--moe-router-topk', '2', '--expert-model-parallel-size', '2'),
    # --log-max-attention-logit, which megatron-core measures only in TransformerEngine's
    # attention, on the local one (the values: test_max_attention_logits.py).
    'tensor_parallel': ('--tensor-model-parallel-size', '2', '--muon-tp-mode', 'distributed',
                        '--log-max-attention-logit'),
}


@pytest.mark.parametrize('parallelism', PARALLELISMS)
def test_demo_trains_with_each_parallelism_at_four_processes(parallelism):
    losses = train(*SMALL, *PARALLELISMS[parallelism], iterations=6, processes=4)
    assert losses[-1] < losses[0] - 0.1, losses


@functools.cache
def _fsdp_at_four_processes() -> tuple[float, ...]:
    return tuple(train(*SMALL, iterations=COMPARED_ITERATIONS, processes=4))


@pytest.mark.parametrize('outer', ['no_shard', 'optim'])
def test_hsdp_matches_fsdp(outer):
    """HSDP (2 replicas x 2 shards) and HFSDP (outer optim) compute what FSDP over 4 ranks does,
    gradient norm and clipping included: the losses may differ only by fp32 round-off."""
    hsdp = train(*SMALL, '--num-distributed-optimizer-instances', '2', '--overlap-grad-reduce',
                 '--outer-dp-sharding-strategy', outer, iterations=COMPARED_ITERATIONS, processes=4)
    fsdp = _fsdp_at_four_processes()
    assert hsdp == pytest.approx(fsdp, rel=RTOL, abs=0), (hsdp, fsdp)
    assert hsdp[-1] != hsdp[0]


def _model_and_optimizer(checkpoint: Path, tmp_path: Path) -> dict:
    """The model and optimizer tensors of a fsdp_dtensor checkpoint, by key."""
    single_file = tmp_path / f'{checkpoint.parent.name}.pt'
    dcp_to_torch_save(checkpoint, single_file)
    state = torch.load(single_file, weights_only=False)
    tensors = {f'model.{k}': v for k, v in state['model'].items()}
    for section in ('state', 'muon'):
        for name, param_state in state['optimizer'][section].items():
            tensors.update({f'optimizer.{name}.{k}': v for k, v in param_state.items()})
    tensors['optimizer.step'] = state['optimizer']['step']
    return tensors


def assert_logged_as_uninterrupted(resumed: str, uninterrupted: str, resumed_at: int, last: int,
                                   rel: float = 0.0):
    """The resumed run computes what the restored state determines: every iteration's loss and
    gradient norm are the uninterrupted run's (equal, or within `rel`)."""
    demo_log.losses(resumed, resumed_at, last)  # the log holds these iterations and only these
    for key in ('lm loss', 'grad norm'):
        got, expected = demo_log.exact_values(resumed, key), demo_log.exact_values(uninterrupted, key)
        for i in range(resumed_at, last + 1):
            assert got[i] == pytest.approx(expected[i], rel=rel, abs=0), (key, i, got, expected)


def test_demo_resumes_from_its_checkpoint_bit_identically(strategy_runs, tmp_path):
    """--save/--save-interval/--exit-interval stop a run at iteration 3; --load resumes it. At
    iteration 6 its model and optimizer (momentum, Adam's moments, step) equal those of the
    uninterrupted run (strategy_runs) bit for bit, and its log shows the same training."""
    uninterrupted = strategy_runs.log('muon', 'optim_grads_params')
    flags = (*SMALL, *NO_DROPOUT, '--save', str(tmp_path / 'resumed'), '--save-interval', '3')
    train(*flags, '--exit-interval', '3', iterations=STRATEGY_ITERATIONS, logged=(1, 3))
    resumed = training_log(*flags, '--load', str(tmp_path / 'resumed'), '--exit-interval', '6',
                           iterations=STRATEGY_ITERATIONS)
    assert_logged_as_uninterrupted(resumed, uninterrupted, resumed_at=4, last=6)
    expected = _model_and_optimizer(strategy_runs.checkpoints / 'iter_0000006', tmp_path)
    got = _model_and_optimizer(tmp_path / 'resumed' / 'iter_0000006', tmp_path)
    assert got.keys() == expected.keys()
    assert any('momentum_buffer' in key for key in got)
    different = [key for key in expected if not torch.equal(got[key], expected[key])]
    assert not different, different


def test_a_load_from_a_directory_without_a_checkpoint_trains_from_scratch(strategy_runs, tmp_path):
    """Megatron's contract: warn ("could not find the metadata file") and train from scratch;
    the training is the one without --load."""
    empty = tmp_path / 'no-checkpoint-here'
    empty.mkdir()
    losses = train(*SMALL, *NO_DROPOUT, '--optimizer', 'muon', '--data-parallel-sharding-strategy',
                   'optim_grads_params', '--load', str(empty), iterations=STRATEGY_ITERATIONS)
    assert losses == strategy_runs('muon', 'optim_grads_params')


QK_CLIP_THRESHOLD = 0.15  # the SMALL GPT's max attention logit passes it at iteration 6


def test_muon_clip_caps_the_logits_and_resumes(strategy_runs, tmp_path):
    """--qk-clip on ZeRO-3: every iteration logs its max attention logit; the training is the
    unclipped run's until a logit first passes the threshold (the clip changes nothing before),
    then the logits stay lower than without the clip; a run resumed from the checkpoint saved
    after the first clip logs what the uninterrupted one does."""
    unclipped = strategy_runs.log('muon', 'optim_grads_params')
    flags = (*SMALL, *NO_DROPOUT, '--qk-clip', '--qk-clip-threshold', str(QK_CLIP_THRESHOLD),
             '--log-max-attention-logit')
    checkpoints = tmp_path / 'clipped'
    clipped = training_log(*flags, '--save', str(checkpoints), '--save-interval', '3',
                           iterations=STRATEGY_ITERATIONS)
    logits = demo_log.exact_values(clipped, 'max attention logit')
    unclipped_logits = demo_log.exact_values(unclipped, 'max attention logit')
    iterations = list(range(1, STRATEGY_ITERATIONS + 1))
    assert sorted(logits) == iterations == sorted(unclipped_logits), clipped[-3000:]
    first_clip = min(i for i in iterations if logits[i] > QK_CLIP_THRESHOLD)
    assert 1 < first_clip <= 6, logits  # the checkpoint of iteration 6 holds a clip
    before, after = iterations[:first_clip], iterations[first_clip:]
    assert [logits[i] for i in before] == [unclipped_logits[i] for i in before]
    losses = demo_log.losses(clipped, 1, STRATEGY_ITERATIONS)
    assert losses[:first_clip] == strategy_runs('muon', 'optim_grads_params')[:first_clip]
    assert max(logits[i] for i in after) < max(unclipped_logits[i] for i in after), (
        logits, unclipped_logits)
    resumed = training_log(*flags, '--load', str(checkpoints), '--ckpt-step', '6',
                           iterations=STRATEGY_ITERATIONS)
    assert_logged_as_uninterrupted(resumed, clipped, resumed_at=7, last=STRATEGY_ITERATIONS)
    assert demo_log.exact_values(resumed, 'max attention logit') == {
        i: logits[i] for i in iterations[6:]}


def test_a_diverged_run_stops_with_a_clear_error():
    """--lr 1e6: every step after the first has NaN gradients and is skipped; after the default
    10 in a row the run stops (non-zero exit) instead of training nothing."""
    failure = failure_of(*SMALL, '--lr', '1e6', iterations=STRATEGY_ITERATIONS + 5)
    assert ('RuntimeError: 10 optimizer steps in a row were skipped: the gradients hold NaN or Inf'
            in failure), failure


def test_adam_on_megatron_fsdp_refuses_to_save_rather_than_hang(tmp_path):
    failure = failure_of('--optimizer', 'adam', '--save', str(tmp_path), '--save-interval', '1',
                         iterations=2)
    assert 'SystemExit: pretrain_gpt.py: --optimizer adam on Megatron-FSDP cannot --save' in failure, failure


def test_megatron_cores_layer_wise_muon_is_refused_in_fp32_and_trains_in_bf16():
    """--no-use-megatron-fsdp --use-distributed-optimizer: megatron-core's own Muon
    (LayerWiseDistributedOptimizer), which megatron-core cannot build in fp32
    (test_megatron_core_paths.py): the demo says so before training; in bf16 it trains."""
    flags = (*SMALL, '--no-use-megatron-fsdp', '--ckpt-format', 'torch_dist',
             '--use-distributed-optimizer')
    failure = failure_of(*flags, iterations=2)
    assert 'SystemExit: pretrain_gpt.py: --optimizer muon --use-distributed-optimizer on Megatron DDP' in failure, failure
    losses = train(*flags, '--bf16', iterations=6)
    assert losses[-1] < losses[0] - 0.1, losses


def test_a_checkpoint_from_two_processes_resumes_on_four_at_the_same_global_batch(strategy_runs):
    """The uninterrupted two-process run's checkpoint of iteration 3 (global batch 8: 4 sequences
    per rank), resumed on four processes (2 per rank): the same training up to the order in which
    the gradients add."""
    uninterrupted = strategy_runs.log('muon', 'optim_grads_params')
    resumed = training_log(*SMALL, *NO_DROPOUT, '--micro-batch-size', '2', '--global-batch-size', '8',
                           '--load', str(strategy_runs.checkpoints), '--ckpt-step', '3',
                           '--exit-interval', '6', iterations=STRATEGY_ITERATIONS, processes=4)
    assert_logged_as_uninterrupted(resumed, uninterrupted, resumed_at=4, last=6, rel=RTOL)


def test_with_dropout_a_resumed_run_draws_the_uninterrupted_runs_dropout(tmp_path):
    """Megatron's checkpoint holds the RNG states; on CPU dropout draws from the default
    generator, which megatron_muon.cpu keeps as the load restored it while the data iterators are
    built: the resumed run is the uninterrupted one, dropout included."""
    uninterrupted = training_log(*SMALL, '--save', str(tmp_path), '--save-interval', '3',
                                 iterations=6)
    resumed = training_log(*SMALL, '--load', str(tmp_path), '--ckpt-step', '3', iterations=6)
    assert_logged_as_uninterrupted(resumed, uninterrupted, resumed_at=4, last=6)


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


@pytest.mark.parametrize('processes', [2, 4])
def test_a_rank_killed_mid_run_ends_the_job_naming_it(processes):
    """SIGKILL to the last rank at iteration 5 of 30: torchrun ends the whole job within 60 s
    with a non-zero exit and names the lost rank; no rank is left waiting for it."""
    launch = subprocess.Popen(
        [str(TORCHRUN), '--standalone', '--nproc-per-node', str(processes),
         *_argv(DEMO, 30, SMALL)],
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


def test_a_checkpoint_without_optimizer_state_says_to_load_the_model_only(tmp_path):
    """A Muon run's --load of a checkpoint without its optimizer state (saved by Adam, or with
    --no-save-optim) stops saying what to do; with --no-load-optim it trains on."""
    flags = (*SMALL, '--load', str(tmp_path))
    train(*SMALL, '--save', str(tmp_path), '--save-interval', '2', '--no-save-optim',
          '--exit-interval', '2', iterations=4, logged=(1, 2))
    failure = failure_of(*flags, iterations=4)
    assert re.search(r'RuntimeError: the checkpoint has no optimizer state for this run \(first '
                     r'missing: optimizer\.\S+\): .*--no-load-optim', failure), failure
    train(*flags, '--no-load-optim', iterations=4, logged=(3, 4))


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
    """`_run_as_torchrun_would`, but rank 1 dies (SIGKILL) having written half of its files of
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
    _run_as_torchrun_would(rank, world_size, argv, log_dir)


def test_a_save_killed_half_way_is_never_the_checkpoint_loaded(tmp_path):
    """Rank 1 dies writing the checkpoint of iteration 4: the run fails, Megatron's tracker still
    names iteration 2 (it is written after every rank has finished), and --load resumes there."""
    flags = (*SMALL, '--save', str(tmp_path), '--save-interval', '2')
    failure_of(*flags, iterations=6, run_rank=_run_killing_rank_1_in_its_second_save,
               retry_lost_peer=False)
    assert (tmp_path / 'latest_checkpointed_iteration.txt').read_text().strip() == '2'
    assert (tmp_path / 'iter_0000004').is_dir()  # what the killed save left
    train(*flags, '--load', str(tmp_path), iterations=6, logged=(3, 6))
