"""The one instrumentation hook: every collective a step sends through torch.distributed (the
optimizer's, Megatron-FSDP's, megatron-core's), seen at its c10d op, and the bytes of the owner
exchange's buffers alive at once (distribution.exchange reports them: `held`)."""

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..compat import upstream


class Observer:
    """What `observed(observer)` reports to; subclass it. `collective`: every collective this
    process issues through torch.distributed (the optimizer's, Megatron-FSDP's, megatron-core's),
    after it is issued; `buffers`: the bytes of the owner exchange's and all_gather_rows'
    buffers alive now, whenever some are added."""

    def collective(self, call: "Collective") -> None:
        pass

    def buffers(self, live_bytes: int) -> None:
        pass


class Collective(NamedTuple):
    """One collective: its c10d op (e.g. "alltoall_base_", "_allgather_base_", "allreduce_"),
    its group's size and this rank's place in it, the tensors handed to it, and the bytes this
    rank receives from other ranks (gathers and all-to-alls; 0 for reductions and broadcasts)."""

    name: str
    group_size: int
    group_rank: int
    tensors: tuple
    received_bytes: int


class Traffic(Observer):
    """Counts of what a step sends: collectives over more than one rank (by c10d op), bytes
    received from other ranks, and the peak bytes of the exchange's buffers alive at once."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.collectives, self.received_bytes, self.peak_buffer_bytes = 0, 0, 0
        self.by_name: Counter = Counter()

    def collective(self, call: Collective) -> None:
        if call.group_size > 1:
            self.collectives += 1
            self.received_bytes += call.received_bytes
            self.by_name[call.name] += 1

    def buffers(self, live_bytes: int) -> None:
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, live_bytes)


_observers: list[Observer] = []
_live_bytes = 0


@contextlib.contextmanager
def observed(observer: Observer) -> Iterator[Observer]:
    """Report to `observer` while the block runs (see Observer). It sees collectives at the c10d
    ops torch.distributed dispatches to, through a dispatch mode: nothing is patched, and nothing
    is observed (or slowed down) outside the block; inside it every tensor op passes through
    Python, so time a step apart from the one observed."""
    _observers.append(observer)
    try:
        with _CollectiveMode():
            yield observer
    finally:
        _observers.remove(observer)


class held:
    """Report `tensors` (None skipped) alive while the block runs, holding no reference to them:
    the block may free them (the assembled matrices, batch by batch; a generator context
    manager would keep its arguments, and every one of them, until the block ends)."""

    def __init__(self, *tensors):
        self.nbytes = _nbytes(t for t in tensors if t is not None) if _observers else 0

    def __enter__(self) -> None:
        global _live_bytes
        _live_bytes += self.nbytes
        for observer in _observers:
            observer.buffers(_live_bytes)

    def __exit__(self, *exc) -> None:
        global _live_bytes
        _live_bytes -= self.nbytes


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _received_bytes(name: str, args: dict, rank: int, size: int) -> int:
    if name == "alltoall_base_":
        output, splits = args["output"], args["output_split_sizes"]
        row = output.numel() // output.shape[0] if output.dim() and output.shape[0] else 0
        own = splits[rank] * row if splits else output.numel() // size
        return (output.numel() - own) * output.element_size()
    if name == "_allgather_base_":
        return _nbytes([args["output_tensor"]]) - _nbytes([args["input_tensor"]])
    if name == "allgather_into_tensor_coalesced_":
        return _nbytes(args["outputs"]) - _nbytes(args["inputs"])
    if name == "allgather_":  # output_tensors[input][rank]
        return sum(_nbytes(t for j, t in enumerate(outputs) if j != rank)
                   for outputs in args["output_tensors"])
    if name == "allgather_coalesced_":  # output_lists[rank][input]
        return sum(_nbytes(outputs) for j, outputs in enumerate(args["output_lists"]) if j != rank)
    return 0


class _CollectiveMode(upstream.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Every other op of the observed block passes here too: c10d's data collectives only.
        if func.namespace != "c10d" or func.name().startswith("c10d::barrier"):
            return out
        bound = dict(zip(upstream.op_argument_names(func), args), **(kwargs or {}))
        if "process_group" not in bound:
            return out
        name = func.name().removeprefix("c10d::")
        group = dist.ProcessGroup.unbox(bound["process_group"])
        rank, size = group.rank(), group.size()
        call = Collective(name, size, rank,
                          tuple(t for value in bound.values() for t in _tensors(value)),
                          _received_bytes(name, bound, rank, size))
        for observer in list(_observers):
            observer.collective(call)
        return out


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
