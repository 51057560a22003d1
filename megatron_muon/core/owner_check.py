"""The check interval's comparison (--muon-check-interval, ZeROTensorParallelMuon's
check_interval): on a checked step every matrix's update is also computed as "allgather" mode
computes it (assembled on every rank and orthogonalized there), and each rank compares the
owners' result for its rows with it before anything is applied. The bound: 0 with fp32
`highest` Newton-Schulz; at a lower precision, where batched kernels may round differently
(docs/design.md, "Library"), the reference's own distance from fp32 Newton-Schulz. A matrix
split over a team is compared with the whole matrix orthogonalized as one, within the fp32
reordering of the team's sums (team_newton_schulz.reordering_bound), and at a lower precision
within twice the reference's distance (the team's Gram matrix is summed at that precision)."""

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from emerging_optimizers import utils as eo_utils

from ..distribution.agreement import agree_on_every_rank
from ..distribution.dtensor_rows import num_experts
from ..distribution.exchange import run_overlapped
from ..distribution.team_groups import whole_results
from ..observe.phases import CHECK, UPDATE, phase
from ..planner.group_plan import GroupPlan
from .checks import CheckResult, MuonCheckError
from .team_newton_schulz import reordering_bound

# What the step does with a matrix's rows that come back: apply(plan, matrix, this rank's rows).
ApplyUpdate = Callable[[GroupPlan, int, torch.Tensor], None]


def all_update_rows(muon: Any, plan: GroupPlan) -> dict[int, torch.Tensor]:
    """This rank's rows of every matrix's update in `plan` (ZeROTensorParallelMuon.update_rows),
    all at once: what "allgather" mode and the check's reference assemble."""
    return {i: muon.update_rows(plan, i) for i in range(len(plan.matrices))}


def allgather_orthogonalize(muon: Any, plan: GroupPlan, local: dict[int, torch.Tensor],
                            apply: ApplyUpdate) -> None:
    """"allgather" mode: every matrix assembled whole on every rank from `local` (its rows,
    all_update_rows) and orthogonalized there (muon.orthogonalize_whole), `apply(plan, matrix,
    this rank's rows)`."""
    for i, result in whole_results(plan, local, muon.orthogonalize_whole):
        start, stop = plan.matrices[i].layout.row_range(plan.rank)
        apply(plan, i, result[start:stop])


class OwnerCheck:
    """A checked step of a ZeROTensorParallelMuon in owner mode (`step`), which it runs every
    check_interval iterations in place of its own."""

    def __init__(self, muon: Any) -> None:
        self.muon = muon

    def step(self, apply: ApplyUpdate) -> None:
        """Owner mode's step with the check: every update computed at once (the reference needs
        them all), the owners' results kept, compared with the reference, then applied; on a
        difference the params and momentum are restored and every rank raises."""
        muon = self.muon
        with phase(CHECK):
            restore = self._snapshot()
        with phase(UPDATE):
            locals_ = [all_update_rows(muon, plan) for plan in muon.plans]
        results = {}
        for plan, local in zip(muon.plans, locals_):
            run_overlapped(muon.owner_exchanges(
                plan, local.__getitem__, lambda plan, i, rows: results.update({(plan, i): rows})))
        with phase(CHECK):
            self._compare(locals_, results, restore)
        with phase(UPDATE):
            for (plan, i), rows in results.items():
                apply(plan, i, rows)

    def _snapshot(self):
        """What restores this rank's params and momentum to now."""
        muon = self.muon
        saved = [(t, t.clone()) for group in muon.param_groups for p in group["params"]
                 for t in (p.to_local(), muon.state[p]["momentum_buffer"].to_local())]

        def restore():
            muon.host_state.wait_for_copies()  # an offloaded momentum's copies back first
            for t, copy in saved:
                t.copy_(copy)

        return restore

    def _compare(self, locals_: list, results: dict, restore) -> None:
        """Before anything is applied: each matrix assembled whole and orthogonalized as
        dist_mode="allgather" does; each rank compares the owner's result for its rows; the
        largest difference and bound of each matrix are reduced over its group."""
        muon = self.muon
        worst, owned, failures = 0.0, 0, []
        for plan, local in zip(muon.plans, locals_):
            references, fp32 = {}, {}
            allgather_orthogonalize(muon, plan, local,
                                    lambda _, i, rows: references.update({i: rows}))
            if muon.fp32_matmul_prec != "highest":
                with eo_utils.fp32_matmul_precision("highest"):
                    allgather_orthogonalize(muon, plan, local,
                                            lambda _, i, rows: fp32.update({i: rows}))
            device = plan.param_of(0).to_local().device
            diffs = torch.zeros(len(plan.matrices), dtype=torch.float64, device=device)
            bounds = torch.zeros_like(diffs)
            for i, reference in references.items():
                if reference.numel() and (plan, i) in results:
                    diffs[i] = (results[plan, i] - reference).abs().max()
                    if fp32:
                        bounds[i] = (reference - fp32[i]).abs().max()
                    if plan.matrices[i].team:  # its Gram sums reordered; bf16: the team's own
                        bounds[i] = max(2 * bounds[i], reordering_bound(
                            plan.matrices[i], muon.newton_schulz_settings))
            dist.all_reduce(diffs, op=dist.ReduceOp.MAX, group=plan.group)
            dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=plan.group)
            worst = max(worst, diffs.max().item() if len(diffs) else 0.0)
            owned += sum(owner == plan.rank for owner in plan.owners)
            failures += [self._describe(plan, i, diffs[i].item(), bounds[i].item())
                         for i in range(len(plan.matrices))
                         if diffs[i] > bounds[i] and plan.owners[i] == plan.rank]
        # Over every rank: tensor-parallel ranks' data-parallel groups hold different matrices,
        # and all ranks must stop together.
        worst, matrices, failures = agree_on_every_rank(worst, owned, failures, muon.device())
        if failures:
            restore()
            raise MuonCheckError(
                f"muon check at iteration {muon.iteration}: the owner exchange's update differs "
                f"from the reference (TensorParallelMuon on the whole matrix); nothing of this "
                f"step was applied:\n  " + "\n  ".join(failures))
        muon.last_check = CheckResult(muon.iteration, worst, matrices)
        if muon.log_checks and dist.get_rank() == 0:
            print(f"muon check at iteration {muon.iteration}: {muon.last_check}", flush=True)

    def _describe(self, plan: GroupPlan, i: int, diff: float, bound: float) -> str:
        param_index = plan.pieces[i][0]
        p = plan.param_of(i)
        expert = ""
        if num_experts(p) > 1:
            expert = f", expert {sum(1 for j in range(i) if plan.pieces[j][0] == param_index)}"
        return (f"{self.muon.name_of(p)}{expert}: shape {tuple(plan.matrices[i].shape)}, owner "
                f"rank {plan.owners[i]} of its data-parallel group (global rank {dist.get_rank()}): "
                f"max |owner - reference| = "
                f"{diff:.6e} > bound {bound:.6e}")
