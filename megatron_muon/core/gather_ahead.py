"""The gather inside backward, on the optimizer's side: an exchange's rows sent to their owners
before the step, once their gradients are final (the chain's hooks say when: chain/
backward_gather.py), and each owner forming, at the step, the very update its holders would
have sent.

Why it is exact: Muon's update is elementwise in two things known before the step, the momentum
before this step and the reduced gradient; what Megatron does to the gradient between its
reduce-scatter and the optimizer (the clip by the grad norm, known only after backward) is
elementwise too. The owner replays that on the whole gradient (`replay`: megatron-core's own
function with the arguments the step's clip took), then runs momentum and Nesterov
(muon_math.momentum_and_nesterov_) on the whole matrix: the same operations on the same values
as each holder's on its rows, so the same bits. Weight decay acts on the weights alone where
this runs (muon_math.weight_decay_leaves_the_gradient); the holders still update their own
momentum rows and weights at the step, as without it.
"""

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from ..distribution.exchange import Gathered, GatheredPart, issue_gather, owner_exchange
from ..planner.group_plan import GroupPlan
from .muon_math import momentum_and_nesterov_

if TYPE_CHECKING:
    from .zero_muon import ZeROTensorParallelMuon

# What Megatron did to a param's reduced gradient before the optimizer, done again in place on
# an owner's whole gradient of it (the chain's BackwardGather.replay).
GradientReplay = Callable[[DTensor, torch.Tensor], None]
Orthogonalize = Callable[[list[int], list[torch.Tensor]], list[torch.Tensor]]


class GatheredAhead:
    """One optimizer's exchanges part of which (the plan's `early` matrices) gathered before its
    step, by (plan, exchange index): each holds the owned matrices' own rows and the gather's
    receive buffer until the step consumes it (`exchange`) or drops it (`discard`)."""

    def __init__(self, muon: "ZeROTensorParallelMuon") -> None:
        self.muon = muon
        self.started: dict[tuple[GroupPlan, int], tuple[dict[int, torch.Tensor], Gathered]] = {}
        self.replay: GradientReplay | None = None

    def start(self, plan: GroupPlan, k: int, gradient: Callable[[DTensor], torch.Tensor]) -> None:
        """The early matrices of exchange k of `plan` gathered now: each one's old momentum rows,
        its gradient rows and an adaptive variant's travelling second moment side by side, to
        its owner. `gradient(p)`: this rank's reduced gradient shard of param p, as the step
        will read it."""
        routes = plan.routes_carrying_momentum[k]
        local = {}
        for i in routes.batch:
            grad = plan.rows_of(i, gradient(plan.param_of(i)))
            momentum, *state = self._state_rows(plan, i)
            local[i] = torch.cat([momentum, grad, *state], dim=1)
        received, _, work = issue_gather(routes, plan.group, local)
        for i in routes.batch:  # sent: the collective holds what it sends until it ends
            if i not in routes.owned:
                local[i] = local[i].new_empty((0, local[i].shape[1]))
        self.started[(plan, k)] = (local, Gathered(received, None, work))

    def _state_rows(self, plan: GroupPlan, i: int) -> list[torch.Tensor]:
        """This rank's rows of matrix i's state before this step that its owner needs: the
        momentum and, where an adaptive variant's travels (SecondMoment.moment2_travels), its
        second moment, as the holders' update_rows read them; zeros before the first step, which
        creates them (ZeROTensorParallelMuon.initial_state)."""
        p = plan.param_of(i)
        state = self.muon.state.get(p) or self.muon.initial_state(p)
        return [plan.rows_of(i, state[name].to_local())
                for name in ("momentum_buffer", "moment2_buffer")[:1 + self._moment2_travels]]

    @property
    def _moment2_travels(self) -> bool:
        second_moment = self.muon.second_moment
        return second_moment is not None and second_moment.moment2_travels

    def exchange(self, plan: GroupPlan, k: int, local: dict[int, torch.Tensor],
                 orthogonalize: Orthogonalize,
                 apply: Callable[[int, torch.Tensor], None]) -> Iterator[None] | None:
        """Exchange k where part of it was gathered ahead (None where not): the rest gathered
        now (`local`: this rank's update rows of each matrix, as the exchange's), the owners
        forming each update gathered ahead (`update`), then `orthogonalize` as the exchange
        would, one scatter for all."""
        entry = self.started.pop((plan, k), None)
        if entry is None:
            return None
        ahead = plan.routes_carrying_momentum[k]

        def formed_then_orthogonalized(owned, fulls):
            if owned[0] not in plan.early:
                return orthogonalize(owned, fulls)
            return orthogonalize(owned, [self.update(plan, i, full)
                                         for i, full in zip(owned, fulls)])

        return owner_exchange(plan.routes[k], plan.group, local, formed_then_orthogonalized,
                              apply, GatheredPart(ahead, *entry), plan.routes_at_step[k])

    def rows_sent(self, plan: GroupPlan, k: int, i: int, rows: torch.Tensor) -> torch.Tensor:
        """This rank's `rows` of matrix i's update, or none where exchange k gathered it ahead:
        its owner forms the update (the rows were computed for what computing them does to the
        holder's momentum and weight)."""
        if i in plan.early and (plan, k) in self.started:
            return rows.new_empty((0, rows.shape[1]))
        return rows

    def update(self, plan: GroupPlan, i: int, parts: torch.Tensor) -> torch.Tensor:
        """Matrix i's update on its owner, from its whole old momentum, gradient and travelling
        state side by side (`parts`), as its holders form theirs on their rows; an adaptive
        variant's travelling columns beside it (SecondMoment.travelling), as the holders' are."""
        cols, p = plan.matrices[i].cols, plan.param_of(i)
        momentum, grad, state = (part.contiguous() for part in parts.split(
            [cols, cols, parts.shape[1] - 2 * cols], dim=1))
        self.replay(p, grad)
        update = momentum_and_nesterov_(self.muon, grad, momentum, self.muon.group_of(p))
        if not self._moment2_travels:
            return update
        return torch.cat([update, self.muon.second_moment.travelling(grad, state)], dim=1)

    def discard(self) -> None:
        """Every exchange gathered ahead dropped, its gather awaited: a skipped step, a step that
        runs another path, or a gradient changed after its gather."""
        for _, gathered in self.started.values():
            if gathered.work is not None:
                gathered.work.wait()
        self.started.clear()
