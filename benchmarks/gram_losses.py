"""The demo's losses with Gram Newton-Schulz (--muon-gram-newton-schulz) against the standard run,
beside the distance between two standard runs that differ by Megatron's --ddp-bucket-size only
(a change no user counts as a change of the model's training): each run's every iteration's
loss to every digit (the demo's exact-values line), the largest difference over the iterations.

    python benchmarks/gram_losses.py [--iterations 100] [--nproc 2] [--bucket-size 1000]

writes benchmarks/results/gram-losses.json.
"""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "gram-losses.json"
LOSS = re.compile(r"iteration +(\d+) \| exact values \| lm loss: (\S+) \|")


def losses(nproc: int, iterations: int, *flags: str) -> list[float]:
    """Every iteration's loss of the demo on `nproc` ranks with `flags`, as `make demo` runs it."""
    torchrun = Path(sys.executable).with_name("torchrun")
    run = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", str(nproc),
                          "examples/pretrain_gpt.py", "--train-iters", str(iterations),
                          "--eval-iters", "0", *flags],
                         cwd=REPO, capture_output=True, text=True, check=False)
    found = {int(i): float(loss) for i, loss in LOSS.findall(run.stdout)}
    if run.returncode or sorted(found) != list(range(1, iterations + 1)):
        raise SystemExit(f"the demo failed ({' '.join(flags)}):\n{run.stdout[-3000:]}\n"
                         f"{run.stderr[-3000:]}")
    return [found[i] for i in range(1, iterations + 1)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--bucket-size", type=int, default=1000,
                        help="the other standard run's --ddp-bucket-size")
    args = parser.parse_args()
    runs = {"standard": (), f"standard, --ddp-bucket-size {args.bucket_size}":
            ("--ddp-bucket-size", str(args.bucket_size)), "gram": ("--muon-gram-newton-schulz",)}
    found = {name: losses(args.nproc, args.iterations, *flags) for name, flags in runs.items()}
    standard, bucket, gram = found.values()
    between_buckets = max(abs(a - b) for a, b in zip(standard, bucket))
    gram_distance = max(abs(a - b) for a, b in zip(standard, gram))
    print(f"the demo at W={args.nproc}, {args.iterations} iterations: the largest difference of "
          f"an iteration's loss from the standard run's: --ddp-bucket-size {args.bucket_size} "
          f"{between_buckets:.3e}, --muon-gram-newton-schulz {gram_distance:.3e} "
          f"({gram_distance / between_buckets if between_buckets else float('inf'):.2f}x); "
          f"last losses {standard[-1]:.6f}, {bucket[-1]:.6f}, {gram[-1]:.6f}")
    RESULTS.write_text(json.dumps(dict(nproc=args.nproc, iterations=args.iterations,
                                       between_buckets=between_buckets,
                                       gram_distance=gram_distance, losses=found), indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
