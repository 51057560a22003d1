"""The chain's step in phases (distribution.phases) beyond the Muon step's own: the whole step
(STEP), the grads made ready before the update (GRADS: Megatron-FSDP's grad sync where not yet
done, megatron-core's prepare_grads, grad norm and clipping, the NaN/Inf decision; it ends where
a megatron-core chain calls step_with_ready_grads, outside every inner optimizer's profiler
range) and the scalar optimizers' steps (SCALAR, through their step hooks)."""

import contextlib
import functools
from typing import Any, Iterator

import torch

from ..distribution.phases import GRADS, SCALAR, STEP, phase, started, timed_by


class TimedStep:
    """Installs the phases on `chain` (a megatron-core ChainedOptimizer, or an optimizer) and the
    `scalars` (the chain's inner optimizers that are not Muon); `timed(timers)` runs a step in
    them."""

    def __init__(self, chain: Any, scalars: list[torch.optim.Optimizer]) -> None:
        self._until_update = None
        self._grads = callable(getattr(chain, "step_with_ready_grads", None))
        if self._grads:
            ready = chain.step_with_ready_grads

            @functools.wraps(ready)
            def step_with_ready_grads(*args, **kwargs):
                self._update_starts()
                return ready(*args, **kwargs)

            chain.step_with_ready_grads = step_with_ready_grads
        for optimizer in scalars:
            ends = []
            optimizer.register_step_pre_hook(lambda *_, ends=ends: ends.append(started(SCALAR)))
            optimizer.register_step_post_hook(lambda *_, ends=ends: ends.pop()())

    @contextlib.contextmanager
    def timed(self, timers: Any) -> Iterator[None]:
        """A step within: its phases report to `timers` (Megatron's, or None: profiler only)."""
        with timed_by(timers), phase(STEP):
            self._until_update = started(GRADS) if self._grads else None
            try:
                yield
            finally:
                self._update_starts()

    def _update_starts(self) -> None:
        """GRADS ends: the update starts, or the step ends without one (skipped)."""
        end, self._until_update = self._until_update, None
        if end is not None:
            end()
