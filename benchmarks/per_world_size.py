"""A benchmark script run under torchrun once per world size: the launcher's side (each run
writes its JSON, read back by world size; the summary saved in benchmarks/results/) and the
worker's (the process group and its device)."""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed as dist

RESULTS = Path(__file__).resolve().parent / "results"


def parser(description: str, world_sizes: list[int], stem: str) -> argparse.ArgumentParser:
    """A benchmark's command line: --world-sizes, --stem (results/STEM.json and STEM.png) and
    the worker's own flags (`run` passes them); the benchmark adds its own."""
    arguments = argparse.ArgumentParser(description=description)
    arguments.add_argument("--world-sizes", type=int, nargs="+", default=world_sizes)
    arguments.add_argument("--stem", default=stem, help="results/STEM.json and STEM.png")
    arguments.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    arguments.add_argument("--out", help=argparse.SUPPRESS)
    return arguments


def run(script: str, world_sizes, *flags: str) -> dict[int, dict]:
    """{W: what `script --worker ... --out FILE` wrote} for each world size, run one after
    another (gloo on CPU, NCCL on GPUs; one OpenMP thread a process)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in world_sizes:
            out = Path(tmp) / f"w{world}.json"
            subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", str(world), script,
                            "--worker", *flags, "--out", str(out)],
                           check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            runs[world] = json.loads(out.read_text())
    return runs


def write_gathered(out: str, measurements: Iterable[tuple[str, Callable[[], object]]]) -> None:
    """The worker's side of `run`: each (name, measure) run on every rank in turn, its figures
    gathered to rank 0, which writes {name: [each rank's]} to `out`; then the process group
    ends."""
    gathered = {}
    for name, measure in measurements:
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, measure())
        gathered[name] = per_rank
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def save(results: dict, stem: str, plot, print_table) -> None:
    """results/<stem>.json and, by `plot(results, path)`, <stem>.png; then the table printed and
    where they are."""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(results, indent=1))
    plot(results, RESULTS / f"{stem}.png")
    print_table(results)
    print(f"wrote {RESULTS / f'{stem}.json'} and {RESULTS / f'{stem}.png'}")


def init_worker() -> None:
    """The worker's process group: NCCL with its rank's GPU, else gloo."""
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
