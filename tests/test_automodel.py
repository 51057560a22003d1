"""NeMo Automodel's Megatron-FSDP strategy with Muon, built and stepped as Automodel's LLM recipe
(recipes/llm/train_ft.py) does: a tiny Hugging Face Llama parallelized by Automodel's
parallelize_megatron_fsdp (the standalone megatron-fsdp 0.5.0 Automodel pins), the optimizer from
a recipe YAML naming megatron_muon.automodel.MegatronFSDPMuonConfig, then Automodel's
shard_optimizers_for_megatron_fsdp (megatron_fsdp's fully_shard_optimizer) around it; every step
bit-identical to single-device Muon + AdamW. Runs in its own venv (make test-automodel): Automodel
pins transformers and megatron-fsdp apart from the main suite's; skipped elsewhere."""

import functools

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

pytest.importorskip("nemo_automodel", reason="NeMo Automodel runs in its own venv: make "
                                             "test-automodel")

from nemo_automodel.components.config.loader import load_yaml_config  # noqa: E402
from nemo_automodel.components.distributed.config import MegatronFSDPConfig  # noqa: E402
from nemo_automodel.components.distributed import parallelizer  # noqa: E402
from nemo_automodel.components.distributed.megatron_fsdp import \
    parallelize_megatron_fsdp  # noqa: E402
from nemo_automodel.recipes._dist_utils import shard_optimizers_for_megatron_fsdp  # noqa: E402
from nemo_automodel.recipes._typed_config import RecipeConfig  # noqa: E402

from megatron_muon.automodel import MegatronFSDPMuonConfig  # noqa: E402
from test_standalone import ADAMW, MUON, steps_match_single_device, \
    tiny_hugging_face_model  # noqa: E402

RECIPE = f"""
distributed:
  strategy: megatron_fsdp
optimizer:
  _target_: megatron_muon.automodel.MegatronFSDPMuonConfig
  lr: {MUON["lr"]}
  momentum: {MUON["momentum"]}
  nesterov: {str(MUON["nesterov"]).lower()}
  weight_decay: {MUON["weight_decay"]}
  adamw_lr: {ADAMW["lr"]}
  adamw_betas: {list(ADAMW["betas"])}
  adamw_eps: {ADAMW["eps"]}
  adamw_weight_decay: {ADAMW["weight_decay"]}
  fp32_matmul_prec: highest
"""


def _recipe_steps_exactly(rank, world_size, recipe_path, zero_dp_strategy):
    torch.manual_seed(0)
    model, _ = tiny_hugging_face_model("Llama")
    reference = type(model)(model.config)
    reference.load_state_dict(model.state_dict())
    mesh = init_device_mesh("cpu", (world_size, 1, 1), mesh_dim_names=("dp", "cp", "tp"))
    distributed = MegatronFSDPConfig(zero_dp_strategy=zero_dp_strategy)
    # Automodel lets Megatron-FSDP take the current CUDA device; on CPU, the CPU.
    shard_model = parallelizer.megatron_fsdp_fully_shard_model
    parallelizer.megatron_fsdp_fully_shard_model = functools.partial(shard_model, device="cpu")
    try:
        model, _ = parallelize_megatron_fsdp(model, distributed, mesh)
    finally:
        parallelizer.megatron_fsdp_fully_shard_model = shard_model
    config = RecipeConfig(load_yaml_config(recipe_path)).optimizer
    assert type(config) is MegatronFSDPMuonConfig  # not swapped for dion's
    [optimizer] = config.build(model, device_mesh=mesh)

    def recipe_shards(optimizer):
        [sharded] = shard_optimizers_for_megatron_fsdp(
            model, [optimizer], distributed, allow=config.supports_megatron_fsdp_sharding)
        return sharded

    steps_match_single_device(rank, reference, model, optimizer, {},
                              f"Automodel ZeRO-{zero_dp_strategy} W={world_size}", recipe_shards)


@pytest.mark.parametrize("world_size, zero_dp_strategy", [(2, 3), (2, 1), (4, 3)])
def test_automodels_recipe_builds_ours_from_its_yaml_and_every_step_is_exact(
        distributed, tmp_path, world_size, zero_dp_strategy):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE)
    distributed(_recipe_steps_exactly, world_size, str(recipe), zero_dp_strategy)


def test_param_group_overrides_are_refused_naming_what_to_use():
    with pytest.raises(ValueError, match="optimizer.muon and optimizer.adamw"):
        MegatronFSDPMuonConfig(param_group_overrides=[{"pattern": "bias", "lr_mult": 0.1}])
