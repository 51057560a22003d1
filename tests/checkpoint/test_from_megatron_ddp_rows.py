"""Where a Megatron DDP torch_dist checkpoint stores the rows of Megatron-FSDP's SwiGLU fc1
(checkpoint.keys.swiglu_rows), and the pieces a rank's chunk is read in (_pieces), against
megatron-core's own apply_swiglu_sharded_factory."""

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from megatron_muon.checkpoint.from_megatron_ddp import _pieces
from megatron_muon.checkpoint.keys import swiglu_rows

LAYER = (0, 1, 2)  # layer 1 of 2, stacked on a leading axis as torch_dist saves layers


def _factory(data: torch.Tensor, tp: int, tp_rank: int):
    """SwiGLU fc1's factory as megatron-core's sharded_state_dict builds it for `data`."""
    sharded = ShardedTensor.from_rank_offsets("fc1", data, LAYER, (1, tp_rank, tp),
                                              replica_id=0, prepend_axis_num=1)
    return apply_swiglu_sharded_factory(sharded, (LAYER,))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_swiglu_rows_find_each_fsdp_row_where_megatron_ddp_stored_it(tp):
    gate_and_up = 16  # a TP rank's [gate; up] rows
    frame = torch.arange(tp * gate_and_up * 3.0).view(tp * gate_and_up, 3)  # Megatron-FSDP's
    stored = torch.full_like(frame, -1.0)
    for rank in range(tp):  # what each TP rank of Megatron DDP saves, at its pieces' offsets
        local = frame[rank * gate_and_up:(rank + 1) * gate_and_up]
        for piece in _factory(local, tp, rank).build():
            start = piece.global_offset[1]
            stored[start:start + piece.local_shape[0]] = piece.data
    for rank in range(tp):  # every TP rank of Megatron-FSDP finds the same rows
        key, stacked, rows = swiglu_rows(_factory(torch.empty_like(frame, device="meta"), tp,
                                                  rank))
        assert (key, stacked) == ("fc1", (1,))
        assert sum(end - first for first, end, _ in rows) == len(frame)
        for first, end, at in rows:
            assert torch.equal(stored[at:at + end - first], frame[first:end]), (rank, first)


def test_a_chunk_across_gate_and_up_is_read_in_two_pieces():
    rows = swiglu_rows(_factory(torch.empty(64, 3, device="meta"), 2, 1))[2]
    assert rows == ((0, 16, 0), (16, 32, 32), (32, 48, 16), (48, 64, 48))
    chunk = ChunkStorageMetadata(offsets=torch.Size([40, 0]), sizes=torch.Size([12, 3]))
    assert _pieces(chunk, rows) == [((0, 8), (24, 0), (8, 3)), ((8, 4), (48, 0), (4, 3))]
    assert _pieces(chunk, None) == [(None, (40, 0), (12, 3))]
    empty = ChunkStorageMetadata(offsets=torch.Size([64, 0]), sizes=torch.Size([0, 3]))
    assert _pieces(empty, rows) == []
