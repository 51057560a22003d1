"""Run Megatron-FSDP and megatron-core on a machine without CUDA (CPU, gloo).

Megatron-FSDP schedules its collectives on CUDA streams and events; on CPU every collective is
synchronous, so that bookkeeping can be a no-op. Nothing here runs when CUDA is available.
"""

import contextlib

import torch


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _Stream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _Event()

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_applied = False


def apply_cpu_compat() -> bool:
    """Patch torch.cuda's stream/event API into no-ops when CUDA is absent; idempotent.

    Returns True when the patches are (or already were) in place, False on a CUDA machine.
    """
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    torch.cuda.Stream = _Stream
    torch.cuda.Event = _Event
    torch.cuda.current_stream = lambda *args, **kwargs: _Stream()
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.current_device = lambda: 0
    # megatron_fsdp.uneven_dtensor.validate_uneven_dtensor moves a small check tensor to CUDA.
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    _applied = True
    return True
