"""Muon on Megatron-FSDP through Megatron-Bridge's recipes and training loop (megatron-muon[bridge]).

    import megatron_muon.bridge                  # before megatron.bridge, on a machine without CUDA
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    cfg = recipe()                                # any ConfigContainer
    cfg.optimizer.optimizer = "muon"
    cfg.ddp.use_megatron_fsdp = True
    megatron_muon.bridge.install(cfg)            # validates; Bridge then builds our Muon
    pretrain(cfg, forward_step)

Bridge runs neither megatron.training's argument validation nor its optimizer factory: it builds
the optimizer through the config's `provide()` (Bridge's setup_optimizer). `install(cfg)` checks
the ConfigContainer against integrations.rules (each refusal naming Bridge's field), makes
`cfg.optimizer` a MuonOptimizerConfig (its `provide()` builds ours for Muon on Megatron-FSDP,
megatron-core's otherwise), makes Bridge's MuonClip ours (its train step's `clip_qk(model)` would
clip the whole weights again after our in-step clip of the sharded main weights), loads checkpoints
across Megatron DDP and Megatron-FSDP, and without CUDA applies the CPU layer for Bridge
(cpu.training_compat).
"""

import dataclasses
import inspect
import os
import warnings
from pathlib import Path

from ..chain import qk_clip
from ..chain.model_chunks import find_megatron_fsdp
from ..checkpoint import checksums, direction
from ..compat import upstream
from ..core.zero_adaptive_muon import check_adaptive_settings
from ..cpu import training_compat
from ..fixes import upstream_fixes
from ..integrations import factory, rules
from ..integrations.arguments import asks_for_ours, takes_dist_muon, taking_dist_muon
from ..integrations.muon_settings import MuonSettings
from ..integrations.run_state import RunState, training_log_then

# Where users, and the configs Bridge saves, name this module's classes (megatron_muon/bridge.py).
PUBLIC_MODULE = "megatron_muon.bridge"

training_compat.stand_in_for_gpu_only_imports()  # before anything imports megatron.bridge
upstream.import_bridge()

import megatron.bridge.training.initialize  # noqa: E402  (after the stand-ins)
import megatron.bridge.training.train  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.bridge.training.checkpointing import (CheckpointType,  # noqa: E402
                                                    DefaultCheckpointManager)
from megatron.bridge.training.config import OptimizerConfig  # noqa: E402
from megatron.bridge.training.mixed_precision import get_mixed_precision_config  # noqa: E402
from megatron.bridge.training.utils.checkpoint_utils import get_checkpoint_name  # noqa: E402
from megatron.bridge.utils.instantiate_utils import register_allowed_target_prefix  # noqa: E402

_megatron_clip_qk = megatron.bridge.training.train.clip_qk
_bridge_training_log = megatron.bridge.training.train.training_log
_bridge_load_base_checkpoint = upstream.current(
    "megatron.bridge.training.checkpointing._load_base_checkpoint")
_LOAD_BASE_CHECKPOINT_PARAMETERS = inspect.signature(_bridge_load_base_checkpoint)
_RUN = RunState()


@dataclasses.dataclass(kw_only=True)
class MuonOptimizerConfig(OptimizerConfig):
    """Bridge's OptimizerConfig plus megatron-muon's settings (its flags'), built by Bridge through
    `provide()`: Muon on Megatron-FSDP is ours, everything else megatron-core's, as Bridge's
    setup_optimizer would build it."""

    muon_dist_mode: str = MuonSettings.dist_mode
    """ZeROTensorParallelMuon's dist_mode: "owner" or "allgather" (--muon-dist-mode)."""

    muon_owner_choice: str = MuonSettings.owner_choice
    """How owner mode picks owners: "time" (estimated step time, rates measured at
    construction) or "bytes" (fewest bytes first) (--muon-owner-choice)."""

    muon_max_consecutive_skipped_steps: int = MuonSettings.max_consecutive_skipped_steps
    """Stop after this many steps in a row skipped for non-finite gradients; 0: never."""

    muon_check_interval: int = MuonSettings.check_interval
    """Every this many steps, compare each Muon update with the whole-matrix reference
    (ZeROTensorParallelMuon's check_interval); 0: never."""

    muon_max_exchange_bytes: int | None = MuonSettings.max_exchange_bytes
    """The most the owner step's working memory holds at once on a rank, in bytes
    (--muon-max-exchange-bytes; ZeROTensorParallelMuon's max_exchange_bytes); None: what Muon's
    state saves a rank against Adam's."""

    muon_use_syrk: bool = MuonSettings.use_syrk
    """Newton-Schulz through emerging-optimizers' Triton SYRK kernel (--muon-use-syrk;
    ZeROTensorParallelMuon's use_syrk): CUDA, bf16 (muon_fp32_matmul_prec "medium")."""

    muon_gram_newton_schulz: bool = MuonSettings.gram_newton_schulz
    """Gram Newton-Schulz on each matrix whole on its owner whose shape it costs fewer FLOPs for
    (--muon-gram-newton-schulz; ZeROTensorParallelMuon's gram_newton_schulz)."""

    muon_gram_restarts: tuple[int, ...] = MuonSettings.gram_restarts
    """The iterations at which Gram Newton-Schulz restarts from the long side
    (--muon-gram-restarts; ZeROTensorParallelMuon's gram_restarts)."""

    muon_max_team_size: int = MuonSettings.max_team_size
    """A matrix whose Newton-Schulz alone exceeds its share may be split over a team of up to this
    many ranks (--muon-max-team-size; ZeROTensorParallelMuon's max_team_size); 1: never."""

    muon_gather_inside_backward: bool = MuonSettings.gather_inside_backward
    """Each exchange's momentum and gradient rows sent to their owners during backward, the
    owners forming the update (--muon-gather-inside-backward; docs/design.md)."""

    def provide(self, model_chunks, config_overrides=None, use_gloo_process_groups=False,
                pg_collection=None):
        chunks = model_chunks if isinstance(model_chunks, list) else [model_chunks]
        optimizer = factory.get_megatron_optimizer(
            self, chunks, config_overrides=config_overrides,
            use_gloo_process_groups=use_gloo_process_groups, pg_collection=pg_collection,
            **MuonSettings.of(self).factory_arguments())
        _RUN.built(optimizer, getattr(_RUN.bridge_logger, "tensorboard_dir", None))
        return optimizer


class ChecksummedCheckpointManager(DefaultCheckpointManager):
    """Bridge's own checkpoint manager plus megatron-muon's checksums (checkpoint.checksums):
    after a persistent, synchronous save each rank records its files' sizes and CRC-32s; before a
    load the checkpoint Bridge will read (its own choice of it) is verified on every rank, and a
    damaged file stops the run, named, before anything is read. install() makes it Bridge's
    manager (cfg.checkpoint.custom_manager_class) for Muon on Megatron-FSDP in fsdp_dtensor."""

    def save(self, ctx, callback_manager) -> None:
        super().save(ctx, callback_manager)
        config = self.checkpoint_config
        if not ctx.non_persistent_ckpt and not config.async_save:
            checksums.record_on_every_rank(
                Path(get_checkpoint_name(config.save, ctx.state.train_state.step)))

    def load(self, ctx):
        config = self.checkpoint_config
        if (found := _checkpoint_in(config.load, config.ckpt_step)) is not None:
            checksums.verify_on_every_rank(found[0])
        return super().load(ctx)


def _checkpoint_in(load_dir, ckpt_step) -> tuple[Path, bool] | None:
    """(the checkpoint Bridge's load reads in `load_dir`, by Bridge's own choice of iteration;
    whether it is a release checkpoint, which has no iteration), or None where there is none."""
    iteration, release = (upstream.resolve_checkpoint_iteration(load_dir, ckpt_step)
                          if load_dir else (-1, False))
    if iteration == upstream.DIRECT_ITERATION_DIR:
        return Path(load_dir), False
    found = iteration >= 0 or release
    return (Path(get_checkpoint_name(load_dir, iteration, release)), release) if found else None


def _load_base_checkpoint(*args, **kwargs):
    """Bridge's (which asserts the formats match, after the build), but across formats as
    megatron_muon.training's --load (checkpoint.direction). A Megatron DDP checkpoint's rank-0
    read is Bridge's own."""
    bound = _LOAD_BASE_CHECKPOINT_PARAMETERS.bind(*args, **kwargs).arguments
    cfg, config, rank0 = bound.get("cfg"), bound["ckpt_cfg"], bound.get("rank0")
    found = _checkpoint_in(bound["load_dir"],
                           None if bound.get("ignore_ckpt_step") else config.ckpt_step)
    if cfg is None or found is None:
        return _bridge_load_base_checkpoint(*args, **kwargs)
    checkpoint, release = found
    crossing = direction.crossing(checkpoint, muon_on_megatron_fsdp=muon_on_megatron_fsdp(cfg),
                                  megatron_fsdp=_megatron_fsdp(cfg),
                                  ckpt_format=config.ckpt_format)
    if crossing is None or (rank0 and crossing is direction.Direction.FROM_MEGATRON_DDP):
        return _bridge_load_base_checkpoint(*args, **kwargs)
    if rank0:
        state = direction.read_before_the_load(crossing, checkpoint)
    else:
        _log(f"loading {crossing.says(checkpoint)}")
        state = direction.load(crossing, checkpoint, bound["sharded_state_dict"],
                               cfg.model.num_moe_experts)
    return state, str(checkpoint), release, CheckpointType[crossing.value]


def _megatron_fsdp(cfg) -> bool:
    return cfg.ddp.use_megatron_fsdp or cfg.dist.use_megatron_fsdp


def muon_on_megatron_fsdp(cfg) -> bool:
    """Whether a ConfigContainer asks for what megatron_muon provides (arguments.asks_for_ours)."""
    return asks_for_ours(cfg.optimizer.optimizer, _megatron_fsdp(cfg))


def install(cfg) -> None:
    """Check `cfg` (a Bridge ConfigContainer) and have Bridge build Muon on Megatron-FSDP with
    megatron_muon; raise, naming each field, before anything is built. Call before pretrain()."""
    # Bridge's Kimi K2 recipe (optimizer_utils.distributed_muon_with_cosine_annealing) names
    # megatron-core's layer-wise distributed Muon, which is for Megatron DDP.
    dist_muon = takes_dist_muon(cfg.optimizer.optimizer, _megatron_fsdp(cfg))
    muon = dist_muon or muon_on_megatron_fsdp(cfg)
    upstream_fixes.apply()  # for every optimizer, where the installed upstream needs them
    if _megatron_fsdp(cfg):
        rules.refuse(_reader(cfg), _field_name, training_loop=True, muon=muon,
                     what=("Muon on " if muon else "") + "Megatron-FSDP through Megatron-Bridge")
    if muon:
        settings = MuonSettings.of(cfg.optimizer)
        if (refusal := settings.refusal(lambda name: f"cfg.optimizer.muon_{name}")) is not None:
            raise ValueError(refusal)
        if cfg.optimizer.optimizer == "adaptive_muon":
            optimizer = cfg.optimizer
            check_adaptive_settings(
                optimizer.adaptive_muon_moment2_method, optimizer.adaptive_muon_beta2,
                optimizer.adaptive_muon_eps, settings.use_syrk)
    if dist_muon:
        cfg.optimizer.optimizer = "muon"
        _log(taking_dist_muon("cfg.optimizer.optimizer 'dist_muon' with Megatron-FSDP"))
    if not isinstance(cfg.optimizer, MuonOptimizerConfig):
        cfg.optimizer = MuonOptimizerConfig(**{
            field.name: getattr(cfg.optimizer, field.name)
            for field in dataclasses.fields(cfg.optimizer) if field.init})
    upstream.patch("megatron.bridge.training.train.clip_qk", _clip_qk)
    upstream.patch("megatron.bridge.training.train.training_log", _training_log)
    upstream.patch("megatron.bridge.training.checkpointing._load_base_checkpoint",
                   _load_base_checkpoint)
    _RUN.bridge_logger = cfg.logger
    _checksum_checkpoints(cfg)
    upstream_fixes.skip_dataset_helper_build_at(
        "megatron.bridge.training.initialize.compile_helpers")
    if training_compat.apply_bridge_compat():
        cfg.dist.distributed_backend = "gloo"  # NCCL needs GPUs


def _checksum_checkpoints(cfg) -> None:
    """ChecksummedCheckpointManager for Muon on Megatron-FSDP in fsdp_dtensor, unless the user
    brings a manager of their own (then said, once)."""
    if not (muon_on_megatron_fsdp(cfg) and cfg.checkpoint.ckpt_format == "fsdp_dtensor"):
        return
    ours = f"{PUBLIC_MODULE}.{ChecksummedCheckpointManager.__name__}"
    if cfg.checkpoint.custom_manager_class not in (None, ours):
        if not dist.is_initialized() or dist.get_rank() == 0:
            warnings.warn(f"cfg.checkpoint.custom_manager_class is "
                          f"{cfg.checkpoint.custom_manager_class}: checkpoints are saved and "
                          f"loaded without megatron-muon's checksums")
        return
    # Bridge instantiates allow-listed names only.
    register_allowed_target_prefix(f"{PUBLIC_MODULE}.")
    cfg.checkpoint.custom_manager_class = ours


def _field_name(section: str, field: str) -> str:
    return f"cfg.{section}.{field}"


def _log(message: str) -> None:
    """One line from the first rank (install runs before Bridge starts the process group)."""
    if (dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))) == 0:
        print(f"megatron-muon: {message}", flush=True)


def _reader(cfg):
    """integrations.rules' settings of a ConfigContainer. fp16 is what Bridge's mixed precision
    will set (runtime_config_update applies it to the optimizer config in pretrain)."""

    def read(section, field):
        if (section, field) == ("optimizer", "fp16") and cfg.mixed_precision is not None:
            return get_mixed_precision_config(cfg.mixed_precision).fp16
        return getattr(getattr(cfg, section), field)

    return read


def _clip_qk(model, log_max_only=False):
    """Bridge's QK-clip after the optimizer's step (chain.qk_clip.clip_qk_after_the_step), ours
    where every model chunk is Megatron-FSDP's."""
    chunks = model if isinstance(model, list) else [model]
    return qk_clip.clip_qk_after_the_step(model, log_max_only, _megatron_clip_qk,
                                          all(find_megatron_fsdp(chunk) for chunk in chunks))


def _report_beside_bridge(logged: dict) -> None:
    """After Bridge's training_log, every log interval, our step's timers and scalars where it
    logs and writes its own (step_report.log_beside_megatron)."""
    logger, state = logged["config"].logger, logged["global_state"]
    if state.train_state.step % logger.log_interval == 0:
        _RUN.log_step(state.timers, logger.timing_log_level, logger.log_timers_to_tensorboard,
                      (state.tensorboard_logger, state.wandb_logger), state.train_state.step,
                      logger.log_interval, reset=True)


_training_log = training_log_then(_bridge_training_log, _report_beside_bridge)
