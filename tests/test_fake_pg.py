"""The multi-rank code paths with no data moving, on this machine's CPU (the GPU suite runs the
same on CUDA tensors): every tensor a collective sees is on the ranks' device."""

import pytest
import torch
import torch.distributed as dist

import fake_paths
from fake_ranks import Guard, WrongDevice, run_fake_ranks


def _fails_off_device(rank, world_size, guard):
    cuda_guard = Guard("cuda", guard.store)  # now the ranks' device is CUDA
    with pytest.raises(WrongDevice, match="all_reduce was handed a tensor on cpu"):
        dist.all_reduce(torch.zeros(3))
    assert cuda_guard.calls == {}


def test_the_guard_fails_a_collective_given_a_tensor_off_the_ranks_device():
    failure = run_fake_ranks(_fails_off_device, 2, "cpu")
    assert failure is None, failure


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_path_keeps_collectives_on_the_ranks_device(world_size, tmp_path):
    failure = run_fake_ranks(fake_paths.every_path, world_size, "cpu", str(tmp_path))
    assert failure is None, failure
