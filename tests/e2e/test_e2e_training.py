"""End to end, training: examples/pretrain_gpt.py trains the demo GPT with megatron.training at
W=2 (at its own precision, as `make demo` runs it, and under every sharding strategy), and at
W=4 with experts and tensor parallelism (HSDP and HFSDP against Megatron DDP, in process: the
flag sweep, tests/e2e/test_flag_sweep.py); a script laid out like Megatron-LM's own
pretrain_gpt.py trains with only the README's additions (e2e_harness runs them)."""

import json
import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import demo_log
from e2e_harness import (NO_DROPOUT, SMALL, STRATEGIES, STRATEGY_ITERATIONS, assert_loss_falls,
                         demo_run_log, failure_of, train, training_log)
from e2e_harness import no_idle_workers  # noqa: F401 (an autouse fixture)
from tolerances import RTOL, printed_within

from megatron_muon.reporting.step_report import SCALARS
from megatron_muon.reporting.rates_file import RATES_FILE
from megatron_muon.estimate.parts import Rates

PHASES = ('muon-grads', 'muon-update', 'muon-gather', 'muon-newton-schulz', 'muon-scatter',
          'muon-scalar-optimizer', 'muon-param-sync', 'muon-check')

pytestmark = pytest.mark.e2e

# The check's run: two checks (iterations 5 and 10), then two iterations after the last; the
# demo's loss falls by about 2 in these 12 (assert_loss_falls asks 1).
CHECKED_ITERATIONS = 12


def test_muon_on_megatron_fsdp_loss_falls(tmp_path):
    """The default: --optimizer muon through megatron_muon.training's switch and factory, at the
    demo's own Newton-Schulz precision (the suite's header says which), with the check interval:
    every 5th iteration's updates also computed whole and compared, and the compute weights
    checked after the param sync (and found equal: a failed check stops the run). At
    --timing-log-level 2 each iteration's log has our step and its phases among Megatron's
    timers, each with its (min, max) over the ranks (observe.phases); with
    --log-timers-to-tensorboard TensorBoard's event file has them (each one's max over ranks)
    and the step's scalars (reporting.step_report) every iteration."""
    log = demo_run_log('--optimizer', 'muon', '--muon-check-interval', '5',
                       '--timing-log-level', '2', '--logging-level', '20',
                       '--log-timers-to-tensorboard', '--tensorboard-dir', str(tmp_path),
                       iterations=CHECKED_ITERATIONS)
    assert_loss_falls(demo_log.losses(log, 1, CHECKED_ITERATIONS))
    checks = re.findall(r'^muon check at iteration (\d+): max \|owner - reference\| = (\S+) over '
                        r'\d+ matrices; no replicas; compute weights equal$', log, re.MULTILINE)
    assert [iteration for iteration, _ in checks] == ['5', '10'], checks
    blocks = _timer_blocks(log)
    assert len(blocks) == CHECKED_ITERATIONS
    checked = [i + 1 for i, block in enumerate(blocks) if 'muon-check' in block]
    assert checked == [5, 10], checked  # the check's timer where it ran
    for i, block in enumerate(blocks, 1):  # ms: our step inside Megatron's, our phases in ours
        assert set(block) == {'optimizer', 'muon-step', *PHASES} - (
            set() if i in checked else {'muon-check'}), (i, block)
        assert all(0 < low <= high for low, high in block.values()), (i, block)
        # Nested on every rank, so the phases' minima add up to at most the step's maximum. How
        # much of the step they cover (97-98% on the demo here) is a figure for the docs, not
        # an assertion: a test holds no timing.
        lows = sum(block[name][0] for name in PHASES if name in block)
        assert lows <= block['muon-step'][1] and block['muon-step'][0] <= block['optimizer'][1], (
            i, block)
    board = EventAccumulator(str(tmp_path))
    board.Reload()
    written = {name: [(e.step, e.value) for e in board.Scalars(name)]
               for name in board.Tags()['scalars']}
    every = list(range(1, CHECKED_ITERATIONS + 1))
    for name in ('muon-step', *PHASES):  # the max over ranks, in s (the log's ms, rounded)
        steps = checked if name == 'muon-check' else every
        assert [step for step, _ in written[f'{name}-time']] == steps, name
        assert [1e3 * value for _, value in written[f'{name}-time']] == pytest.approx(
            [blocks[step - 1][name][1] for step in steps], abs=0.006), name
    for name in SCALARS[:-1]:
        assert [step for step, _ in written[name]] == every, name
        assert len({value for _, value in written[name]}) == 1, name  # planned once
    assert written['muon/skipped-steps'][-1][1] == 0
    # (an exchange whose rows all stay where they are issues no collective)
    assert written['muon/exchanges'][0][1] > 0 and written['muon/collectives'][0][1] > 0
    assert written['muon/bytes-received'][0][1] > 0
    assert written['muon/newton-schulz-busiest-over-mean'][0][1] >= 1
    # The check's result from iteration 5 on: the last check's, as the log prints it.
    check = dict(written['muon/check-max-difference'])
    assert sorted(check) == list(range(5, CHECKED_ITERATIONS + 1))
    assert check[CHECKED_ITERATIONS] == pytest.approx(float(checks[-1][1]), rel=1e-3)
    # Beside the event file, the rates the run measured at construction, as `make scale` reads
    # them (reporting.rates_file; tests/plan/test_scale_model.py holds them to the measurements).
    rates = Rates(json.loads((tmp_path / RATES_FILE).read_text()))
    assert rates.all_to_all_gbps > 0 and rates.newton_schulz_seconds(1e9) > 0


def _timer_blocks(log: str) -> list[dict[str, tuple[float, float]]]:
    """Each iteration's timers of ours (muon-step's block) with Megatron's `optimizer` printed
    before them: {name: (min, max) over ranks, ms}."""
    blocks, optimizer = [], None
    for name, low, high in re.findall(r'^ +([a-z-]+) \.+: \(([\d.]+), ([\d.]+)\)$', log,
                                      re.MULTILINE):
        if name == 'optimizer':
            optimizer = (float(low), float(high))
        elif name == 'muon-step':
            blocks.append({'optimizer': optimizer})
        if name.startswith('muon-'):
            blocks[-1][name] = (float(low), float(high))
    return blocks


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


def test_megatron_lm_style_script_trains_with_muon_on_zero3_and_zero1():
    """tests/megatron_lm_style_pretrain_gpt.py parses its own arguments and calls pretrain() as
    Megatron-LM's script does; with install() and add_muon_args chained into its provider (the
    README's two additions) it trains, and ZeRO-1 (unsharded compute weights, which only the
    param sync makes current) computes ZeRO-3's training; every strategy alike: the demo's
    test_every_sharding_strategy_trains_alike. Such a script logs only Megatron's rounded
    losses: compared as prints (tolerances.printed_within)."""
    iterations = list(range(1, STRATEGY_ITERATIONS + 1))
    runs = {}
    for strategy in ('optim_grads_params', 'optim'):
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


# Kimi K2's layers at the SMALL GPT's size: multi-latent attention (q and kv low-rank projections,
# a rope part), 4 routed experts top-2 beside a shared expert, the first layer dense.
MLA = ('--multi-latent-attention', '--q-lora-rank', '32', '--kv-lora-rank', '32',
       '--qk-head-dim', '16', '--qk-pos-emb-head-dim', '8', '--v-head-dim', '16')
KIMI_K2_LIKE = (*MLA, '--num-experts', '4', '--moe-router-topk', '2', '--moe-ffn-hidden-size',
                '64', '--moe-shared-expert-intermediate-size', '64', '--moe-layer-freq', '[0,1]',
                '--expert-model-parallel-size', '2')
# A fifth of the first iteration's max logit here (0.0103): the first step clips every head, and
# iteration 2's max logit falls to about a quarter. At 0.008 (three quarters of it) a few heads
# were scaled by ~0.9, which on a Xeon with native bf16 moved iteration 2's loss and gradient norm
# by less than fp32 resolves.
MLA_CLIP_THRESHOLD = 0.002


@pytest.mark.parametrize('processes, model', [
    pytest.param(2, KIMI_K2_LIKE, id='Kimi-K2-like-W2'),
    # megatron-core's MoE layer trains under TP only with sequence parallelism, which its torch
    # LayerNorm (no TE or apex) lacks: TP=2 with MLA alone.
    pytest.param(4, (*MLA, '--tensor-model-parallel-size', '2'), id='MLA-TP2-W4')])
def test_muon_clip_on_multi_latent_attention_trains_and_clips(processes, model):
    """MuonClip on MLA through megatron.training: every iteration logs its max attention logit,
    the loss falls, and the run leaves the unclipped one after the first step, whose logits passed
    the threshold (the clip happens; its values against megatron-core's
    MultiLatentAttention.clip_qk: test_qk_clip.py): the next forward reads the clipped weights,
    its max logit down near the threshold."""
    logged = ('--log-max-attention-logit',)
    clipped = training_log(*SMALL, *NO_DROPOUT, *model, *logged, '--qk-clip',
                           '--qk-clip-threshold', str(MLA_CLIP_THRESHOLD), iterations=6,
                           processes=processes)
    unclipped = training_log(*SMALL, *NO_DROPOUT, *model, *logged, iterations=6,
                             processes=processes)
    logits = demo_log.exact_values(clipped, 'max attention logit')
    assert sorted(logits) == list(range(1, 7)), clipped[-3000:]
    assert logits[1] > MLA_CLIP_THRESHOLD, logits
    losses = demo_log.losses(clipped, 1, 6)
    assert losses[-1] < losses[0] - 0.1, losses
    unclipped_logits = demo_log.exact_values(unclipped, 'max attention logit')
    assert logits[2] < unclipped_logits[2] / 2, (logits, unclipped_logits)
    norms, unclipped_norms = (demo_log.exact_values(log, 'grad norm') for log in (clipped, unclipped))
    assert norms[1] == unclipped_norms[1] and norms[2] != unclipped_norms[2], (norms, unclipped_norms)
