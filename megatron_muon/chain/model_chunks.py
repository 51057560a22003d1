"""Megatron-FSDP inside a model chunk, and the main weights it holds, named as the chunk names its
params (and as checkpoints name them: at_global_expert_index)."""

from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_experts_in_state_dict


def find_megatron_fsdp(chunk):
    """The MegatronFSDP inside a model chunk (megatron-core's FullyShardedDataParallel wraps it as
    `.module`), or None. Duck-typed: megatron_fsdp and megatron-core each ship a MegatronFSDP."""
    while chunk is not None:
        if hasattr(chunk, "install_optimized_model_weights") and hasattr(chunk, "finish_grad_sync"):
            return chunk
        chunk = getattr(chunk, "module", None)
    return None


def named_main_weights(chunk) -> list:
    """(name, main weight) for every param of a Megatron-FSDP model chunk, named as the chunk
    names its params. The chunk's modules hold the main weights only between the grad sync and
    the next param sync or forward (Megatron-FSDP swaps them), so this asks Megatron-FSDP."""
    fsdp = find_megatron_fsdp(chunk)
    prefix, module = "", chunk
    while module is not fsdp:
        prefix, module = prefix + "module.", module.module
    return [(f"{prefix}module.{name}", p)
            for name, p in fsdp.param_and_grad_buffer.optimizer_named_parameters]


def at_global_expert_index(by_name: dict, num_experts: int | None) -> dict:
    """`by_name` keyed as Megatron's fsdp_dtensor checkpoints name params
    (DistributedOptimizer._param_name): local experts renamed to their global index, so
    expert-parallel ranks never share a key (megatron-core's handle_experts_in_state_dict)."""
    return handle_experts_in_state_dict(dict(by_name), num_experts) if num_experts else by_name
