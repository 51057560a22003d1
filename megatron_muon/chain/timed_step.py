"""The chain's step in phases (observe.phases) beyond the Muon step's own: the whole step
(STEP), the grads made ready before the update (GRADS: Megatron-FSDP's grad sync where not yet
done, the NaN/Inf decision, a megatron-core chain's prepare_grads, grad norm and clipping; it
ends where such a chain calls step_with_ready_grads, else where the chain's step is called,
outside every inner optimizer's profiler range) and the scalar optimizers' steps (SCALAR,
through their step hooks). Outside megatron.training, with a report interval, its own
PhaseTimes time them, and every interval-th step rank 0 logs step_report.report's figures."""

import contextlib
import functools
import logging
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ..observe.phases import GRADS, SCALAR, STEP, PhaseTimes, phase, started, timed_by
from ..reporting.step_report import report

logger = logging.getLogger(__name__)


class TimedStep:
    """Installs the phases on `chain` (a megatron-core ChainedOptimizer, or an optimizer) and the
    `scalars` (the chain's inner optimizers that are not Muon); `timed(timers)` runs a step in
    them. `report_interval` (0: never) and `owner` (the FSDPMuonChainedOptimizer): its own
    PhaseTimes (`phase_times`) where a step comes without timers, and the report logged."""

    def __init__(self, chain: Any, scalars: list[torch.optim.Optimizer], report_interval: int = 0,
                 owner: Any = None) -> None:
        if report_interval < 0:
            raise ValueError(
                f"report_interval must be at least 0 (0: never), got {report_interval}")
        self.phase_times = PhaseTimes() if report_interval else None
        self._interval, self._owner, self._steps = report_interval, owner, 0
        self._until_update = None
        self._ends_inside = callable(getattr(chain, "step_with_ready_grads", None))
        if self._ends_inside:
            ready = chain.step_with_ready_grads

            @functools.wraps(ready)
            def step_with_ready_grads(*args, **kwargs):
                self._update_starts()
                return ready(*args, **kwargs)

            chain.step_with_ready_grads = step_with_ready_grads
        self._scalar_steps = []  # each scalar optimizer's open SCALAR phase
        for optimizer in scalars:
            ends = []
            optimizer.register_step_pre_hook(lambda *_, ends=ends: ends.append(started(SCALAR)))
            optimizer.register_step_post_hook(lambda *_, ends=ends: ends.pop()())
            self._scalar_steps.append(ends)

    @contextlib.contextmanager
    def timed(self, timers: Any) -> Iterator[None]:
        """A step within: its phases report to `timers` (Megatron's; None: to phase_times where
        there is one, else to the profiler only)."""
        if timers is None and self.phase_times is not None:
            timers = self.phase_times
            timers.reset()
        with timed_by(timers), phase(STEP):
            self._until_update = started(GRADS)
            try:
                yield
            finally:
                self._update_starts()
                for ends in self._scalar_steps:  # left open by a step that raised
                    while ends:
                        ends.pop()()
        self._steps += 1
        if self._interval and self._steps % self._interval == 0 and (
                not dist.is_initialized() or dist.get_rank() == 0):
            logger.info("muon step %d: %s", self._steps, ", ".join(
                f"{name} {value:.6g}" for name, value in report(self._owner).items()))

    def inner_step(self, chain: Any) -> Any:
        """`chain.step()`, GRADS ended before it unless the chain ends it inside (a megatron-core
        chain readies its grads in its step)."""
        if not self._ends_inside:
            self._update_starts()
        return chain.step()

    def _update_starts(self) -> None:
        """GRADS ends: the update starts, or the step ends without one (skipped)."""
        end, self._until_update = self._until_update, None
        if end is not None:
            end()
