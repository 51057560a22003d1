"""A Megatron-FSDP checkpoint of ours (`fsdp_dtensor`) loaded by a Megatron DDP run
(`--ckpt-format torch_dist`: megatron-core's Muon, or any optimizer with --no-load-optim, e.g. to
evaluate), on the fly in the load path of megatron.training and of Bridge (checkpoint.direction
decides, and calls `load`): the reverse of from_megatron_ddp. Unaided, megatron.training takes
the directory for a plain DCP checkpoint and stops with a bare AttributeError.

The DDP run generates its torch_dist state dict (ShardedTensors around its own params and
optimizer state, its RNG as a ShardedObject); each tensor is read whole from the fsdp_dtensor key
of its param (its model name; the optimizer's by the chain's names, experts at their global
index; SwiGLU's fc1 from the halves megatron.training's save splits it into) straight into the
DDP run's tensor, and what dist_checkpointing.load would return is handed back. TP 1: a TP > 1
run stops, before anything is read."""

from pathlib import Path

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import (LocalNonpersistentObject, ShardedObject,
                                                      ShardedTensor, ShardedTensorFactory)
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..chain.model_chunks import at_global_expert_index
from .keys import (CHAIN_PREFIX, COMMON, MODEL, SCHEDULER, OptimizerStateNotLoadable, StoredKey,
                   load_the_model_only, optimizer_section, stored_keys, stored_metadata)


def common_state(checkpoint_dir: Path, stored: dict | None = None) -> dict:
    """What of COMMON an fsdp_dtensor checkpoint holds (a Bridge run's: iteration, version)."""
    stored = stored or stored_metadata(checkpoint_dir)
    return _read([key for key in COMMON if key in stored], checkpoint_dir, stored)


def load(checkpoint_dir: Path, sharded_state_dict: dict, num_experts: int | None) -> dict:
    """What dist_checkpointing.load would return for the DDP run's `sharded_state_dict`, read
    from our fsdp_dtensor checkpoint in `checkpoint_dir`: every tensor in place, found before
    any is read (else nothing changes)."""
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        raise RuntimeError(f"{checkpoint_dir}: a Megatron-FSDP checkpoint loads on Megatron DDP "
                           f"at --tensor-model-parallel-size 1 only, for now")
    stored = stored_metadata(checkpoint_dir)
    model = sharded_state_dict["model"]
    global_names = _global_names(list(model), num_experts)
    wanted = {}
    for name, entry in model.items():
        if isinstance(entry, (ShardedTensor, ShardedTensorFactory)):
            wanted.update(_model_reads(name, global_names[name], entry.data, stored))
    by_key = {(found.key, found.stacked): name for name, found in stored_keys(model).items()}
    optimizer = sharded_state_dict.get("optimizer")
    if optimizer is not None:
        for entry in _sharded_entries(optimizer):
            wanted.update(_optimizer_reads(entry, by_key, global_names, stored))
    missing = [key for key in wanted if key not in stored]
    if missing:
        raise RuntimeError(f"{checkpoint_dir} has no {missing[0]} ({len(missing)} missing): "
                           f"it was saved for another model; nothing was loaded")
    _fill(wanted, checkpoint_dir)
    state = _with_data({key: value for key, value in sharded_state_dict.items()
                        if key not in ("rng_state", SCHEDULER)})
    if optimizer is not None:
        _with_common_step(state["optimizer"],
                          _read(["optimizer.step"], checkpoint_dir, stored)["optimizer.step"])
    if SCHEDULER in sharded_state_dict:
        prefix = f"{SCHEDULER}."
        state[SCHEDULER] = {
            key[len(prefix):]: value for key, value in _read(
                [key for key in stored if key.startswith(prefix)], checkpoint_dir, stored).items()}
    if "rng_state" in sharded_state_dict:
        state["rng_state"] = _rng_states(checkpoint_dir, stored)
    state.update(common_state(checkpoint_dir, stored))
    return state


def _model_reads(name: str, global_name: str, data: torch.Tensor, stored: dict) -> dict:
    """{fsdp_dtensor key: the DDP tensor (or rows of it) it fills} for a weight: whole, or a
    gated fc1's halves (megatron.training's save splits it: handle_swiglu_in_state_dict)."""
    key = f"{MODEL.prefix}{global_name}"
    if key in stored or f"{key}_w" not in stored:
        return {key: data}
    half = data.shape[0] // 2
    return {f"{key}_w": data[:half], f"{key}_v": data[half:]}


def _optimizer_reads(entry, by_key: dict[tuple[str, tuple[int, ...]], str], global_names: dict,
                     stored: dict) -> dict:
    """{fsdp_dtensor key: tensor} for one of megatron-core's model-space optimizer tensors: a
    state from our chain's section of its kind; an fp32 master weight (bf16 runs) from our
    model section, which holds the fp32 main weights."""
    _, _, kind_and_key = entry.key.partition("optimizer.state.")
    kind, _, model_key = kind_and_key.partition(".")
    stacked = tuple(entry.global_offset[:entry.prepend_axis_num]) if isinstance(
        entry, ShardedTensor) else _first_stacked(entry)
    name = by_key.get((model_key, stacked))
    if name is not None and kind == "fp32_param":
        return _model_reads(name, global_names[name], entry.data, stored)
    section = optimizer_section(kind)
    if section is None or name is None:
        raise OptimizerStateNotLoadable(load_the_model_only(
            f"this run's optimizer state {entry.key} has no counterpart in a Megatron-FSDP Muon "
            f"checkpoint (DistributedOptimizer's buffer layout, or another optimizer's)"))
    return {f"{section.prefix}{CHAIN_PREFIX}{global_names[name]}{section.suffix}": entry.data}


def _first_stacked(factory: ShardedTensorFactory) -> tuple[int, ...]:
    piece: StoredKey | None = stored_keys({"": factory}).get("")
    return piece.stacked if piece else ()


def _sharded_entries(tree):
    """The ShardedTensors and factories in a nested dict/list."""
    values = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, list) else ()
    for value in values:
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)):
            yield value
        else:
            yield from _sharded_entries(value)


def _with_data(tree):
    """`tree` as dist_checkpointing.load returns it: each sharded entry replaced by its (loaded)
    tensor or object, a local object unwrapped."""
    if isinstance(tree, (ShardedTensor, ShardedTensorFactory, ShardedObject)):
        return tree.data
    if isinstance(tree, LocalNonpersistentObject):
        return tree.unwrap()
    if isinstance(tree, dict):
        return {key: _with_data(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_with_data(value) for value in tree]
    return tree


def _with_common_step(tree, step: torch.Tensor) -> None:
    """Our chain's step count as the common_step of each Adam part's state (megatron-core's
    FP32Optimizer.load_state_dict gives every param its step from it; a torch_dist checkpoint
    holds it in its common state)."""
    if isinstance(tree, dict):
        state = tree.get("state")
        if isinstance(state, dict) and any(isinstance(value, dict) and "exp_avg" in value
                                           for value in state.values()):
            state["common_step"] = step.to(torch.float32)
        for value in tree.values():
            _with_common_step(value, step)


def _global_names(names: list, num_experts: int | None) -> dict:
    """{model name: the name our checkpoint keys it by}: local experts at their global index."""
    renamed = at_global_expert_index({name: name for name in names}, num_experts)
    return {local: global_name for global_name, local in renamed.items()}


def _rng_states(checkpoint_dir: Path, stored: dict) -> list:
    """torch_dist's rng_state for this rank's (pp, tp): the data-parallel ranks' RNG states,
    from our checkpoint's "rng_state.(pp, tp).<dp>.<name>" entries."""
    position = (f"rng_state.({parallel_state.get_pipeline_model_parallel_rank()}, "
                f"{parallel_state.get_tensor_model_parallel_rank()}).")
    states: dict[int, dict] = {}
    for key, value in _read([key for key in stored if key.startswith(position)],
                            checkpoint_dir, stored).items():
        dp, _, field = key[len(position):].partition(".")
        node = states.setdefault(int(dp), {})
        *path, leaf = field.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return [states[dp] for dp in sorted(states)]


def _read(keys, checkpoint_dir: Path, stored: dict) -> dict:
    """{key: its value} of `keys` in the checkpoint (`stored`: its metadata): tensors (on the
    host) and objects."""
    state = {key: torch.empty(stored[key].size, dtype=stored[key].properties.dtype, device="cpu")
             if isinstance(stored[key], TensorStorageMetadata) else None for key in keys}
    return _fill(state, checkpoint_dir)


def _fill(state: dict, checkpoint_dir: Path) -> dict:
    """`state` ({flat key: the tensor to fill, or None for an object}) read from the checkpoint."""
    dcp_load(state, storage_reader=FileSystemReader(str(checkpoint_dir)),
             planner=DefaultLoadPlanner(allow_partial_load=True))
    return state
