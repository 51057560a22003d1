"""How each format keys what a checkpoint holds, for both directions of a load across them.

Megatron DDP saves `torch_dist`: each tensor under the key megatron-core's sharded_state_dict
gives it (transformer layers stacked on a leading axis, experts too, the local spec's layer
norms under the linear layers they feed; SwiGLU's fc1 as every TP rank's gate rows, then every up
row). Our Muon chain on Megatron-FSDP saves `fsdp_dtensor`: each tensor under its module name,
in a section per kind (SECTIONS). What both formats share beside the tensors (COMMON), and the
one refusal of optimizer state a load cannot read (load_the_model_only), live here too."""

import dataclasses
from pathlib import Path
from typing import NamedTuple

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from torch.distributed.checkpoint import FileSystemReader

from ..chain.model_chunks import find_megatron_fsdp

# Each run of rows SwiGLU's fc1 stores apart: (first, end) of the DTensor's rows, and where that
# run starts as stored (swiglu_rows).
Rows = tuple[tuple[int, int, int], ...]


class StoredKey(NamedTuple):
    """Where a torch_dist checkpoint keeps one of a model's tensors."""
    key: str  # the ShardedTensor's key
    stacked: tuple[int, ...]  # its offsets on the leading stacked axes: a layer's, an expert's
    rows: Rows | None  # SwiGLU's fc1: its runs of rows stored apart; else None


class Section(NamedTuple):
    """One kind of tensor in both formats: ours keys it `prefix` + the param's name + `suffix`
    (the model's name for a weight, the chain's for optimizer state: CHAIN_PREFIX + it);
    megatron-core's torch_dist keys it `torch_dist.format(<the param's ShardedTensor key>)`."""
    prefix: str
    suffix: str
    torch_dist: str
    # Whether a Megatron DDP run's load reads it from ours (to_megatron_ddp); a kind it does not
    # read is refused there, naming --no-load-optim.
    to_megatron_ddp: bool = True

    @property
    def is_optimizer_state(self) -> bool:
        return self.prefix.startswith("optimizer.")


SECTIONS = (
    Section("model.module.", "", "{}"),
    Section("optimizer.muon.", ".momentum_buffer", "optimizer.state.momentum_buffer.{}"),
    # --optimizer adaptive_muon's second moment: AdaMuon's (one per element) loads from
    # Megatron DDP's save; NorMuon's and NAMO's (per row or one) megatron-core 0.19's DDP save
    # refuses. The way back is not taken.
    Section("optimizer.muon.", ".moment2_buffer", "optimizer.state.moment2_buffer.{}",
            to_megatron_ddp=False),
    Section("optimizer.state.", ".exp_avg", "optimizer.state.exp_avg.{}"),
    Section("optimizer.state.", ".exp_avg_sq", "optimizer.state.exp_avg_sq.{}"),
)
MODEL = SECTIONS[0]
# What the chain names a param in its optimizer sections: Megatron-FSDP's two wrappers, then the
# model's own name (chain/chained.py's _named_params).
CHAIN_PREFIX = "module.module."

# What every rank shares beside the tensors, in both formats; the schedule is read with the
# state. Of a Megatron DDP checkpoint, rank 0 reads the first three before the load: what
# megatron.training needs to generate the state dict of the run's own format.
COMMON = ("args", "iteration", "checkpoint_version", "num_floating_point_operations_so_far")
READ_BEFORE_THE_LOAD = COMMON[:3]
SCHEDULER = "opt_param_scheduler"

# What a refusal of optimizer state asks for, in megatron.training's flag and Bridge's field.
NO_LOAD_OPTIM = "--no-load-optim (Bridge: cfg.checkpoint.load_optim False)"


class OptimizerStateNotLoadable(RuntimeError):
    pass


def load_the_model_only(why: str) -> str:
    """The refusal of optimizer state a load cannot read: `why`, then what to do."""
    return (f"{why}. Load the model only with {NO_LOAD_OPTIM}: the optimizer state (Muon's "
            f"momentum, the scalar optimizer's moments) then starts at zero.")


def optimizer_section(torch_dist_kind: str) -> Section | None:
    """The section of ours that a Megatron DDP run's load reads megatron-core's optimizer state
    `torch_dist_kind` (its key: "optimizer.state.<kind>.<the param's key>") from, or None."""
    return next((section for section in SECTIONS if section.to_megatron_ddp
                 and section.torch_dist == f"optimizer.state.{torch_dist_kind}.{{}}"), None)


def is_torch_dist(checkpoint_dir: Path) -> bool:
    return dist_checkpointing.check_is_distributed_checkpoint(str(checkpoint_dir))


def is_ours(checkpoint_dir: Path) -> bool:
    """Whether `checkpoint_dir` holds our fsdp_dtensor checkpoint (torch_dist told apart first)."""
    if is_torch_dist(checkpoint_dir) or not (checkpoint_dir / ".metadata").is_file():
        return False
    return any(key.startswith(MODEL.prefix) for key in stored_metadata(checkpoint_dir))


def stored_metadata(checkpoint_dir: Path) -> dict:
    """{key: its storage metadata} of a DCP checkpoint (torch_dist or fsdp_dtensor)."""
    return FileSystemReader(str(checkpoint_dir)).read_metadata().state_dict_metadata


def stored_tensors(model) -> dict[str, StoredKey]:
    """stored_keys of megatron-core's sharded_state_dict of the module Megatron-FSDP wraps: how a
    torch_dist save of it keys each param."""
    return stored_keys(find_megatron_fsdp(model).module.sharded_state_dict(
        prefix="", metadata={"singleton_local_shards": False}))


def stored_keys(sharded: dict) -> dict[str, StoredKey]:
    """{name: its StoredKey} of a model's sharded_state_dict: its ShardedTensors, and SwiGLU's
    fc1 (a factory)."""
    found = {}
    for name, entry in sharded.items():
        if isinstance(entry, ShardedTensor):
            found[name] = StoredKey(entry.key,
                                    tuple(entry.global_offset[:entry.prepend_axis_num]), None)
        elif isinstance(entry, ShardedTensorFactory) and (swiglu := swiglu_rows(entry)):
            found[name] = swiglu
    return found


def swiglu_rows(factory: ShardedTensorFactory) -> StoredKey | None:
    """SwiGLU's fc1 (apply_swiglu_sharded_factory stores every TP rank's gate rows, then every
    up row), else None. Its rows: each run of the DTensor's rows (`factory.data`: the TP ranks'
    [gate; up] in TP order) and where it is stored."""
    shape = tuple(factory.data.shape)
    pieces = dataclasses.replace(factory, data=torch.empty(shape, device="meta")).build()
    if len(pieces) != 2 or any(not isinstance(piece, ShardedTensor) or piece.key != factory.key
                               for piece in pieces):
        return None
    axis, built = pieces[0].prepend_axis_num, pieces[0].local_shape[0]
    tp = (pieces[1].global_offset[axis] - pieces[0].global_offset[axis]) // built
    if tp < 1 or shape[0] % (2 * tp):
        return None
    half = shape[0] // (2 * tp)  # a TP rank's gate rows, and its up rows
    rows = tuple(run for r in range(tp) for run in ((2 * r * half, (2 * r + 1) * half, r * half),
                 ((2 * r + 1) * half, (2 * r + 2) * half, (tp + r) * half)))
    return StoredKey(factory.key, tuple(pieces[0].global_offset[:axis]), rows)
