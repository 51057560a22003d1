"""The CPU layer's collectives mean what they mean on NCCL (megatron_muon.cpu.torch_compat)."""

import torch
import torch.distributed as dist

from megatron_muon.cpu.torch_compat import apply_cpu_compat


def _reduce_scatters_average(rank, world_size):
    apply_cpu_compat()
    values = torch.arange(2 * world_size, dtype=torch.float32) + 10 * rank
    mean = sum(torch.arange(2 * world_size, dtype=torch.float32) + 10 * r
               for r in range(world_size)) / world_size
    expected = mean.chunk(world_size)[rank]
    out = torch.empty(2)
    assert dist.reduce_scatter_tensor(out, values, op=dist.ReduceOp.AVG) is None
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out = torch.empty(2)
    dist.reduce_scatter_tensor(out, values, op=dist.ReduceOp.AVG, async_op=True).wait()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out = torch.empty(2)
    dist.reduce_scatter(out, list(values.chunk(world_size)), op=dist.ReduceOp.AVG)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    dist.reduce_scatter_tensor(out, values)  # SUM, as before
    torch.testing.assert_close(out, mean.chunk(world_size)[rank] * world_size, rtol=0, atol=0)


def test_reduce_scatter_averages_under_avg_as_on_nccl(distributed):
    """gloo's reduce-scatter sums under ReduceOp.AVG in torch 2.8 (1 and 2 give 3.0; fixed in
    later torch), which made every Megatron-FSDP run with --ddp-average-in-collective train on
    W-times gradients on CPU; with the CPU layer it averages, as NCCL does."""
    for world_size in (2, 4):
        distributed(_reduce_scatters_average, world_size)
