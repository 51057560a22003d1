"""The gather inside backward, on Megatron's side: each Muon exchange's rows start toward their
owners as soon as Megatron-FSDP has reduced the last micro-batch's gradients of every matrix in
it, during backward under --overlap-grad-reduce and in `finish_grad_sync` without it; the step
then runs only Newton-Schulz and the scatter for them (core/gather_ahead.py forms the update).

What the owners need from the step, the clip, is recorded as megatron-core's ChainedOptimizer
calls `clip_grad_by_total_norm_fp32` and replayed on each owner's whole gradient with that
function. A gradient reduced again after its rows left (a micro-batch outside Megatron's
`no_sync`) makes the step discard what was gathered ahead and gather at the step, as without it.

Where a part cannot gather ahead the start-up log says why (`reasons`); where it can, the factory
has its plans packed with the batches that fit within what Muon's state saves first
(GroupPlanner.ahead; plan.packed_plan), and the log says how many matrices gather ahead.
"""

import contextlib
import types
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..compat import upstream
from ..core.muon_math import weight_decay_leaves_the_gradient
from ..core.zero_muon import ZeROTensorParallelMuon

# The chains gathering inside backward now; the patched upstream calls report to them.
_active: "weakref.WeakSet[BackwardGather]" = weakref.WeakSet()


def reasons(muon: ZeROTensorParallelMuon, fsdp_models) -> list[str]:
    """Why this Muon part gathers at the step, not inside backward (none: it may)."""
    why = {"--muon-dist-mode allgather (no owners)": muon.dist_mode != "owner",
           "--optimizer-cpu-offload (the state is in host memory: the device saves nothing "
           "to hold gathered rows in)": bool(muon.host_state.params),
           "L2 weight decay (it changes the gradient)": not weight_decay_leaves_the_gradient(muon)}
    return [reason for reason, holds in why.items() if holds]


class BackwardGather:
    """For the chain: which matrices of its Muon parts gather inside backward (each plan's
    `early`, in its first `ahead` exchanges, packed so by the factory), and when each exchange's
    gather ahead starts. `finish_grad_sync(fsdp)` frames a chunk's grad sync (its reduces are
    final, and so is every gradient after it); `before_step()` and `after_step()` frame the
    chain's step."""

    def __init__(self, muon_optimizers: list[ZeROTensorParallelMuon], fsdp_models) -> None:
        self._fsdp_of_pipeline = {fsdp.grad_reduce_pipeline: fsdp for fsdp in fsdp_models}
        # Main weight -> its Megatron-FSDP; module param (what a bucket lists) -> main weight.
        self._fsdp_of = {weight: fsdp for fsdp in fsdp_models
                         for _, weight in fsdp.param_and_grad_buffer.optimizer_named_parameters}
        self._weights = {weight.orig_param: weight for weight in self._fsdp_of}
        self.exchanges = []  # (muon, plan, k, its params), in the order every rank starts them
        self.said = {}
        for muon in muon_optimizers:
            self.said[muon] = reasons(muon, fsdp_models)
            if not self.said[muon]:
                if not muon.planner.ahead and muon.interleaved is None:  # built without the flag
                    muon.planner.ahead = True
                    muon.plans = muon.planner.packed()  # every rank, before any state
                for chain in [chain for chain in _active if muon in chain.said]:
                    _active.discard(chain)  # a chain built around another's parts takes over
                muon.ahead.replay = self.replay
                self.exchanges += [(muon, plan, k, {plan.param_of(i) for i in routes.batch})
                                   for plan in muon.plans
                                   for k, routes in enumerate(plan.routes_carrying_momentum)]
        self._stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self._clips: dict[DTensor, list[tuple]] = {}
        self._syncing = False
        self._new_step()
        _patch_upstream()
        _active.add(self)

    def watch_scaling(self, chunk) -> None:
        """A chunk's `scale_gradients` (megatron-core's finalize_model_grads calls it under
        --calculate-per-token-loss, after the grad sync) changes gradients whose rows may have
        left: that step gathers at the step instead."""
        scale = getattr(chunk, "scale_gradients", None)
        if scale is None:
            return

        def scale_gradients(*args, **kwargs):
            self.stale = True
            return scale(*args, **kwargs)

        chunk.scale_gradients = scale_gradients

    def _new_step(self) -> None:
        self.waiting = list(self.exchanges)
        self.final: set[DTensor] = set()
        self.started: set[DTensor] = set()
        self.stale = False
        self._clips.clear()

    @contextlib.contextmanager
    def finish_grad_sync(self, fsdp) -> Iterator[None]:
        """A chunk's grad sync: every reduce in it is of the last micro-batch, and after it every
        gradient of the chunk is final: the exchanges not yet started start then (without
        --overlap-grad-reduce the sync reduces every gradient itself, in
        MegatronFSDP.start_grad_sync, apart from the bucket reduce; with it, where Megatron's
        no_sync never marked the last micro-batch)."""
        self._syncing = True
        try:
            yield
        finally:
            self._syncing = False
        self._final({weight for weight, of in self._fsdp_of.items() if of is fsdp})

    def reduced(self, pipeline, bucket_group) -> None:
        """A bucket group of `pipeline` reduced: its params' gradients are final after the last
        micro-batch's; exchanges whose every matrix is final start, in the plans' order."""
        fsdp = self._fsdp_of_pipeline.get(pipeline)
        if fsdp is None or not fsdp.ddp_config.overlap_grad_reduce:
            return  # without it the grad sync reduces them (again): finish_grad_sync
        weights = {self._weights[p] for p in _bucket_params(pipeline, bucket_group)
                   if p in self._weights}
        self.stale |= bool(weights & self.started)
        if self._syncing or getattr(fsdp, "is_last_microbatch", False) or fsdp.model_auto_sync:
            self._final(weights, pipeline)

    def _final(self, weights: set[DTensor], pipeline=None) -> None:
        """These gradients are final: the exchanges whose every matrix is start, in the plans'
        order (on CUDA once `pipeline`'s reduce has ended)."""
        if self.stale:
            return
        self.final |= weights
        ready = [entry for entry in self.waiting if entry[3] <= self.final]
        for muon, plan, k, params in ready:
            self.waiting.remove((muon, plan, k, params))
            self.started |= params
            with self._after(pipeline):
                muon.ahead.start(plan, k, self._gradient)

    def _gradient(self, weight: DTensor) -> torch.Tensor:
        return _main_grad_shard(self._fsdp_of[weight], weight)

    @contextlib.contextmanager
    def _after(self, pipeline) -> Iterator[None]:
        """On CUDA, on a stream of its own that waits for the reduce (compute goes on)."""
        if self._stream is None:
            yield
            return
        event = _pending_reduce_event(pipeline) if pipeline is not None else None
        if event is not None:
            self._stream.wait_event(event)
        else:
            self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            yield

    def before_step(self) -> None:
        """The chain's step begins: what a gradient reduced again made stale is dropped, and on
        CUDA the step's stream waits for the gathers and owns their buffers."""
        if self.stale:
            self._discard()
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)
            for muon in self._gathering():
                for local, gathered in muon.ahead.started.values():
                    for tensor in (*local.values(), gathered.received):
                        tensor.record_stream(torch.cuda.current_stream())

    def after_step(self) -> None:
        """The step ended (or was skipped): nothing gathered ahead is left, the next step's
        gathers start afresh."""
        self._discard()
        self._new_step()

    def _discard(self) -> None:
        for muon in self._gathering():
            muon.ahead.discard()

    def _gathering(self) -> list[ZeROTensorParallelMuon]:
        """The Muon parts with exchanges that gather ahead, each once."""
        return list(dict.fromkeys(muon for muon, *_ in self.exchanges))

    def clipped(self, parameters, max_norm, total_norm, use_decoupled_grad) -> None:
        for p in parameters:
            self._clips.setdefault(p, []).append((max_norm, total_norm, use_decoupled_grad))

    def replay(self, weight: DTensor, grad: torch.Tensor) -> None:
        """What this step's clip did to `weight`'s gradient, done to `grad` (an owner's whole
        gradient of it) by megatron-core's own function, with the same arguments."""
        for max_norm, total_norm, use_decoupled_grad in self._clips.get(weight, ()):
            holder = types.SimpleNamespace(grad=grad, decoupled_grad=grad)
            upstream.clip_grad_by_total_norm_fp32([holder], max_norm, total_norm,
                                                  use_decoupled_grad)

    def say(self) -> None:
        """One line a Muon part on rank 0: how many of its matrices gather inside backward, in
        how many of its exchanges, and why none where none does."""
        if dist.get_rank() != 0:
            return
        for muon, why in self.said.items():
            early = sum(len(plan.early) for plan in muon.plans)
            count = sum(plan.ahead for plan in muon.plans)
            total = (sum(len(plan.matrices) for plan in muon.plans),
                     sum(len(plan.routes) for plan in muon.plans))
            params = "expert" if any(group.get("is_expert_parallel")
                                     for group in muon.param_groups) else "dense"
            if why:
                rest = f"none, for {', '.join(why)}"
            elif early == total[0]:
                rest = "every one"
            elif early:
                rest = ("the rest at the step: no more fit within what its state saves against "
                        "Adam's without adding a collective to the step")
            else:  # AdaMuon's (its state is Adam's size), or every batch ahead adds a round
                rest = ("none fits within what its state saves against Adam's without adding a "
                        "collective to the step")
            print(f"megatron-muon: --muon-gather-inside-backward: {type(muon).__name__} "
                  f"({params} params): {early} of {total[0]} matrices gather inside backward, "
                  f"in {count} of {total[1]} exchanges ({rest})", flush=True)


def _patch_upstream() -> None:
    """Megatron-FSDP's bucket reduce and megatron-core's clip, reporting to the active chains
    (once per process; inert without one)."""
    for copy in upstream.INSTALLED_MEGATRON_FSDP_COPIES:
        target = f"{copy}.{upstream.BUCKET_REDUCE_TARGET}"
        if not upstream.is_patched(target):
            upstream.patch(target, _reporting_reduces(upstream.current(target)))
    if not upstream.is_patched(upstream.CLIP_TARGET):
        clip = upstream.current(upstream.CLIP_TARGET)
        upstream.patch(upstream.CLIP_TARGET, _recording_clips(clip))


def _reporting_reduces(bucket_group_gradient_reduce):
    def reduce_reported(self, bucket_group, *args, **kwargs):
        result = bucket_group_gradient_reduce(self, bucket_group, *args, **kwargs)
        for chain in list(_active):
            chain.reduced(self, bucket_group)
        return result
    return reduce_reported


def _recording_clips(clip_grad_by_total_norm_fp32):
    def clip_recorded(parameters, max_norm, total_norm, use_decoupled_grad=False):
        parameters = list(parameters) if not isinstance(parameters, torch.Tensor) else [parameters]
        for chain in list(_active):
            chain.clipped(parameters, max_norm, total_norm, use_decoupled_grad)
        return clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad)
    return clip_recorded


# Megatron-FSDP's gradient buffers, read as its own code reads them.

def _bucket_params(pipeline, bucket_ids) -> list:
    """The module params of a GradReducePipeline's buckets (Megatron-FSDP's parameter groups)."""
    return [p for i in bucket_ids for p in pipeline.buffer.parameter_groups[i].params]


def _pending_reduce_event(pipeline):
    """The CUDA event after which the last bucket group this pipeline reduced is in its gradient
    buffer (GradReducePipeline.grad_reduce_queue's newest), or None where it was awaited."""
    return pipeline.grad_reduce_queue[-1][0] if pipeline.grad_reduce_queue else None


def _main_grad_shard(fsdp, main_weight):
    """This rank's shard of a main weight's reduced gradient in Megatron-FSDP's buffer, as
    ParamAndGradBuffer.update_main_grads attaches it to the weight (cast to the weight's dtype
    where the buffer holds another, rows of the weight's shape), before update_main_grads runs."""
    buffer, module_param = fsdp.param_and_grad_buffer, main_weight.orig_param
    group = buffer.parameter_groups[buffer.param_to_param_group[module_param]]
    grad = group.main_grad_buffer.get_item(
        group.main_grad_buffer.param_idx[module_param],
        only_shard=buffer.bucketing_policy.data_parallel_sharding_strategy != "no_shard")
    if group.main_weight_buffer is not None and not buffer.use_decoupled_grad:
        grad = grad.to(main_weight.dtype)
    return grad.view(-1, *module_param.shape[1:])
