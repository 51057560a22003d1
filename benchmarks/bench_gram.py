"""Gram Newton-Schulz against standard Newton-Schulz (--muon-gram-newton-schulz), side by side in
one run on this machine: each flagship shape scaled down with its aspect kept, both algorithms
timed in alternating rounds (so a drift of the machine's speed falls on both), the ratio of each
round's pair; the median ratio with its quartiles, beside the ratio of their FLOPs (counted,
exact). At Megatron's default precision where this machine has bf16 matmuls (Gram then in fp16),
else at fp32 (`highest`), as the demo runs.

    python benchmarks/bench_gram.py [--rounds N] [--scale K]

writes benchmarks/results/gram.json (make bench runs it).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_muon.compat import upstream  # noqa: E402
from megatron_muon.core.gram_newton_schulz import gram_newton_schulz  # noqa: E402
from megatron_muon.cpu.torch_compat import fast_newton_schulz_precision  # noqa: E402
from megatron_muon.plan import GramSchedule, ns_flops  # noqa: E402

# (what, rows, cols) at full size: the flagships' rectangular matrices (and a square one, where
# Gram does not run: the plan keeps it standard).
FLAGSHIP_SHAPES = [
    ("Llama-70B fused fc1 (1:7)", 57344, 8192),
    ("Llama-70B fc2 (1:3.5)", 8192, 28672),
    ("MoE expert fc2 (1:3.5)", 7168, 2048),
    ("MoE expert fc1 (1:1.75)", 4096, 7168),
    ("attention projection (1:1)", 8192, 8192),
]
RESULTS = REPO / "benchmarks" / "results" / "gram.json"


def _seconds(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def bench(rounds: int, scale: int, steps: int = 5, coefficient_type: str = "quintic"):
    """Each shape divided by `scale` (its aspect kept): (what, shape, FLOPs ratio, median time
    ratio, its quartiles, the two medians in ms)."""
    schedule = GramSchedule(steps)
    rows = []
    for what, full_rows, full_cols in FLAGSHIP_SHAPES:
        shape = (full_rows // scale, full_cols // scale)
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0))

        def standard():
            return upstream.newton_schulz(x, steps, coefficient_type)

        def gram():
            return gram_newton_schulz(x, schedule, coefficient_type)

        standard(), gram()  # warm up
        pairs = [(_seconds(standard), _seconds(gram)) for _ in range(rounds)]
        ratios = sorted(g / s for s, g in pairs)
        quartiles = statistics.quantiles(ratios, n=4)
        runs = schedule.runs_on(*shape)
        rows.append(dict(
            what=what, shape=list(shape), gram_runs_here=runs,
            flops_ratio=schedule.flops(*shape) / ns_flops(*shape, steps),
            time_ratio=statistics.median(ratios), quartiles=[quartiles[0], quartiles[2]],
            standard_ms=statistics.median(s for s, _ in pairs) * 1e3,
            gram_ms=statistics.median(g for _, g in pairs) * 1e3))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--scale", type=int, default=16, help="divide each side by this")
    args = parser.parse_args()
    torch.manual_seed(0)
    precision = fast_newton_schulz_precision()
    with torch.no_grad():
        torch.set_float32_matmul_precision(precision)
        rows = bench(args.rounds, args.scale)
    print(f"Gram / standard Newton-Schulz, 5 quintic iterations, one restart, at "
          f"--muon-fp32-matmul-prec {precision}, {torch.get_num_threads()} threads; "
          f"{args.rounds} alternating rounds, median [quartiles]")
    print("| shape | scaled | FLOPs | time | standard ms | Gram ms | the plan runs Gram |")
    print("| --- | --- | ---: | --- | ---: | ---: | --- |")
    for r in rows:
        print(f"| {r['what']} | {r['shape'][0]} x {r['shape'][1]} | {r['flops_ratio']:.2f} | "
              f"{r['time_ratio']:.2f} [{r['quartiles'][0]:.2f}-{r['quartiles'][1]:.2f}] | "
              f"{r['standard_ms']:.1f} | {r['gram_ms']:.1f} | "
              f"{'yes' if r['gram_runs_here'] else 'no'} |")
    RESULTS.write_text(json.dumps(dict(precision=precision, rounds=args.rounds,
                                       scale=args.scale, threads=torch.get_num_threads(),
                                       rows=rows), indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
