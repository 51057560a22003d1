"""A Megatron DDP checkpoint (`--ckpt-format torch_dist`) loaded by a Muon run on Megatron-FSDP
(`fsdp_dtensor`), on the fly in the load path of megatron.training (`--load DIR` with the new
run's own flags) and of Bridge: checkpoint.direction decides, and calls `load`. Unaided,
megatron.training takes the torch_dist checkpoint for its own format and stops with a bare
KeyError ('model'): the two formats key each tensor differently (checkpoint.keys).

What is read, under the keys megatron-core's sharded_state_dict gives this run's model (the
GPTModel inside Megatron-FSDP makes the ShardedTensors Megatron DDP saved; experts at their global
index; SwiGLU's fc1 by swiglu_rows): the weights; with the optimizer, megatron-core Muon's momentum
(and AdaMuon's second moment), the scalar part's Adam moments and the step count (megatron-core's
Muon chain saves them per param); the iteration, the schedule, the RNG states and the args. Each
rank reads only the rows it holds (StackedLoadPlanner). Optimizer state in DistributedOptimizer's
bucket space (--use-distributed-optimizer) names no param: loading it stops, before anything
changes, naming --no-load-optim (keys.load_the_model_only)."""

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import \
    preprocess_state_dict_for_uneven_dtensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from ..chain.model_chunks import at_global_expert_index, find_megatron_fsdp
from .keys import (CHAIN_PREFIX, COMMON, SCHEDULER, SECTIONS, OptimizerStateNotLoadable, Rows,
                   StoredKey, load_the_model_only, stored_metadata, stored_tensors)


def common_state(checkpoint_dir: Path) -> dict:
    """What every rank shares of a torch_dist checkpoint: args, iteration, schedule, ..."""
    return dist_checkpointing.load_common_state_dict(str(checkpoint_dir))


def stored_key(fqn: str, names: dict[str, StoredKey],
               chain_names: dict[str, StoredKey]) -> StoredKey | None:
    """Where the torch_dist checkpoint keeps what a flattened fsdp_dtensor key reads: a weight
    by its model name (`names`), optimizer state by the chain's (`chain_names`)."""
    for section in SECTIONS:
        if fqn.startswith(section.prefix) and fqn.endswith(section.suffix):
            name = fqn[len(section.prefix):len(fqn) - len(section.suffix)]
            if section.is_optimizer_state:
                name, by_name = name.removeprefix(CHAIN_PREFIX), chain_names
            else:
                by_name = names
            if name in by_name:
                found = by_name[name]
                return StoredKey(section.torch_dist.format(found.key), found.stacked, found.rows)
    return None


class StackedLoadPlanner(DefaultLoadPlanner):
    """torch DCP's load planner reading each tensor of `remapped` ({its flattened key: where it
    is stored}) from there: this rank's chunk of it, at the stacked offsets before the chunk's
    own; where the stored key has rows, each run of rows it stores apart read apart
    (_pieces)."""

    def __init__(self, remapped: dict[str, StoredKey]) -> None:
        super().__init__(allow_partial_load=True)
        self.remapped, self.views = remapped, {}

    def create_local_plan(self) -> LoadPlan:
        stored = self.metadata.state_dict_metadata
        items = []
        for fqn, stored_at in self.remapped.items():
            ones, chunks = (1,) * len(stored_at.stacked), []
            for chunk in _chunks(self.state_dict[fqn]):
                for view, offsets, sizes in _pieces(chunk, stored_at.rows):
                    self.views[fqn, len(chunks)] = view
                    chunks.append(ChunkStorageMetadata(
                        offsets=torch.Size(stored_at.stacked + offsets),
                        sizes=torch.Size(ones + sizes)))
            items += [dataclasses.replace(
                item, dest_index=dataclasses.replace(item.dest_index, fqn=fqn))
                for item in create_read_items_for_chunk_list(stored_at.key, stored[stored_at.key],
                                                             chunks)]
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        local = self.state_dict[index.fqn]
        local = local.to_local() if isinstance(local, DTensor) else local
        view = self.views[index.fqn, index.index]
        local = local.narrow(0, *view) if view else local
        return local.view((1,) * len(self.remapped[index.fqn].stacked) + tuple(local.shape))


def _pieces(chunk, rows: Rows | None) -> list[tuple]:
    """(the local tensor's rows it fills: (first, count), None for all; offsets and sizes as
    stored) of each piece of `chunk` that `rows` (swiglu_rows' runs; None: none) stores apart."""
    offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
    if rows is None:
        return [(None, offsets, sizes)]
    start, end = offsets[0], offsets[0] + sizes[0]
    return [((low - start, high - low), (at + low - first, *offsets[1:]), (high - low, *sizes[1:]))
            for first, last, at in rows
            for low, high in [(max(start, first), min(end, last))] if low < high]


def _chunks(value: torch.Tensor) -> list:
    """This rank's chunk(s) of the global tensor, as torch DCP sees them (an uneven Megatron-FSDP
    DTensor answers with its chunk metadata: preprocess_state_dict_for_uneven_dtensor)."""
    if isinstance(value, DTensor):
        return value.__create_chunk_list__()
    return [ChunkStorageMetadata(offsets=torch.Size((0,) * value.dim()), sizes=value.shape)]


def load(checkpoint_dir: Path, state_dict: dict) -> dict:
    """megatron.training's fsdp_dtensor load (its _load_base_checkpoint on rank0=False) of the
    torch_dist checkpoint in `checkpoint_dir`: `state_dict` as load_checkpoint generated it for
    this run (the model's and optimizer's tensors, filled in place), with the common state.
    Every tensor is found in the checkpoint before any is read, else nothing changes."""
    model = state_dict.pop("_model")
    common = common_state(checkpoint_dir)
    stored = stored_metadata(checkpoint_dir)
    tensors = {section: state_dict[section] for section in ("model", "optimizer")
               if section in state_dict}
    refusal = _bucket_space(common, stored, checkpoint_dir) if "optimizer" in tensors else None
    remapped = {}
    if refusal is None:
        names = stored_tensors(model[0])
        num_experts = getattr(find_megatron_fsdp(model[0]).module.config, "num_moe_experts", None)
        remapped, refusal = _remapped(tensors, names, at_global_expert_index(names, num_experts),
                                      stored)
    _raise_on_every_rank(refusal)
    preprocess_state_dict_for_uneven_dtensor(tensors)
    dcp_load(tensors, storage_reader=FileSystemReader(str(checkpoint_dir)),
             planner=StackedLoadPlanner(remapped))
    if "optimizer" in tensors:
        tensors["optimizer"]["step"] = _step_count(common)
    for key in (*COMMON, SCHEDULER):
        if key in common:
            state_dict[key] = common[key]
    if "rng_state" in state_dict:
        state_dict["rng_state"] = _rng_states(checkpoint_dir, state_dict["rng_state"])
    state_dict.pop("rerun_state_machine", None)
    return state_dict


def _remapped(tensors: dict, names: dict[str, StoredKey], chain_names: dict[str, StoredKey],
              stored: dict) -> tuple[dict[str, StoredKey], Exception | None]:
    """({flattened key: stored_key's} of every tensor in `tensors`, None),
    or (what was found, the refusal): naming --no-load-optim where an optimizer state is not in
    the checkpoint (saved by another optimizer: Adam's moments where Muon's momentum is wanted),
    naming the param where a weight is not."""
    remapped = {}
    for fqn in _tensor_keys(tensors):
        if fqn == "optimizer.step":  # the chain's step count: from the common state
            continue
        found = stored_key(fqn, names, chain_names)
        if found is not None and found.key in stored:
            remapped[fqn] = found
        elif fqn.startswith("optimizer."):
            return remapped, OptimizerStateNotLoadable(load_the_model_only(
                f"the Megatron DDP checkpoint has no {fqn.rsplit('.', 1)[1]} for "
                f"{fqn.split('.', 2)[2].rsplit('.', 1)[0].removeprefix(CHAIN_PREFIX)}: it was "
                f"saved by another optimizer or with --no-save-optim"))
        else:
            return remapped, RuntimeError(
                f"{fqn.removeprefix('model.')} is not in the Megatron DDP checkpoint under the key "
                f"megatron-core's sharded_state_dict gives it here"
                f"{f' ({found.key})' if found else ''}: this layout does not load from "
                f"torch_dist yet; nothing was loaded")
    return remapped, None


def _raise_on_every_rank(refusal: Exception | None) -> None:
    """Every rank raises if any rank found a refusal (the first rank's): the ranks reach the
    load's collectives together or none does."""
    refusals = [None] * dist.get_world_size()
    dist.all_gather_object(refusals, None if refusal is None else (type(refusal), str(refusal)))
    found = next((found for found in refusals if found is not None), None)
    if found is not None:
        kind, message = found
        raise kind(message)


def _tensor_keys(tree: dict, prefix: str = ""):
    """The dotted keys of the tensors in a nested dict, as torch DCP flattens them."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _tensor_keys(value, f"{prefix}{key}.")
        elif isinstance(value, torch.Tensor):
            yield f"{prefix}{key}"


def _bucket_space(common: dict, stored: dict, checkpoint_dir: Path) -> Exception | None:
    """The refusal of optimizer state saved in DistributedOptimizer's buffer layout, or None."""
    if any(key.startswith("optimizer.distributed.") for key in stored):
        saved = getattr(common.get("args"), "optimizer", "its optimizer")
        return OptimizerStateNotLoadable(load_the_model_only(
            f"the Megatron DDP checkpoint in {checkpoint_dir} keeps --optimizer {saved}'s state "
            f"in DistributedOptimizer's buffer layout (--use-distributed-optimizer), which names "
            f"no param"))
    return None


def _step_count(common: dict) -> torch.Tensor:
    """The chain's step count: the scalar part's common_step (megatron-core's Adam keeps one),
    else the iteration."""
    steps = [state["state"]["common_step"] for state in common["optimizer"].values()
             if isinstance(state, dict) and "common_step" in state.get("state", {})]
    return torch.tensor(int(steps[0]) if steps else common["iteration"], device="cpu")


def _rng_states(checkpoint_dir: Path, generated: dict) -> dict:
    """{"(pp, tp)": the data-parallel ranks' RNG states}, fsdp_dtensor's shape of rng_state, from
    torch_dist's rng_state object of this rank's (pp, tp)."""
    (position,) = generated
    pp, tp = (parallel_state.get_pipeline_model_parallel_rank(),
              parallel_state.get_tensor_model_parallel_rank())
    wanted = {"rng_state": ShardedObject(
        "rng_state", None, (parallel_state.get_pipeline_model_parallel_world_size(),
                            parallel_state.get_tensor_model_parallel_world_size()),
        (pp, tp), replica_id=0)}
    loaded = dist_checkpointing.load(wanted, str(checkpoint_dir), validate_access_integrity=False)
    return {position: loaded["rng_state"]}
