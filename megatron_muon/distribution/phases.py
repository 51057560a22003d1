"""The optimizer step's phases: each a torch profiler range (benchmarks/step_profile.py reads the
labels) and, while a run's Megatron timers are in use (`timed_by`: megatron-core's
OptimizerConfig.timers, which megatron.training sets), a Megatron timer of level 2 named as
megatron-core names its own ("muon-gather", ...), so `--timing-log-level 2` reports each phase's
(min, max) over ranks beside megatron-core's optimizer timers (integrations.megatron_lm logs
them) and `--log-timers-to-tensorboard` writes them. A Megatron timer synchronizes the device
when it starts and stops, as megatron-core's own level-2 timers do: at level 2 a step may run
slower than without."""

import contextlib
from typing import Any

from torch.profiler import record_function

GATHER, NEWTON_SCHULZ, SCATTER, PARAM_SYNC = (
    "muon.gather", "muon.newton_schulz", "muon.scatter", "muon.param_sync")
# Each phase's Megatron timer.
TIMER_NAMES = {GATHER: "muon-gather", NEWTON_SCHULZ: "muon-newton-schulz",
               SCATTER: "muon-scatter", PARAM_SYNC: "muon-param-sync"}
TIMER_LEVEL = 2

_timers: Any = None  # Megatron's Timers while a step runs under timed_by, else None


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
    timer = _timers(TIMER_NAMES[label], log_level=TIMER_LEVEL) if _timers is not None else None
    with record_function(label):
        if timer is not None:
            timer.start()
        try:
            yield
        finally:
            if timer is not None:
                timer.stop()
