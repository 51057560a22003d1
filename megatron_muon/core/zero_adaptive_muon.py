"""megatron-core's `--optimizer adaptive_muon` (emerging-optimizers' AdaptiveMuon: AdaMuon,
NorMuon, NAMO) on Megatron-FSDP's sharded main weights: ZeROTensorParallelMuon's step and exchange,
Newton-Schulz unscaled, then the variant's second moment (second_moment.py) where it needs to
run, and Muon's scale once, by the whole (TP-unsharded) matrix's shape."""

import math
import typing
from collections.abc import Iterable
from typing import Any

import torch
from emerging_optimizers.orthogonalized_optimizers.adaptive_muon import AdaptiveMuon, Moment2MethodT
from torch.distributed.tensor import DTensor, Shard

from ..distribution.dtensor_rows import ParamAttributes, num_experts, tp_local_rows
from ..distribution.exchange import OwnerRoutes
from ..fixes.upstream_fixes import scale_after_second_moment, whole_shape
from ..planner.group_plan import GroupPlan
from . import gram_newton_schulz
from .second_moment import SECOND_MOMENTS, Columns
from .settings import tensor_parallel_muon_settings
from .zero_muon import ZeROTensorParallelMuon

MOMENT2_METHODS = typing.get_args(Moment2MethodT)


def check_adaptive_settings(moment2_method: str, beta2: float, eps: float, use_syrk: bool,
                            decoupled_weight_decay: bool = True) -> None:
    """Refuse, before any state, what the variants cannot run here, naming Megatron's flag."""
    def setting(name):
        return (f"ZeROTensorParallelAdaptiveMuon: {name} (OptimizerConfig.adaptive_muon_{name}, "
                f"--adaptive-muon-{name.replace('_', '-')})")

    if moment2_method not in SECOND_MOMENTS:
        raise ValueError(f"{setting('moment2_method')} must be one of {tuple(SECOND_MOMENTS)} on "
                         f"Megatron-FSDP, got {moment2_method!r}")
    if moment2_method == "namo" and not decoupled_weight_decay:
        raise ValueError(f"{setting('moment2_method')} 'namo' needs decoupled weight decay "
                         f"(use_decoupled_weight_decay=True): emerging-optimizers' AdaptiveMuon "
                         f"refuses it with L2")
    if not 0 <= beta2 < 1:
        raise ValueError(f"{setting('beta2')} must be in [0, 1), got {beta2!r}")
    if not eps >= 0:
        raise ValueError(f"{setting('eps')} must be at least 0, got {eps!r}")
    if use_syrk:
        raise ValueError("ZeROTensorParallelAdaptiveMuon: --muon-use-syrk runs Muon's scaled "
                         "Newton-Schulz; adaptive_muon scales after its second moment: drop it")


class ZeROTensorParallelAdaptiveMuon(ZeROTensorParallelMuon, AdaptiveMuon):
    """megatron-core's TensorParallelAdaptiveMuon (as fixes.upstream_fixes repairs it)
    for Megatron-FSDP main weights: each update bit-identical (fp32 `highest`) to it on the
    unsharded model. An AdaptiveMuon as megatron-core's is (its second-moment methods), stepped
    by ZeROTensorParallelMuon.

    Args:
        moment2_method: "adamuon" (elementwise, on each rank's rows), "normuon" (per row, or
            per column of a wider matrix, on the matrix's owner) or "namo" (a scalar from whole
            norms, on the owner); OptimizerConfig's adaptive_muon_moment2_method.
        beta2, eps: the second moment's decay and epsilon (param groups may set their own).
        **kwargs: ZeROTensorParallelMuon's arguments (--muon-use-syrk refused).

    State: "momentum_buffer" as ZeROTensorParallelMuon's; "moment2_buffer" sharded as the main
    weights are: AdaMuon's shaped like the param, NorMuon's `k` columns per row, NAMO's one
    (second_moment.py).
    """

    def __init__(self, params: Iterable[DTensor] | Iterable[dict], *,
                 moment2_method: str = "adamuon", beta2: float = 0.95, eps: float = 1e-8,
                 use_syrk: bool = False, **kwargs: Any) -> None:
        decoupled = tensor_parallel_muon_settings(kwargs)["use_decoupled_weight_decay"]
        check_adaptive_settings(moment2_method, beta2, eps, use_syrk, decoupled)
        super().__init__(params, second_moment=SECOND_MOMENTS[moment2_method], **kwargs)
        self.moment2_method = moment2_method  # AdaptiveMuon's methods read it
        for group in self.param_groups:
            group.setdefault("beta2", beta2)
            group.setdefault("eps", eps)

    def _set_newton_schulz(self, settings: dict, use_syrk: bool, upstream_runs_syrk: bool) -> None:
        scale_after_second_moment(self, settings)  # AdaptiveMuon's step reads what it sets
        # AdaptiveMuon scales after the second moment: Gram Newton-Schulz unscaled too.
        gram_newton_schulz.route_newton_schulz_through_it(self, settings, scaled=False)

    def initial_state(self, p: DTensor) -> dict[str, DTensor]:
        """Muon's state and the second moment, placed as `p` is: its columns per row
        (second_moment.py) beside each of this rank's rows."""
        rows, cols = tp_local_rows(p) // num_experts(p), p.to_local().shape[-1]
        columns = self.second_moment.held_columns(rows, cols)
        local = p.to_local()
        local = torch.zeros((*local.shape[:-1], columns), dtype=local.dtype, device=local.device)
        # The last dim's TP shards (a partition along it) each hold `columns`.
        last = Shard(p.dim() - 1)
        shards = math.prod(p.device_mesh.size(dim) for dim, placement in enumerate(p.placements)
                           if placement == last)
        shape = torch.Size((*p.shape[:-1], columns * shards))
        moment2 = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                     shape=shape, stride=torch.empty(shape, device="meta").stride())
        return {**super().initial_state(p), "moment2_buffer": moment2}

    def _moment2_rows(self, plan: GroupPlan, i: int) -> torch.Tensor:
        return plan.rows_of(i, self.state[plan.param_of(i)]["moment2_buffer"].to_local())

    def prefetch_state(self, plan: GroupPlan, routes: OwnerRoutes) -> None:
        """Nothing ahead: an offloaded second moment is also on the device while an older
        exchange's update is applied (holder_update), which beside the next exchange's state
        would pass plan.offload's two-exchange bound; each matrix's state comes as it is read."""

    def update_rows(self, plan: GroupPlan, i: int) -> torch.Tensor:
        """Muon's update rows, with the second moment's travelling columns beside them."""
        rows = super().update_rows(plan, i)
        if not self.second_moment.moment2_travels:
            return rows
        moment2 = self._moment2_rows(plan, i)
        with self.host_state.rows(plan.param_of(i), moment2, write=False) as moment2:
            beside = self.second_moment.travelling(plan.grad_rows(i), moment2)
        return torch.cat([rows, beside], dim=1)

    def _columns(self, p: DTensor, rows: int) -> Columns:
        return self.second_moment.columns(rows, p.to_local().shape[-1])

    def orthogonalize_owned(self, params: list[DTensor], fulls: list[torch.Tensor],
                            batch_key: Any) -> list[torch.Tensor]:
        """Newton-Schulz (unscaled) on the update's columns, batched as Muon's, then the second
        moment's owner part on each whole matrix with its travelling columns."""
        parts = [self._columns(p, full.shape[0]).split(full) for p, full in zip(params, fulls)]
        updates = [update.contiguous() for update, _, _ in parts]
        orthogonalized = super().orthogonalize_owned(params, updates, batch_key)
        return [self._owner_update(p, update, result, grad, moment2) for p, update, result,
                (_, grad, moment2) in zip(params, updates, orthogonalized, parts)]

    def orthogonalize_whole(self, p: DTensor, full: torch.Tensor) -> torch.Tensor:
        update, grad, moment2 = self._columns(p, full.shape[0]).split(full)
        update = update.contiguous()
        return self._owner_update(p, update, super().orthogonalize_whole(p, update), grad, moment2)

    def _owner_update(self, p: DTensor, update: torch.Tensor, orthogonalized: torch.Tensor,
                      grad: torch.Tensor, moment2: torch.Tensor) -> torch.Tensor:
        return self.second_moment.owner_update(
            self, update, orthogonalized, grad, moment2, self.group_of(p),
            whole_shape(self, ParamAttributes(p), orthogonalized.shape))

    def apply_update(self, plan: GroupPlan, i: int, rows: torch.Tensor) -> None:
        p, shape = plan.param_of(i), plan.matrices[i].shape
        with self.host_state.rows(p, self._moment2_rows(plan, i),
                                  read=not self.second_moment.moment2_travels) as moment2:
            update = self.second_moment.holder_update(
                self, rows, self._columns(p, shape[0]).returned, moment2, self.group_of(p),
                whole_shape(self, ParamAttributes(p), shape))
        super().apply_update(plan, i, update)
