"""get_megatron_optimizer with megatron-core's signature: Muon on Megatron-FSDP builds ours,
every other request goes to megatron-core unchanged."""

import copy

import torch
from megatron.core.optimizer import ChainedOptimizer, FP32Optimizer
from megatron.core.optimizer import get_megatron_optimizer as _core_get_megatron_optimizer
from megatron.core.optimizer import get_standard_config_overrides
from megatron.core.optimizer.optimizer_config import ParamKey, ParamPredicate
from megatron.core.process_groups_config import ProcessGroupCollection

from ..chain import backward_gather
from ..chain.chained import FSDPMuonChainedOptimizer
from ..chain.model_chunks import find_megatron_fsdp
from ..chain.qk_clip import build_max_attention_logits
from ..compat import upstream
from ..core.state_offload import offload_between_steps
from ..core.zero_adaptive_muon import ZeROTensorParallelAdaptiveMuon
from ..core.zero_muon import ZeROTensorParallelMuon
from ..fixes import upstream_fixes
from ..planner.interleaving import interleave
from ..planner.param_tags import is_scalar_param, tag_params
from . import rules
from .arguments import FSDP_OPTIMIZERS
from .muon_settings import MuonSettings

# What steps each of arguments.FSDP_OPTIMIZERS on Megatron-FSDP.
MUON_CLASSES = {"muon": ZeROTensorParallelMuon, "adaptive_muon": ZeROTensorParallelAdaptiveMuon}


def get_megatron_optimizer(config, model_chunks, config_overrides=None, use_gloo_process_groups=True,
                           pg_collection=None, dump_param_to_param_group_map=None,
                           muon_dist_mode=MuonSettings.dist_mode,
                           muon_max_consecutive_skipped_steps=(
                               MuonSettings.max_consecutive_skipped_steps),
                           muon_check_interval=MuonSettings.check_interval,
                           muon_owner_choice=MuonSettings.owner_choice,
                           muon_max_exchange_bytes=MuonSettings.max_exchange_bytes,
                           muon_use_syrk=MuonSettings.use_syrk,
                           muon_gram_newton_schulz=MuonSettings.gram_newton_schulz,
                           muon_gram_restarts=MuonSettings.gram_restarts,
                           muon_max_team_size=MuonSettings.max_team_size,
                           muon_gather_inside_backward=MuonSettings.gather_inside_backward):
    """megatron-core's `get_megatron_optimizer`, plus `optimizer='muon'` (ZeROTensorParallelMuon)
    and `optimizer='adaptive_muon'` (ZeROTensorParallelAdaptiveMuon) on Megatron-FSDP chunks.

    The `muon_*` arguments (each --muon-* flag's value; megatron_muon.arguments gives the flags):
    - `muon_dist_mode`: ZeROTensorParallelMuon's `dist_mode`, "owner" (each matrix's
      Newton-Schulz on one owner rank, rows exchanged) or "allgather" (every rank gathers every
      matrix whole);
    - `muon_owner_choice`: its `owner_choice`, "time" (owners by the step's estimated time, from
      rates measured at construction) or "bytes" (by the bytes each rank receives);
    - `muon_check_interval`: its `check_interval`, every how many steps the owners' updates are
      also computed whole and compared (0: never);
    - `muon_max_exchange_bytes`: its `max_exchange_bytes`, each rank's budget for one exchange's
      buffers;
    - `muon_max_team_size`: its `max_team_size`, how many ranks a matrix too large for one may
      be split over (1: none);
    - `muon_use_syrk`: its `use_syrk`, Newton-Schulz through emerging-optimizers' SYRK kernel
      (also on with `OptimizerConfig.muon_use_syrk`, where megatron-core has it);
    - `muon_gram_newton_schulz`, `muon_gram_restarts`: its `gram_newton_schulz` and
      `gram_restarts`, Gram Newton-Schulz where it costs fewer FLOPs and its restarts;
    - `muon_max_consecutive_skipped_steps`: FSDPMuonChainedOptimizer's limit on steps skipped
      in a row for a non-finite gradient before the run stops;
    - `muon_gather_inside_backward`: FSDPMuonChainedOptimizer's `gather_inside_backward`, the
      exchanges' rows sent to their owners during backward (chain.backward_gather)."""
    upstream_fixes.apply()  # for every optimizer, where the installed upstream needs them
    fsdp_modules = [find_megatron_fsdp(chunk) for chunk in model_chunks]
    ours = config.optimizer in FSDP_OPTIMIZERS and all(fsdp_modules)
    if ours:
        muon = "Muon" if config.optimizer == "muon" else "Adaptive Muon"
        rules.refuse(_config_field(config, model_chunks), _config_field_name,
                     training_loop=False, what=f"{muon} on Megatron-FSDP")
    upstream_fixes.average_hfsdp_gradients(module for module in fsdp_modules if module)
    if not ours:
        return _core_get_megatron_optimizer(
            config, model_chunks, config_overrides=config_overrides,
            use_gloo_process_groups=use_gloo_process_groups, pg_collection=pg_collection,
            dump_param_to_param_group_map=dump_param_to_param_group_map)
    # No part is a DistributedOptimizer, so no gloo groups are needed.
    process_groups = ProcessGroupCollection.setup_process_groups_for_optimizer(
        pg_collection, model_chunks, use_gloo_process_groups=False)
    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    parts = _build_parts(config, model_chunks, config_overrides, process_groups, pg_collection,
                         dict(dist_mode=muon_dist_mode, owner_choice=muon_owner_choice,
                              check_interval=muon_check_interval,
                              max_exchange_bytes=muon_max_exchange_bytes, use_syrk=muon_use_syrk,
                              max_team_size=muon_max_team_size,
                              gram_newton_schulz=muon_gram_newton_schulz,
                              gram_restarts=tuple(muon_gram_restarts),
                              offload_fraction=_offload_fraction(config)),
                         fsdp_modules if muon_gather_inside_backward else None)
    if config.optimizer_cpu_offload:
        _say_what_is_offloaded(parts, config.optimizer_offload_fraction)
    max_attention_logits = build_max_attention_logits(
        model_chunks, pg_collection.dp_cp, _held_rows_in(parts))
    chain = FSDPMuonChainedOptimizer(ChainedOptimizer(parts), model_chunks,
                                     muon_max_consecutive_skipped_steps, max_attention_logits,
                                     gather_inside_backward=muon_gather_inside_backward)
    if chain.backward_gather:
        chain.backward_gather.say()
    return chain


# The config class that holds each section of integrations.rules' settings, as users name them.
_CONFIG_CLASSES = {"optimizer": "OptimizerConfig", "ddp": "DistributedDataParallelConfig",
                   "model": "TransformerConfig"}


def _config_field(config, model_chunks):
    """integrations.rules' settings of a factory call: the OptimizerConfig, and the first
    chunk's DDP and transformer configs (AttributeError where there is none)."""
    sections = {"optimizer": lambda: config, "ddp": lambda: model_chunks[0].ddp_config,
                "model": lambda: model_chunks[0].config}

    def read(section, field):
        if section not in sections:
            raise AttributeError(f"the factory has no {field}")
        return getattr(sections[section](), field)

    return read


def _config_field_name(section, field):
    return f"{_CONFIG_CLASSES.get(section, section)}.{field}"


def _offload_fraction(config) -> float:
    """The share of the state in host memory: OptimizerConfig.optimizer_offload_fraction under
    optimizer_cpu_offload, as megatron-core's HybridDeviceOptimizer reads them; else none."""
    return config.optimizer_offload_fraction if config.optimizer_cpu_offload else 0.0


def _say_what_is_offloaded(parts, fraction: float) -> None:
    """One line on rank 0: how many params' state each part keeps in host memory (a fraction of
    0, megatron-core's OptimizerConfig default, keeps none: the line says so)."""
    if torch.distributed.get_rank() != 0:
        return
    counts = [f"{len(part.optimizer.host_state.params)} of "
              f"{sum(len(group['params']) for group in part.optimizer.param_groups)} "
              f"{_part_name(part)} params" for part in parts]
    print(f"megatron-muon: optimizer_cpu_offload with optimizer_offload_fraction {fraction}: the "
          f"state of {', '.join(counts)} in host memory between steps", flush=True)


def _part_name(part) -> str:
    if isinstance(part.optimizer, ZeROTensorParallelMuon):
        return "Muon"
    return type(part.optimizer).__name__


def _held_rows_in(parts):
    """ZeROTensorParallelMuon.held_rows of whichever Muon part steps a main weight (KeyError if
    none does)."""
    muons = [part.optimizer for part in parts if isinstance(part.optimizer, ZeROTensorParallelMuon)]

    def held_rows(main_weight):
        for muon in muons:
            try:
                return muon.held_rows(main_weight)
            except KeyError:
                pass
        raise KeyError(main_weight)

    return held_rows


def _muon_overrides(config, config_overrides):
    """The caller's overrides plus Muon's own: non-matrix and embedding params go to the scalar
    optimizer (`muon_scalar_optimizer`)."""
    overrides = dict(get_standard_config_overrides(config) if config_overrides is None
                     else config_overrides)
    for key in upstream.EMERGING_OPTIMIZERS[config.optimizer].default_param_overrides:
        overrides.pop(key, None)
    scalar = ParamKey(predicate=ParamPredicate(name="muon_scalar_param", fn=is_scalar_param))
    overrides[scalar] = {"optimizer": config.muon_scalar_optimizer}
    return overrides


def _foreach_over_dtensors(optimizer) -> None:
    """torch's Adam and AdamW steps, where the caller chose no implementation, as one foreach
    call per op over all params, on every device: torch picks foreach for CUDA params only
    (`_default_to_fused_or_foreach`), and its per-param loop on the DTensor main weights pays one
    DTensor dispatch per op per param (on CPU a rank holding 35 small shards of the demo took 30 ms
    where its peer took 2; bit-identical results)."""
    if isinstance(optimizer, torch.optim.Adam):  # AdamW too
        for group in optimizer.param_groups:
            if group.get("foreach") is None and not group.get("fused"):
                group["foreach"] = True


def _build_parts(config, model_chunks, config_overrides, process_groups, pg_collection,
                 muon_settings, gathering_inside=None):
    """The chain's parts: Muon and the scalar optimizer, dense and expert, each Muon part planned
    (and the two interleaved where they can be). `gathering_inside`: the Megatron-FSDP modules
    under --muon-gather-inside-backward, whose Muon parts that can gather so are packed for it
    (chain.backward_gather.reasons)."""
    tag_params(model_chunks)
    groups = upstream.get_param_groups(model_chunks, config,
                                       _muon_overrides(config, config_overrides))
    ddp_config = model_chunks[0].ddp_config
    # Replicated grads (no_shard) are norm-reduced over model parallelism only, sharded ones over
    # one optimizer instance, as megatron-core's Megatron-FSDP path does; HFSDP shards across the
    # instances too, so there every rank holds its own rows.
    if ddp_config.data_parallel_sharding_strategy == "no_shard":
        grad_stats_group = process_groups["mp_group"]
    elif (ddp_config.num_distributed_optimizer_instances > 1
          and ddp_config.outer_dp_sharding_strategy != "no_shard"):
        grad_stats_group = torch.distributed.group.WORLD
    else:
        grad_stats_group = process_groups["intra_dist_opt_group"]
    # Megatron-FSDP's main weights already are fp32 and it installs them into the model itself:
    # the parts step them in place with no precision wrapper and no distributed optimizer.
    part_config = copy.copy(config)
    part_config.bf16 = False
    part_config.use_distributed_optimizer = False
    # The scalar part's state goes to host memory as Muon's does (offload_between_steps), so that
    # it steps where and as it steps without offload; megatron-core's HybridDeviceOptimizer would
    # step it on the host.
    part_config.optimizer_cpu_offload = False

    names = {p: name for chunk in model_chunks for name, p in chunk.named_parameters()}
    parts = []
    for is_expert in (False, True):
        for optimizer_name in ("muon", config.muon_scalar_optimizer):
            selected = [g for g in groups if g["is_expert_parallel"] == is_expert
                        and g.get("optimizer", "muon") == optimizer_name]
            if not selected:
                continue
            if optimizer_name == "muon":
                dp_group = pg_collection.expt_dp if is_expert else pg_collection.dp_cp
                if dp_group is None:
                    first = names[selected[0]["params"][0]]
                    raise ValueError(f"{first} and the other expert matrices need an expert "
                                     "data-parallel group, but pg_collection.expt_dp is None")
                # megatron-core's own reading of the config (the moment2 fields for adaptive_muon)
                muon_kwargs = upstream.EMERGING_OPTIMIZERS[config.optimizer].config_to_kwargs(
                    config, model_chunks, pg_collection)
                config_syrk = muon_kwargs.pop("use_syrk", False)  # megatron-core main's
                settings = {**muon_settings, "use_syrk": muon_settings["use_syrk"] or config_syrk}
                muon = MUON_CLASSES[config.optimizer](selected, dp_group=dp_group,
                                                      param_names=names, **settings, **muon_kwargs)
                part = FP32Optimizer(muon, part_config, upstream.eopt_init_state_fn)
            else:
                scalar_config = copy.copy(part_config)
                scalar_config.optimizer = optimizer_name
                part = upstream.get_megatron_optimizer_based_on_param_groups(
                    config=scalar_config, model_chunks=model_chunks, param_groups=selected,
                    pg_collection=pg_collection)
                _foreach_over_dtensors(part.optimizer)
                part.optimizer.host_state = offload_between_steps(
                    part.optimizer, muon_settings["offload_fraction"])
            part.config = config  # ChainedOptimizer expects one config across its parts
            part.grad_stats_parallel_group = grad_stats_group
            part.tp_group = pg_collection.tp
            part.expert_tp_group = getattr(pg_collection, "expt_tp", pg_collection.tp)
            parts.append(part)
    # The dense part before the expert part, as Megatron's chain steps them; planned and stepped
    # together where memory allows.
    muons = [part.optimizer for part in parts if isinstance(part.optimizer, ZeROTensorParallelMuon)]
    for muon in muons if gathering_inside is not None else ():
        muon.planner.ahead = not backward_gather.reasons(muon, gathering_inside)
        if muon.planner.ahead and len(muons) == 1:
            muon.plans = muon.planner.packed()  # interleave packs both parts again below
    if len(muons) == 2:
        interleave(*muons)
    return parts
