"""What Muon on Megatron-FSDP refuses, in one table that every way in checks with its own names:
megatron.training's command line (arguments.validate_muon_args), the factory
(factory.get_megatron_optimizer) and Megatron-Bridge's ConfigContainer (megatron_muon.bridge).

A rule reads settings by their field names, which Megatron's argparse namespace, OptimizerConfig,
DistributedDataParallelConfig and TransformerConfig share; each way in says where a field lives
and how to name it (`--qk-clip-alpha`, `TransformerConfig.qk_clip_alpha`,
`cfg.model.qk_clip_alpha`). A rule is skipped where a setting it reads does not exist (the factory
has no `use_torch_fsdp2`), or where it concerns a training loop the way in does not run. The
optimizers' own arguments (--muon-tp-mode, --muon-dist-mode, --muon-max-consecutive-skipped-steps,
lr, momentum...) are checked by ZeROTensorParallelMuon and FSDPMuonChainedOptimizer themselves.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

# Where Megatron keeps each setting a rule reads: 'optimizer' (OptimizerConfig), 'ddp'
# (DistributedDataParallelConfig), 'model' (TransformerConfig) or 'dist' (the process setup:
# megatron.training's flags, Bridge's DistributedInitConfig).
SECTIONS = {
    "fp16": "optimizer",
    "optimizer_cpu_offload": "optimizer",
    "optimizer_offload_fraction": "optimizer",
    "use_precision_aware_optimizer": "optimizer",
    "num_distributed_optimizer_instances": "ddp",
    "outer_dp_sharding_strategy": "ddp",
    "overlap_grad_reduce": "ddp",
    "qk_clip": "model",
    "qk_clip_alpha": "model",
    "qk_clip_threshold": "model",
    "cache_mla_latents": "model",
    "attention_output_gate": "model",
    "pipeline_model_parallel_size": "model",
    "use_torch_fsdp2": "dist",
}


# Whose optimizers on Megatron-FSDP a rule refuses: Muon's (ours), megatron-core's (Adam, SGD:
# where they train wrong there), or any.
MUON, OTHERS, ANY = "muon", "others", "any"


@dataclasses.dataclass(frozen=True)
class Rule:
    refuses: Callable[[Any], bool]  # given the settings (attribute access by field name)
    says: str  # formatted with each field's name (`{qk_clip}`) and `value` (`{value.qk_clip}`)
    in_training_loops_only: bool = False  # megatron.training's and Bridge's, not the factory's
    optimizers: str = MUON


RULES = (
    # benchmarks/sweep.py: Adam on Megatron-FSDP in fp16 stops in its first step.
    Rule(lambda s: s.fp16, "{fp16} (use bf16 or fp32: Muon has no fp16 path, and megatron-core "
         "0.19's DistributedOptimizer on Megatron-FSDP stops in its first fp16 step, "
         "AttributeError in _collect_main_grad_data_for_unscaling)", optimizers=ANY),
    Rule(lambda s: s.qk_clip and not 0 < s.qk_clip_alpha < 1,
         "{qk_clip_alpha} {value.qk_clip_alpha} (must lie in (0, 1))"),
    Rule(lambda s: s.qk_clip and not s.qk_clip_threshold > 0,
         "{qk_clip_threshold} {value.qk_clip_threshold} (must be positive)"),
    # MultiLatentAttention.clip_qk refuses absorption (the kv up projection is gone).
    Rule(lambda s: s.qk_clip and s.cache_mla_latents,
         "{qk_clip} with {cache_mla_latents} (MLA's absorption mode has no kv up projection to "
         "clip; megatron-core's clip_qk refuses it too)"),
    Rule(lambda s: s.qk_clip and s.attention_output_gate,
         "{qk_clip} with {attention_output_gate} (megatron-core's QK-clip does not define the "
         "gate rows)"),
    Rule(lambda s: s.use_torch_fsdp2, "{use_torch_fsdp2} (Muon supports Megatron-FSDP only)"),
    # mcore_fsdp_adapter's _get_dp_tp_mesh lays the whole world out as (dp_cp ep tp): with
    # pipeline stages the model wrap dies in einops.
    Rule(lambda s: s.pipeline_model_parallel_size > 1,
         "{pipeline_model_parallel_size} {value.pipeline_model_parallel_size} (megatron-core "
         "0.19's Megatron-FSDP builds its device mesh over the data-, expert- and "
         "tensor-parallel ranks only: pipeline parallelism fails at model wrap, with any "
         "optimizer)", optimizers=ANY),
    Rule(lambda s: s.optimizer_cpu_offload and not 0 <= s.optimizer_offload_fraction <= 1,
         "{optimizer_offload_fraction} {value.optimizer_offload_fraction} (the share of the "
         "optimizer state in host memory: must lie in [0, 1])"),
    Rule(lambda s: s.use_precision_aware_optimizer, "{use_precision_aware_optimizer}"),
    # Megatron's training loops (megatron.training's and Bridge's setup) mark the last
    # micro-batch (config.no_sync_func) only with overlap_grad_reduce, and Megatron-FSDP reduces
    # across HSDP replicas only then: Adam's grad norm came out 0.71x Megatron DDP's in the sweep.
    Rule(lambda s: s.num_distributed_optimizer_instances > 1 and not s.overlap_grad_reduce,
         "{num_distributed_optimizer_instances} > 1 without {overlap_grad_reduce} (the HSDP "
         "replicas would never reduce their gradients together)",
         in_training_loops_only=True, optimizers=ANY),
    # benchmarks/sweep.py: with the gradients right (upstream_fixes.average_hfsdp_gradients),
    # megatron-core's DistributedOptimizer still takes the grad norm of part of them: 0.54x
    # Megatron DDP's, logged and clipped by. Muon's chain takes it over every shard.
    Rule(lambda s: s.num_distributed_optimizer_instances > 1
         and s.outer_dp_sharding_strategy != "no_shard",
         "{outer_dp_sharding_strategy} {value.outer_dp_sharding_strategy} with megatron-core's "
         "optimizers (its DistributedOptimizer's grad norm, logged and clipped by, is not Megatron "
         "DDP's there: 0.54x in megatron-muon's flag sweep, where Muon's equals it)",
         optimizers=OTHERS),
)


class _Absent(Exception):
    """A setting this way in does not have."""


class _Settings:
    def __init__(self, read: Callable[[str, str], Any]):
        self._read = read

    def __getattr__(self, field: str) -> Any:
        return self._read(SECTIONS[field], field)


def problems(read: Callable[[str, str], Any], name: Callable[[str, str], str],
             training_loop: bool, muon: bool = True) -> list[str]:
    """What RULES refuse in one configuration. `read(section, field)` is a setting's value (raise
    AttributeError where this way in has none); `name(section, field)` is how its user spells
    it; `training_loop`: whether the way in runs Megatron's training loop; `muon`: whether it
    asks for Muon (else megatron-core's optimizers' rules apply)."""

    def read_or_skip(section, field):
        try:
            return read(section, field)
        except AttributeError as absent:
            raise _Absent(field) from absent

    settings = _Settings(read_or_skip)
    names = {field: name(section, field) for field, section in SECTIONS.items()}
    found = []
    for rule in RULES:
        if (rule.in_training_loops_only and not training_loop) or \
                rule.optimizers == (OTHERS if muon else MUON):
            continue
        try:
            refused = rule.refuses(settings)
        except _Absent:
            continue
        if refused:
            found.append(rule.says.format(value=settings, **names))
    return found


def refuse(read, name, training_loop: bool, what: str, muon: bool = True) -> None:
    """Raise one ValueError listing every problem, before anything is built."""
    found = problems(read, name, training_loop, muon)
    if found:
        raise ValueError(f"{what} does not support: " + "; ".join(found))
