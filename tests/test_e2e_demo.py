"""End to end: examples/pretrain_gpt.py trains the demo GPT with megatron.training at W=2, and at
W=4 with experts, tensor parallelism, HSDP and HFSDP; a script laid out like Megatron-LM's own
pretrain_gpt.py trains with only the README's additions.

One test launches the demo with torchrun, as `make demo` does. The others run each rank of a
script as torchrun would (its environment variables, the script as __main__) in a fresh process
forked from the suite's server, which has imported torch and megatron once: a torchrun launch
spent about half of its 15 s in the same imports, over again in every process."""

import functools
import os
import re
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import close_pools, run_distributed

REPO = Path(__file__).resolve().parents[1]
DEMO = 'examples/pretrain_gpt.py'
TORCHRUN = Path(sys.executable).with_name('torchrun')
ITERATIONS = 25
COMPARED_ITERATIONS = 4  # the loss of iteration 4 is the first to see the third update
# Megatron's per-iteration log line, e.g. "iteration        3/      25 | ... | lm loss: 6.72E+00 |".
ITERATION_LOSS = re.compile(r' iteration\s+(\d+)/\s*\d+ \|.*\| lm loss: ([-+.\dEe]+) \|')


@pytest.fixture(autouse=True, scope="module")
def no_idle_workers():
    """The other modules' idle gloo workers would take CPU from these runs (conftest)."""
    close_pools()


def _logged_losses(log: str, first: int, last: int) -> list[float]:
    losses = {int(i): float(loss) for i, loss in ITERATION_LOSS.findall(log)}
    assert sorted(losses) == list(range(first, last + 1)), log[-3000:]
    return [losses[i] for i in sorted(losses)]


def torchrun(*flags: str, iterations: int = ITERATIONS) -> list[float]:
    """Launch the demo with torchrun at W=2; return its training losses."""
    run = subprocess.run(
        [str(TORCHRUN), '--standalone', '--nproc-per-node', '2', DEMO,
         '--train-iters', str(iterations), '--eval-iters', '0', *flags],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert run.returncode == 0, f'training failed:\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}'
    return _logged_losses(run.stdout, 1, iterations)


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
          logged: tuple[int, int] | None = None, script: str = DEMO) -> list[float]:
    """Run the demo (or `script`) on `processes` ranks; return the logged training losses
    (iterations `logged`, first and last: 1 to `iterations` unless the run resumes or exits
    early). Megatron logs them on the last rank."""
    argv = [script, '--train-iters', str(iterations), '--eval-iters', '0', *flags]
    with tempfile.TemporaryDirectory(prefix='e2e-') as log_dir:
        run_distributed(_run_as_torchrun_would, processes, argv, log_dir, timeout=600, fresh=True)
        log = (Path(log_dir) / f'{processes - 1}.log').read_text()
    first, last = logged or (1, iterations)
    return _logged_losses(log, first, last)


def assert_loss_falls(losses: list[float]) -> None:
    # Untrained: ~ln(1024) = 6.9; the corpus's floor is ~1.1 (examples/synthetic_data.py).
    first, last = losses[0], sum(losses[-3:]) / 3
    assert first > 6.5 and last < first - 1.0, losses


def test_muon_on_megatron_fsdp_loss_falls():
    """The default: --optimizer muon through megatron_muon.training's switch and factory."""
    assert_loss_falls(torchrun('--optimizer', 'muon'))


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
    `strategy_runs.checkpoints`: the uninterrupted run the resume test compares with."""
    checkpoints = tmp_path_factory.mktemp('uninterrupted')

    @functools.cache
    def losses(optimizer, strategy):
        saves = (('--save', str(checkpoints), '--save-interval', '3')
                 if (optimizer, strategy) == ('muon', 'optim_grads_params') else ())
        return train(*SMALL, *NO_DROPOUT, '--optimizer', optimizer,
                     '--data-parallel-sharding-strategy', strategy, *saves,
                     iterations=STRATEGY_ITERATIONS)

    losses.checkpoints = checkpoints
    return losses


@pytest.mark.parametrize('optimizer', ['muon', 'adam'])
def test_every_sharding_strategy_trains_alike(strategy_runs, optimizer):
    """no_shard and ZeRO-1/2/3 compute the same training: every forward reads the weights the
    last step made (under ZeRO-1/2 only after the step's param sync), so the losses agree up to
    fp32 round-off. megatron-core's Adam on Megatron-FSDP is the comparison for Muon's chain."""
    zero3 = strategy_runs(optimizer, 'optim_grads_params')
    for strategy in STRATEGIES:
        losses = strategy_runs(optimizer, strategy)
        assert losses == pytest.approx(zero3, rel=1e-5, abs=0), (strategy, losses, zero3)
    assert zero3[-1] < zero3[0] - 0.1, zero3


def test_muon_on_zero3_matches_muon_on_the_unsharded_model(strategy_runs):
    """Megatron DDP with megatron-core's own Muon holds every matrix whole; the losses may differ
    only by fp32 round-off (the gradient reductions add in another order)."""
    sharded = strategy_runs('muon', 'optim_grads_params')
    unsharded = train(*SMALL, *NO_DROPOUT, '--optimizer', 'muon', '--no-use-megatron-fsdp',
                      '--ckpt-format', 'torch_dist', iterations=STRATEGY_ITERATIONS)
    assert sharded == pytest.approx(unsharded, rel=1e-5, abs=0), (sharded, unsharded)


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
    README's two additions) it trains, and every strategy computes the same training."""
    runs = {strategy: train(*MEGATRON_LM_STYLE_RUN, '--data-parallel-sharding-strategy', strategy,
                            iterations=STRATEGY_ITERATIONS,
                            script='tests/megatron_lm_style_pretrain_gpt.py')
            for strategy in STRATEGIES}
    zero3 = runs['optim_grads_params']
    for strategy, losses in runs.items():
        assert losses == pytest.approx(zero3, rel=1e-5, abs=0), (strategy, losses, zero3)
    assert zero3[-1] < zero3[0] - 0.3, zero3


PARALLELISMS = {
    'experts': ('--num-experts', '4', '--moe-router-topk', '2', '--expert-model-parallel-size', '2'),
    'tensor_parallel': ('--tensor-model-parallel-size', '2', '--muon-tp-mode', 'distributed'),
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
    assert hsdp == pytest.approx(fsdp, rel=1e-5, abs=0), (hsdp, fsdp)
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


def test_demo_resumes_from_its_checkpoint_bit_identically(strategy_runs, tmp_path):
    """--save/--save-interval/--exit-interval stop a run at iteration 3; --load resumes it. At
    iteration 6 its model and optimizer (momentum, Adam's moments, step) equal those of the
    uninterrupted run (strategy_runs) bit for bit. Dropout off: on CPU it draws from the CPU
    generator, which the resumed run does not find where the uninterrupted one was (Megatron's
    RNG restore; the weights are ours)."""
    strategy_runs('muon', 'optim_grads_params')
    flags = (*SMALL, *NO_DROPOUT, '--save', str(tmp_path / 'resumed'), '--save-interval', '3')
    train(*flags, '--exit-interval', '3', iterations=STRATEGY_ITERATIONS, logged=(1, 3))
    train(*flags, '--load', str(tmp_path / 'resumed'), '--exit-interval', '6',
          iterations=STRATEGY_ITERATIONS, logged=(4, 6))
    expected = _model_and_optimizer(strategy_runs.checkpoints / 'iter_0000006', tmp_path)
    got = _model_and_optimizer(tmp_path / 'resumed' / 'iter_0000006', tmp_path)
    assert got.keys() == expected.keys()
    assert any('momentum_buffer' in key for key in got)
    different = [key for key in expected if not torch.equal(got[key], expected[key])]
    assert not different, different
