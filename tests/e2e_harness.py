"""The end-to-end tests' harness (no tests here): examples/pretrain_gpt.py, or a script laid out
like Megatron-LM's own pretrain_gpt.py, trains through megatron.training on gloo.

`demo_run_log`, `training_log`, `train` and `failure_of` run each rank of a script as torchrun
would (its environment variables, the script as __main__) in a fresh process forked from the
suite's server, which has imported torch and megatron once: a torchrun launch spent about half of
its 15 s in the same imports, over again in every process (torchrun's own launch is
test_e2e_fault's killed rank's). `strategy_runs` (conftest's session fixture of that name) runs
the demo once per optimizer and sharding strategy for the tests of every e2e module that compare
with it."""

import functools
import sys
import tempfile
from pathlib import Path

import pytest

import conftest
import demo_log
from conftest import close_pools, first_failure, run_distributed
from rank_processes import run_as_torchrun, run_as_torchrun_would

REPO = Path(__file__).resolve().parents[1]
DEMO = 'examples/pretrain_gpt.py'
TORCHRUN = Path(sys.executable).with_name('torchrun')  # test_e2e_fault's launch
ITERATIONS = 25
# Newton-Schulz in fp32 on every machine: the comparisons allow fp32 reordering (tolerances.py),
# which bf16 matmuls would round up into differences of their own. The demo's own choice of
# precision (bf16 where bf16 matmuls are native) is test_muon_on_megatron_fsdp_loss_falls's.
FP32_NEWTON_SCHULZ = ('--muon-fp32-matmul-prec', 'highest')

# A smaller GPT than the demo's for the comparisons: they test the sharding, not the model.
SMALL = ('--num-layers', '2', '--hidden-size', '64', '--ffn-hidden-size', '256',
         '--seq-length', '64', '--max-position-embeddings', '64')
NO_DROPOUT = ('--hidden-dropout', '0', '--attention-dropout', '0')
STRATEGIES = ('no_shard', 'optim', 'optim_grads', 'optim_grads_params')
STRATEGY_ITERATIONS = 10


@pytest.fixture(autouse=True, scope="module")
def no_idle_workers():
    """The other modules' idle gloo workers would take CPU from these runs (conftest). Every e2e
    module imports this fixture, which makes it theirs."""
    close_pools()


def demo_run_log(*flags: str, iterations: int) -> str:
    """The demo at W=2 at its own precision, as `make demo` runs it (each rank as torchrun would,
    run_as_torchrun), and what every rank printed on stdout (rank 0's check lines; the last
    rank's iterations), then on stderr (Megatron's logger: its timers)."""
    run = run_as_torchrun(conftest.SERVER, [DEMO, '--train-iters', str(iterations),
                                            '--eval-iters', '0', *flags], 2, daemon=False)
    assert run.returncode == 0, f'training failed:\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}'
    return run.stdout + run.stderr


def train(*flags: str, iterations: int = ITERATIONS, processes: int = 2,
          logged: tuple[int, int] | None = None) -> list[float]:
    """Run the demo on `processes` ranks; return the training losses it computed (iterations
    `logged`, first and last: 1 to `iterations` unless the run resumes or exits early)."""
    first, last = logged or (1, iterations)
    return demo_log.losses(training_log(*flags, iterations=iterations, processes=processes),
                           first, last)


def script_argv(script: str, iterations: int, flags) -> list[str]:
    """The command line of `script` (after torchrun's own flags) with fp32 Newton-Schulz."""
    return [script, '--train-iters', str(iterations), '--eval-iters', '0', *FP32_NEWTON_SCHULZ,
            *flags]


def training_log(*flags: str, iterations: int, processes: int = 2, script: str = DEMO) -> str:
    """What the last rank, where Megatron logs the iterations, printed."""
    argv = script_argv(script, iterations, flags)
    with tempfile.TemporaryDirectory(prefix='e2e-') as log_dir:
        run_distributed(run_as_torchrun_would, processes, argv, log_dir, timeout=600, fresh=True)
        return (Path(log_dir) / f'{processes - 1}.log').read_text()


def failure_of(*flags: str, iterations: int, processes: int = 2,
               run_rank=run_as_torchrun_would, retry_lost_peer: bool = True) -> str:
    """Run the demo (each rank as `run_rank` runs it), which must stop with an error; what the
    failing rank raised."""
    with tempfile.TemporaryDirectory(prefix='e2e-') as log_dir:
        failure = first_failure(run_rank, processes, script_argv(DEMO, iterations, flags),
                                log_dir, timeout=600, fresh=True, retry_lost_peer=retry_lost_peer)
    assert failure, 'the run did not stop with an error'
    return failure


def assert_loss_falls(losses: list[float]) -> None:
    # Untrained: ~ln(1024) = 6.9; the corpus's floor is ~1.1 (examples/synthetic_data.py).
    first, last = losses[0], sum(losses[-3:]) / 3
    assert first > 6.5 and last < first - 1.0, losses


def strategy_runs(checkpoints: Path):
    """The demo's losses by optimizer and sharding strategy (dropout off), each run once for all
    the tests that compare with them (conftest's session fixture `strategy_runs` calls this
    once). Muon's ZeRO-3 run also saves a checkpoint every 3 iterations into
    `strategy_runs.checkpoints`: the uninterrupted run the resume tests compare with
    (`strategy_runs.log`: its log), and logs its max attention logits."""

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
