"""Memory of a train step on one rank, measured: the bytes held at rest, by what holds them
(counted from the tensors: optimizer state, main weights, gradients, model weights), and the peak
each phase of the step adds above them, from torch's allocator. On CUDA that is its peak
statistics (`max_memory_allocated`, reset per phase); on CPU the profiler's allocation records
(`torch.profiler` with `profile_memory`: every allocation and free while it records)."""

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from ..compat import upstream

# What holds the bytes at rest; a storage shared by two kinds counts for the first.
AT_REST = ("optimizer state", "main weights", "gradients", "model weights")
# On CUDA, what the allocator holds beyond the tensors counted (caches, communicator buffers).
UNCOUNTED = "other"
# The phases of a train step measure_train_step measures.
PHASES = ("forward-backward", "optimizer step")
_PHASE = "megatron_muon.tools.memory.phase."


class AllocationTracker:
    """Bytes allocated on `device` since the tracker started, and, once it has stopped, their
    peak within each phase it is told of (`with tracker.phase(name)`) in `peaks`, and what was
    alive when the phase began in `starts` (so a phase adds `peaks - starts` of its own). Bytes
    freed inside the block that were allocated before it are not counted freed (torch's CPU
    allocator reports no size for them), so a CPU peak can only be overstated."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.peaks: dict[str, int] = {}
        self.starts: dict[str, int] = {}
        self._profiler = None
        self.start_bytes = 0  # on CUDA: what the allocator held when the tracker started

    def __enter__(self) -> "AllocationTracker":
        if self.cuda:
            torch.cuda.synchronize()
            self.start_bytes = torch.cuda.memory_allocated()
        else:
            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profiler.__enter__()
        return self

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.starts[name] = torch.cuda.memory_allocated() - self.start_bytes
            yield
            torch.cuda.synchronize()
            self.peaks[name] = torch.cuda.max_memory_allocated() - self.start_bytes
        else:
            with record_function(_PHASE + name):
                yield

    def __exit__(self, *exc) -> None:
        if self.cuda:
            return
        self._profiler.__exit__(*exc)
        events = upstream.profiler_events(self._profiler)
        allocations = sorted((e.start_ns(), e.nbytes()) for e in events
                             if e.name() == "[memory]" and e.device_type() == DeviceType.CPU)
        for e in events:
            if e.name().startswith(_PHASE):
                start, end = e.start_ns(), e.start_ns() + e.duration_ns()
                name = e.name().removeprefix(_PHASE)
                self.starts[name], self.peaks[name] = _live_within(allocations, start, end)


def _live_within(allocations: list[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
    """(bytes alive at `start`, the most alive until `end`), from (time, bytes allocated or
    freed) records in time order, counted from the first."""
    live, at_start, peak = 0, None, 0
    for time, nbytes in allocations:
        if time > end:
            break
        if time >= start and at_start is None:
            at_start = peak = live
        live += nbytes
        if time >= start:
            peak = max(peak, live)
    return (live, live) if at_start is None else (at_start, peak)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a Megatron optimizer (chained, wrapped, or one itself)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    parts = getattr(optimizer, "chained_optimizers", None)
    if parts is not None:
        return [inner for part in parts for inner in torch_optimizers(part)]
    return torch_optimizers(optimizer.optimizer)


def _megatron_fsdp_buffers(model_chunks) -> dict[str, list[torch.Tensor]]:
    """Megatron-FSDP's buffers by kind (its ParameterGroup's DataParallelBuffer fields: main
    weights, gradients, model weights), which hold what its params view between steps (under
    ZeRO-1/2 the unsharded compute weights are reachable through no param then)."""
    from ..chain.model_chunks import find_megatron_fsdp

    kinds = {"main weights": [], "gradients": [], "model weights": []}
    for chunk in model_chunks:
        fsdp = find_megatron_fsdp(chunk)
        for group in fsdp.param_and_grad_buffer.parameter_groups if fsdp else ():
            for field in dataclasses.fields(group):
                data = getattr(getattr(group, field.name), "data", None)
                if field.name.endswith(("buffer", "buf")) and torch.is_tensor(data):
                    kind = ("gradients" if "grad" in field.name or field.name.endswith("gbuf")
                            else "main weights" if field.name.startswith("main")
                            else "model weights")
                    kinds[kind].append(data)
    return kinds


def at_rest_bytes(model_chunks, optimizer) -> dict[str, int]:
    """Bytes of each kind (AT_REST) this rank holds between steps, every storage counted once:
    a param viewing a bucket counts the whole bucket, padding included, as the allocator does."""
    optimizers = torch_optimizers(optimizer)
    main_weights = [p for o in optimizers for g in o.param_groups for p in g["params"]]
    model_params = [p for chunk in model_chunks for p in chunk.parameters()]
    fsdp = _megatron_fsdp_buffers(model_chunks)
    held = {
        "optimizer state": [v for o in optimizers for state in o.state.values()
                            for v in state.values() if torch.is_tensor(v)],
        "main weights": main_weights + fsdp["main weights"],
        "gradients": [g for p in main_weights + model_params
                      for g in (p.grad, getattr(p, "main_grad", None)) if g is not None]
        + fsdp["gradients"],
        # Megatron DDP's `buffers` attribute is its list of gradient buffers: nn.Module's own.
        "model weights": model_params + fsdp["model weights"]
        + [b for chunk in model_chunks for b in torch.nn.Module.buffers(chunk)],
    }
    seen, counted = set(), {}
    for kind in AT_REST:
        counted[kind] = 0
        for t in held[kind]:
            storage = _local(t).untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                counted[kind] += storage.nbytes()
    return counted


@dataclass(frozen=True)
class StepMemory:
    """One rank's memory in a train step: bytes at rest by kind, and the most each phase holds
    above what was alive when the step began."""
    at_rest: dict[str, int]
    phases: dict[str, int]

    @property
    def resting(self) -> int:
        return sum(self.at_rest.values())

    @property
    def peak(self) -> int:
        return self.resting + max(self.phases.values(), default=0)


def measure_train_step(model_chunks, optimizer, forward_backward: Callable[[], None],
                       device: torch.device, steps: int = 1) -> StepMemory:
    """Run 1 + `steps` train steps (`forward_backward()`, which leaves the gradients synced, then
    `optimizer.step()`) and measure the last `steps`. On CUDA each phase's figure is the most it
    added in any of them (which buffers are alive together can depend on when asynchronous work
    ends). On CPU, where the CPU layer runs every collective to its end, it is the least: the
    steps then differ only where gloo drops a finished collective's tensors, on its own thread,
    after the next phase has begun (seen: Megatron-FSDP's 28 MiB param-gather buffer alive twice
    in one step of three, Adam's and Muon's alike, at W=4 on 2 cores). The first step, tracked but
    not measured, makes every buffer a step frees one the tracker saw allocated (on CPU a free of
    memory allocated before it started goes uncounted) and creates the optimizer's state, counted
    at rest."""
    with AllocationTracker(device) as tracker:
        forward_backward()
        optimizer.step()
        for step in range(steps):
            with tracker.phase(f"{PHASES[0]} {step}"):
                forward_backward()
            with tracker.phase(f"{PHASES[1]} {step}"):
                optimizer.step()
    at_rest = at_rest_bytes(model_chunks, optimizer)
    began = [tracker.starts[f"{PHASES[0]} {step}"] for step in range(steps)]
    if tracker.cuda:
        at_rest[UNCOUNTED] = max(0, tracker.start_bytes + began[-1] - sum(at_rest.values()))
    over_steps = max if tracker.cuda else min
    return StepMemory(at_rest, {phase: over_steps(tracker.peaks[f"{phase} {step}"] - began[step]
                                                  for step in range(steps)) for phase in PHASES})
