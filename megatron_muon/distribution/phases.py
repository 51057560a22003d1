"""The optimizer step's phases: each a torch profiler range (benchmarks/step_profile.py reads the
labels) and, while a run's Megatron timers are in use (`timed_by`: megatron-core's
OptimizerConfig.timers, which megatron.training sets), a Megatron timer named as megatron-core
names its own: the chain's whole step "muon-step" at level 1, its parts ("muon-gather", ...)
at level 2, so `--timing-log-level` reports each one's (min, max) over ranks beside
megatron-core's optimizer timers (integrations.megatron_lm logs them) and
`--log-timers-to-tensorboard` writes them. A Megatron timer synchronizes the device when it
starts and stops, as megatron-core's own timers do: at level 2 a step may run slower than
without."""

import contextlib
from typing import Any

from torch.profiler import record_function

STEP, GATHER, NEWTON_SCHULZ, SCATTER, PARAM_SYNC = (
    "muon.step", "muon.gather", "muon.newton_schulz", "muon.scatter", "muon.param_sync")
# Each phase's Megatron timer and its level.
TIMERS = {STEP: ("muon-step", 1), GATHER: ("muon-gather", 2),
          NEWTON_SCHULZ: ("muon-newton-schulz", 2), SCATTER: ("muon-scatter", 2),
          PARAM_SYNC: ("muon-param-sync", 2)}

_timers: Any = None  # Megatron's Timers while a step runs under timed_by, else None


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
    """The profiler range `label` and, under timed_by, its Megatron timer."""
    name, level = TIMERS[label]
    timer = _timers(name, log_level=level) if _timers is not None else None
    with record_function(label):
        if timer is not None:
            timer.start()
        try:
            yield
        finally:
            if timer is not None:
                timer.stop()
