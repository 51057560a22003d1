"""Muon's state in host memory between steps (ZeROTensorParallelMuon(offload_state=True); issue
60, not yet reachable from Megatron's flags). Each state tensor's shard lives on the host (pinned
where the params are on a GPU); the step brings one matrix's rows of it to the params' device
where it reads them, and copies them back when it is done with them, so the device holds the
state of the matrices being updated, not all of it. The copies are synchronous in this version:
exact and simple; the overlap plan.offload counts (the next exchange's state in flight while one
computes) is still to come.

The optimizer's own accounting, per step: the bytes copied each way and the most state on the
device at once (HostState.moved_to_device, moved_to_host, most_on_device)."""

import contextlib
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager

import torch
from torch.distributed.tensor import DTensor


class HostState:
    """Host copies of an optimizer's state, and the rows of it the step works on, on the device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pin = device.type == "cuda"
        self.moved_to_device = self.moved_to_host = self.most_on_device = 0
        self._on_device = 0

    def home(self, state: dict) -> None:
        """Put each DTensor of one param's state in host memory, where it is not already (a new
        state, or one a checkpoint load placed on the param's device, as torch.optim's
        load_state_dict does)."""
        for name, value in state.items():
            local = value.to_local() if isinstance(value, DTensor) else None
            if local is None or (local.device.type == "cpu" and local.is_pinned() == self.pin):
                continue
            host = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=self.pin)
            host.copy_(local)
            state[name] = DTensor.from_local(host, value.device_mesh, value.placements,
                                             run_check=False, shape=value.shape,
                                             stride=value.stride())

    def start_step(self, states: Iterable[dict]) -> None:
        """Each param's state homed (home), the step's accounting reset."""
        for state in states:
            self.home(state)
        self.moved_to_device = self.moved_to_host = self.most_on_device = 0

    @contextlib.contextmanager
    def rows(self, host_rows: torch.Tensor, read: bool = True,
             write: bool = True) -> Iterator[torch.Tensor]:
        """`host_rows` (a view of a homed state) on the device while the block runs (copied
        there where the block reads them), then copied back where it changes them. A copy on
        the CPU too, so that the CPU runs what a GPU runs."""
        nbytes = host_rows.numel() * host_rows.element_size()
        on_device = torch.empty(host_rows.shape, dtype=host_rows.dtype, device=self.device)
        if read:
            on_device.copy_(host_rows)
            self.moved_to_device += nbytes
        self._on_device += nbytes
        self.most_on_device = max(self.most_on_device, self._on_device)
        try:
            yield on_device
            if write:
                host_rows.copy_(on_device)
                self.moved_to_host += nbytes
        finally:
            self._on_device -= nbytes


def state_rows(host_state: HostState | None, rows: torch.Tensor, read: bool = True,
               write: bool = True) -> AbstractContextManager[torch.Tensor]:
    """Rows of a state where the step reads or changes them (HostState.rows): on the device if
    offloaded, else as they are."""
    return host_state.rows(rows, read, write) if host_state else contextlib.nullcontext(rows)
