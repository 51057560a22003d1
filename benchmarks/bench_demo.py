"""The demo's training iteration as megatron.training times it, ours beside what users would pick
instead: each run is `examples/pretrain_gpt.py` under torchrun, and its figure is the median of
megatron.training's "elapsed time per iteration" over the iterations after the first --skip.

    python benchmarks/bench_demo.py [--world-sizes 2 4] [--iters 40] [--rounds 3]

Runs: Muon on Megatron-FSDP (ours) under ZeRO-3 (the demo's default) and ZeRO-1, megatron-core's
Muon on Megatron DDP (every rank orthogonalizes every matrix), and Adam on Megatron-FSDP's ZeRO-3;
megatron-core's layer-wise Muon cannot be built in fp32 (docs/reliability.md, "Refused
configurations"), bench_muon_step.py measures it.
The configurations take turns round by round, so a slow spell of the machine falls on all of them
alike; each is reported as the median over rounds of its runs' medians, with its ratio to
megatron-core's Muon on DDP. Newton-Schulz runs at the demo's precision (Megatron's bf16, or fp32
on a CPU that emulates bf16 matmuls), which the results record. Writes
benchmarks/results/demo.json.
"""

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

from megatron_muon.cpu.torch_compat import fast_newton_schulz_precision

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DDP = ["--no-use-megatron-fsdp", "--ckpt-format", "torch_dist"]
RUNS = {
    "ours, ZeRO-3": [],
    "ours, ZeRO-1": ["--data-parallel-sharding-strategy", "optim"],
    "Muon on DDP": DDP,
    "Adam, ZeRO-3": ["--optimizer", "adam"],
}
REFERENCE = "Muon on DDP"
ITERATION_MS = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")


def iteration_ms(world: int, iters: int, skip: int, flags: list[str]) -> float:
    """The median iteration time of one demo run."""
    command = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node",
               str(world), str(ROOT / "examples" / "pretrain_gpt.py"), "--train-iters", str(iters),
               "--eval-iters", "0", "--eval-interval", str(iters + 1), *flags]
    run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if run.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{run.stdout[-3000:]}{run.stderr[-3000:]}")
    times = [float(ms) for ms in ITERATION_MS.findall(run.stdout)][skip:]
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--skip", type=int, default=10, help="first iterations left out")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    precision = fast_newton_schulz_precision()  # what the demo runs at here
    print(f"Newton-Schulz at --muon-fp32-matmul-prec {precision}, the demo's choice here")
    results = {"newton_schulz_precision": precision}
    for world in args.world_sizes:
        medians = {name: [] for name in RUNS}
        for _ in range(args.rounds):
            for name, flags in RUNS.items():
                medians[name].append(iteration_ms(world, args.iters, args.skip, flags))
        reference = statistics.median(medians[REFERENCE])
        results[world] = {name: dict(ms=statistics.median(values), rounds=values,
                                     ratio=statistics.median(values) / reference)
                          for name, values in medians.items()}
        print(f"W={world}: median ms per iteration (rounds: {args.rounds}, iterations "
              f"{args.skip + 1}-{args.iters}), ratio to {REFERENCE}, each round's median")
        for name, figures in results[world].items():
            rounds = " ".join(f"{value:.1f}" for value in figures["rounds"])
            print(f"  {name:<16} {figures['ms']:8.1f}  {figures['ratio']:5.2f}   ({rounds})")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "demo.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {RESULTS / 'demo.json'}")


if __name__ == "__main__":
    main()
