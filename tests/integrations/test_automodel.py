"""NeMo Automodel's Megatron-FSDP strategy with Muon, built and stepped as Automodel's LLM recipe
(recipes/llm/train_ft.py) does: a tiny Hugging Face Llama parallelized by Automodel's
parallelize_megatron_fsdp (the standalone megatron-fsdp 0.5.0 Automodel pins), the optimizer from
a recipe YAML naming megatron_muon.front_ends.automodel.MegatronFSDPMuonConfig, then Automodel's
shard_optimizers_for_megatron_fsdp (megatron_fsdp's fully_shard_optimizer) around it; every step
bit-identical to single-device Muon + AdamW. Runs in its own venv (make test-automodel): Automodel
pins transformers and megatron-fsdp apart from the main suite's; skipped elsewhere."""

import copy
import functools
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

pytest.importorskip("nemo_automodel", reason="NeMo Automodel runs in its own venv: make "
                                             "test-automodel")

from nemo_automodel.components.checkpoint.stateful_wrappers import OptimizerState  # noqa: E402
from nemo_automodel.components.config.loader import load_yaml_config  # noqa: E402
from nemo_automodel.components.distributed.config import MegatronFSDPConfig  # noqa: E402
from nemo_automodel.components.distributed import parallelizer  # noqa: E402
from nemo_automodel.components.optim.optimizer import LRSchedulerConfig  # noqa: E402
from nemo_automodel.components.distributed.megatron_fsdp import \
    parallelize_megatron_fsdp  # noqa: E402
from nemo_automodel.recipes._dist_utils import shard_optimizers_for_megatron_fsdp  # noqa: E402
from nemo_automodel.recipes._typed_config import RecipeConfig  # noqa: E402

from megatron_muon.front_ends.automodel import MegatronFSDPMuonConfig  # noqa: E402
from test_standalone import (ADAMW, MUON, dcp_model_state_dict, resumes_exactly,  # noqa: E402
                             steps_match_single_device, tiny_hugging_face_model)

RECIPE = f"""
distributed:
  strategy: megatron_fsdp
optimizer:
  _target_: megatron_muon.front_ends.automodel.MegatronFSDPMuonConfig
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


def _recipe_built(world_size, recipe_path, zero_dp_strategy):
    """(the unsharded model as built, the model as Automodel's recipe parallelizes it, our
    optimizer built from the recipe's YAML, the recipe's next step: its
    shard_optimizers_for_megatron_fsdp, i.e. fully_shard_optimizer, on the optimizer)."""
    torch.manual_seed(0)
    model, _ = tiny_hugging_face_model("Llama")
    reference = copy.deepcopy(model)
    mesh = _mesh(world_size)
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

    return reference, model, optimizer, recipe_shards


@functools.cache
def _mesh(world_size):
    return init_device_mesh("cpu", (world_size, 1, 1), mesh_dim_names=("dp", "cp", "tp"))


def _recipe_steps_exactly(rank, world_size, recipe_path, zero_dp_strategy):
    reference, model, optimizer, recipe_shards = _recipe_built(world_size, recipe_path,
                                                               zero_dp_strategy)
    steps_match_single_device(rank, reference, model, optimizer, {},
                              f"Automodel ZeRO-{zero_dp_strategy} W={world_size}", recipe_shards)


@pytest.mark.parametrize("world_size, zero_dp_strategy", [(2, 3), (2, 1), (4, 3)])
def test_automodels_recipe_builds_ours_from_its_yaml_and_every_step_is_exact(
        distributed, tmp_path, world_size, zero_dp_strategy):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE)
    distributed(_recipe_steps_exactly, world_size, str(recipe), zero_dp_strategy)


def _recipe_schedules_both_learning_rates(rank, world_size, recipe_path):
    _, _, optimizer, _ = _recipe_built(world_size, recipe_path, 3)
    [scheduler] = LRSchedulerConfig(lr_warmup_steps=2, lr_decay_style="cosine").build(
        [optimizer], SimpleNamespace(epoch_len=None, max_steps=10, num_epochs=1))
    muon_lrs = []
    for _ in range(4):
        scheduler.step(1)
        [muon], [adamw] = (part.optimizer.param_groups for part in optimizer.chained_optimizers)
        assert adamw["lr"] / muon["lr"] == pytest.approx(ADAMW["lr"] / MUON["lr"], rel=1e-12)
        muon_lrs.append(muon["lr"])
    assert len(set(muon_lrs)) == 4 and max(muon_lrs) == pytest.approx(MUON["lr"]), muon_lrs


def test_automodels_lr_scheduler_keeps_adamws_rate_relative_to_muons(distributed, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE)
    distributed(_recipe_schedules_both_learning_rates, 2, str(recipe))


def _automodel_checkpoint(model, optimizer):
    """Automodel's checkpointer's optimizer state (OptimizerState: torch's
    get_optimizer_state_dict, flattened by parameter name) beside the model's DCP state dict."""
    optimizer_state = OptimizerState([model], [optimizer])  # per model part, as the recipe
    state = {"model": dcp_model_state_dict(model), **optimizer_state.state_dict()}

    def loaded():
        model.install_optimized_model_weights()
        optimizer_state.load_state_dict(state)  # torch's set_optimizer_state_dict

    return state, loaded


def _recipe_resumes_exactly(rank, world_size, recipe_path, path, offload):
    def build():
        _, model, optimizer, recipe_shards = _recipe_built(world_size, recipe_path, 3)
        assert all(bool(part.optimizer.host_state.params) == offload
                   for part in optimizer.chained_optimizers)
        return model, recipe_shards(optimizer)

    resumes_exactly(rank, build, _automodel_checkpoint, path, f"Automodel W={world_size}")


@pytest.mark.parametrize("world_size, offload", [(2, False), (4, True)])
def test_automodels_checkpoint_of_ours_resumes_exactly(distributed, tmp_path, world_size, offload):
    """(`offload`: the recipe's `optimizer.offload: true`, the state in host memory.)"""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE + ("  offload: true\n" if offload else ""))
    distributed(_recipe_resumes_exactly, world_size, str(recipe), str(tmp_path / "checkpoint"),
                offload)


def test_param_group_overrides_are_refused_naming_what_to_use():
    with pytest.raises(ValueError, match="optimizer.muon and optimizer.adamw"):
        MegatronFSDPMuonConfig(param_group_overrides=[{"pattern": "bias", "lr_mult": 0.1}])


def test_a_model_not_on_megatron_fsdp_is_refused_naming_the_strategy():
    """As Automodel leaves it at world size 1, or under another strategy."""
    with pytest.raises(ValueError, match="distributed.strategy: megatron_fsdp"):
        MegatronFSDPMuonConfig().build(torch.nn.Linear(4, 4))
