"""Where an optimizer step's time goes, from torch.profiler's record of it (nothing patched): each
op's own time on the calling thread, by phase:

- elementwise: Muon's ops other than matrix multiplies (momentum, weight decay, the update,
  Newton-Schulz's normalization), inside a Muon optimizer's step (ours or megatron-core's);
- gather, scatter: our owner exchange's (observe.phases' GATHER / SCATTER labels: issuing,
  waiting, assembling; allgather mode's gathers too);
- ns_matmul: Newton-Schulz's matrix multiplies, inside a Muon step;
- scalar_opt: the scalar optimizer (torch.optim's `Optimizer.step#Adam.step` label);
- param_sync: installing and gathering the updated params (observe.phases' PARAM_SYNC label:
  the wait for the gather too), and gathers and broadcasts outside our exchange (megatron-core's);
- other: the rest (the chained optimizer's glue, grad norm, Python).
"""

from collections import Counter

from torch.profiler import ProfilerActivity, profile, record_function

from megatron_muon.observe.phases import GATHER, PARAM_SYNC, SCATTER

PHASES = ("elementwise", "gather", "ns_matmul", "scatter", "scalar_opt", "param_sync", "other")
LABELS = {GATHER: "gather", SCATTER: "scatter", PARAM_SYNC: "param_sync"}
STEP = "bench.optimizer_step"
MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}
SCALAR_OPTIMIZERS = ("Adam", "AdamW")
PARAM_SYNC_OPS = ("c10d::allgather", "c10d::_allgather_base", "c10d::broadcast")


def profiled(step) -> dict[str, float]:
    """Run `step()` once under the profiler; seconds of the step by phase (their sum is the
    step's time on this thread, the profiler's overhead included)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function(STEP):
            step()
    seconds: Counter = Counter()
    for root in (event for event in prof.events() if event.name == STEP):
        _add(root, "other", seconds)
    return {phase: seconds[phase] for phase in PHASES}


def _add(event, inherited: str, seconds: Counter) -> None:
    phase = _phase(event.name, inherited)
    seconds[phase] += event.self_cpu_time_total / 1e6
    for child in event.cpu_children:
        _add(child, phase, seconds)


def _phase(name: str, inherited: str) -> str:
    if inherited in ("scalar_opt", "gather", "scatter", "param_sync"):
        return inherited
    if name.startswith("Optimizer.step#"):
        optimizer = name.removeprefix("Optimizer.step#").split(".")[0]
        return "scalar_opt" if optimizer in SCALAR_OPTIMIZERS else "elementwise"
    if name in LABELS:
        return LABELS[name]
    if inherited == "elementwise" and name in MATMULS:
        return "ns_matmul"
    if name.startswith(PARAM_SYNC_OPS):
        return "param_sync"
    return inherited
