"""Muon on Megatron-FSDP's sharded main weights (ZeRO-1/2/3, HSDP), exact and TP-aware."""

from collections.abc import Callable, Hashable, Iterable, Iterator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from emerging_optimizers import utils as eo_utils
from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon
from torch.distributed.tensor import DTensor

from ..compat import tensor_parallel
from ..distribution.dtensor_rows import ParamAttributes
from ..distribution.exchange import OwnerRoutes, owner_exchange, run_overlapped
from ..observe.phases import UPDATE, phase
from ..plan import MAX_EXCHANGE_BYTES
from ..planner.group_plan import GroupPlan, offloaded_params
from ..planner.group_planner import GroupPlanner
from . import gram_newton_schulz, syrk
from .checks import CheckResult
from .gather_ahead import GatheredAhead
from .muon_math import momentum_update_
from .owner_check import ApplyUpdate, OwnerCheck, all_update_rows, allgather_orthogonalize
from .second_moment import SecondMoment
from .settings import (DistMode, OwnerChoice, check_hooks, check_params, check_settings,
                       gram_schedule, tensor_parallel_muon_settings)
from .state_offload import HostState
from .team_newton_schulz import orthogonalized_by_team


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
            shortest estimated step (plan.choose_owners_by_time), with rates measured here at
            construction (measured_cost); "bytes": fewest bytes first, Newton-Schulz FLOPs
            balanced within `byte_slack` (plan.choose_owners; what "time" falls back to where
            it would not stay faster by more than the measured figures' spread). At fp32
            `highest` owners change no result bit, only where work runs (docs/design.md).
        max_team_size: owner mode may split a matrix whose Newton-Schulz alone exceeds its
            share over a team of up to this many ranks, orthogonalized together in
            TensorParallelMuon's "distributed" form (--muon-max-team-size; plan/team_split.py,
            core/team_newton_schulz.py); 1 (the default): every matrix whole on one owner.
        byte_slack: the cap on the bytes owner mode moves beyond the layout's minimum, as a
            fraction of it (None, the default: none under "time"; plan.BYTE_SLACK under "bytes").
        max_exchange_bytes: the most the owner step's working memory may hold at once on a rank
            (--muon-max-exchange-bytes): everything two exchanges in flight hold, as
            plan.working_memory counts it. Same-shape matrices are
            orthogonalized together and batches exchanged together (one collective per
            direction) within it; a matrix needing more than half goes alone in its batch,
            and rank 0 says so. None (the default): per rank, what Muon's state saves it
            against Adam's plus the most the step must exceed a rank's saving anyway
            (plan.rank_budgets; the saving alone with the state offloaded).
            "allgather" mode and a checked step hold every update at once, beyond it.
        use_syrk: Newton-Schulz through emerging_optimizers' Triton SYRK kernel
            (--muon-use-syrk; megatron_muon.core.syrk says where it runs): CUDA, bf16 (`medium`),
            each matrix in its own call (the kernel takes no batch); refused at construction
            where it cannot run.
        gram_newton_schulz: Gram Newton-Schulz where a matrix is whole and it costs fewer FLOPs,
            restarting at `gram_restarts` (--muon-gram-*; core/gram_newton_schulz.py).
        param_names: {param: name}, for error messages.
        second_moment: an adaptive variant's second moment after Newton-Schulz (SecondMoment,
            core/second_moment.py; ZeROTensorParallelAdaptiveMuon passes its own), None for
            Muon: the planner sizes the exchanges by the columns it carries.
        offload_fraction: the share of the state kept in host memory between steps
            (--optimizer-offload-fraction; core/state_offload.py), picked param by param as
            megatron-core's HybridDeviceOptimizer picks them; 0 (the default): none.
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

    def __init__(self, params: Iterable[DTensor] | Iterable[dict], *,
                 dp_group: dist.ProcessGroup | None = None, dist_mode: DistMode = "owner",
                 owner_choice: OwnerChoice = "time", byte_slack: float | None = None,
                 max_exchange_bytes: int | None = MAX_EXCHANGE_BYTES,
                 param_names: dict | None = None, check_interval: int = 0,
                 use_syrk: bool = False, second_moment: SecondMoment | None = None,
                 offload_fraction: float = 0.0, max_team_size: int = 1,
                 gram_newton_schulz: bool = False, gram_restarts: tuple[int, ...] = (2,),
                 **kwargs: Any) -> None:
        self.gram = gram_schedule(gram_newton_schulz, gram_restarts, kwargs)
        check_settings(dist_mode, owner_choice, byte_slack, max_exchange_bytes, check_interval,
                       offload_fraction, max_team_size, kwargs)
        check_hooks(type(self))
        upstream_runs_syrk = use_syrk and syrk.tensor_parallel_muon_takes_syrk()
        super().__init__(params, **kwargs, **({"use_syrk": True} if upstream_runs_syrk else {}))
        self.use_syrk = use_syrk
        self.second_moment = second_moment
        self.dp_group = dp_group
        self.dist_mode = dist_mode
        self.owner_choice = owner_choice
        self.check_interval, self.max_team_size = check_interval, max_team_size
        self.iteration = 0
        self.log_checks = True  # False: the caller logs `last_check`
        self.last_check: CheckResult | None = None
        self._param_names = param_names or {}
        self._group_index = {p: index for index, group in enumerate(self.param_groups)
                             for p in group["params"]}
        check_params(self)
        self.newton_schulz_settings = tensor_parallel_muon_settings(kwargs)
        self._set_newton_schulz(self.newton_schulz_settings, use_syrk, upstream_runs_syrk)
        # What this rank carries out each step, per exchange group (the bench and tests read it;
        # the factory re-packs it with another Muon part's headroom), the rows of each param it
        # holds, and where same-shape matrices run batched.
        self.planner = GroupPlanner(self)
        self.batched_newton_schulz = self.planner.batched_newton_schulz
        self.plans: list[GroupPlan] = self.planner.plan(byte_slack, max_exchange_bytes,
                                                         headroom=not offload_fraction)
        self._held_rows = self.planner.held_rows
        self.interleaved = None  # stepped with another part (planner.interleaving)
        self._check = OwnerCheck(self)
        self.ahead = GatheredAhead(self)  # chain.backward_gather starts them, drops leftovers
        self.host_state = HostState(self.device(), offloaded_params(self.plans, offload_fraction))

    def _set_newton_schulz(self, settings: dict, use_syrk: bool, upstream_runs_syrk: bool) -> None:
        """Newton-Schulz as TensorParallelMuon's orthogonalize runs it (scaled), through the SYRK
        kernel with --muon-use-syrk. A variant may run it otherwise (before planning, which
        times it)."""
        if use_syrk:
            syrk.route_newton_schulz_through_it(self, settings, upstream_runs_syrk)
        gram_newton_schulz.route_newton_schulz_through_it(self, settings, scaled=True)

    def held_rows(self, p: DTensor) -> tuple[int, int, int]:
        """(start, stop, rows): this rank holds rows [start, stop) of `p`'s `rows` TP-local rows."""
        return self._held_rows[p]

    def device(self) -> torch.device:
        """The params' device, that of their process groups (CPU without params)."""
        return next((p.to_local().device for p in self._group_index), torch.device("cpu"))

    def name_of(self, p: torch.Tensor) -> str:
        return self._param_names.get(p) or f"the parameter of shape {tuple(p.shape)}"

    def tp_group_of(self, attrs: Any) -> dist.ProcessGroup | None:
        return tensor_parallel.tensor_parallel_group(self.pg_collection, attrs)

    def splits_qkv(self, attrs: Any) -> bool:
        return self.split_qkv and self.is_qkv_fn(attrs)

    def orthogonalize_full(self, p: DTensor, full: torch.Tensor) -> torch.Tensor:
        """TensorParallelMuon.orthogonalize on a full matrix (or a stack of them) of param `p`,
        with Megatron's tags and its param group's options, as OrthogonalizedOptimizer.step
        calls it."""
        group = self.param_groups[self._group_index[p]]
        return self.orthogonalize(ParamAttributes(p), full,
                                  **{k: v for k, v in group.items() if k != "params"})

    @torch.no_grad()
    def _init_group(self, group: dict, skip_non_grad_params: bool = True) -> None:
        # Every rank holds momentum for every param, empty where its shard is empty, so state
        # keys agree across ranks (megatron-core's checkpoint init calls this too).
        for p in group["params"]:
            if len(self.state[p]) == 0:
                self.state[p].update(self.initial_state(p))
                self.host_state.home(p, self.state[p])

    def initial_state(self, p: DTensor) -> dict:
        """A param's state before its first step, placed as the param is."""
        return {"momentum_buffer": DTensor.from_local(
            torch.zeros_like(p.to_local()), p.device_mesh, p.placements, run_check=False,
            shape=p.shape, stride=p.stride())}

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        """OrthogonalizedOptimizer.step's loop on this rank's rows: per matrix weight decay,
        momentum and Nesterov (muon_math.momentum_update_, upstream's operations in its order,
        elementwise, so on a matrix's rows as on its whole param); then, in place of one
        orthogonalize call per param, the matrices of each exchange group orthogonalized whole
        (on their owners, or on every rank in "allgather" mode); then p -= lr * update on this
        rank's rows. In owner mode each exchange computes its matrices' updates when it starts
        and frees them when it ends, so the working memory stays within max_exchange_bytes. The
        weight-update hooks around that update are refused (settings.WEIGHT_UPDATE_HOOKS)."""
        if closure is not None:
            raise ValueError("closure is not supported")
        self.iteration += 1
        checking = (self.check_interval and self.dist_mode == "owner"
                    and self.iteration % self.check_interval == 0)
        for group in self.param_groups:
            self._init_group(group)
        apply = self.apply_update
        with eo_utils.fp32_matmul_precision(self.fp32_matmul_prec), \
                self.host_state.stepping(self.state):
            if checking:
                return self._check.step(apply)
            if self.interleaved is not None:  # run beside another part's (the factory's)
                return self.interleaved.step(self)
            for plan in self.plans:
                if self.dist_mode == "owner":
                    run_overlapped(self.owner_exchanges(plan, partial(self.update_rows, plan),
                                                        apply, partial(self.prefetch_state, plan)))
                else:
                    allgather_orthogonalize(self, plan, all_update_rows(self, plan), apply)
        return None

    def apply_update(self, plan: GroupPlan, i: int, rows: torch.Tensor) -> None:
        """p -= lr * update on this rank's rows of matrix i (`rows`: what its owner sent back)."""
        p = plan.param_of(i)
        plan.rows_of(i, p.to_local()).add_(rows, alpha=-self.group_of(p)["lr"])

    def group_of(self, p: DTensor) -> dict:
        return self.param_groups[self._group_index[p]]

    def momentum_rows(self, plan: GroupPlan, i: int) -> torch.Tensor:
        return plan.rows_of(i, self.state[plan.param_of(i)]["momentum_buffer"].to_local())

    def prefetch_state(self, plan: GroupPlan, routes: OwnerRoutes) -> None:
        """The exchange's offloaded momentum rows on their way to the device while the exchange
        before it computes (HostState.prefetch)."""
        for i in routes.batch:
            self.host_state.prefetch(plan.param_of(i), self.momentum_rows(plan, i))

    def update_rows(self, plan: GroupPlan, i: int) -> torch.Tensor:
        """Weight decay and momentum on this rank's rows of matrix i (in place), and the rows of
        its update to orthogonalize (muon_math.momentum_update_)."""
        p = plan.param_of(i)
        with self.host_state.rows(p, self.momentum_rows(plan, i)) as momentum:
            return momentum_update_(self, plan.rows_of(i, p.to_local()), plan.grad_rows(i),
                                    momentum, self.group_of(p))

    def owner_exchanges(self, plan: GroupPlan, local_rows: Callable[[int], torch.Tensor],
                        apply: ApplyUpdate, ahead: Callable[[OwnerRoutes], None] | None = None
                        ) -> Iterator[Iterator[None]]:
        """The plan's exchanges, for exchange.run_overlapped: each one's matrices gathered to
        their owners, orthogonalized there batch by batch, the rows sent back and `apply(plan,
        matrix, this rank's rows)`. `local_rows(i)`: this rank's rows of matrix i's update, asked
        for (UPDATE) when its exchange starts, after `ahead(the next exchange's routes)`."""
        def orthogonalize(owned, fulls):
            if plan.matrices[owned[0]].team:
                return orthogonalized_by_team(self, plan, owned, fulls)
            return self.orthogonalize_owned([plan.param_of(i) for i in owned], fulls,
                                            plan.matrices[owned[0]].batch_key)

        for k, routes in enumerate(plan.routes):
            if ahead and k + 1 < len(plan.routes):
                ahead(plan.routes[k + 1])
            with phase(UPDATE):  # where gathered ahead: the holders' momentum and weights only
                local = {i: self.ahead.rows_sent(plan, k, i, local_rows(i)) for i in routes.batch}
            yield (self.ahead.exchange(plan, k, local, orthogonalize, partial(apply, plan)) or
                   owner_exchange(routes, plan.group, local, orthogonalize, partial(apply, plan)))

    def orthogonalize_whole(self, p: DTensor, full: torch.Tensor) -> torch.Tensor:
        """One matrix's update as "allgather" mode computes it, on its own (the check's
        reference, apart from the owners' orthogonalize_owned)."""
        return self.orthogonalize_full(p, full)

    def orthogonalize_owned(self, params: list[DTensor], fulls: list[torch.Tensor],
                            batch_key: Hashable) -> list[torch.Tensor]:
        """Newton-Schulz on the full matrices this rank owns in one batch: one batched call per
        param group (orthogonalize gets that group's options) where `batched_newton_schulz`
        allows it, else one call each. The owner's hook: what it returns is what the owner
        exchange sends back (the check interval compares it with the reference)."""
        if not self.batched_newton_schulz.get((tuple(fulls[0].shape), batch_key)):
            return [self.orthogonalize_full(p, full) for p, full in zip(params, fulls)]
        return _orthogonalized_by_group(self, params, fulls)


def _orthogonalized_by_group(muon: ZeROTensorParallelMuon, params: list[DTensor],
                             fulls: list[torch.Tensor]) -> list[torch.Tensor]:
    """Same-shape matrices orthogonalized in one batched call per param group (a group's matrices
    share its options), a group's lone matrix alone."""
    by_group: dict[int, list[int]] = {}
    for j, p in enumerate(params):
        by_group.setdefault(id(muon.group_of(p)), []).append(j)
    results = [None] * len(fulls)
    for members in by_group.values():
        if len(members) == 1:
            results[members[0]] = muon.orthogonalize_full(params[members[0]], fulls[members[0]])
            continue
        stacked = torch.stack([fulls[j] for j in members])
        batched = muon.orthogonalize_full(params[members[0]], stacked)
        for j, result in zip(members, batched.unbind()):
            results[j] = result
    return results
