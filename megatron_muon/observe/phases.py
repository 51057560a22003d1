"""The optimizer step's phases: each a torch profiler range (benchmarks/step_profile.py reads the
labels) and, while a run's Megatron timers are in use (`timed_by`: megatron-core's
OptimizerConfig.timers, which megatron.training sets), a Megatron timer named as megatron-core
names its own: the chain's whole step "muon-step" at level 1, its parts ("muon-gather", ...)
at level 2, so `--timing-log-level` reports each one's (min, max) over ranks beside
megatron-core's optimizer timers (front_ends.megatron_lm logs them) and
`--log-timers-to-tensorboard` writes them. A Megatron timer synchronizes the device when it
starts and stops, as megatron-core's own timers do: at level 2 a step may run slower than
without. Outside megatron.training, PhaseTimes stands in for Megatron's timers."""

import contextlib
import time
from typing import Any, Callable

import torch
from torch.profiler import record_function

STEP, GRADS, UPDATE, GATHER, NEWTON_SCHULZ, SCATTER, SCALAR, PARAM_SYNC, CHECK, OFFLOAD = (
    "muon.step", "muon.grads", "muon.update", "muon.gather", "muon.newton_schulz",
    "muon.scatter", "muon.scalar_optimizer", "muon.param_sync", "muon.check",
    "muon.offload_copies")
# Each phase's Megatron timer and its level: the step at 1, the disjoint parts it runs at 2.
TIMERS = {STEP: ("muon-step", 1), GRADS: ("muon-grads", 2), UPDATE: ("muon-update", 2),
          GATHER: ("muon-gather", 2), NEWTON_SCHULZ: ("muon-newton-schulz", 2),
          SCATTER: ("muon-scatter", 2), SCALAR: ("muon-scalar-optimizer", 2),
          PARAM_SYNC: ("muon-param-sync", 2), CHECK: ("muon-check", 2),
          OFFLOAD: ("muon-offload-copies", 2)}
# Counted apart wherever they run: the offloaded state's copies happen inside the update and the
# scalar optimizer's step, whose timers pause meanwhile (the parts still add up to the step).
CARVED_OUT = frozenset({OFFLOAD})

_timers: Any = None  # Megatron's Timers while a step runs under timed_by, else None
_open_parts = 0  # level-2 phases open now
_counting: Any = None  # the level-2 timer running now


def timer_names(level: int) -> list[str]:
    """The timers of the phases at `level` or below (--timing-log-level)."""
    return [name for name, at in TIMERS.values() if at <= level]


@contextlib.contextmanager
def timed_by(timers: Any):
    """Phases within report to `timers` (megatron.core.timers.Timers, or None: profiler only)."""
    global _timers
    previous, _timers = _timers, timers
    try:
        yield
    finally:
        _timers = previous


@contextlib.contextmanager
def phase(label: str):
    """The profiler range `label` and, under timed_by, its Megatron timer; a level-2 phase
    inside another (all_gather_rows inside the check's reference) counts in the outer one's
    timer only, so the level-2 timers add up to the step, but a CARVED_OUT one, for which the
    outer one's timer pauses."""
    global _open_parts, _counting
    name, level = TIMERS[label]
    paused = _counting if label in CARVED_OUT else None
    counted = _timers is not None and (level == 1 or not _open_parts or paused is not None)
    timer = _timers(name, log_level=level) if counted else None
    outer = _counting
    if timer is not None and level > 1:
        _counting = timer
    _open_parts += level > 1
    try:
        with record_function(label):
            if paused is not None:
                paused.stop()
            if timer is not None:
                timer.start()
            try:
                yield
            finally:
                if timer is not None:
                    timer.stop()
                if paused is not None:
                    paused.start()
    finally:
        _open_parts -= level > 1
        _counting = outer


def started(label: str) -> Callable[[], None]:
    """`label`'s phase begun outside a with block (from a hook); call what it returns to end it."""
    stack = contextlib.ExitStack()
    stack.enter_context(phase(label))
    return stack.close


class PhaseTimes:
    """Megatron's timers' calling convention (`timers(name, log_level=...)` giving a timer with
    start() and stop(), as `phase` calls megatron.core.timers.Timers) for runs
    without megatron.training: {timer name: seconds} of the last step (`seconds`; `reset()`
    before each), the device synchronized at each start and stop, as Megatron's timers do."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str, log_level: int = 0) -> "_Timer":
        return _Timer(self.seconds, name)

    def reset(self) -> None:
        self.seconds.clear()


class _Timer:
    def __init__(self, seconds: dict[str, float], name: str) -> None:
        self._seconds, self._name, self._start = seconds, name, 0.0

    def start(self) -> None:
        _synchronize()
        self._start = time.perf_counter()

    def stop(self) -> None:
        _synchronize()
        elapsed = time.perf_counter() - self._start
        self._seconds[self._name] = self._seconds.get(self._name, 0.0) + elapsed


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
