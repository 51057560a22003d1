"""The one table of what Muon on Megatron-FSDP refuses (integrations.rules): each rule refuses its
configuration and accepts the supported one next to it, and each way in (the command line, the
factory) names the settings as its users spell them."""

import argparse
import types

import pytest

from megatron_muon.integrations import rules
from megatron_muon.integrations.arguments import validate_muon_args
from megatron_muon.integrations.factory import get_megatron_optimizer

SUPPORTED = dict(fp16=False, optimizer_cpu_offload=False, optimizer_offload_fraction=1.0,
                 use_precision_aware_optimizer=False,
                 num_distributed_optimizer_instances=1, overlap_grad_reduce=False, qk_clip=False,
                 qk_clip_alpha=0.5, qk_clip_threshold=100.0, cache_mla_latents=False,
                 attention_output_gate=False, use_torch_fsdp2=False,
                 pipeline_model_parallel_size=1, outer_dp_sharding_strategy="no_shard")
# A refused configuration, what the command line says of it, and what the factory says (None: the
# factory does not check it: a training-loop rule, or a setting it has no field for).
REFUSED = [
    (dict(fp16=True), "--fp16 (use bf16 or fp32", "OptimizerConfig.fp16 (use bf16 or fp32"),
    (dict(qk_clip=True, qk_clip_alpha=1.0), "--qk-clip-alpha 1.0 (must lie in (0, 1))",
     "TransformerConfig.qk_clip_alpha 1.0 (must lie in (0, 1))"),
    (dict(qk_clip=True, qk_clip_alpha=0.0), "--qk-clip-alpha 0.0 (must lie in (0, 1))",
     "TransformerConfig.qk_clip_alpha 0.0"),
    (dict(qk_clip=True, qk_clip_threshold=0.0), "--qk-clip-threshold 0.0 (must be positive)",
     "TransformerConfig.qk_clip_threshold 0.0 (must be positive)"),
    (dict(qk_clip=True, cache_mla_latents=True), "--qk-clip with --cache-mla-latents",
     "TransformerConfig.qk_clip with TransformerConfig.cache_mla_latents"),
    (dict(qk_clip=True, attention_output_gate=True), "--qk-clip with --attention-output-gate",
     "TransformerConfig.qk_clip with TransformerConfig.attention_output_gate"),
    (dict(use_torch_fsdp2=True), "--use-torch-fsdp2 (Muon supports Megatron-FSDP only)", None),
    (dict(pipeline_model_parallel_size=2), "--pipeline-model-parallel-size 2 (megatron-core "
     "0.19's Megatron-FSDP builds its device mesh over the data-, expert- and tensor-parallel "
     "ranks only", "TransformerConfig.pipeline_model_parallel_size 2"),
    (dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.5),
     "--optimizer-offload-fraction 1.5 (the share of the optimizer state in host memory: must "
     "lie in [0, 1])", "OptimizerConfig.optimizer_offload_fraction 1.5"),
    (dict(use_precision_aware_optimizer=True), "--use-precision-aware-optimizer",
     "OptimizerConfig.use_precision_aware_optimizer"),
    (dict(num_distributed_optimizer_instances=2),
     "--num-distributed-optimizer-instances > 1 without --overlap-grad-reduce", None),
]
# Next to each: the same setting, supported.
ACCEPTED = [dict(qk_clip=False, qk_clip_alpha=1.0), dict(qk_clip=False, cache_mla_latents=True),
            # Muon's state and the scalar optimizer's go to host memory (core/state_offload.py).
            dict(optimizer_cpu_offload=True), dict(optimizer_offload_fraction=1.5),
            dict(optimizer_cpu_offload=True, optimizer_offload_fraction=0.0),
            dict(qk_clip=True, qk_clip_alpha=0.99, qk_clip_threshold=1e-3),
            dict(num_distributed_optimizer_instances=2, overlap_grad_reduce=True),
            # Muon's chain takes HFSDP's grad norm whole (megatron-core's optimizers' is refused).
            dict(num_distributed_optimizer_instances=2, overlap_grad_reduce=True,
                 outer_dp_sharding_strategy="optim")]


def _problems(settings: dict, training_loop: bool = True) -> list[str]:
    return rules.problems(lambda section, field: settings[field],
                          lambda section, field: f"{section}.{field}", training_loop)


def test_the_supported_configurations_pass():
    assert _problems(SUPPORTED) == []
    for changes in ACCEPTED:
        assert _problems({**SUPPORTED, **changes}) == [], changes


@pytest.mark.parametrize("changes, on_the_command_line, in_the_factory", REFUSED)
def test_each_rule_refuses_on_the_command_line(changes, on_the_command_line, in_the_factory):
    assert len(_problems({**SUPPORTED, **changes})) == 1
    args = argparse.Namespace(optimizer="muon", use_megatron_fsdp=True, muon_dist_mode="owner",
                              **{**SUPPORTED, **changes})
    with pytest.raises(ValueError) as refused:
        validate_muon_args(args)
    assert str(refused.value).startswith(
        "--optimizer muon with --use-megatron-fsdp does not support: " + on_the_command_line)


def _section(settings: dict, name: str, **more) -> types.SimpleNamespace:
    """The settings rules.SECTIONS places in section `name`, as a config object."""
    return types.SimpleNamespace(**more, **{field: settings[field] for field, section
                                            in rules.SECTIONS.items() if section == name})


def _factory_chunk(settings):
    return types.SimpleNamespace(install_optimized_model_weights=None, finish_grad_sync=None,
                                 ddp_config=_section(settings, "ddp"),
                                 config=_section(settings, "model"))


@pytest.mark.parametrize("changes, on_the_command_line, in_the_factory", REFUSED)
def test_each_rule_refuses_in_the_factory_with_the_config_fields_names(
        changes, on_the_command_line, in_the_factory):
    settings = {**SUPPORTED, **changes}
    config = _section(settings, "optimizer", optimizer="muon")
    with pytest.raises(Exception) as raised:
        get_megatron_optimizer(config, [_factory_chunk(settings)])
    if in_the_factory is None:  # checked, and passed: building the optimizer fails on the fakes
        assert "does not support" not in str(raised.value)
    else:
        assert raised.type is ValueError
        assert str(raised.value).startswith("Muon on Megatron-FSDP does not support: ")
        assert in_the_factory in str(raised.value)


def test_every_problem_is_named_in_one_error():
    args = argparse.Namespace(optimizer="muon", use_megatron_fsdp=True, muon_dist_mode="owner",
                              **{**SUPPORTED, "fp16": True, "use_precision_aware_optimizer": True})
    with pytest.raises(ValueError, match="--fp16 .*; --use-precision-aware-optimizer"):
        validate_muon_args(args)


def test_megatron_fsdp_with_another_optimizer_is_refused_what_fails_or_trains_wrong_for_it():
    """What benchmarks/sweep.py found wrong with megatron-core's own optimizers on Megatron-FSDP
    (Adam in fp16 stops, HSDP without --overlap-grad-reduce never reduces across replicas, HFSDP's
    grad norm is partial), refused naming the flags; not Muon's rules
    (--use-precision-aware-optimizer)."""
    refused = argparse.Namespace(optimizer="adam", use_megatron_fsdp=True, **{
        **SUPPORTED, "fp16": True, "pipeline_model_parallel_size": 4,
        "use_precision_aware_optimizer": True, "num_distributed_optimizer_instances": 2,
        "outer_dp_sharding_strategy": "optim"})
    with pytest.raises(ValueError) as raised:
        validate_muon_args(refused)
    said = str(raised.value)
    assert said.startswith("--use-megatron-fsdp does not support: --fp16 (use bf16 or fp32: Muon "
                           "has no fp16 path, and megatron-core 0.19's DistributedOptimizer")
    for named in ("--pipeline-model-parallel-size 4 (megatron-core 0.19's Megatron-FSDP builds "
                  "its device mesh over the data-, expert- and tensor-parallel ranks only",
                  "--num-distributed-optimizer-instances > 1 without --overlap-grad-reduce",
                  "--outer-dp-sharding-strategy optim with megatron-core's optimizers"):
        assert named in said, said
    assert said.count("; ") == 3 and "--use-precision-aware-optimizer" not in said
    validate_muon_args(argparse.Namespace(optimizer="adam", use_megatron_fsdp=False, **{
        **SUPPORTED, "pipeline_model_parallel_size": 4}))  # Megatron DDP: Megatron's to check


def test_a_rule_whose_setting_a_way_in_lacks_is_skipped():
    settings = {**SUPPORTED, "use_torch_fsdp2": True}

    def read(section, field):
        if section == "dist":
            raise AttributeError(field)
        return settings[field]

    assert rules.problems(read, lambda section, field: field, training_loop=True) == []
    hsdp = {**SUPPORTED, "num_distributed_optimizer_instances": 2}
    assert _problems(hsdp, training_loop=False) == []
    assert len(_problems(hsdp, training_loop=True)) == 1
