"""Muon's optimizer step on Megatron-FSDP (ZeRO-3): owner-compute vs gather-everything vs Adam,
and megatron-core's own Muon on Megatron DDP (every rank orthogonalizes every matrix) and with its
LayerWiseDistributedOptimizer (whole matrices per rank, ZeRO-1).

    python benchmarks/bench_muon_step.py [--world-sizes 1 2 4] [--steps 10] [--configs demo ...]
        [--stem latest]

Runs itself under torchrun once per world size (gloo on CPU, NCCL on GPUs), on the demo GPT, a
wider one, an MoE GPT (4 experts, expert-parallel 2), the demo GPT under HSDP (2 replicas,
outer strategy no_shard or optim) and the demo GPT with MuonClip (--qk-clip, a threshold its
logits pass every step), and writes benchmarks/results/latest.json and latest.png (--stem: another
name, e.g. for a run of some --configs only). Bytes, collectives and
Newton-Schulz FLOPs are counted from the calls a step really makes; times are medians of --steps
steps after warm-up, every mode measured side by side in the same processes, the modes taking
turns step by step; a ratio of two modes is the median of its rounds' ratios, printed with their
quartiles [q1-q3] (a round's two steps ran a moment apart). Ours ("owner": owners by estimated
time, the default) runs beside ours with byte-first owners ("owner_bytes": --muon-owner-choice
bytes) on every config. Beside megatron-core's modes runs ours on Megatron-FSDP's ZeRO-1
("owner_zero1": weights unsharded in the forward, as Megatron DDP keeps them), and on the dense
configs ours with --muon-gather-inside-backward ("owner_inside"). Bytes and collectives
are the optimizer step's (gradient reductions run before it, ZeRO-3's weight gathers in the
forward). megatron-core's layer-wise optimizer cannot be built in fp32 (docs/reliability.md,
"Refused configurations"), so it runs with bf16 set on a fp32 model: its params stay fp32 and so
does its arithmetic. Bytes, collectives, buffers and FLOPs are counted on one warm-up step
(observe.collectives.observed and torch's FlopCounterMode; nothing is patched), times on the
others.
"""

import io
import os
import statistics
import time
from contextlib import ExitStack, redirect_stdout
from functools import partial

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from megatron_muon.cpu.torch_compat import fast_newton_schulz_precision
from megatron_muon.observe.collectives import Traffic, observed
import per_world_size  # beside this script
from step_profile import PHASES, profiled

# Megatron's bf16 (medium), but fp32 where bf16 matmuls are emulated: ~100x slower there.
NEWTON_SCHULZ_PRECISION = fast_newton_schulz_precision()
# "owner_bytes": ours with --muon-owner-choice bytes (byte-first owners: ours before owners by
# time), beside "owner" (owners by time, the default), on every config.
BYTES_MODE = "owner_bytes"
MODES = ("owner", BYTES_MODE, "allgather", "adam")
MEGATRON_CORE_MODES = ("ddp", "layerwise")  # on dense models without HSDP only
# Beside them, ours on Megatron-FSDP's ZeRO-1 ("optim"): weights unsharded in the forward, as
# Megatron DDP and the layer-wise optimizer keep them; "owner" is ZeRO-3.
ZERO1_MODE = "owner_zero1"
SIDE_BY_SIDE_MODES = (ZERO1_MODE,) + MEGATRON_CORE_MODES
# "owner" with --muon-check-interval 1: what a checked step costs (every N-th step with N).
CHECKED_MODE = "owner_checked"
# "owner" with --optimizer-cpu-offload (all of the state in host memory between steps): on CPU
# the host is the device, so its copies are host-to-host; the bytes each way and the most state
# on the device at once are the optimizer's own accounting (core/state_offload.HostState).
OFFLOAD_MODE = "owner_offload"
# "owner" with --muon-gather-inside-backward: the batches its owners can hold gathered at the grad
# sync (finish_grad_sync, before the step's clock starts; with --overlap-grad-reduce, during
# backward), the rest at the step. "step ms" is then what stays after backward's reductions.
INSIDE_MODE = "owner_inside"
WARMUP = 3
# The warm-up step whose collectives, bytes, buffers and FLOPs are counted
# (observe.collectives.observed and torch's FlopCounterMode: every op passes through Python while
# they count, so no timed step is counted); the plan is fixed, so every step's counts are the same.
COUNTED_STEP = WARMUP - 1
# After the timed steps, this many steps run under torch.profiler for the per-phase profile.
PROFILED_STEPS = 3


def configs(world):
    """name -> (model shape, parallelism) of the configs that run at this world size."""
    from megatron_muon.tools.testing import GPTShape

    demo = GPTShape(layers=4, hidden=256, ffn=1024, heads=4, vocab=1024, seq=256, micro_batch=4)
    runs = {
        "demo": (demo, {}),
        "wide": (GPTShape(layers=2, hidden=512, ffn=2048, heads=8, vocab=1024, seq=128, micro_batch=2), {}),
        "moe": (GPTShape(layers=2, hidden=256, ffn=512, heads=4, vocab=1024, seq=128, micro_batch=4),
                dict(num_experts=4, expert_parallel=min(2, world))),
    }
    # The clip's cost: the max-logit all-reduce and the q/k row scaling, over "demo"'s step.
    runs["clip"] = (demo, dict(model=dict(qk_clip=True, qk_clip_threshold=0.01)))
    if world > 1:
        runs["hsdp"] = (demo, dict(replicas=2, outer_strategy="no_shard"))
        runs["hfsdp"] = (demo, dict(replicas=2, outer_strategy="optim"))
    return runs


def optimizer_state_bytes(optimizer):
    """This rank's optimizer-state bytes under a Megatron optimizer (chained or not)."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    total = 0
    for part in parts:
        for state in part.optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    local = value.to_local() if hasattr(value, "to_local") else value
                    total += local.numel() * local.element_size()
    return total


def build(shape, parallel, mode):
    from megatron_muon import get_megatron_optimizer
    from megatron_muon.tools.testing import ddp_gpt, fsdp_gpt, optimizer_config

    if mode in MEGATRON_CORE_MODES:
        layer_wise = mode == "layerwise"
        model = ddp_gpt(shape, layer_wise=layer_wise)
        config = optimizer_config("muon", muon_fp32_matmul_prec=NEWTON_SCHULZ_PRECISION,
                                  use_distributed_optimizer=False,
                                  use_layer_wise_distributed_optimizer=layer_wise, bf16=layer_wise)
        return model, get_megatron_optimizer(config, [model]), config
    model = fsdp_gpt(shape, strategy="optim" if mode == ZERO1_MODE else "optim_grads_params",
                     num_experts=parallel.get("num_experts"),
                     outer_strategy=parallel.get("outer_strategy", "no_shard"),
                     **parallel.get("model", {}))
    config = optimizer_config("adam" if mode == "adam" else "muon",
                              muon_fp32_matmul_prec=NEWTON_SCHULZ_PRECISION,
                              optimizer_cpu_offload=mode == OFFLOAD_MODE,
                              optimizer_offload_fraction=1.0)
    optimizer = get_megatron_optimizer(config, [model],
                                       muon_dist_mode="allgather" if mode == "allgather" else "owner",
                                       muon_owner_choice="bytes" if mode == BYTES_MODE else "time",
                                       muon_check_interval=1 if mode == CHECKED_MODE else 0,
                                       muon_gather_inside_backward=mode == INSIDE_MODE)
    return model, optimizer, config


def measure(shape, parallel, steps):
    """One rank's figures for every mode on one model shape and parallelism."""
    from megatron_muon.tools.testing import init_parallel_state, lm_loss

    init_parallel_state(expert_parallel=parallel.get("expert_parallel", 1),
                        replicas=parallel.get("replicas", 1))
    rank = dist.get_rank()
    modes = MODES + ((CHECKED_MODE, OFFLOAD_MODE, INSIDE_MODE) + SIDE_BY_SIDE_MODES
                     if not parallel else ())
    built = {mode: build(shape, parallel, mode) for mode in modes}
    traffic = {mode: Traffic() for mode in modes}
    flops = {mode: FlopCounterMode(display=False) for mode in modes}
    train_times, step_times = {mode: [] for mode in modes}, {mode: [] for mode in modes}
    phases = {mode: [] for mode in modes}
    timed = range(WARMUP, WARMUP + steps)
    # The modes take turns step by step, so the machine's slow spells fall on all of them alike.
    for step in range(WARMUP + steps + PROFILED_STEPS):
        for mode, (model, optimizer, _) in built.items():
            start = time.perf_counter()
            optimizer.zero_grad()
            with model.no_sync():  # marks the last micro-batch: HSDP reduces across replicas
                pass
            lm_loss(model, step, rank, shape).backward()
            model.finish_grad_sync()
            dist.barrier()
            step_start = time.perf_counter()
            with ExitStack() as counting:
                counting.enter_context(redirect_stdout(io.StringIO()))  # the checks' log lines
                if step == COUNTED_STEP:
                    counting.enter_context(observed(traffic[mode]))
                    counting.enter_context(flops[mode])  # only Newton-Schulz multiplies matrices
                if step >= timed.stop:
                    phases[mode].append(profiled(optimizer.step))
                else:
                    optimizer.step()
            dist.barrier()
            end = time.perf_counter()
            if step in timed:
                train_times[mode].append(end - start)
                step_times[mode].append(end - step_start)
    figures = {mode: dict(
        step_s=statistics.median(step_times[mode]), train_step_s=statistics.median(train_times[mode]),
        step_times_s=step_times[mode], train_times_s=train_times[mode],
        received_bytes=traffic[mode].received_bytes, collectives=traffic[mode].collectives,
        collectives_by_op=dict(traffic[mode].by_name),
        ns_flops=flops[mode].get_total_flops(), state_bytes=optimizer_state_bytes(optimizer),
        transient_bytes=traffic[mode].peak_buffer_bytes,
        phase_s={phase: statistics.median(p[phase] for p in phases[mode]) for phase in PHASES})
        for mode, (_, optimizer, _) in built.items()}
    figures["plan"] = plan_figures(*built["owner"])
    if INSIDE_MODE in built:
        plans = [plan for muon in built[INSIDE_MODE][1].muon_optimizers for plan in muon.plans]
        figures[INSIDE_MODE]["exchanges_ahead"] = (sum(plan.ahead for plan in plans),
                                                   sum(len(plan.routes) for plan in plans))
        figures[INSIDE_MODE]["matrices_ahead"] = (sum(len(plan.early) for plan in plans),
                                                  sum(len(plan.matrices) for plan in plans))
    if OFFLOAD_MODE in built:  # of its last step; the parts step one after the other
        host_states = [part.optimizer.host_state
                       for part in built[OFFLOAD_MODE][1].chained_optimizers]
        figures[OFFLOAD_MODE]["offload"] = dict(
            to_device=sum(h.moved_to_device for h in host_states),
            to_host=sum(h.moved_to_host for h in host_states),
            most_on_device=max(h.most_on_device for h in host_states))
    return figures


BYTE_SLACKS = (0.0, 0.05, 0.25, 1.0, 4.0)


def owner_tradeoff(matrices, byte_slack):
    """What the byte-first choice (choose_owners) gives for a byte budget (from the plan alone):
    bytes over the layout minimum, and the busiest rank's Newton-Schulz FLOPs over the mean."""
    from megatron_muon.plan import choose_owners, layout_min_bytes

    owners = choose_owners(matrices, 4, byte_slack)
    load = [0] * matrices[0].layout.ranks
    for matrix, owner in zip(matrices, owners):
        load[owner] += matrix.ns_flops(steps=1)
    moved = sum(m.bytes_to_owner(o, 4) for m, o in zip(matrices, owners))
    minimum = layout_min_bytes(matrices, 4)
    return dict(byte_slack=byte_slack, comm_ratio_to_bound=moved / minimum if minimum else None,
                ns_max_over_mean=max(load) * len(load) / sum(load))


def plan_figures(model, optimizer, config):
    """The layout's own numbers, from the owner plans: the bound, Muon's size and batch count,
    and the Newton-Schulz FLOPs of every matrix this rank sees, named so that the union over
    ranks is the single-device model (experts of other expert-parallel ranks are other matrices)."""
    from megatron.core import parallel_state

    from megatron_muon.chain.model_chunks import named_main_weights
    from megatron_muon.plan import layout_min_bytes
    from megatron_muon.core.zero_muon import ZeROTensorParallelMuon

    muons = [p.optimizer for p in optimizer.optimizer.chained_optimizers
             if isinstance(p.optimizer, ZeROTensorParallelMuon)]
    plans = [plan for muon in muons for plan in muon.plans]
    names = {id(p): name for name, p in named_main_weights(model)}
    ep_rank = parallel_state.get_expert_model_parallel_rank()

    def global_name(param, suffix=""):
        name = names[id(param)] + suffix
        return f"{name}@ep{ep_rank}" if ".experts." in name else name

    flops_by_matrix, min_bytes_by_plan = {}, {}
    for plan in plans:
        min_bytes_by_plan[global_name(plan.params[0])] = layout_min_bytes(plan.matrices, 4)
        for i, matrix in enumerate(plan.matrices):
            flops_by_matrix[global_name(plan.param_of(i), f"[{i}]")] = matrix.ns_flops(
                config.muon_num_ns_steps)
    return dict(
        owner_tradeoff=[owner_tradeoff(plan.matrices, slack) for plan in plans
                        for slack in BYTE_SLACKS],
        min_bytes_by_plan=min_bytes_by_plan,
        muon_elements=sum(m.layout.num_rows * m.cols for plan in plans for m in plan.matrices),
        flops_by_matrix=flops_by_matrix,
        batches=sum(len(routes.batches) for plan in plans for routes in plan.routes),
        moving_batches=sum(r.gather.moves or r.scatter.moves for plan in plans for r in plan.routes),
        largest_batch_bytes=max((sum(plan.matrices[i].layout.num_rows * plan.matrices[i].cols * 4
                                     for i in routes.batch)
                                 for plan in plans for routes in plan.routes), default=0))


def worker(args):
    per_world_size.init_worker()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    per_world_size.write_gathered(args.out, (
        (name, partial(measure, shape, parallel, args.steps))
        for name, (shape, parallel) in configs(dist.get_world_size()).items()
        if not args.configs or name in args.configs))


def summarize(world, per_rank):
    """Per-rank figures of one (config, W) run → the reported row."""
    plan = per_rank[0]["plan"]

    def union(key):  # over ranks: the plans and matrices of every expert-parallel rank, once
        return {name: value for r in per_rank for name, value in r["plan"][key].items()}

    elements, min_bytes = plan["muon_elements"], sum(union("min_bytes_by_plan").values())
    row = dict(world_size=world, muon_elements=elements, shape_batches=plan["batches"],
               batches_moving_rows=plan["moving_batches"],
               comm_bytes_layout_min=min_bytes / world,
               comm_bytes_generic_bound=2 * elements * 4 * (world - 1) / world ** 2)
    single_device_flops = sum(union("flops_by_matrix").values())
    for mode in _muon_modes(per_rank[0]):
        figures = [r[mode] for r in per_rank]
        received = [f["received_bytes"] for f in figures]
        flops = [f["ns_flops"] for f in figures]
        mean_flops = statistics.mean(flops)
        row[mode] = dict(
            comm_bytes_per_rank=statistics.mean(received), comm_bytes_per_rank_max=max(received),
            comm_ratio_to_bound=(sum(received) / min_bytes) if min_bytes else None,
            ns_flops_per_rank_max=max(flops), ns_flops_per_rank_mean=mean_flops,
            ns_max_over_mean=max(flops) / mean_flops if mean_flops else None,
            ns_redundancy=sum(flops) / single_device_flops if single_device_flops else None,
            collectives_per_step=max(f["collectives"] for f in figures),
            collectives_by_op=_busiest_collectives(figures),
            collectives_per_shape_batch=max(f["collectives"] for f in figures) / plan["batches"],
            muon_step_s=max(f["step_s"] for f in figures),
            muon_step_rounds_s=rounds(per_rank, mode),
            train_step_s=max(f["train_step_s"] for f in figures),
            peak_transient_bytes=max(f["transient_bytes"] for f in figures),
            phase_s=max((f["phase_s"] for f in figures), key=lambda s: sum(s.values())),
            optimizer_state_bytes=max(f["state_bytes"] for f in figures))
    adam = [r["adam"] for r in per_rank]
    row["adam"] = dict(adam_step_s=max(f["step_s"] for f in adam),
                       collectives_per_step=max(f["collectives"] for f in adam),
                       collectives_by_op=_busiest_collectives(adam),
                       train_step_s=max(f["train_step_s"] for f in adam),
                       optimizer_state_bytes=max(f["state_bytes"] for f in adam))
    row["owner_over_allgather"] = paired_ratio(per_rank, "owner", "allgather")
    row["time_over_bytes_owners"] = paired_ratio(per_rank, "owner", BYTES_MODE)
    row["muon_over_adam_train_step"] = paired_ratio(per_rank, "owner", "adam", "train_times_s")
    for ours in ("owner", ZERO1_MODE):
        for mode in MEGATRON_CORE_MODES:
            if mode in row:
                row[f"{ours}_over_{mode}_train_step"] = paired_ratio(per_rank, ours, mode,
                                                                      "train_times_s")
                row[f"{ours}_over_{mode}_muon_step"] = paired_ratio(per_rank, ours, mode)
    if CHECKED_MODE in row:
        checked, owner = row[CHECKED_MODE], row["owner"]
        row["checked_step"] = dict(
            over_owner_muon_step=paired_ratio(per_rank, CHECKED_MODE, "owner"),
            extra_collectives=checked["collectives_per_step"] - owner["collectives_per_step"],
            extra_bytes_per_rank=checked["comm_bytes_per_rank"] - owner["comm_bytes_per_rank"])
    if OFFLOAD_MODE in row:
        offloaded = [r[OFFLOAD_MODE]["offload"] for r in per_rank]
        row["offloaded_step"] = dict(
            over_owner_muon_step=paired_ratio(per_rank, OFFLOAD_MODE, "owner"),
            over_owner_train_step=paired_ratio(per_rank, OFFLOAD_MODE, "owner", "train_times_s"),
            each_way_bytes=max(max(o["to_device"], o["to_host"]) for o in offloaded),
            most_on_device_bytes=max(o["most_on_device"] for o in offloaded))
    if INSIDE_MODE in row:
        row["gathered_inside"] = dict(
            over_owner_muon_step=paired_ratio(per_rank, INSIDE_MODE, "owner"),
            over_owner_train_step=paired_ratio(per_rank, INSIDE_MODE, "owner", "train_times_s"),
            exchanges_ahead=per_rank[0][INSIDE_MODE]["exchanges_ahead"],
            matrices_ahead=per_rank[0][INSIDE_MODE]["matrices_ahead"])
    row["largest_batch_bytes"] = plan["largest_batch_bytes"]
    row["owner_tradeoff"] = plan["owner_tradeoff"]
    row["newton_schulz_precision"] = NEWTON_SCHULZ_PRECISION
    return row


def _busiest_collectives(figures) -> dict[str, int]:
    """The collectives by c10d op of the rank that issues the most."""
    return max(figures, key=lambda f: f["collectives"])["collectives_by_op"]


def rounds(per_rank, mode, times="step_times_s") -> list[float]:
    """`mode`'s time in each timed round, its slowest rank's (barriers bound the step)."""
    return [max(ranks) for ranks in zip(*(r[mode][times] for r in per_rank))]


def paired_ratio(per_rank, mode, base, times="step_times_s") -> dict:
    """`mode`'s time over `base`'s, round by round: the modes take turns, so a round's two steps
    share the machine's speed of the moment, which wanders by more than the differences measured
    here (docs/benchmarks.md). The median and quartiles of the rounds' ratios."""
    ratios = [a / b for a, b in zip(rounds(per_rank, mode, times), rounds(per_rank, base, times))]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3  # --steps 1
    return dict(median=statistics.median(ratios), q1=q1, q3=q3)


def _muon_modes(figures) -> list[str]:
    """The Muon modes a run measured: ours, then megatron-core's where the config has them."""
    return [mode for mode in ("owner", BYTES_MODE, "allgather", CHECKED_MODE, OFFLOAD_MODE,
                              INSIDE_MODE) + SIDE_BY_SIDE_MODES if mode in figures]


def _fixed(value) -> str:
    """A ratio with two decimals, or "-" where it has no denominator (nothing to move)."""
    return "-" if value is None else f"{value:.2f}"


def _paired(ratio) -> str:
    """A paired ratio: the median of the rounds' ratios [their quartiles]."""
    return f"{ratio['median']:.2f} [{ratio['q1']:.2f}-{ratio['q3']:.2f}]"


def print_table(results):
    print(f"Newton-Schulz at --muon-fp32-matmul-prec {NEWTON_SCHULZ_PRECISION} "
          f"({'fp32: this CPU emulates bf16 matmuls' if NEWTON_SCHULZ_PRECISION == 'highest' else 'bf16'})")
    head = (f"{'config':6} {'W':>2} {'mode':11} {'recv MB/rank':>12} {'ratio':>6} {'NS GFLOP max':>12} "
            f"{'max/mean':>8} {'redund':>6} {'coll':>5} {'step ms':>8} {'train ms':>9}")
    print(head)
    for name, rows in results.items():
        for row in rows:
            for mode in _muon_modes(row):
                m = row[mode]
                ratio = "-" if m["comm_ratio_to_bound"] is None else f"{m['comm_ratio_to_bound']:.3f}"
                mean = _fixed(m["ns_max_over_mean"])
                print(f"{name:6} {row['world_size']:>2} {mode:11} {m['comm_bytes_per_rank'] / 1e6:>12.3f} "
                      f"{ratio:>6} {m['ns_flops_per_rank_max'] / 1e9:>12.2f} {mean:>8} "
                      f"{m['ns_redundancy']:>6.2f} {m['collectives_per_step']:>5} "
                      f"{m['muon_step_s'] * 1e3:>8.1f} {m['train_step_s'] * 1e3:>9.1f}")
            a = row["adam"]
            print(f"{name:6} {row['world_size']:>2} {'adam':11} {'':>12} {'':>6} {'':>12} {'':>8} {'':>6} "
                  f"{'':>5} {a['adam_step_s'] * 1e3:>8.1f} {a['train_step_s'] * 1e3:>9.1f}")
            print(f"{'':9} layout min {row['comm_bytes_layout_min'] / 1e6:.3f} MB/rank, generic bound "
                  f"{row['comm_bytes_generic_bound'] / 1e6:.3f} MB/rank, owner/allgather step "
                  f"{_paired(row['owner_over_allgather'])}, muon/adam train step "
                  f"{_paired(row['muon_over_adam_train_step'])}, peak transient "
                  f"{row['owner']['peak_transient_bytes'] / row['largest_batch_bytes']:.2f}x largest batch")
            print(f"{'':9} owners by time / by bytes (--muon-owner-choice): optimizer step "
                  f"{_paired(row['time_over_bytes_owners'])}, NS max/mean "
                  f"{_fixed(row['owner']['ns_max_over_mean'])} vs "
                  f"{_fixed(row[BYTES_MODE]['ns_max_over_mean'])}, bytes/bound "
                  f"{_fixed(row['owner']['comm_ratio_to_bound'])} vs "
                  f"{_fixed(row[BYTES_MODE]['comm_ratio_to_bound'])}")
            for ours in ("owner", ZERO1_MODE) if "ddp" in row else ():
                print(f"{'':9} {ours} vs megatron-core: train step / Muon DDP "
                      f"{_paired(row[f'{ours}_over_ddp_train_step'])}, / layer-wise "
                      f"{_paired(row[f'{ours}_over_layerwise_train_step'])}; optimizer step "
                      f"/ Muon DDP "
                      f"{_paired(row[f'{ours}_over_ddp_muon_step'])}, / layer-wise "
                      f"{_paired(row[f'{ours}_over_layerwise_muon_step'])}; state bytes {ours} "
                      f"{row[ours]['optimizer_state_bytes'] / 1e6:.2f} MB, DDP "
                      f"{row['ddp']['optimizer_state_bytes'] / 1e6:.2f}, layer-wise "
                      f"{row['layerwise']['optimizer_state_bytes'] / 1e6:.2f}")
            print(f"{'':9} collectives per step by c10d op (the busiest rank's): " + "; ".join(
                f"{mode} " + ", ".join(f"{count} {op}" for op, count in
                                       sorted(row[mode]["collectives_by_op"].items()))
                for mode in _muon_modes(row) + ["adam"]))
            if "layerwise" in row:
                print(f"{'':9} the step by phase, ms (torch.profiler, its overhead included; "
                      f"the slowest rank's; step_profile.py):")
                print(f"{'':11}{'mode':12}" + "".join(f"{p:>11}" for p in PHASES) + f"{'total':>9}")
                for mode in ("owner", ZERO1_MODE, "layerwise"):
                    ms = {p: s * 1e3 for p, s in row[mode]["phase_s"].items()}
                    print(f"{'':11}{mode:12}" + "".join(f"{ms[p]:>11.1f}" for p in PHASES)
                          + f"{sum(ms.values()):>9.1f}")
            if "checked_step" in row:
                c = row["checked_step"]
                print(f"{'':9} a checked step (--muon-check-interval; every N-th): "
                      f"{_paired(c['over_owner_muon_step'])}x the owner step, "
                      f"{c['extra_collectives']:+d} collectives, "
                      f"{c['extra_bytes_per_rank'] / 1e6:+.3f} MB/rank")
            if "offloaded_step" in row:
                o = row["offloaded_step"]
                print(f"{'':9} the state in host memory (--optimizer-cpu-offload; host to host "
                      f"here): optimizer step {_paired(o['over_owner_muon_step'])}x the owner "
                      f"step, train step {_paired(o['over_owner_train_step'])}x; "
                      f"{o['each_way_bytes'] / 1e6:.2f} MB each way, at most "
                      f"{o['most_on_device_bytes'] / 1e6:.2f} MB of it on the device at once, of "
                      f"{row[OFFLOAD_MODE]['optimizer_state_bytes'] / 1e6:.2f} MB")
            if "gathered_inside" in row:
                g = row["gathered_inside"]
                print(f"{'':9} the gather inside backward (--muon-gather-inside-backward; "
                      f"{g['matrices_ahead'][0]} of {g['matrices_ahead'][1]} matrices ahead, in "
                      f"{g['exchanges_ahead'][0]} of {g['exchanges_ahead'][1]} exchanges, "
                      f"at the grad sync here): step after backward "
                      f"{_paired(g['over_owner_muon_step'])}x the owner step, train step "
                      f"{_paired(g['over_owner_train_step'])}x (gloo: nothing overlaps)")
            if row["world_size"] > 1:
                print(f"{'':9} byte-first owners (--muon-owner-choice bytes), byte slack -> "
                      f"(bytes/bound, NS max/mean): " + ", ".join(
                    f"{t['byte_slack']:g} -> ({_fixed(t['comm_ratio_to_bound'])}, "
                    f"{_fixed(t['ns_max_over_mean'])})" for t in row["owner_tradeoff"]))


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 3, figsize=(15, 4 * len(results)), squeeze=False)
    for (name, rows), (comm, times, train) in zip(results.items(), axes):
        worlds = [r["world_size"] for r in rows]
        for mode in _muon_modes(rows[0]):
            comm.plot(worlds, [r[mode]["comm_bytes_per_rank"] / 1e6 for r in rows], "o-", label=mode)
            times.plot(worlds, [r[mode]["muon_step_s"] * 1e3 for r in rows], "o-", label=f"muon {mode}")
            train.plot(worlds, [r[mode]["train_step_s"] * 1e3 for r in rows], "o-", label=f"muon {mode}")
        comm.plot(worlds, [r["comm_bytes_layout_min"] / 1e6 for r in rows], "k--", label="layout minimum")
        times.plot(worlds, [r["adam"]["adam_step_s"] * 1e3 for r in rows], "o-", label="adam")
        train.plot(worlds, [r["adam"]["train_step_s"] * 1e3 for r in rows], "o-", label="adam")
        comm.set(title=f"{name}: bytes received per rank per step", xlabel="W", ylabel="MB")
        times.set(title=f"{name}: optimizer step", xlabel="W", ylabel="ms")
        train.set(title=f"{name}: training step", xlabel="W", ylabel="ms")
        for ax in (comm, times, train):
            ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main():
    parser = per_world_size.parser(__doc__.splitlines()[0], [1, 2, 4], "latest")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--configs", nargs="+", choices=list(configs(2)),
                        help="run only these (default: all)")
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    runs = per_world_size.run(__file__, args.world_sizes, "--steps", str(args.steps),
                              *(["--configs", *args.configs] if args.configs else []))
    results = {name: [summarize(w, runs[w][name]) for w in args.world_sizes if name in runs[w]]
               for name in configs(max(args.world_sizes)) if name in runs[max(args.world_sizes)]}
    per_world_size.save(results, args.stem, plot, print_table)


if __name__ == "__main__":
    main()
