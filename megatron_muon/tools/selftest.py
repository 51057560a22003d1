"""Prove megatron-muon exact on this cluster:
`torchrun --nproc-per-node N -m megatron_muon.selftest`.

For each sharding strategy and, where the world size allows, tensor parallelism 2, expert
parallelism 2 and HSDP (2 replicas), it builds a small megatron-core GPT on Megatron-FSDP, trains a
few iterations with Muon (or --optimizer adaptive_muon) in owner mode and the check interval at 2:
on iterations 2, 4 and 6 every matrix's update from the owner exchange is compared with the update
of the whole, unsharded matrix (megatron-core's TensorParallelMuon, as single-device Muon computes
it from the same momentum; NorMuon's second moment with it), then replicas and compute weights
with the main weights. Rank 0 prints one row per configuration
(the largest |owner - reference|, pass or fail, the median optimizer step of the unchecked
iterations, Newton-Schulz TFLOP/s, bytes received per rank per step, from the plan, and the
largest rank's peak memory in two more, unchecked, train steps: at rest plus the most its forward-
backward or optimizer step adds, megatron_muon.tools.memory.measure_train_step) and the exit
status is 0 only when every configuration passed; 1 when one failed; 2 when one ran past
--time-limit (it is named: a hang in a collective). NCCL on GPUs, gloo on CPU. Given the user's
model (Megatron's model flags, or --estimate-model), rank 0 then prints its estimated optimizer
step at W, 4 W and 16 W (estimate), Newton-Schulz timed here on the model's own shapes.
"""

import argparse
import contextlib
import gc
import io
import json
import os
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist

from ..compat import versions
from ..core.checks import MuonCheckError
from ..core.second_moment import SECOND_MOMENTS
from ..estimate.figures import assumed, estimated_steps, newton_schulz_shapes
from ..estimate.model import MODEL_FLAGS, MODELS, spec_from_flags
from ..estimate.parts import Rates, measure_rates
from ..integrations.arguments import FSDP_OPTIMIZERS

ITERATIONS, CHECK_INTERVAL = 6, 2


def configurations(world_size: int) -> list[dict]:
    """(name, settings) the world size allows: every strategy; EP=2 on an even world; TP=2 and
    HSDP once each leaves at least 2 data-parallel ranks."""
    configs = [dict(name=f"{label} ({strategy})", strategy=strategy) for label, strategy in
               (("no_shard", "no_shard"), ("ZeRO-1", "optim"), ("ZeRO-2", "optim_grads"),
                ("ZeRO-3", "optim_grads_params"))]
    if world_size % 2 == 0:
        configs.append(dict(name="ZeRO-2, EP=2 (4 experts)", strategy="optim_grads",
                            expert_parallel=2))
    if world_size % 2 == 0 and world_size >= 4:
        configs.append(dict(name="ZeRO-3, TP=2", strategy="optim_grads_params", tensor_parallel=2))
        configs.append(dict(name="HSDP: 2 replicas of ZeRO-3", strategy="optim_grads_params",
                            replicas=2))
    return configs


def _synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _NewtonSchulzClock:
    """Time and FLOPs of the Newton-Schulz this rank runs as an owner, around each of the
    optimizer's own Newton-Schulz calls (its scaled_orthogonalize_fn, a QKV split's block each;
    an attribute of that one instance: nothing upstream is touched); the FLOPs of what runs
    (plan.matrix_ns_flops: Gram's where --muon-gram-newton-schulz runs it on a whole matrix)."""

    def __init__(self, muon, steps: int):
        from ..compat.tensor_parallel import newton_schulz_gets_it_whole
        from ..plan import matrix_ns_flops

        self.seconds, self.flops = 0.0, 0
        orthogonalize = muon.scaled_orthogonalize_fn

        def timed(grad, tp_group=None, partition_dim=None):
            _synchronize()
            start = time.perf_counter()
            result = orthogonalize(grad, tp_group, partition_dim)
            _synchronize()
            self.seconds += time.perf_counter() - start
            batch = grad.shape[0] if grad.dim() == 3 else 1
            whole = newton_schulz_gets_it_whole(tp_group, partition_dim)
            self.flops += batch * matrix_ns_flops(*grad.shape[-2:], steps,
                                                  muon.gram if whole else None)
            return result

        muon.scaled_orthogonalize_fn = timed


def run_configuration(config: dict, args, corrupt: bool, rates_dir: str | None = None) -> dict:
    """Train one configuration; its row's figures (collective: every rank returns the same);
    with `rates_dir`, the rates its optimizer measured at construction written there
    (reporting.rates_file; `rates`: the file, or None where nothing was measured)."""
    from megatron.core import parallel_state

    from ..integrations.factory import get_megatron_optimizer
    from ..reporting.rates_file import write_rates
    from .memory import measure_train_step
    from .testing import GPTShape, fsdp_gpt, init_parallel_state, lm_loss, optimizer_config

    init_parallel_state(expert_parallel=config.get("expert_parallel", 1),
                        tensor_parallel=config.get("tensor_parallel", 1),
                        replicas=config.get("replicas", 1))
    shape = GPTShape(layers=2, hidden=args.hidden, ffn=4 * args.hidden, heads=4, vocab=256,
                     seq=args.seq, micro_batch=2)
    model = fsdp_gpt(shape, strategy=config["strategy"], overlap=True,
                     num_experts=4 if config.get("expert_parallel", 1) > 1 else None)
    settings = optimizer_config(optimizer=args.optimizer,
                                adaptive_muon_moment2_method=args.adaptive_muon_moment2_method,
                                muon_fp32_matmul_prec=args.muon_fp32_matmul_prec)
    optimizer = get_megatron_optimizer(settings, [model], muon_check_interval=CHECK_INTERVAL,
                                       muon_gram_newton_schulz=args.muon_gram_newton_schulz)
    rates = write_rates(optimizer, rates_dir) if rates_dir else None
    clocks = [_NewtonSchulzClock(muon, settings.muon_num_ns_steps)
              for muon in optimizer.muon_optimizers]
    if corrupt:
        _corrupt_one_owner_result(optimizer.muon_optimizers[0])
    step_seconds, worst = [], 0.0

    def forward_backward(iteration):
        optimizer.zero_grad()
        with model.no_sync():  # as Megatron's schedules mark the last micro-batch
            pass
        lm_loss(model, iteration, parallel_state.get_data_parallel_rank(), shape).backward()
        _synchronize()

    for iteration in range(1, ITERATIONS + 1):
        forward_backward(iteration)
        before = [(clock.flops, clock.seconds) for clock in clocks]
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):  # the checks' own lines
            optimizer.step()
        _synchronize()
        if iteration % CHECK_INTERVAL:
            step_seconds.append(time.perf_counter() - start)
        else:  # timed: the unchecked steps alone (a check runs the reference's Newton-Schulz too)
            worst = max([worst] + [muon.last_check.worst for muon in optimizer.muon_optimizers])
            for clock, (flops, seconds) in zip(clocks, before):
                clock.flops, clock.seconds = flops, seconds
    device = next(model.parameters()).device
    for muon in optimizer.muon_optimizers:  # memory as a run between checks holds it
        muon.check_interval = 0
    with contextlib.redirect_stdout(io.StringIO()):
        memory = measure_train_step([model], optimizer, lambda: forward_backward(ITERATIONS + 1),
                                    device)
    received = sum(plan.bytes_received() for muon in optimizer.muon_optimizers
                   for plan in muon.plans)
    figures = torch.tensor([statistics.median(step_seconds), received, memory.peak],
                           dtype=torch.float64, device=device)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    work = torch.tensor([sum(c.flops for c in clocks), sum(c.seconds for c in clocks)],
                        dtype=torch.float64, device=device)
    dist.all_reduce(work)
    return dict(worst=worst, rates=rates, step_ms=figures[0].item() * 1e3,
                bytes=int(figures[1].item()),
                peak_mib=figures[2].item() / 2**20,
                tflops=work[0].item() / work[1].item() / 1e12 if work[1] else 0.0)


def _corrupt_one_owner_result(muon):
    """--corrupt: on checked iterations, one element of the first result of each batch an owner
    orthogonalizes is off by 1e-3 (what a broken exchange would do); the check must catch it."""
    owned_results = muon.orthogonalize_owned

    def corrupted(params, fulls, batch_key):
        results = owned_results(params, fulls, batch_key)
        if muon.iteration % CHECK_INTERVAL == 0 and results and results[0].numel():
            results[0] = results[0].clone()
            results[0][(0,) * results[0].dim()] += 1e-3
        return results

    muon.orthogonalize_owned = corrupted


@contextlib.contextmanager
def time_limit(seconds: float, name: str):
    """Ends the process (status 2) naming the configuration when it runs past `seconds`: a rank
    waiting forever in a collective never raises."""
    def expire():
        print(f"megatron-muon self-test: rank {dist.get_rank()}: '{name}' ran past "
              f"{seconds:g} s (--time-limit): hung (a collective that never completes) or too "
              f"slow for the limit; stopping",
              file=sys.stderr, flush=True)
        os._exit(2)

    watchdog = threading.Timer(seconds, expire)
    watchdog.daemon = True
    watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()


def _rates_line(path) -> str:
    """What a rates file holds, in one line, and how the scale model takes it."""
    table = json.loads(path.read_text())
    rates = [tflops for _, tflops in table["newton_schulz"]]
    return (f"  rates measured at construction: Newton-Schulz {min(rates):.3g}-{max(rates):.3g} "
            f"TFLOP/s, all-to-all {table['all_to_all_gbps'] or 0:.3g} GB/s, matmul "
            f"{table['matmul_tflops']:.3g} TFLOP/s; written to {path} (estimates at any W: "
            f"make scale SCALE_ARGS=\"--rates {path}\")")


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(prog="python -m megatron_muon.selftest", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024 if cuda else 64,
                        help="hidden size of the test GPTs (default: 1024 on GPUs, 64 on CPU)")
    parser.add_argument("--seq", type=int, default=256 if cuda else 32, help="sequence length")
    parser.add_argument("--muon-fp32-matmul-prec", default="highest",
                        choices=("highest", "high", "medium", "low"),
                        help="Newton-Schulz precision (default highest: fp32, bound 0; a lower one "
                             "is held to its own distance from fp32)")
    parser.add_argument("--optimizer", default="muon", choices=FSDP_OPTIMIZERS,
                        help="Megatron's --optimizer: muon, or adaptive_muon (the check covers "
                             "its second moment too)")
    parser.add_argument("--adaptive-muon-moment2-method", default="adamuon",
                        choices=tuple(SECOND_MOMENTS), help="--optimizer adaptive_muon's variant")
    parser.add_argument("--muon-gram-newton-schulz", action="store_true",
                        help="Gram Newton-Schulz where it costs fewer FLOPs, as Megatron's flag "
                             "(the estimate then shows the step with it too)")
    parser.add_argument("--time-limit", type=float, default=600,
                        help="seconds one configuration may take before the run stops as hung")
    parser.add_argument("--rates-dir", default=None,
                        help="write the rates the first configuration measured at construction "
                             "(megatron_muon_rates.json) here, for the scale model: make scale "
                             "SCALE_ARGS=\"--rates FILE\"")
    parser.add_argument("--corrupt", action="store_true",
                        help="corrupt one owner result in the first configuration, to see a "
                             "failure caught (the run then exits 1)")
    estimate = parser.add_argument_group(
        "the step's estimate for your model (megatron_muon.estimate, as `make scale`), at "
        "this run's rates (Newton-Schulz timed on your model's shapes here, the network "
        "measured by the first configuration): a named model or Megatron's model flags")
    estimate.add_argument("--estimate-model", choices=tuple(MODELS),
                          help="a model the scale model knows")
    estimate.add_argument("--estimate-world-size", type=int, default=None,
                          help="W to estimate at, and 4 W and 16 W (default: this run's)")
    estimate.add_argument("--tensor-model-parallel-size", type=int, default=1,
                          help="your run's TP (the ranks data parallel: W / TP)")
    estimate.add_argument("--expert-model-parallel-size", type=int, default=None,
                          help="your run's EP (default: as many data-parallel ranks as divide "
                               "the experts, up to 64)")
    estimate.add_argument("--swiglu", action="store_true", help="as Megatron's flag")
    for flag in MODEL_FLAGS:
        estimate.add_argument(f"--{flag.replace('_', '-')}", type=int, default=None,
                              help="as Megatron's flag")
    args = parser.parse_args(argv)
    try:
        custom = spec_from_flags({flag: getattr(args, flag) for flag in MODEL_FLAGS},
                                 args.swiglu)
    except ValueError as error:
        parser.error(str(error))
    if custom and args.estimate_model:
        parser.error("give --estimate-model or Megatron's model flags (--num-layers, ...), "
                     "not both")
    args.estimate = (args.estimate_model, MODELS[args.estimate_model]) if args.estimate_model \
        else ("your model", custom) if custom else None
    return args


def _estimate_problem(args, world_size: int) -> str | None:
    """Why args.estimate's layout cannot be built, or None."""
    world = args.estimate_world_size or world_size
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size or 1
    experts = args.estimate[1].config.get("num_moe_experts")
    if world % (tp * ep):
        return (f"--estimate-world-size {world} is not a multiple of --tensor-model-parallel-size "
                f"{tp} x --expert-model-parallel-size {ep}")
    if ep > 1 and (not experts or experts % ep):
        return (f"--expert-model-parallel-size {ep} does not divide the model's experts "
                f"({experts or 'it has none'})")
    return None


def print_estimates(args, world_size: int, run_rates) -> None:
    """Rank 0, in a group of its own (megatron-core builds the meta model under its parallel
    state): args.estimate's step at W, 4 W and 16 W (estimate.figures.estimated_steps), its
    Newton-Schulz timed here, the rest from `run_rates` (the first configuration's file)."""
    from megatron.core.optimizer import OptimizerConfig

    from .testing import init_parallel_state

    name, spec = args.estimate
    tp = args.tensor_model_parallel_size
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    init_parallel_state()
    table = json.loads(run_rates.read_text()) if run_rates else {}
    shapes = newton_schulz_shapes(spec, tp, OptimizerConfig.muon_tp_mode)
    steps = OptimizerConfig.muon_num_ns_steps
    table.update(measure_rates(steps, shapes, report=None, device_too=not table))
    rates = Rates(table)
    measured = [tflops for _, tflops in table["newton_schulz"]]
    assumptions = assumed(rates, steps)
    print(f"estimated optimizer step of {name} (TP {tp}), ms, collectives' latency counted: "
          f"Newton-Schulz timed here on its {len(shapes)} shapes ({min(measured):.3g}-"
          f"{max(measured):.3g} TFLOP/s), network {assumptions.bandwidth_gbps:.3g} GB/s per "
          f"rank{'' if table.get('all_to_all_gbps') else ' (assumed: nothing measured)'}",
          flush=True)
    gram = args.muon_gram_newton_schulz
    header = (f"{'W':>7} {'DP':>6} {'EP':>4} {'Adam ms':>9} {'Muon ms':>9} {'busiest/ideal':>13} "
              f"{'teams ms':>9} {'busiest/ideal':>13}" + (f" {'Gram ms':>9}" if gram else ""))
    print(header + "\n" + "=" * len(header), flush=True)
    for row in estimated_steps(spec, args.estimate_world_size or world_size, rates, assumptions,
                               tp, args.expert_model_parallel_size, gram=gram):
        owner, teams = row["owner"], row["teams"]
        print(f"{row['world']:>7} {row['data_parallel']:>6} {row['expert_parallel']:>4} "
              f"{row['adam_step_ms']:>9.3g} {owner['step_ms']:>9.3g} "
              f"{owner['busiest_over_ideal']:>13.2f} {teams['step_ms']:>9.3g} "
              f"{teams['busiest_over_ideal']:>13.2f}"
              + (f" {row['gram']['step_ms']:>9.3g}" if gram else ""), flush=True)
    dist.destroy_process_group()


def main(argv=None) -> int:
    args = parse_args(argv)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        from ..cpu.torch_compat import apply_cpu_compat
        apply_cpu_compat()
    dist.init_process_group(backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    if args.estimate and (problem := _estimate_problem(args, world_size)):
        say(f"megatron-muon self-test: {problem}", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        return 2
    device = (f"{torch.cuda.get_device_name()} x {world_size}" if torch.cuda.is_available()
              else f"CPU, {world_size} processes")
    say(f"megatron-muon self-test: {backend} on {device}; torch {torch.__version__}, megatron-core "
        f"{versions.installed_version('megatron-core')}, megatron-muon {versions.own_version()}; "
        f"--optimizer {args.optimizer}"
        f"{f' ({args.adaptive_muon_moment2_method})' if args.optimizer != 'muon' else ''}; "
        f"Newton-Schulz "
        f"--muon-fp32-matmul-prec {args.muon_fp32_matmul_prec}"
        f"{' --muon-gram-newton-schulz' if args.muon_gram_newton_schulz else ''}; "
        f"GPT hidden {args.hidden}, "
        f"seq {args.seq}; {ITERATIONS} iterations, checked at every {CHECK_INTERVAL}nd", flush=True)
    header = (f"{'configuration':<30} {'max |diff|':>10}  {'result':<6} {'step ms':>9} "
              f"{'NS TFLOP/s':>10} {'bytes recv/rank':>15} {'peak MiB':>9}")
    say(header + "\n" + "=" * len(header), flush=True)
    failed, run_rates = [], None
    # Megatron-FSDP collects garbage whenever it builds a model (ParamAndGradBuffer's
    # _init_each_parameter_group_buffers): with what the imports made frozen, each configuration's
    # collection scans only its own objects (on CPU: 0.5 s a configuration saved per rank).
    gc.freeze()
    # The estimate takes the first configuration's measured rates, written where asked or to a
    # directory of its own.
    rates_dir = args.rates_dir or (tempfile.mkdtemp() if args.estimate else None)
    for index, config in enumerate(configurations(world_size)):
        with time_limit(args.time_limit, config["name"]):
            try:
                row = run_configuration(config, args, corrupt=args.corrupt and index == 0,
                                        rates_dir=rates_dir if index == 0 else None)
            except MuonCheckError as error:  # every rank raises it together
                failed.append(config["name"])
                say(f"{config['name']:<30} {'-':>10}  {'FAIL':<6}\n{error}", flush=True)
                continue
        say(f"{config['name']:<30} {row['worst']:>10.3e}  {'pass':<6} {row['step_ms']:>9.1f} "
            f"{row['tflops']:>10.4f} {row['bytes']:>15,} {row['peak_mib']:>9.1f}", flush=True)
        if row["rates"] is not None and rank == 0:
            run_rates = row["rates"]
            say(_rates_line(run_rates), flush=True)
    say(f"self-test {'FAILED: ' + ', '.join(failed) if failed else 'passed'}", flush=True)
    dist.destroy_process_group()
    if args.estimate and rank == 0:
        print_estimates(args, world_size, run_rates)
    return 1 if failed else 0
