"""Muon on Megatron-FSDP's sharded main weights (ZeRO-1/2/3, HSDP), exact and TP-aware."""

import inspect
import math
import statistics
import typing
from collections import Counter
from functools import partial
from typing import Any, Literal

import torch
import torch.distributed as dist
from emerging_optimizers import utils as eo_utils
from emerging_optimizers.orthogonalized_optimizers import OrthogonalizedOptimizer
from emerging_optimizers.orthogonalized_optimizers.muon import MuonScaleT
from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import syrk, upstream
from .checks import CheckResult, MuonCheckError, agree_on_every_rank, data_parallel_dims
from .exchange import OwnerRoutes, all_gather_ints, all_gather_rows, owner_exchange, run_overlapped
from .measured_cost import measure, seconds_beyond_noise
from .muon_math import momentum_update_
from .plan import (MAX_EXCHANGE_BYTES, Matrix, RowLayout, StepCost, affordable_bytes,
                   batch_matrices, cost_key, orthogonalization_key, owner_bytes, owner_plan,
                   per_exchange_bytes, qkv_row_blocks, row_layouts, split_matrices)

DistMode = Literal["owner", "allgather"]
DIST_MODES = typing.get_args(DistMode)
OwnerChoice = Literal["time", "bytes"]
OWNER_CHOICES = typing.get_args(OwnerChoice)
# Measured batched Newton-Schulz must take at most this share of the per-matrix calls' time to be
# chosen at fp32 `highest`: a near tie is noise (on this project's CPU 256x1024 batched by 2 took
# 1.02x the per-matrix calls' time in one measurement, and was measured faster in another), and
# per-matrix calls are megatron-core's own.
BATCHED_MUST_SAVE = 0.9
TP_MODES = typing.get_args(inspect.signature(TensorParallelMuon.__init__).parameters["tp_mode"].annotation)


def _shard_index(p: DTensor) -> int:
    """Which row shard of `p` this rank holds, from its mesh coordinate. Rows follow
    megatron_fsdp's chunk order (uneven_dtensor): the shard dim it visits first is the least
    significant. Replicas (no_shard, HSDP's outer dim) hold the same shard."""
    mesh, coordinate = p.device_mesh, p.device_mesh.get_coordinate()
    shard_order = upstream.mesh_shard_order(mesh) or range(mesh.ndim - 1, -1, -1)
    dp_dims = data_parallel_dims(p)
    shard, stride = 0, 1
    for dim in reversed(shard_order):
        if dim in dp_dims and p.placements[dim] == Shard(0):
            shard, stride = shard + coordinate[dim] * stride, stride * mesh.size(dim)
    return shard


def _tp_local_rows(p: DTensor) -> int:
    """Rows of the 2-D matrix (3-D stacks: one row per last-dim vector) the data-parallel
    shards tile: the TP-local matrix when TP splits dim 0."""
    rows, dp_dims = p.shape[0], data_parallel_dims(p)
    for mesh_dim, placement in enumerate(p.placements):
        if placement == Shard(0) and mesh_dim not in dp_dims:
            rows //= p.device_mesh.size(mesh_dim)
    return rows * math.prod(p.shape[1:-1])


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D view of a local shard (a stack of expert matrices becomes their rows)."""
    return t.view(-1, t.shape[-1])


def _with_defaults(muon_kwargs: dict) -> dict:
    """TensorParallelMuon's arguments as it takes them: `muon_kwargs` over its defaults."""
    defaults = {name: parameter.default for name, parameter
                in inspect.signature(TensorParallelMuon.__init__).parameters.items()}
    return {**defaults, **muon_kwargs}


def _check_settings(dist_mode, owner_choice, byte_slack, max_exchange_bytes, check_interval,
                    muon_kwargs) -> None:
    """Refuse bad settings up front (TensorParallelMuon finds some only inside the first step,
    after momentum has changed), naming Megatron's flag."""
    given = {**_with_defaults(muon_kwargs), "dist_mode": dist_mode, "owner_choice": owner_choice,
             "byte_slack": byte_slack, "max_exchange_bytes": max_exchange_bytes,
             "check_interval": check_interval}
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


def _check_hooks(cls) -> None:
    """Refuse, before any state exists, a subclass that overrides a weight-update hook (it would
    otherwise be dropped without a word)."""
    for hook in WEIGHT_UPDATE_HOOKS:
        if getattr(cls, hook) is not getattr(OrthogonalizedOptimizer, hook):
            raise NotImplementedError(
                f"{cls.__name__}.{hook}: ZeROTensorParallelMuon updates each rank's rows of a "
                f"matrix apart, so a weight-update hook, which sees the whole param (e.g. "
                f"MuonHyperball's norm), cannot be honoured on Megatron-FSDP's sharded main "
                f"weights; use megatron-core's optimizer with Megatron DDP for it")


class _ParamAttributes:
    """Megatron's tags (is_qkv, partition_dim, expert_tp, ...) of a main-weight param: its own,
    else those of the model param Megatron-FSDP made it from."""

    def __init__(self, param):
        self._param = param

    def __getattr__(self, name):
        try:
            return getattr(self._param, name)
        except AttributeError:
            return getattr(self._param.orig_param, name)


class GroupPlan:
    """The matrices of one exchange group, fixed at construction: one per param, or one per
    expert of a stacked expert weight; where this rank's rows of each sit in its param's local
    shard; their owners, this rank's routes through the exchanges that carry their batches, and
    the working-memory budget they were planned within, and the measured StepCost the owners
    were chosen by (None: byte-first, or no owners)."""

    def __init__(self, params, matrices, pieces, owners, exchanges, group, budget, cost=None):
        self.params, self.matrices, self.pieces, self.owners = params, matrices, pieces, owners
        self.group, self.budget, self.cost = group, budget, cost
        self.rank = dist.get_rank(group)
        self.routes = [OwnerRoutes(matrices, owners, batches, self.rank) for batches in exchanges]

    def param_of(self, i: int):
        return self.params[self.pieces[i][0]]

    def rows_of(self, i: int, local: torch.Tensor) -> torch.Tensor:
        """This rank's rows of matrix i within `local`, its param's local shard (or a tensor
        shaped like it)."""
        _, lo, hi = self.pieces[i]
        return _as_rows(local)[lo:hi]


class ZeROTensorParallelMuon(TensorParallelMuon):
    """megatron-core's TensorParallelMuon for Megatron-FSDP main weights.

    Params are `nn.Parameter(DTensor)` whose rows are sharded unevenly (`Shard(0)`, a rank may
    hold none), replicated (`no_shard`), or both (HSDP: shards inside a replica). Momentum and
    weight decay run on the local rows; each momentum update is assembled into its full matrix
    and run through TensorParallelMuon's orthogonalize (TP Newton-Schulz, QKV split, scale
    modes); each rank applies its own rows. A param tagged `num_stacked_experts = E` (a grouped
    GEMM's experts stacked along dim 0, 2-D fused or 3-D) is E matrices, orthogonalized apart.

    Args:
        dp_group: the data-parallel group the params are sharded and replicated over (all of
            it: shards and replicas); by default the group of the param's data-parallel mesh dims.
        dist_mode: "owner" (default) assembles each matrix on one owner, which alone runs its
            Newton-Schulz and sends the result rows to the ranks holding them (replicas too);
            "allgather" assembles every matrix on every rank (each rank repeats all
            Newton-Schulz work; kept as the reference).
        owner_choice: how owner mode picks each matrix's owner. "time" (default): for the
            shortest estimated step, Newton-Schulz time and bytes over the bandwidth counted
            (plan.choose_owners_by_time), with rates measured here at construction
            (measured_cost: each shape's Newton-Schulz call as the step makes it, and one
            all-to-all; the median of every rank's samples); "bytes": fewest bytes first,
            Newton-Schulz FLOPs balanced within `byte_slack` (plan.choose_owners; what "time"
            falls back to where it would not stay faster with Newton-Schulz or bytes dearer by
            the measured figures' spread). At fp32 `highest` owners change no result bit, only
            where work runs (docs/design.md: what they mean at bf16).
        byte_slack: the cap on the bytes owner mode moves beyond the layout's minimum, as a
            fraction of it (None, the default: no cap under "time", where bytes are priced at
            the measured bandwidth; plan.BYTE_SLACK under "bytes").
        max_exchange_bytes: the most the owner step's working memory may hold at once on a rank
            (--muon-max-exchange-bytes): the update rows, exchange buffers, assembled matrices,
            results and Newton-Schulz of the two exchanges in flight (one is gathered while the
            previous one computes), as plan.working_memory counts them. Same-shape matrices are
            orthogonalized together and consecutive batches exchanged together (one collective
            per direction) within half of it each; a matrix that alone needs more goes alone,
            and rank 0 says so once at construction. None (the default): per exchange group,
            what Muon's state saves the rank that saves least against Adam's
            (plan.affordable_bytes), so that the step never holds more than Adam's state would.
            "allgather" mode and a checked step hold every update at once, beyond it.
        use_syrk: Newton-Schulz through emerging_optimizers' Triton SYRK kernel
            (--muon-use-syrk; megatron_muon.syrk says where it runs): CUDA, bf16 (`medium`),
            each matrix in its own call (the kernel takes no batch); refused at construction
            where it cannot run.
        param_names: {param: name}, for error messages.
        check_interval: every this many iterations (0: never), owner mode also computes every
            matrix's update as "allgather" does and compares what the owners sent back with it
            before anything is applied; above the bound (0 with fp32 `highest` Newton-Schulz,
            else the reference's own distance from fp32 Newton-Schulz) it restores its params
            and momentum and raises on every rank, naming the matrix. Off, it costs nothing.
            `iteration` counts its steps; FSDPMuonChainedOptimizer sets it to Megatron's
            iteration (skipped steps count) and logs the check with its own.
        **kwargs: TensorParallelMuon's arguments.

    Every setting and param is checked at construction, before any state exists; an error names
    the setting (or Megatron flag) and the param.
    """

    def __init__(self, params, *, dp_group=None, dist_mode: DistMode = "owner",
                 owner_choice: OwnerChoice = "time", byte_slack: float | None = None,
                 max_exchange_bytes: int | None = MAX_EXCHANGE_BYTES,
                 param_names: dict | None = None,
                 check_interval: int = 0, use_syrk: bool = False, **kwargs: Any):
        _check_settings(dist_mode, owner_choice, byte_slack, max_exchange_bytes, check_interval,
                        kwargs)
        _check_hooks(type(self))
        upstream_runs_syrk = use_syrk and upstream.tensor_parallel_muon_takes_syrk()
        super().__init__(params, **kwargs, **({"use_syrk": True} if upstream_runs_syrk else {}))
        self.use_syrk = use_syrk
        self.dp_group = dp_group
        self.dist_mode = dist_mode
        self.owner_choice = owner_choice
        self.check_interval = check_interval
        self.iteration = 0
        self.log_checks = True  # False: the caller logs `last_check`
        self.last_check: CheckResult | None = None
        self._param_names = param_names or {}
        self._held_rows: dict[DTensor, tuple[int, int, int]] = {}
        self._group_index = {p: index for index, group in enumerate(self.param_groups)
                             for p in group["params"]}
        self._validate_all()
        if use_syrk:
            self._use_syrk(_with_defaults(kwargs), upstream_runs_syrk)
        # {(shape, batch key): whether same-shape matrices run in one batched call}
        self.batched_newton_schulz: dict[tuple, bool] = {}
        # What this rank carries out each step, per exchange group (the bench and tests read it).
        self.plans = [self._plan_group(params, group, byte_slack, max_exchange_bytes)
                      for (group, _), params in self._exchange_groups().items()]
        if dist.get_rank() == 0 and dist_mode == "owner":
            self._say_which_go_alone(max_exchange_bytes is None)

    def _use_syrk(self, settings: dict, upstream_runs_it: bool) -> None:
        """Refuse --muon-use-syrk where the kernel cannot run (before any state), else route
        Newton-Schulz through it where megatron-core's TensorParallelMuon does not."""
        first = self.param_groups[0]["params"][0]
        tp_groups = {self._tp_group(_ParamAttributes(p)) for group in self.param_groups
                     for p in group["params"]} - {None}
        problem = syrk.why_it_cannot_run(self.fp32_matmul_prec, self.tp_mode,
                                         [g.size() for g in tp_groups], first.to_local().device)
        if problem:
            raise ValueError(f"ZeROTensorParallelMuon: {problem}")
        if not upstream_runs_it:
            self.scaled_orthogonalize_fn = syrk.scaled_orthogonalize_fn(
                self.scaled_orthogonalize_fn, settings["num_ns_steps"],
                settings["coefficient_type"], settings["scale_mode"],
                settings["extra_scale_factor"])

    def _say_which_go_alone(self, derived: bool) -> None:
        """One line: the matrices that alone need more than half their working-memory budget
        (each goes alone in its batch and exchange), the largest named with its size."""
        needs = [(owner_bytes(matrix, plan.param_of(i).element_size()), plan, i)
                 for plan in self.plans for i, matrix in enumerate(plan.matrices)]
        alone = [need for need in needs if need[0] > per_exchange_bytes(need[1].budget)]
        if not alone:
            return
        largest, plan, i = max(alone, key=lambda item: item[0])
        rows, cols = plan.matrices[i].shape
        budget = f"{plan.budget / 2**20:.1f} MiB"
        if derived:
            budget = f"the default, what Muon's state saves a rank against Adam's, {budget}"
        print(f"megatron-muon: {len(alone)} Muon matrices each need more than half of "
              f"--muon-max-exchange-bytes ({budget}) and are orthogonalized alone; the largest, "
              f"{self._name(plan.param_of(i))} ({rows}x{cols}, "
              f"{rows * cols * plan.param_of(i).element_size() / 2**20:.1f} MiB), needs "
              f"{largest / 2**20:.1f} MiB on its owner", flush=True)

    def held_rows(self, p: DTensor) -> tuple[int, int, int]:
        """(start, stop, rows): this rank's shard of `p` holds rows [start, stop) of its
        TP-local matrix of `rows` rows (3-D stacks: of their rows)."""
        return self._held_rows[p]

    def bytes_received_per_step(self) -> int:
        """What this rank receives in one owner step (gather and scatter), from its plan."""
        return sum(sum(route.recv_counts) * plan.param_of(0).element_size()
                   for plan in self.plans for routes in plan.routes
                   for route in (routes.gather, routes.scatter) if route.moves)

    def _device(self) -> torch.device:
        """The params' device, that of their process groups (CPU without params)."""
        return next((p.to_local().device for group in self.param_groups for p in group["params"]),
                    torch.device("cpu"))

    def _name(self, p) -> str:
        return self._param_names.get(p) or f"the parameter of shape {tuple(p.shape)}"

    def _exchange_group(self, p: DTensor):
        dims = data_parallel_dims(p)
        size = math.prod(p.device_mesh.size(dim) for dim in dims)
        if self.dp_group is not None:
            if self.dp_group.size() != size:
                raise ValueError(
                    f"{self._name(p)}: dp_group has {self.dp_group.size()} ranks but the param is "
                    f"data-parallel over {size} ({p.device_mesh})")
            return self.dp_group
        if len(dims) == 1:
            return p.device_mesh.get_group(dims[0])
        names = p.device_mesh.mesh_dim_names
        return upstream.flatten_mesh(p.device_mesh[tuple(names[dim] for dim in dims)]).get_group()

    def _validate(self, p) -> None:
        name = self._name(p)
        if not isinstance(p, DTensor):
            raise TypeError(
                f"{name}: ZeROTensorParallelMuon takes Megatron-FSDP's DTensor main weights, got a "
                f"{type(p).__name__}; wrap the model with Megatron-FSDP (fully_shard_model or "
                f"FullyShardedDataParallel) before building the optimizer")
        if any(not isinstance(pl, (Shard, Replicate)) for pl in p.placements):
            raise ValueError(f"{name}: unsupported DTensor placements {p.placements}")
        experts = self._num_experts(p)
        if p.dim() != 2 and not (p.dim() == 3 and p.shape[0] == experts):
            raise ValueError(f"{name}: Muon orthogonalizes 2-D matrices (or stacks of "
                             f"num_stacked_experts expert matrices); got shape {tuple(p.shape)}")
        if _tp_local_rows(p) % experts:
            raise ValueError(f"{name}: num_stacked_experts={experts} does not divide its rows")
        attrs = _ParamAttributes(p)
        tp_group = self._tp_group(attrs)
        if experts > 1 and tp_group is not None and tp_group.size() > 1:
            raise NotImplementedError(f"{name}: stacked expert weights with expert tensor parallelism")
        if self._splits_qkv(attrs):
            shapes = getattr(attrs, "qkv_split_shapes", None) or self.qkv_split_shapes
            if not shapes or _tp_local_rows(p) % sum(shapes):
                raise ValueError(
                    f"{name}: split_qkv (Megatron's default) needs q/k/v row counts that tile its "
                    f"{_tp_local_rows(p)} rows, got qkv_split_shapes={shapes}; pass "
                    f"--muon-no-split-qkv if the model has no fused QKV weight")

    @staticmethod
    def _data_parallel_layout(p: DTensor) -> tuple:
        """(mesh dim name, size, placement) of each data-parallel mesh dim."""
        names = p.device_mesh.mesh_dim_names or (None,) * p.device_mesh.ndim
        return tuple((names[dim], p.device_mesh.size(dim), p.placements[dim])
                     for dim in data_parallel_dims(p))

    @staticmethod
    def _num_experts(p) -> int:
        return getattr(_ParamAttributes(p), "num_stacked_experts", 1)

    def _validate_all(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                self._validate(p)
            meshes = {self._data_parallel_layout(p): p for p in group["params"]}
            if len(meshes) > 1:
                (a, first), (b, second) = list(meshes.items())[:2]
                raise ValueError(
                    f"one param group mixes data-parallel layouts: {self._name(first)} {a} and "
                    f"{self._name(second)} {b}; put dense and expert params in separate groups")

    def _exchange_groups(self) -> dict:
        """{(process group, data-parallel layout): its params}: dense params over dp_cp, experts
        over expert data parallelism, each exchanged within its group."""
        by_group: dict[Any, list[DTensor]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                key = (self._exchange_group(p), self._data_parallel_layout(p))
                by_group.setdefault(key, []).append(p)
        return by_group

    @staticmethod
    def _learn_layouts(params: list, group) -> list[RowLayout]:
        """Each param's row layout over `group`: which shard each rank holds and how many rows
        (one collective for all of them, at construction, never per step)."""
        table = all_gather_ints(
            [_shard_index(params[0])] + [_as_rows(p.to_local()).shape[0] for p in params],
            group, params[0].to_local().device)
        return row_layouts([row[0] for row in table], [row[1:] for row in table],
                           [_tp_local_rows(p) for p in params])

    def _plan_group(self, params: list, group, byte_slack: float | None,
                    max_exchange_bytes: int) -> GroupPlan:
        layouts = self._learn_layouts(params, group)
        rank = dist.get_rank(group)
        matrices, pieces = [], []
        for index, (p, layout) in enumerate(zip(params, layouts)):
            self._held_rows[p] = (*layout.row_range(rank), layout.num_rows)
            cols = p.to_local().shape[-1]
            for start, matrix in split_matrices(layout, self._num_experts(p), cols,
                                                self._batch_key(p), self._row_blocks(p)):
                matrices.append(matrix)
                pieces.append((index, *layout.local_range(rank, start, start + matrix.shape[0])))
        representatives = {}  # a matrix and its param of each cost key, in plan order
        for matrix, (index, _, _) in zip(matrices, pieces):
            representatives.setdefault(cost_key(matrix), (matrix, params[index]))
        batchable = self._batchable(matrices, representatives)
        element_bytes = params[0].element_size()
        budget = max_exchange_bytes or affordable_bytes(matrices, element_bytes)
        cost = None
        if self.dist_mode == "owner" and self.owner_choice == "time":
            cost = self._measure_cost(matrices, representatives, batchable, group,
                                      element_bytes, per_exchange_bytes(budget))
        else:
            self.batched_newton_schulz.update((key[:2], True) for key in batchable)
        # TP ranks hold equally shaped TP-local matrices laid out alike and agree on the
        # measured cost, so they pick the same owners: TP Newton-Schulz then meets its TP peers
        # on the same matrix.
        plan = owner_plan(matrices, element_bytes, byte_slack, budget, cost)
        return GroupPlan(params, matrices, pieces, plan.owners, plan.exchanges, group, budget, cost)

    @torch.no_grad()
    def _measure_cost(self, matrices: list[Matrix], representatives: dict, batchable: set,
                      group, element_bytes: int, max_batch_bytes: int) -> StepCost:
        """The group's StepCost from measured_cost.measure: each shape's Newton-Schulz call on one
        matrix, and, where it may be batched, on as many as an owner gets of its largest batch
        spread over the group (at least 2). At fp32 `highest`, where batching changes no bit,
        `batched_newton_schulz` takes the batched call where it is clearly faster
        (BATCHED_MUST_SAVE, and by more than the figures' spread); at bf16/tf32 same-shape
        matrices stay batched, as with owners by bytes, so the rounding never follows a
        measurement. A shape's seconds follow its FLOPs unless its own rate stands apart beyond
        the noise (measured_cost.seconds_beyond_noise). One all-to-all gives the bandwidth. The
        figures' median spread is the StepCost's: owners leave byte-first only for a gain that
        outlasts it (plan.choose_owners_by_time)."""
        largest_batch: dict = {}
        for batch in batch_matrices(matrices, max_batch_bytes, element_bytes):
            key = cost_key(matrices[batch[0]])
            largest_batch[key] = max(largest_batch.get(key, 0), len(batch))
        # Batched calls are timed only where a batch holds two matrices or more (a sample of at
        # most max_batch_bytes of owner_bytes then; a shape whose batches hold one never runs
        # batched).
        timed_batched = {key for key in batchable if largest_batch[key] > 1}
        runs = []
        for key, (matrix, p) in representatives.items():
            count = (max(2, math.ceil(largest_batch[key] / group.size()))
                     if key in timed_batched else 1)
            device = p.to_local().device
            sample = torch.randn((count, *matrix.shape), device=device,
                                 generator=torch.Generator(device).manual_seed(0))
            runs.append((1, lambda p=p, sample=sample: self._orthogonalize(p, sample[0])))
            if key in timed_batched:
                runs.append((count, lambda p=p, sample=sample: self._orthogonalize(p, sample)))
        tp_group = self._tp_group(_ParamAttributes(next(iter(representatives.values()))[1]))
        with eo_utils.fp32_matmul_precision(self.fp32_matmul_prec):
            per_matrix, bytes_per_second = measure(runs, group, [tp_group], self._device())
        figures, calls = iter(per_matrix), {}
        for key in representatives:
            calls[key] = next(figures)
            if key in timed_batched:
                single, batched = calls[key], next(figures)
                # Batched only where it saves more than the figures' spread too.
                must_save = min(BATCHED_MUST_SAVE, 1 - max(single.spread, batched.spread))
                chosen = (batched.seconds < must_save * single.seconds
                          or self.fp32_matmul_prec != "highest")
                self.batched_newton_schulz[key[:2]] = chosen
                calls[key] = batched if chosen else single
        seconds = seconds_beyond_noise(  # FLOPs of one iteration: the step count scales all alike
            {key: matrix.ns_flops(steps=1) for key, (matrix, _) in representatives.items()}, calls)
        return StepCost(lambda matrix, count: count * seconds[cost_key(matrix)], bytes_per_second,
                        spread=statistics.median(m.spread for m in per_matrix))

    def _tp_group(self, attrs):
        # As TensorParallelMuon.orthogonalize chooses it.
        if not self.pg_collection:
            return None
        return self.pg_collection.expt_tp if getattr(attrs, "expert_tp", False) else self.pg_collection.tp

    def _splits_qkv(self, attrs) -> bool:
        return self.split_qkv and self.is_qkv_fn(attrs)

    def _row_blocks(self, p) -> tuple[int, ...] | None:
        """Rows of the q, k and v blocks Newton-Schulz sees for a QKV-split param (for its cost)."""
        attrs = _ParamAttributes(p)
        if not self._splits_qkv(attrs):
            return None
        shapes = getattr(attrs, "qkv_split_shapes", None) or self.qkv_split_shapes
        return qkv_row_blocks(_tp_local_rows(p), shapes)

    def _batch_key(self, p) -> tuple | None:
        attrs = _ParamAttributes(p)
        tp_group = self._tp_group(attrs)
        return orthogonalization_key(attrs, self._splits_qkv(attrs),
                                     tp_group.size() if tp_group is not None else 1)

    def _orthogonalize(self, p, full: torch.Tensor) -> torch.Tensor:
        """TensorParallelMuon.orthogonalize on a full matrix (or a stack of them) of param `p`,
        with Megatron's tags and its param group's options, as OrthogonalizedOptimizer.step
        calls it."""
        group = self.param_groups[self._group_index[p]]
        return self.orthogonalize(_ParamAttributes(p), full,
                                  **{k: v for k, v in group.items() if k != "params"})

    @torch.no_grad()
    def _init_group(self, group: dict, skip_non_grad_params: bool = True) -> None:
        # Every rank holds momentum for every param, empty where its shard is empty, so state
        # keys agree across ranks (megatron-core's checkpoint init calls this too).
        for p in group["params"]:
            state = self.state[p]
            if len(state) == 0:
                state["momentum_buffer"] = DTensor.from_local(
                    torch.zeros_like(p.to_local()), p.device_mesh, p.placements, run_check=False,
                    shape=p.shape, stride=p.stride())

    @torch.no_grad()
    def step(self, closure=None):
        """OrthogonalizedOptimizer.step's loop on this rank's rows: per matrix weight decay,
        momentum and Nesterov (muon_math.momentum_update_, upstream's operations in its order,
        elementwise, so on a matrix's rows as on its whole param); then, in place of one
        orthogonalize call per param, the matrices of each exchange group orthogonalized whole
        (on their owners, or on every rank in "allgather" mode); then p -= lr * update on this
        rank's rows. In owner mode each exchange computes its matrices' updates when it starts
        and frees them when it ends, so the working memory stays within max_exchange_bytes. The
        weight-update hooks around that update are refused at construction
        (WEIGHT_UPDATE_HOOKS)."""
        if closure is not None:
            raise ValueError("closure is not supported")
        self.iteration += 1
        checking = (self.check_interval and self.dist_mode == "owner"
                    and self.iteration % self.check_interval == 0)
        for group in self.param_groups:
            self._init_group(group)
        restore = self._snapshot() if checking else None

        def apply(plan, i, rows):
            p = plan.param_of(i)
            plan.rows_of(i, p.to_local()).add_(rows, alpha=-self._group_of(p)["lr"])

        with eo_utils.fp32_matmul_precision(self.fp32_matmul_prec):
            if checking:
                self._checked_step(apply, restore)
                return None
            for plan in self.plans:
                if self.dist_mode == "owner":
                    self._owner_orthogonalize(plan, partial(self._update_rows, plan), apply)
                else:
                    self._allgather_orthogonalize(plan, self._all_update_rows(plan), apply)
        return None

    def _checked_step(self, apply, restore) -> None:
        """Owner mode's step with the check: every update computed at once (the reference needs
        them all), the owners' results kept, compared with the reference, then applied."""
        locals_ = [self._all_update_rows(plan) for plan in self.plans]
        results = {}
        for plan, local in zip(self.plans, locals_):
            self._owner_orthogonalize(plan, local.__getitem__,
                                      lambda plan, i, rows: results.update({(plan, i): rows}))
        self._check_against_reference(locals_, results, restore)
        for (plan, i), rows in results.items():
            apply(plan, i, rows)

    def _group_of(self, p) -> dict:
        return self.param_groups[self._group_index[p]]

    def _all_update_rows(self, plan: GroupPlan) -> dict[int, torch.Tensor]:
        return {i: self._update_rows(plan, i) for i in range(len(plan.matrices))}

    def _update_rows(self, plan: GroupPlan, i: int) -> torch.Tensor:
        """Weight decay and momentum on this rank's rows of matrix i (in place), and the rows of
        its update to orthogonalize (muon_math.momentum_update_)."""
        p = plan.param_of(i)
        param_rows = plan.rows_of(i, p.to_local())
        # Megatron-FSDP leaves grad=None where a rank's shard is empty.
        grad_rows = (plan.rows_of(i, p.grad.to_local()) if p.grad is not None
                     else torch.zeros_like(param_rows))
        return momentum_update_(self, param_rows, grad_rows,
                                plan.rows_of(i, self.state[p]["momentum_buffer"].to_local()),
                                self._group_of(p))

    def _snapshot(self):
        """What restores this rank's params and momentum to now."""
        saved = [(t, t.clone()) for group in self.param_groups for p in group["params"]
                 for t in (p.to_local(), self.state[p]["momentum_buffer"].to_local())]
        return lambda: [t.copy_(copy) for t, copy in saved]

    def _check_against_reference(self, locals_: list, results: dict, restore) -> None:
        """The check interval's comparison, before anything is applied: each matrix assembled
        whole and orthogonalized by TensorParallelMuon as dist_mode="allgather" does; each rank
        compares the owner's result for its rows; the largest difference and bound of each
        matrix are reduced over its group. The bound: 0 with fp32 `highest` Newton-Schulz; at a
        lower precision, where batched kernels may round differently (docs/design.md,
        "Library"), the reference's own distance from fp32 Newton-Schulz."""
        worst, owned, failures = 0.0, 0, []
        for plan, local in zip(self.plans, locals_):
            references, fp32 = {}, {}
            self._allgather_orthogonalize(plan, local,
                                          lambda _, i, rows: references.update({i: rows}))
            if self.fp32_matmul_prec != "highest":
                with eo_utils.fp32_matmul_precision("highest"):
                    self._allgather_orthogonalize(plan, local,
                                                  lambda _, i, rows: fp32.update({i: rows}))
            device = plan.param_of(0).to_local().device
            diffs = torch.zeros(len(plan.matrices), dtype=torch.float64, device=device)
            bounds = torch.zeros_like(diffs)
            for i, reference in references.items():
                if reference.numel() and (plan, i) in results:
                    diffs[i] = (results[plan, i] - reference).abs().max()
                    if fp32:
                        bounds[i] = (reference - fp32[i]).abs().max()
            dist.all_reduce(diffs, op=dist.ReduceOp.MAX, group=plan.group)
            dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=plan.group)
            worst = max(worst, diffs.max().item() if len(diffs) else 0.0)
            owned += sum(owner == plan.rank for owner in plan.owners)
            failures += [self._describe(plan, i, diffs[i].item(), bounds[i].item())
                         for i in range(len(plan.matrices))
                         if diffs[i] > bounds[i] and plan.owners[i] == plan.rank]
        # Over every rank: tensor-parallel ranks' data-parallel groups hold different matrices,
        # and all ranks must stop together.
        worst, matrices, failures = agree_on_every_rank(worst, owned, failures, self._device())
        if failures:
            restore()
            raise MuonCheckError(
                f"muon check at iteration {self.iteration}: the owner exchange's update differs "
                f"from the reference (TensorParallelMuon on the whole matrix); nothing of this "
                f"step was applied:\n  " + "\n  ".join(failures))
        self.last_check = CheckResult(self.iteration, worst, matrices)
        if self.log_checks and dist.get_rank() == 0:
            print(f"muon check at iteration {self.iteration}: {self.last_check}", flush=True)

    def _describe(self, plan: GroupPlan, i: int, diff: float, bound: float) -> str:
        param_index = plan.pieces[i][0]
        p = plan.param_of(i)
        expert = ""
        if self._num_experts(p) > 1:
            expert = f", expert {sum(1 for j in range(i) if plan.pieces[j][0] == param_index)}"
        return (f"{self._name(p)}{expert}: shape {tuple(plan.matrices[i].shape)}, owner rank "
                f"{plan.owners[i]} of its data-parallel group (global rank {dist.get_rank()}): "
                f"max |owner - reference| = "
                f"{diff:.6e} > bound {bound:.6e}")

    def _allgather_orthogonalize(self, plan: GroupPlan, local: dict, apply) -> None:
        for i, matrix in enumerate(plan.matrices):
            full = all_gather_rows(local[i], matrix.layout, plan.group)
            start, stop = matrix.layout.row_range(plan.rank)
            apply(plan, i, self._orthogonalize(plan.param_of(i), full)[start:stop])

    def _owner_orthogonalize(self, plan: GroupPlan, local_rows, apply) -> None:
        """Each exchange's matrices gathered to their owners, orthogonalized there batch by
        batch, the rows sent back and `apply(plan, matrix, this rank's rows)`, two exchanges in
        flight (exchange.run_overlapped). `local_rows(i)`: this rank's rows of matrix i's update,
        asked for when its exchange starts."""
        def orthogonalize(owned, fulls):
            return self.orthogonalize_owned([plan.param_of(i) for i in owned], fulls,
                                            plan.matrices[owned[0]].batch_key)

        run_overlapped(owner_exchange(routes, plan.group, {i: local_rows(i) for i in routes.batch},
                                      orthogonalize, lambda i, rows: apply(plan, i, rows))
                       for routes in plan.routes)

    def orthogonalize_owned(self, params: list, fulls: list, batch_key) -> list:
        """Newton-Schulz on the full matrices this rank owns in one batch: one batched call per
        param group (orthogonalize gets that group's options) where `batched_newton_schulz`
        allows it, else one call each. The owner's hook: what it returns is what the owner
        exchange sends back (the check interval compares it with the reference)."""
        if not self.batched_newton_schulz.get((tuple(fulls[0].shape), batch_key)):
            return [self._orthogonalize(p, full) for p, full in zip(params, fulls)]
        by_group: dict[int, list[int]] = {}
        for j, p in enumerate(params):
            by_group.setdefault(self._group_index[p], []).append(j)
        results = [None] * len(fulls)
        for members in by_group.values():
            if len(members) == 1:
                results[members[0]] = self._orthogonalize(params[members[0]], fulls[members[0]])
                continue
            stacked = torch.stack([fulls[j] for j in members])
            for j, result in zip(members, self._orthogonalize(params[members[0]], stacked).unbind()):
                results[j] = result
        return results

    @torch.no_grad()
    def _batchable(self, matrices: list[Matrix], representatives: dict) -> set:
        """The cost keys whose same-shape matrices an owner may orthogonalize in one batched call
        (`batched_newton_schulz` says whether it does): shapes two of the group's matrices
        share, that orthogonalize alike. At fp32 `highest` only where batched Newton-Schulz
        reproduces the per-matrix bits on the params' device (the backend may pick other kernels
        for 3-D input: seen on CPU for 7x13, not for 256x1024), tried on two random matrices; at
        `medium`/`low` (bf16/tf32 matmuls) always, the batched kernels rounding differently by
        less than that precision's own error (docs/design.md, "Library")."""
        if self.use_syrk:  # the kernel takes 2-D matrices only
            return set()
        counts = Counter(cost_key(matrix) for matrix in matrices)
        return {key for key, (matrix, p) in representatives.items()
                if matrix.batch_key is not None and counts[key] > 1
                and (self.fp32_matmul_prec != "highest"
                     or self._batched_is_exact(p, (matrix.shape, matrix.batch_key)))}

    def _batched_is_exact(self, p, key: tuple) -> bool:
        device = p.to_local().device
        sample = torch.randn((2, *key[0]), device=device,
                             generator=torch.Generator(device).manual_seed(0))
        with eo_utils.fp32_matmul_precision(self.fp32_matmul_prec):
            batched = self._orthogonalize(p, sample)
            single = torch.stack([self._orthogonalize(p, m) for m in sample])
        return torch.equal(batched, single)
