"""Each checkpoint file's size and CRC-32, recorded when it is saved and verified before it is
loaded: a truncated or corrupted file is named before any state changes, instead of a bare
EOFError or a run that loads damaged weights and trains on NaN.

Files are those of a DCP checkpoint directory: each rank writes `__<rank>_<n>.distcp`, rank 0
the rest (`.metadata`). Every rank records its own files in `checksums/rank<rank>.json` inside
the directory; at load the ranks split the recorded files between them (any world size)."""

import json
import os
import warnings
import zlib
from pathlib import Path

import torch.distributed as dist

MANIFESTS = "checksums"


def _crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def _written_by(checkpoint: Path, rank: int) -> list[Path]:
    def writer(name: str) -> int:
        if name.startswith("__") and name.endswith(".distcp"):
            return int(name[2:].split("_", 1)[0])
        return 0

    return sorted(p for p in checkpoint.iterdir() if p.is_file() and writer(p.name) == rank)


def record(checkpoint: Path, rank: int) -> None:
    """Record the size and CRC-32 of the files this rank wrote into `checkpoint`."""
    entries = {p.name: {"bytes": p.stat().st_size, "crc32": _crc32(p)}
               for p in _written_by(checkpoint, rank)}
    manifests = checkpoint / MANIFESTS
    manifests.mkdir(exist_ok=True)
    partial = manifests / f".rank{rank}.json.partial"
    partial.write_text(json.dumps(entries, indent=1, sort_keys=True))
    os.replace(partial, manifests / f"rank{rank}.json")  # never a half-written manifest


def recorded(checkpoint: Path) -> dict[str, dict] | None:
    """Every recorded file's size and CRC-32, or None if the checkpoint has no manifests (saved
    without them)."""
    manifests = sorted((checkpoint / MANIFESTS).glob("rank*.json"))
    if not manifests:
        return None
    return {name: entry for m in manifests for name, entry in json.loads(m.read_text()).items()}


def damage(checkpoint: Path, files: dict[str, dict], rank: int, world_size: int) -> list[str]:
    """What is wrong with this rank's share of the recorded `files` (every world_size-th)."""
    problems = []
    for name in sorted(files)[rank::world_size]:
        path, expected = checkpoint / name, files[name]
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif (size := path.stat().st_size) != expected["bytes"]:
            problems.append(f"{path}: {size} bytes, {expected['bytes']} when saved (truncated or "
                            f"overwritten)")
        elif (crc := _crc32(path)) != expected["crc32"]:
            problems.append(f"{path}: contents differ from the save (CRC-32 {crc}, "
                            f"{expected['crc32']} when saved)")
    return problems


def record_on_every_rank(checkpoint: Path) -> None:
    """After a save (persistent and complete): each rank records its files, then all wait."""
    record(checkpoint, dist.get_rank())
    dist.barrier()


def verify_on_every_rank(checkpoint: Path) -> None:
    """Check the checkpoint a load will read against its recorded checksums, the ranks sharing
    the files; raise on every rank, naming each damaged file, before anything is read."""
    if not checkpoint.is_dir():
        return  # no checkpoint: the training loop warns and trains from scratch
    files = recorded(checkpoint)
    if files is None:
        if dist.get_rank() == 0:
            warnings.warn(f"{checkpoint} has no recorded checksums (saved without them): loading "
                          f"it unverified")
        return
    everyones = [None] * dist.get_world_size()
    dist.all_gather_object(everyones, damage(checkpoint, files, dist.get_rank(),
                                             dist.get_world_size()))
    problems = [problem for mine in everyones for problem in mine]
    if problems:
        raise RuntimeError(f"the checkpoint {checkpoint} is damaged; nothing was loaded:\n  "
                           + "\n  ".join(problems))
