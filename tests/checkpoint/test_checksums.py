"""Checkpoint files' sizes and CRC-32s: recorded by the rank that wrote them, verified in shares."""

import pytest

from megatron_muon.checkpoint import checksums


@pytest.fixture
def checkpoint(tmp_path):
    for name, size in [(".metadata", 10), ("__0_0.distcp", 3000), ("__1_0.distcp", 2000),
                       ("__1_1.distcp", 1000), ("__2_0.distcp", 0)]:
        (tmp_path / name).write_bytes(bytes(i % 251 for i in range(size)))
    for rank in range(3):
        checksums.record(tmp_path, rank)
    return tmp_path


def test_each_rank_records_the_files_it_wrote(checkpoint):
    files = checksums.recorded(checkpoint)
    assert sorted(files) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__1_1.distcp", "__2_0.distcp"]
    assert files["__1_0.distcp"]["bytes"] == 2000
    assert sorted(p.name for p in (checkpoint / "checksums").iterdir()) == [
        "rank0.json", "rank1.json", "rank2.json"]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_the_ranks_share_the_files_and_find_every_damage(checkpoint, world_size):
    files = checksums.recorded(checkpoint)
    assert [p for r in range(world_size) for p in checksums.damage(checkpoint, files, r, world_size)] == []
    (checkpoint / "__1_1.distcp").unlink()
    truncated = checkpoint / "__0_0.distcp"
    truncated.write_bytes(truncated.read_bytes()[:1234])
    flipped = bytearray((checkpoint / "__1_0.distcp").read_bytes())
    flipped[700] ^= 1
    (checkpoint / "__1_0.distcp").write_bytes(flipped)
    problems = sorted(p for r in range(world_size) for p in checksums.damage(checkpoint, files, r, world_size))
    assert [p.split(": ", 1)[1].split(" (")[0] for p in problems] == [
        "1234 bytes, 3000 when saved", "contents differ from the save", "missing"]
    assert [p.split(": ", 1)[0].rsplit("/", 1)[1] for p in problems] == [
        "__0_0.distcp", "__1_0.distcp", "__1_1.distcp"]


def test_a_checkpoint_saved_without_checksums_has_none_recorded(tmp_path):
    (tmp_path / "__0_0.distcp").write_bytes(b"x")
    assert checksums.recorded(tmp_path) is None
