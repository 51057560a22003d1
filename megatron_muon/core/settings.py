"""ZeROTensorParallelMuon's settings (dist modes, owner choices, TensorParallelMuon's tp modes and
defaults) and what it refuses at construction, before any state exists: a bad setting, naming
Megatron's flag; a subclass's weight-update hook it cannot honour; a param it cannot step,
naming it."""

import inspect
import typing
from collections.abc import Sequence
from typing import Literal

from emerging_optimizers.orthogonalized_optimizers import OrthogonalizedOptimizer
from emerging_optimizers.orthogonalized_optimizers.muon import MuonScaleT
from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..compat import upstream
from ..plan import GramSchedule, gram_refusal
from ..distribution.dtensor_rows import (ParamAttributes, data_parallel_layout, num_experts,
                                         tp_local_rows)

DistMode = Literal["owner", "allgather"]
DIST_MODES = typing.get_args(DistMode)
OwnerChoice = Literal["time", "bytes"]
OWNER_CHOICES = typing.get_args(OwnerChoice)
TP_MODES = typing.get_args(
    inspect.signature(TensorParallelMuon.__init__).parameters["tp_mode"].annotation)


def tensor_parallel_muon_settings(muon_kwargs: dict) -> dict:
    """TensorParallelMuon's arguments as it takes them: `muon_kwargs` over its defaults."""
    defaults = {name: parameter.default for name, parameter
                in inspect.signature(TensorParallelMuon.__init__).parameters.items()}
    return {**defaults, **muon_kwargs}


def gram_schedule(gram_newton_schulz: bool, restarts: Sequence[int],
                  muon_kwargs: dict) -> GramSchedule | None:
    """--muon-gram-newton-schulz's schedule (None without it), over TensorParallelMuon's
    num_ns_steps; a restart outside its iterations refused, naming the flags."""
    if not gram_newton_schulz:
        return None
    schedule = GramSchedule(tensor_parallel_muon_settings(muon_kwargs)["num_ns_steps"],
                            tuple(restarts))
    if problem := gram_refusal(schedule):
        raise ValueError(f"ZeROTensorParallelMuon: {problem}")
    return schedule


def check_settings(dist_mode, owner_choice, byte_slack, max_exchange_bytes, check_interval,
                   offload_fraction, max_team_size, muon_kwargs) -> None:
    """Refuse bad settings up front (TensorParallelMuon finds some only inside the first step,
    after momentum has changed), naming Megatron's flag."""
    given = {**tensor_parallel_muon_settings(muon_kwargs), "dist_mode": dist_mode,
             "owner_choice": owner_choice,
             "byte_slack": byte_slack, "max_exchange_bytes": max_exchange_bytes,
             "check_interval": check_interval, "offload_fraction": offload_fraction,
             "max_team_size": max_team_size}
    scale_modes = typing.get_args(MuonScaleT)
    rules = [  # (setting, Megatron flag, valid?, what it must be)
        ("dist_mode", "--muon-dist-mode", lambda v: v in DIST_MODES, f"one of {DIST_MODES}"),
        ("owner_choice", "--muon-owner-choice", lambda v: v in OWNER_CHOICES,
         f"one of {OWNER_CHOICES}"),
        ("tp_mode", "--muon-tp-mode", lambda v: v in TP_MODES, f"one of {TP_MODES}"),
        ("coefficient_type", "--muon-coefficient-type", lambda v: v in upstream.COEFFICIENT_SETS,
         f"one of {tuple(sorted(upstream.COEFFICIENT_SETS))}"),
        ("scale_mode", "--muon-scale-mode", lambda v: v in scale_modes, f"one of {scale_modes}"),
        ("lr", "--lr", lambda v: v >= 0, "at least 0"),
        ("momentum", "--muon-momentum", lambda v: 0 <= v < 1, "in [0, 1)"),
        ("weight_decay", "--weight-decay", lambda v: v >= 0, "at least 0"),
        ("byte_slack", None, lambda v: v is None or v >= 0, "None or at least 0"),
        ("max_exchange_bytes", "--muon-max-exchange-bytes", lambda v: v is None or v > 0,
         "None (what Muon's state saves a rank) or positive"),
        ("check_interval", "--muon-check-interval", lambda v: v >= 0, "at least 0"),
        ("offload_fraction", "--optimizer-offload-fraction", lambda v: 0 <= v <= 1, "in [0, 1]"),
        ("max_team_size", "--muon-max-team-size", lambda v: isinstance(v, int) and v >= 1,
         "an integer, at least 1"),
    ]
    for name, flag, valid, expected in rules:
        if not valid(given[name]):
            via = f" ({flag})" if flag else ""
            raise ValueError(f"ZeROTensorParallelMuon: {name}{via} must be {expected}, "
                             f"got {given[name]!r}")
    if given["split_qkv"] and given["is_qkv_fn"] is None:
        raise ValueError("ZeROTensorParallelMuon: split_qkv (Megatron's default; "
                         "--muon-no-split-qkv turns it off) needs is_qkv_fn")


# OrthogonalizedOptimizer.step's hooks around `p -= lr * update`: they see one param whole (e.g.
# MuonHyperball rescales it to its norm), which a rank holding some rows of it cannot honour.
WEIGHT_UPDATE_HOOKS = ("pre_weight_update_fn_inplace", "post_weight_update_fn_inplace")


def check_hooks(cls) -> None:
    """Refuse, before any state exists, a subclass that overrides a weight-update hook (it would
    otherwise be dropped without a word)."""
    for hook in WEIGHT_UPDATE_HOOKS:
        if getattr(cls, hook) is not getattr(OrthogonalizedOptimizer, hook):
            raise NotImplementedError(
                f"{cls.__name__}.{hook}: ZeROTensorParallelMuon updates each rank's rows of a "
                f"matrix apart, so a weight-update hook, which sees the whole param (e.g. "
                f"MuonHyperball's norm), cannot be honoured on Megatron-FSDP's sharded main "
                f"weights; use megatron-core's optimizer with Megatron DDP for it")


def _check_param(muon, p) -> None:
    """Refuse a param the optimizer cannot step, naming it."""
    name = muon.name_of(p)
    if not isinstance(p, DTensor):
        raise TypeError(
            f"{name}: ZeROTensorParallelMuon takes Megatron-FSDP's DTensor main weights, got a "
            f"{type(p).__name__}; wrap the model with Megatron-FSDP (fully_shard_model or "
            f"FullyShardedDataParallel) before building the optimizer")
    if any(not isinstance(pl, (Shard, Replicate)) for pl in p.placements):
        raise ValueError(f"{name}: unsupported DTensor placements {p.placements}")
    experts = num_experts(p)
    if p.dim() != 2 and not (p.dim() == 3 and p.shape[0] == experts):
        raise ValueError(f"{name}: Muon orthogonalizes 2-D matrices (or stacks of "
                         f"num_stacked_experts expert matrices); got shape {tuple(p.shape)}")
    if tp_local_rows(p) % experts:
        raise ValueError(f"{name}: num_stacked_experts={experts} does not divide its rows")
    attrs = ParamAttributes(p)
    tp_group = muon.tp_group_of(attrs)
    if experts > 1 and tp_group is not None and tp_group.size() > 1:
        raise NotImplementedError(f"{name}: stacked expert weights with expert tensor parallelism")
    if muon.splits_qkv(attrs):
        shapes = getattr(attrs, "qkv_split_shapes", None) or muon.qkv_split_shapes
        if not shapes or tp_local_rows(p) % sum(shapes):
            raise ValueError(
                f"{name}: split_qkv (Megatron's default) needs q/k/v row counts that tile its "
                f"{tp_local_rows(p)} rows, got qkv_split_shapes={shapes}; pass "
                f"--muon-no-split-qkv if the model has no fused QKV weight")


def _check_teams(muon) -> None:
    """Refuse teams (max_team_size > 1) beside what they do not run with yet, naming the flags:
    a team's blocks are orthogonalized in owner mode's exchange, plainly."""
    if muon.max_team_size == 1:
        return
    beside = [flag for flag, on in (
        ("--muon-dist-mode allgather", muon.dist_mode != "owner"),
        ("--muon-use-syrk", muon.use_syrk),
        ("--optimizer adaptive_muon", muon.second_moment is not None)) if on]
    if beside:
        raise ValueError(f"ZeROTensorParallelMuon: --muon-max-team-size "
                         f"{muon.max_team_size} does not run with {', '.join(beside)} yet; "
                         f"leave it at 1 (every matrix whole on one owner)")


def check_params(muon) -> None:
    """Refuse, before any state, teams beside what they do not run with, a param it cannot
    step, or a group mixing layouts."""
    _check_teams(muon)
    for group in muon.param_groups:
        for p in group["params"]:
            _check_param(muon, p)
        meshes = {data_parallel_layout(p): p for p in group["params"]}
        if len(meshes) > 1:
            (a, first), (b, second) = list(meshes.items())[:2]
            raise ValueError(
                f"one param group mixes data-parallel layouts: {muon.name_of(first)} {a} and "
                f"{muon.name_of(second)} {b}; put dense and expert params in separate groups")
