"""Every rank's code path on one machine's one device, without moving float data: each rank is a
process with torch's fake process group (collectives return without touching their outputs), and
a guard that fails any collective handed a tensor off the ranks' device (CUDA for NCCL, CPU for
gloo). Megatron-FSDP and the optimizer plan from exchanged shapes, so object collectives and
integer gathers do move, through a TCPStore the ranks share; everything else is a no-op, so these
runs check devices and control flow, not numbers."""

import datetime
import inspect
import pickle

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rank_processes import run_ranks

TENSOR_COLLECTIVES = ["all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
                      "_all_gather_base", "reduce_scatter",
                      "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all",
                      "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv"]


class WrongDevice(RuntimeError):
    pass


class _Done:
    def wait(self, *args):
        return True


class Guard:
    """Patches torch.distributed's collectives for this process: device checks, counts by name,
    and real data movement for metadata (objects, integer tensors) through `store`."""

    def __init__(self, device_type: str, store: dist.Store):
        self.device_type, self.store = device_type, store
        self.calls: dict[str, int] = {}
        self._sequence: dict[tuple, int] = {}
        for name in TENSOR_COLLECTIVES:
            if hasattr(dist, name):
                self._patch(name, self._checked(name, getattr(dist, name)))
        for name in ["all_gather_object", "broadcast_object_list", "gather_object",
                     "scatter_object_list"]:
            self._patch(name, getattr(self, name))

    @staticmethod
    def _patch(name, fn):
        setattr(dist, name, fn)  # where callers look them up (torch's own internals not)

    def _checked(self, name, collective):
        signature = inspect.signature(collective)

        def run(*args, **kwargs):
            tensors = [t for a in [*args, *kwargs.values()]
                       for t in (a if isinstance(a, (list, tuple)) else [a])
                       if isinstance(t, torch.Tensor)]
            for t in tensors:
                if t.device.type != self.device_type:
                    raise WrongDevice(f"torch.distributed.{name} was handed a tensor on {t.device} "
                                      f"(shape {tuple(t.shape)}); this group's device is "
                                      f"{self.device_type}")
            self.calls[name] = self.calls.get(name, 0) + 1
            if name == "all_to_all_single":
                # The fake group refuses uneven splits where a rank receives but sends nothing
                # (real backends take them): this one is checked, not issued. What arrives is
                # zeros, so later steps stay finite.
                tensors[0].zero_()
                return _Done() if kwargs.get("async_op") else None
            work = collective(*args, **kwargs)
            group = signature.bind(*args, **kwargs).arguments.get("group")
            output = tensors[0] if tensors else None
            # The fake group leaves outputs as they were (possibly uninitialized memory): give
            # them finite values, as if every rank held what this one holds.
            if name in ("all_gather_into_tensor", "_all_gather_base"):
                local = tensors[1]
                if local.is_floating_point():
                    output.view(-1, local.numel()).copy_(local.reshape(1, -1).clone())
                else:
                    self._gather_ints(output, local, group)
            elif name in ("reduce_scatter_tensor", "_reduce_scatter_base"):
                chunks = tensors[1].view(-1, output.numel())
                output.view(-1).copy_(chunks[dist.get_rank(group)].clone())
            return work
        return run

    def _exchange(self, kind, group, value, readers, publish=True):
        """Publish this rank's `value`; return those of the group ranks in `readers` (indices)."""
        ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
        sequence = self._sequence[ranks] = self._sequence.get(ranks, -1) + 1
        key = f"{kind}/{ranks}/{sequence}"
        if publish:
            self.store.set(f"{key}/{ranks.index(dist.get_rank())}", pickle.dumps(value))
        return [pickle.loads(self.store.get(f"{key}/{i}")) for i in readers]

    def _gather_ints(self, output, local, group):
        size = dist.get_world_size(group)
        values = self._exchange("ints", group, local.cpu(), range(size))
        output.copy_(torch.cat(values).view_as(output))

    def all_gather_object(self, object_list, obj, group=None):
        object_list[:] = self._exchange("gather", group, obj, range(dist.get_world_size(group)))

    def broadcast_object_list(self, object_list, src=None, group=None, device=None, group_src=None):
        src = _group_rank(group, src, group_src)
        is_src = dist.get_rank(group) == src
        object_list[:] = self._exchange("broadcast", group, list(object_list), [src],
                                        publish=is_src)[0]

    def gather_object(self, obj, object_gather_list=None, dst=None, group=None, group_dst=None):
        is_dst = dist.get_rank(group) == _group_rank(group, dst, group_dst)
        readers = range(dist.get_world_size(group)) if is_dst else []
        values = self._exchange("gather_object", group, obj, readers)
        if is_dst:
            object_gather_list[:] = values

    def scatter_object_list(self, scatter_object_output_list, scatter_object_input_list=None,
                            src=None, group=None, group_src=None):
        src = _group_rank(group, src, group_src)
        is_src = dist.get_rank(group) == src
        everyone = self._exchange("scatter", group, scatter_object_input_list, [src],
                                  publish=is_src)[0]
        scatter_object_output_list[0] = everyone[dist.get_rank(group)]


def _group_rank(group, global_rank, group_rank):
    """The group rank an object collective names, as a global rank or a group rank."""
    if group_rank is not None:
        return group_rank
    return dist.get_group_rank(group or dist.group.WORLD, global_rank)


def _fake_rank(rank, world_size, fn, device_type, port, args):
    if device_type == "cpu":
        from megatron_muon.cpu.torch_compat import apply_cpu_compat
        apply_cpu_compat()
    else:
        torch.cuda.set_device(0)
    torch.set_num_threads(1)
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=120))
    fn(rank, world_size, Guard(device_type, store), *args)


def run_fake_ranks(fn, world_size: int, device_type: str, *args,
                   timeout: float = 300) -> str | None:
    """Run fn(rank, world_size, guard, *args) in one process per rank, all on this machine's one
    `device_type` device; the first failure, or None."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        run_ranks(mp.get_context("forkserver"), _fake_rank, world_size, fn, device_type,
                  store.port, args, timeout=timeout)
    except RuntimeError as failure:
        return str(failure)
    return None
