"""Each rank's peak memory in a whole train step (forward, backward, gradient sync, optimizer step),
split into what holds it: ours (Muon on Megatron-FSDP's ZeRO-3, ZeRO-2, ZeRO-1, each also with
--muon-gather-inside-backward; --optimizer
adaptive_muon's AdaMuon and NorMuon on ZeRO-3), Adam on each of those layouts (megatron-core's
optimizer), and megatron-core's Muon on Megatron DDP and its layer-wise distributed optimizer
(dense models).

    python benchmarks/bench_memory.py [--world-sizes 2 4] [--muon-max-exchange-bytes N --stem S]

Runs itself under torchrun once per world size (gloo on CPU, NCCL on GPUs) on bench_muon_step's
demo, wide and MoE GPTs. Each (optimizer, layout) is built alone and trained two steps, then three
steps are measured with tools.memory.measure_train_step: the bytes at rest counted from the
tensors (model weights, main weights, gradients, optimizer state; each storage once), and the most
each phase adds above what was alive when its step began, from torch's allocator (on CUDA its peak
statistics, the most over the three steps; on CPU the profiler's allocation records, the least:
measure_train_step says why). A figure is
its largest rank's (the one that runs out first), beside the collectives its optimizer step
issues over more than one rank (the busiest rank's; Muon's working-memory budget, by default
what its state saves a rank plus the headroom its largest matrices need, decides how many
exchanges, two all-to-alls each, it takes). Beside
them: what Muon's state saves against
Adam's on the same layout, per rank on average (their optimizer-state bytes apart, summed over the
ranks, over W: 4 bytes per Muon element over W), and how much of it the peak keeps (the largest
rank's peak, Adam's minus ours, over the saving). Writes benchmarks/results/memory.json and
memory.png; prints the Newton-Schulz precision and W beside every figure. Bytes are counted, not
timed; still, two runs can differ: owners by time follow rates measured at construction, and
which of Megatron-FSDP's buffers are alive together can depend on when asynchronous work ends.
"""

from functools import partial

import torch
import torch.distributed as dist

import per_world_size  # beside this script
from bench_muon_step import MEGATRON_CORE_MODES, NEWTON_SCHULZ_PRECISION, build, configs

CONFIGS = ("demo", "wide", "moe")
LAYOUTS = {"ZeRO-3": "optim_grads_params", "ZeRO-2": "optim_grads", "ZeRO-1": "optim"}
WARMUP = 2
MEASURED_STEPS = 3  # each phase's figure: its most over them on CUDA, its least on CPU
MIB = 1 << 20


# --optimizer adaptive_muon's variants, ours on ZeRO-3: AdaMuon keeps a second moment as large as
# Adam's exp_avg_sq beside its momentum, NorMuon a few columns per row.
ADAPTIVE = {"adamuon": "adaptive_muon", "normuon": "adaptive_muon"}
# Ours with --muon-gather-inside-backward, on every layout: its owners hold the matrices gathered
# ahead (old momentum and gradient rows, whole) from the grad sync to the step.
INSIDE = "muon-inside"


def runs(parallel) -> list[tuple[str, str]]:
    """(optimizer, layout) pairs measured: ours and Adam on every Megatron-FSDP layout, the
    adaptive variants on ZeRO-3, and megatron-core's Muon modes on the dense models."""
    pairs = [(optimizer, layout) for layout in LAYOUTS for optimizer in ("muon", INSIDE, "adam")]
    pairs += [(variant, "ZeRO-3") for variant in ADAPTIVE]
    if not parallel:
        pairs += [("muon", mode) for mode in MEGATRON_CORE_MODES]
    return pairs


def built(shape, parallel, optimizer, layout, budget):
    from megatron_muon import get_megatron_optimizer
    from megatron_muon.tools.testing import fsdp_gpt, optimizer_config

    if layout in MEGATRON_CORE_MODES:
        model, opt, _ = build(shape, parallel, layout)
        return model, opt
    model = fsdp_gpt(shape, strategy=LAYOUTS[layout], num_experts=parallel.get("num_experts"),
                     **parallel.get("model", {}))
    variant = ({"adaptive_muon_moment2_method": optimizer} if optimizer in ADAPTIVE else {})
    config = optimizer_config(ADAPTIVE.get(optimizer, "muon" if optimizer == INSIDE else optimizer),
                              muon_fp32_matmul_prec=NEWTON_SCHULZ_PRECISION, **variant)
    return model, get_megatron_optimizer(config, [model], muon_max_exchange_bytes=budget,
                                         muon_gather_inside_backward=optimizer == INSIDE)


def measure(shape, parallel, budget) -> dict:
    """This rank's StepMemory of every run, as dicts."""
    from megatron_muon.observe.collectives import Traffic, observed
    from megatron_muon.tools.memory import measure_train_step
    from megatron_muon.tools.testing import init_parallel_state, lm_loss

    init_parallel_state(expert_parallel=parallel.get("expert_parallel", 1))
    rank, device = dist.get_rank(), _device()
    figures = {}
    for optimizer_name, layout in runs(parallel):
        model, optimizer = built(shape, parallel, optimizer_name, layout, budget)

        def forward_backward(step):
            optimizer.zero_grad()
            lm_loss(model, step, rank, shape).backward()
            model.finish_grad_sync()

        for step in range(WARMUP):
            forward_backward(step)
            with observed(Traffic()) as traffic:  # the last one's: what the memory bound costs
                optimizer.step()
        memory = measure_train_step([model], optimizer, lambda: forward_backward(WARMUP), device,
                                    steps=MEASURED_STEPS)
        figures[f"{optimizer_name} {layout}"] = dict(at_rest=memory.at_rest, phases=memory.phases,
                                                    peak=memory.peak,
                                                    collectives=traffic.collectives)
    return figures


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def worker(args):
    per_world_size.init_worker()
    per_world_size.write_gathered(args.out, (
        (name, partial(measure, shape, parallel, args.muon_max_exchange_bytes))
        for name, (shape, parallel) in configs(dist.get_world_size()).items() if name in CONFIGS))


def summarize(world, per_rank) -> dict:
    """Per-rank figures of one (config, W) → the reported row: each run's largest rank, and per
    layout what Muon saves against Adam per rank on average and how much of it the peak keeps."""
    row = dict(world_size=world, newton_schulz_precision=NEWTON_SCHULZ_PRECISION, runs={})
    for run in per_rank[0]:
        largest = max(per_rank, key=lambda figures: figures[run]["peak"])[run]
        row["runs"][run] = {**largest, "collectives": max(r[run].get("collectives", 0)
                                                          for r in per_rank)}
    for layout in LAYOUTS:
        muon, adam = [[r[f"{name} {layout}"] for r in per_rank] for name in ("muon", "adam")]
        saved = sum(a["at_rest"]["optimizer state"] - m["at_rest"]["optimizer state"]
                    for m, a in zip(muon, adam)) / world
        kept = (max(a["peak"] for a in adam) - max(m["peak"] for m in muon))
        inside = max(r[f"{INSIDE} {layout}"]["peak"] for r in per_rank)
        row[layout] = dict(state_saved_bytes=saved, peak_saved_bytes=kept,
                           peak_keeps=kept / saved if saved else None,
                           inside_peak_saved_bytes=max(a["peak"] for a in adam) - inside)
    for variant in ADAPTIVE:
        row[variant] = {key: max(r[f"{name} ZeRO-3"]["at_rest"]["optimizer state"]
                                 for r in per_rank)
                        for key, name in (("state_bytes", variant), ("adam_state_bytes", "adam"))}
    return row


def print_table(results):
    kinds = ("model weights", "main weights", "gradients", "optimizer state")
    print(f"Per-rank peak of a train step, MiB (the largest rank's), Newton-Schulz at "
          f"--muon-fp32-matmul-prec {NEWTON_SCHULZ_PRECISION}")
    print(f"{'config':6} {'W':>2} {'run':18} " + "".join(f"{k[:12]:>13}" for k in kinds)
          + f"{'fwd-bwd':>9}{'opt step':>9}{'peak':>9}{'colls':>7}")
    for name, rows in results.items():
        for row in rows:
            for run, figures in row["runs"].items():
                rest = figures["at_rest"]
                phases = figures["phases"]
                print(f"{name:6} {row['world_size']:>2} {run:18} "
                      + "".join(f"{rest.get(k, 0) / MIB:>13.2f}" for k in kinds)
                      + f"{phases['forward-backward'] / MIB:>9.2f}"
                      + f"{phases['optimizer step'] / MIB:>9.2f}{figures['peak'] / MIB:>9.2f}"
                      + f"{figures['collectives']:>7}")
            for variant in ADAPTIVE:
                s = row[variant]
                print(f"{'':9} ZeRO-3: {variant}'s optimizer state "
                      f"{s['state_bytes'] / MIB:.2f} MiB on its largest rank, Adam's "
                      f"{s['adam_state_bytes'] / MIB:.2f} (W={row['world_size']})")
            for layout in LAYOUTS:
                s = row[layout]
                keeps = "-" if s["peak_keeps"] is None else f"{s['peak_keeps']:.2f}"
                print(f"{'':9} {layout}: Muon's state saves {s['state_saved_bytes'] / MIB:.2f} MiB "
                      f"a rank against Adam's; Adam's peak minus Muon's "
                      f"{s['peak_saved_bytes'] / MIB:.2f} "
                      f"MiB: {keeps} of it kept; with the gather inside backward "
                      f"{s['inside_peak_saved_bytes'] / MIB:.2f} MiB (W={row['world_size']}, "
                      f"{row['newton_schulz_precision']})")


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = ("model weights", "main weights", "gradients", "optimizer state")
    panels = [(name, row) for name, rows in results.items() for row in rows]
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 3.6 * len(panels)), squeeze=False)
    for (name, row), (ax,) in zip(panels, axes):
        labels = list(row["runs"])
        bottom = [0.0] * len(labels)
        for kind in kinds + ("the most a phase adds",):
            values = [(row["runs"][r]["at_rest"].get(kind, 0) if kind in kinds
                       else max(row["runs"][r]["phases"].values())) / MIB for r in labels]
            ax.bar(labels, values, bottom=bottom, label=kind)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set(title=f"{name}, W={row['world_size']}: per-rank peak of a train step "
                     f"(Newton-Schulz {row['newton_schulz_precision']})", ylabel="MiB")
        ax.tick_params(axis="x", labelrotation=20)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def main():
    parser = per_world_size.parser(__doc__.splitlines()[0], [2, 4], "memory")
    parser.add_argument("--muon-max-exchange-bytes", type=int, default=None,
                        help="Muon's working-memory budget (default: what its state saves a rank)")
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    flags = (("--muon-max-exchange-bytes", str(args.muon_max_exchange_bytes))
             if args.muon_max_exchange_bytes else ())
    per_world = per_world_size.run(__file__, args.world_sizes, *flags)
    results = {name: [summarize(w, per_world[w][name]) for w in args.world_sizes]
               for name in CONFIGS}
    per_world_size.save(results, args.stem, plot, print_table)


if __name__ == "__main__":
    main()
