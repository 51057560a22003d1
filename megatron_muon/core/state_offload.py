"""Optimizer state in host memory between steps (--optimizer-cpu-offload with
--optimizer-offload-fraction). The offloaded params' state shards live on the host (pinned where
the params are on a GPU). Muon's step (ZeROTensorParallelMuon(offload_fraction=...)) brings one
matrix's rows of it to the params' device where it reads them, and copies them back when it is
done with them, so the device holds the state of the matrices being updated, not all of it. On
CUDA the copies run on a stream of their own: Muon's next exchange's momentum comes while the
current one computes (HostState.prefetch, which the owner step calls an exchange ahead; an
adaptive variant's state comes as it is read), and changed rows go back while the step goes on;
the step waits for the last of them before it returns (finish_step), so nothing on the host reads
a row still in flight. On the CPU the same calls copy at once, in the same order. The scalar
optimizer's state (Adam's moments of norms, biases, embeddings: a small share of a model's) comes
to the device whole for its step and goes back after it (offload_between_steps), so its step runs
where and as it runs without offload.

The optimizer's own accounting, per step: the bytes copied each way, those of them copied an
exchange ahead, and the most state on the device at once (HostState.moved_to_device, moved_to_host,
moved_ahead, most_on_device); the copies and the waits for them in their own phase (OFFLOAD)."""

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager

import torch
from torch.distributed.tensor import DTensor

from ..observe.phases import OFFLOAD, phase
from ..plan import offloaded


class HostState:
    """The offloaded params' state in host memory, and the rows of it the step works on, on the
    device."""

    def __init__(self, device: torch.device, params: Sequence[DTensor]):
        self.device = device
        self.params = set(params)
        self.pin = device.type == "cuda"
        self.moved_to_device = self.moved_to_host = self.most_on_device = self.moved_ahead = 0
        self._on_device = 0
        self._copies = torch.cuda.Stream(device) if self.pin and self.params else None
        # Rows on their way to the device, by where they sit on the host: (copy, its event).
        self._prefetched: dict[tuple, tuple[torch.Tensor, torch.cuda.Event | None]] = {}

    def _at_home(self, local: torch.Tensor) -> bool:
        return local.device.type == "cpu" and local.is_pinned() == self.pin

    def _new_home(self, local: torch.Tensor) -> torch.Tensor:
        return torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=self.pin)

    def _device_buffer(self, host: torch.Tensor) -> torch.Tensor:
        """An empty device tensor for `host`'s values."""
        return torch.empty(host.shape, dtype=host.dtype, device=self.device)

    def home(self, p: DTensor, state: dict) -> None:
        """Put `p`'s state in host memory if `p` is offloaded, where it is not already (a new
        state, or one a checkpoint load placed on the param's device, as torch.optim's
        load_state_dict does)."""
        if p not in self.params:
            return
        for name, value, local in _tensors(state):
            if not self._at_home(local):
                host = self._new_home(local)
                _copy(host, local)
                state[name] = _placed_like(value, host)

    def new_step(self) -> None:
        self.moved_to_device = self.moved_to_host = self.most_on_device = self.moved_ahead = 0

    @contextlib.contextmanager
    def stepping(self, state: Mapping[DTensor, dict]) -> Iterator[None]:
        """One step of the optimizer whose `state` this is: each offloaded param's state homed
        (home) and the accounting reset before it, every copy back done after it
        (finish_step)."""
        for p in self.params:
            self.home(p, state[p])
        self.new_step()
        try:
            yield
        finally:
            self.finish_step()

    def to_device(self, state: dict) -> dict:
        """One param's homed state on the device for a step (a state not yet homed stays where
        it is); returns {name: its host tensor} for to_host."""
        homes = {}
        for name, value, host in _tensors(state):
            if self._at_home(host):
                local = self._device_buffer(host)
                _copy(local, host)
                homes[name] = host
                self._hold(host.nbytes)
                state[name] = _placed_like(value, local)
        return homes

    def to_host(self, state: dict, homes: dict) -> None:
        """One param's state back in host memory after a step: copied into its homes (to_device),
        a state the step created into new ones."""
        for name, value, local in _tensors(state):
            host = homes.get(name)
            if host is not None:
                self._on_device -= local.nbytes
            elif self._at_home(local):
                continue
            else:
                host = self._new_home(local)
            _copy(host, local)
            self.moved_to_host += local.nbytes
            state[name] = _placed_like(value, host)

    def rows(self, p: DTensor, state_rows: torch.Tensor, read: bool = True,
             write: bool = True) -> AbstractContextManager[torch.Tensor]:
        """Rows of `p`'s state where the step reads or changes them: on the device if `p` is
        offloaded (rows_on_device), else as they are."""
        if p in self.params:
            return self.rows_on_device(state_rows, read, write)
        return contextlib.nullcontext(state_rows)

    def prefetch(self, p: DTensor, host_rows: torch.Tensor) -> None:
        """Start bringing rows of `p`'s state to the device if `p` is offloaded (on CUDA on the
        copy stream, after the work issued so far: the copy runs beside what the step issues
        next); rows_on_device then takes them without copying again."""
        if p not in self.params or _where(host_rows) in self._prefetched:
            return
        self._copy_ahead(host_rows)

    @phase(OFFLOAD)
    def _copy_ahead(self, host_rows: torch.Tensor) -> None:
        on_device = self._device_buffer(host_rows)
        event = None
        if self._copies is not None:
            self._copies.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._copies):
                on_device.copy_(host_rows, non_blocking=True)
                event = self._copies.record_event()
        else:
            on_device.copy_(host_rows)
        self._prefetched[_where(host_rows)] = (on_device, event)
        self._hold(host_rows.nbytes)
        self.moved_ahead += host_rows.nbytes

    def _hold(self, nbytes: int, copied: bool = True) -> None:
        """`nbytes` more of the state on the device (`copied` there from the host)."""
        self.moved_to_device += nbytes if copied else 0
        self._on_device += nbytes
        self.most_on_device = max(self.most_on_device, self._on_device)

    @contextlib.contextmanager
    def rows_on_device(self, host_rows: torch.Tensor, read: bool = True,
                       write: bool = True) -> Iterator[torch.Tensor]:
        """`host_rows` (a view of a homed state) on the device while the block runs (copied
        there, or taken from prefetch, where the block reads them), then copied back where it
        changes them (on CUDA on the copy stream, once the block's work is done). A copy on the
        CPU too, so that the CPU runs what a GPU runs."""
        nbytes = host_rows.nbytes
        prefetched = self._prefetched.pop(_where(host_rows), None) if read else None
        if prefetched is not None:
            on_device, event = prefetched
            if event is not None:
                _wait(torch.cuda.current_stream(self.device), event)
        else:
            on_device = self._device_buffer(host_rows)
            if read:
                _copy(on_device, host_rows)
            self._hold(nbytes, copied=read)
        try:
            yield on_device
            if write:
                self._write_back(on_device, host_rows)
        finally:
            self._on_device -= nbytes

    @phase(OFFLOAD)
    def _write_back(self, on_device: torch.Tensor, host_rows: torch.Tensor) -> None:
        self.moved_to_host += host_rows.nbytes
        if self._copies is None:
            host_rows.copy_(on_device)
            return
        self._copies.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copies):
            host_rows.copy_(on_device, non_blocking=True)
        on_device.record_stream(self._copies)  # not reused before the copy has read it

    def wait_for_copies(self) -> None:
        """Every copy issued so far done: the host may read and write the state."""
        if self._copies is not None:
            _synchronize(self._copies)

    def finish_step(self) -> None:
        """The end of a step: every copy back done, and rows prefetched for an exchange that did
        not read them (a step an error stopped) dropped."""
        self.wait_for_copies()
        for on_device, _ in self._prefetched.values():
            self._on_device -= on_device.nbytes
        self._prefetched.clear()


# The copies between host and device, and the waits for them, in the OFFLOAD phase.
_copy = phase(OFFLOAD)(torch.Tensor.copy_)
_wait = phase(OFFLOAD)(torch.cuda.Stream.wait_event)
_synchronize = phase(OFFLOAD)(torch.cuda.Stream.synchronize)


def _where(host_rows: torch.Tensor) -> tuple:
    """Where rows sit in host memory: the same rows of a state give the same key."""
    return host_rows.data_ptr(), tuple(host_rows.shape), host_rows.stride()


def _tensors(state: dict) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, value, its local tensor) of each tensor in one param's state but the step count
    (a host scalar torch's Adam keeps)."""
    for name, value in list(state.items()):
        if name != "step" and isinstance(value, torch.Tensor):
            yield name, value, value.to_local() if isinstance(value, DTensor) else value


def _placed_like(value: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` in `value`'s place: a DTensor of the same mesh, placements and shape for a
    DTensor, else itself."""
    if not isinstance(value, DTensor):
        return local
    return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                              shape=value.shape, stride=value.stride())


def offload_between_steps(optimizer: torch.optim.Optimizer, fraction: float) -> HostState:
    """Keep `fraction` of a torch optimizer's state in host memory between its steps: picked
    param by param in param-group order, as megatron-core's HybridDeviceOptimizer picks them
    (plan.offloaded, by param size); before each step it comes to the params' device, after it
    goes back (torch's step pre- and post-hooks), so the step itself runs as without offload.
    Returns the HostState that keeps the accounting."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    picked = [p for p, chosen in zip(params, offloaded([p.numel() for p in params], fraction))
              if chosen]
    device = params[0].device if params else torch.device("cpu")
    host_state = HostState(device, picked)
    homes: dict = {}

    def to_device(optimizer, args, kwargs):
        host_state.new_step()
        homes.clear()
        homes.update({p: host_state.to_device(optimizer.state[p]) for p in picked
                      if p in optimizer.state})

    def to_host(optimizer, args, kwargs):
        for p in picked:
            if p in optimizer.state:
                host_state.to_host(optimizer.state[p], homes.get(p, {}))
        homes.clear()

    optimizer.register_step_pre_hook(to_device)
    optimizer.register_step_post_hook(to_host)
    return host_state
