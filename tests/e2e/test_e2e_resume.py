"""End to end, checkpoints: the demo saves with --save and resumes with --load the training an
uninterrupted run computes (bit for bit at the same world size, dropout and MuonClip included;
at another world size up to the order in which gradients add; with the optimizer state in host
memory or not, either way round), trains from scratch when --load finds no checkpoint, and says what to do when a checkpoint lacks the optimizer state or cannot
be saved (e2e_harness runs the demo)."""

import re
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import demo_log
from e2e_harness import NO_DROPOUT, SMALL, STRATEGY_ITERATIONS, failure_of, train, training_log
from e2e_harness import no_idle_workers  # noqa: F401 (an autouse fixture)
from tolerances import RTOL

pytestmark = pytest.mark.e2e


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


def test_adam_on_megatron_fsdp_refuses_to_save_rather_than_hang(tmp_path):
    failure = failure_of('--optimizer', 'adam', '--save', str(tmp_path), '--save-interval', '1',
                         iterations=2)
    assert 'SystemExit: pretrain_gpt.py: --optimizer adam on Megatron-FSDP cannot --save' in failure, failure


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
    generator, which cpu.torch_compat keeps as the load restored it while the data iterators are
    built: the resumed run is the uninterrupted one, dropout included."""
    uninterrupted = training_log(*SMALL, '--save', str(tmp_path), '--save-interval', '3',
                                 iterations=6)
    resumed = training_log(*SMALL, '--load', str(tmp_path), '--ckpt-step', '3', iterations=6)
    assert_logged_as_uninterrupted(resumed, uninterrupted, resumed_at=4, last=6)


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


OFFLOAD = ('--optimizer-cpu-offload',)  # all of it: megatron.training's fraction defaults to 1.0


def test_demo_resumes_from_its_checkpoint_bit_identically_its_state_offloaded_or_not(
        strategy_runs, tmp_path):
    """--save/--save-interval/--exit-interval stop a run at iteration 3; --load resumes it. The
    run keeps its state in host memory between steps (--optimizer-cpu-offload: Muon's momentum,
    Adam's moments) and logs every loss and grad norm of the uninterrupted run without offload
    (strategy_runs); resumed offloaded, at iteration 6 its model and optimizer (momentum, Adam's
    moments, step) equal the uninterrupted run's bit for bit. Its checkpoint also resumes without
    offload, and the uninterrupted run's resumes offloaded, each logging the same training."""
    uninterrupted = strategy_runs.log('muon', 'optim_grads_params')
    checkpoints = tmp_path / 'offloaded'
    flags = (*SMALL, *NO_DROPOUT, '--save', str(checkpoints), '--save-interval', '3')
    offloaded = training_log(*flags, *OFFLOAD, '--exit-interval', '3',
                             iterations=STRATEGY_ITERATIONS)
    assert_logged_as_uninterrupted(offloaded, uninterrupted, resumed_at=1, last=3)
    resumed = training_log(*flags, *OFFLOAD, '--load', str(checkpoints), '--exit-interval', '6',
                           iterations=STRATEGY_ITERATIONS)
    assert_logged_as_uninterrupted(resumed, uninterrupted, resumed_at=4, last=6)
    expected = _model_and_optimizer(strategy_runs.checkpoints / 'iter_0000006', tmp_path)
    got = _model_and_optimizer(checkpoints / 'iter_0000006', tmp_path)
    assert got.keys() == expected.keys()
    assert any('momentum_buffer' in key for key in got)
    different = [key for key in expected if not torch.equal(got[key], expected[key])]
    assert not different, different
    for load, offload in ((checkpoints, ()), (strategy_runs.checkpoints, OFFLOAD)):
        resumed = training_log(*SMALL, *NO_DROPOUT, *offload, '--load', str(load), '--ckpt-step',
                               '3', '--exit-interval', '6', iterations=STRATEGY_ITERATIONS)
        assert_logged_as_uninterrupted(resumed, uninterrupted, resumed_at=4, last=6)


def test_normuon_with_its_state_offloaded_trains_as_without_it():
    """NorMuon (--optimizer adaptive_muon; its second moment travels with the update's rows) on
    ZeRO-2 with half of the state offloaded, MuonClip clipping every step: every loss and grad
    norm of the run without."""
    flags = (*SMALL, *NO_DROPOUT, '--optimizer', 'adaptive_muon',
             '--adaptive-muon-moment2-method', 'normuon', '--data-parallel-sharding-strategy',
             'optim_grads', '--qk-clip', '--qk-clip-threshold', '0.01', '--exit-interval', '4')
    without = training_log(*flags, iterations=STRATEGY_ITERATIONS)
    offloaded = training_log(*flags, *OFFLOAD, '--optimizer-offload-fraction', '0.5',
                             iterations=STRATEGY_ITERATIONS)
    assert_logged_as_uninterrupted(offloaded, without, resumed_at=1, last=4)


MEGATRON_DDP = ('--no-use-megatron-fsdp', '--ckpt-format', 'torch_dist')
# A gated fc1 (megatron-core saves it through a factory) and 4 experts over expert parallel 2.
SWIGLU_AND_EXPERTS = ('--swiglu', '--num-experts', '4', '--moe-router-topk', '2',
                      '--expert-model-parallel-size', '2')


def test_a_megatron_ddp_muon_run_continues_on_megatron_fsdp(tmp_path):
    """megatron-core's Muon on Megatron DDP saves torch_dist at iteration 3; ours on Megatron-FSDP
    loads it with --load and its own flags (checkpoint.from_megatron_ddp: the weights, Muon's
    momentum, Adam's moments, the step count, the schedule, the RNG) and computes iterations 4-6
    as the DDP run did, with SwiGLU and experts over EP=2 (their momentum under the global
    expert index). Saving needs megatron-core's torch_dist writer, which imports psutil
    (setup.py brings it: a fresh venv saves) and starts processes of its own (the suite's fresh
    ranks are not daemonic, so they may)."""
    flags = (*SMALL, *NO_DROPOUT, *SWIGLU_AND_EXPERTS)
    ddp = training_log(*flags, *MEGATRON_DDP, '--save', str(tmp_path), '--save-interval', '3',
                       iterations=6)
    assert any((tmp_path / 'iter_0000003').glob('*.distcp'))
    resumed = training_log(*flags, '--load', str(tmp_path), '--ckpt-step', '3', iterations=6)
    assert_logged_as_uninterrupted(resumed, ddp, resumed_at=4, last=6, rel=RTOL)


def test_an_adam_ddp_checkpoint_loads_into_muon_with_no_load_optim_only(tmp_path):
    """Adam's moments on Megatron DDP are not Muon's state: the load stops naming
    --no-load-optim before training; with it, the weights, iteration and schedule load and
    iteration 4's loss and grad norm are the DDP run's."""
    adam = ('--optimizer', 'adam')
    ddp = training_log(*SMALL, *NO_DROPOUT, *adam, *MEGATRON_DDP, '--save', str(tmp_path),
                       '--save-interval', '3', iterations=4)
    flags = (*SMALL, *NO_DROPOUT, '--load', str(tmp_path), '--ckpt-step', '3')
    failure = failure_of(*flags, iterations=4)
    assert re.search(r'OptimizerStateNotLoadable: the Megatron DDP checkpoint has no '
                     r'momentum_buffer for \S+: .*--no-load-optim', failure), failure
    resumed = training_log(*flags, '--no-load-optim', iterations=4)
    assert_logged_as_uninterrupted(resumed, ddp, resumed_at=4, last=4, rel=RTOL)


def test_megatron_ddp_continues_a_megatron_fsdp_muon_checkpoint(strategy_runs, tmp_path):
    """The way back: our ZeRO-3 Muon checkpoint of iteration 3, loaded by megatron-core's Muon on
    Megatron DDP with --load and the DDP run's own flags (--ckpt-format torch_dist;
    checkpoint.to_megatron_ddp: weights, momentum, Adam's moments and step, schedule, RNG), computes
    iterations 4-6 as our uninterrupted run (upstream: AttributeError 'NoneType' object has no
    attribute 'items'). So does Megatron's own converter (--ckpt-convert-format torch_dist, which
    saves what the load gave and exits): its torch_dist checkpoint, which Megatron-Bridge's
    export to Hugging Face reads (docs/bridge.md), resumes on Megatron DDP alike."""
    uninterrupted = strategy_runs.log('muon', 'optim_grads_params')
    ours = ('--load', str(strategy_runs.checkpoints), '--ckpt-step', '3')
    resumed = training_log(*SMALL, *NO_DROPOUT, *MEGATRON_DDP, *ours, '--exit-interval', '6',
                           iterations=STRATEGY_ITERATIONS)
    assert_logged_as_uninterrupted(resumed, uninterrupted, resumed_at=4, last=6, rel=RTOL)
    converted = tmp_path / 'converted'
    training_log(*SMALL, *NO_DROPOUT, *MEGATRON_DDP, *ours, '--ckpt-convert-format', 'torch_dist',
                 '--ckpt-convert-save', str(converted), iterations=STRATEGY_ITERATIONS)
    assert any((converted / 'torch_dist' / 'iter_0000003').glob('*.distcp'))
    resumed = training_log(*SMALL, *NO_DROPOUT, *MEGATRON_DDP, '--load',
                           str(converted / 'torch_dist'), '--exit-interval', '6',
                           iterations=STRATEGY_ITERATIONS)
    assert_logged_as_uninterrupted(resumed, uninterrupted, resumed_at=4, last=6, rel=RTOL)
