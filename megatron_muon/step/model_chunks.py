"""Megatron-FSDP inside a model chunk, and the main weights it holds, named as the chunk names its
params."""


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
