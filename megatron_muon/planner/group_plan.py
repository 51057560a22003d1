"""One exchange group's plan: a Draft (owners and batches, before its exchanges are packed
within the ranks' budgets) and the GroupPlan ZeROTensorParallelMuon carries out each step."""

import dataclasses
import functools
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..distribution.dtensor_rows import as_rows
from ..distribution.exchange import OwnerRoutes
from ..plan import (Matrix, OwnedBatches, StepCost, alone_working, newton_schulz_flops,
                    offloaded, owned_batches, packed_beside, packed_plan, state_saved,
                    team_all_reduces)


class GroupPlan:
    """The matrices of one exchange group, fixed at construction: one per param, or one per
    expert of a stacked expert weight; where this rank's rows of each sit in its param's local
    shard; their owners, this rank's routes through the exchanges that carry their batches, each
    rank's working-memory budget they were planned within (`budgets`: plan.rank_budgets), and
    the measured StepCost the owners were chosen by (None: byte-first, or no owners); a matrix
    split over a team is its blocks (plan.team_split), `team_groups` the process groups of the teams
    this rank is a member of."""

    def __init__(self, params: list[DTensor], matrices: list[Matrix],
                 pieces: list[tuple[int, int, int]], owners: list[int],
                 exchanges: list[list[list[int]]], group: dist.ProcessGroup | None,
                 budgets: list[int], cost: StepCost | None = None,
                 team_groups: dict | None = None, fits_beside: bool = True,
                 ahead: int = 0, early: frozenset[int] = frozenset()) -> None:
        self.params, self.matrices, self.pieces, self.owners = params, matrices, pieces, owners
        self.group, self.budgets, self.cost = group, budgets, cost
        # The matrices that gather inside backward, in the first `ahead` exchanges (packed_plan).
        self.ahead, self.early = ahead, early
        self.fits_beside = fits_beside
        self.team_groups = team_groups or {}
        self.rank = dist.get_rank(group)
        self.routes = [OwnerRoutes(matrices, owners, batches, self.rank) for batches in exchanges]

    def param_of(self, i: int) -> DTensor:
        return self.params[self.pieces[i][0]]

    @functools.cached_property
    def routes_carrying_momentum(self) -> list[OwnerRoutes]:
        """The routes of the first `ahead` exchanges' batches that gather inside backward: the
        same owners, each row's old momentum beside its gradient (Matrix.carrying_momentum)."""
        matrices = [matrix.carrying_momentum() for matrix in self.matrices]
        return [OwnerRoutes(matrices, self.owners, early, self.rank)
                for early, _ in self._split_exchanges()]

    @functools.cached_property
    def routes_at_step(self) -> list[OwnerRoutes | None]:
        """The routes of the first `ahead` exchanges' other batches, gathered at the step (None:
        none)."""
        return [OwnerRoutes(self.matrices, self.owners, rest, self.rank) if rest else None
                for _, rest in self._split_exchanges()]

    def _split_exchanges(self) -> list[tuple[list[list[int]], list[list[int]]]]:
        return [([batch for batch in routes.batches if batch[0] in self.early],
                 [batch for batch in routes.batches if batch[0] not in self.early])
                for routes in self.routes[:self.ahead]]

    def bytes_received(self) -> int:
        """What this rank receives in one owner step (gather and scatter)."""
        return sum(sum(route.recv_counts) * self.param_of(0).element_size()
                   for routes in self.routes for route in (routes.gather, routes.scatter)
                   if route.moves)

    def collectives(self, steps: int) -> int:
        """The collectives this rank takes part in during one owner step of `steps` Newton-Schulz
        iterations: each exchange's gather and scatter all-to-all where rows move, and its
        teams' all-reduces (plan.team_all_reduces)."""
        all_to_alls = sum(route.moves for routes in self.routes
                          for route in (routes.gather, routes.scatter))
        return all_to_alls + len(team_all_reduces(self.matrices, self.owners, steps).get(
            self.rank, []))

    def newton_schulz_flops(self) -> dict[int, int]:
        """{global rank: its Newton-Schulz FLOPs of one iteration in this group}
        (plan.newton_schulz_flops)."""
        ranks = dist.get_world_size(self.group)
        flops = newton_schulz_flops(self.matrices, self.owners, 1, ranks)
        return {dist.get_global_rank(self.group, r) if self.group else r: f
                for r, f in enumerate(flops)}

    def rows_of(self, i: int, local: torch.Tensor) -> torch.Tensor:
        """This rank's rows of matrix i within `local`, its param's local shard (or a tensor
        shaped like it); of a team's column block, their columns of it."""
        _, lo, hi = self.pieces[i]
        team = self.matrices[i].team
        if team and team.dim == 1:
            return as_rows(local)[lo:hi, team.start:team.start + self.matrices[i].cols]
        return as_rows(local)[lo:hi]

    def grad_rows(self, i: int) -> torch.Tensor:
        """This rank's rows of matrix i's gradient (zeros where Megatron-FSDP leaves grad=None:
        an empty shard)."""
        p = self.param_of(i)
        if p.grad is None:
            return torch.zeros_like(self.rows_of(i, p.to_local()))
        return self.rows_of(i, p.grad.to_local())


@dataclasses.dataclass(frozen=True)
class Draft:
    """One exchange group's plan before its exchanges are packed: its budgets wait for its
    ranks' savings and headroom over every group they step. `choosing`: owned_batches' settings
    its owners were chosen with."""
    params: list
    matrices: list[Matrix]
    pieces: list[tuple[int, int, int]]
    owned: OwnedBatches
    group: dist.ProcessGroup
    cost: StepCost | None
    choosing: dict
    # {team: its process group} of the teams this rank is a member of (distribution.team_groups)
    team_groups: dict = dataclasses.field(default_factory=dict)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def saved(self) -> list[int]:
        return state_saved(self.matrices, self.params[0].element_size())

    def alone(self) -> list[int]:
        return alone_working(self.matrices, self.owned.owners, self.owned.batches,
                             self.params[0].element_size())

    def packed(self, max_exchange_bytes: int | None, headroom: int | None,
               saved: list[int] | None = None, reserved: list[int] | None = None,
               ahead: bool = False) -> GroupPlan:
        """Its exchanges packed (plan.packed_plan, `ahead`: the gather inside backward's first;
        with `reserved`, beside another group's: plan.packed_beside, and whether this rank holds
        both within its budget)."""
        args = (self.matrices, self.owned, self.params[0].element_size(), max_exchange_bytes,
                headroom, saved)
        plan, fits = ((packed_plan(*args, ahead=ahead), None) if reserved is None
                      else packed_beside(*args, reserved, ahead))
        return GroupPlan(self.params, self.matrices, self.pieces, plan.owners, plan.exchanges,
                         self.group, plan.budgets, self.cost, self.team_groups,
                         fits_beside=fits is None or fits[self.rank], ahead=plan.ahead,
                         early=plan.early)

    def beside(self, base: list[float]) -> "Draft":
        """This draft with owners chosen again, each rank's load starting at `base` (its load in
        the groups whose exchanges run interleaved with this one's: owned_batches), and no team
        groups yet (its teams' members may have changed)."""
        owned = owned_batches(self.matrices, self.params[0].element_size(),
                              cost=self.cost, base=base, **self.choosing)
        return dataclasses.replace(self, owned=owned, team_groups={})


def offloaded_params(plans: Sequence[GroupPlan], fraction: float) -> list[DTensor]:
    """The params whose state goes to host memory: plan.offloaded's pick over the params in the
    order the step visits their matrices, each sized by its whole state (a stacked expert
    weight's matrices together: a param's state is one tensor), so that every rank picks the
    same params. Where each param is one matrix, as in the scale model's plans, these are the
    matrices plan.offload_figures picks."""
    sizes: dict[DTensor, int] = {}
    for plan in plans:
        for routes in plan.routes:
            for i in (i for batch in routes.batches for i in batch):
                matrix = plan.matrices[i]
                elements = matrix.layout.num_rows * (matrix.cols + matrix.moment2_cols)
                sizes[plan.param_of(i)] = sizes.get(plan.param_of(i), 0) + elements
    return [p for p, picked in zip(sizes, offloaded(list(sizes.values()), fraction)) if picked]
