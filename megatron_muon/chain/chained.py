"""The optimizer Megatron's training loop steps: Megatron-FSDP's step contract around the
inner Muon + Adam chain."""

import contextlib
import functools

import torch

from ..compat import upstream
from ..core.zero_muon import ZeROTensorParallelMuon
from ..observe.phases import CHECK, PARAM_SYNC, phase
from .backward_gather import BackwardGather
from .checkpointed import CheckpointedChain
from .model_chunks import at_global_expert_index, find_megatron_fsdp, named_main_weights
from .nonfinite_skip import NonfiniteSkip
from .timed_step import TimedStep
from .weights_check import check_after_param_sync


class FSDPMuonChainedOptimizer(CheckpointedChain):
    """Steps Megatron-FSDP models the way `megatron_fsdp.fully_shard_optimizer` does, for a chain.

    `step()`: `finish_grad_sync()` on each chunk unless it auto-syncs or something (Megatron's
    `finalize_model_grads`) already synced it since the last step, then the inner optimizer, then
    `install_optimized_model_weights()` once per chunk, after every inner part has updated its
    main weights. Everything else is the inner optimizer's.

    A step whose gradients hold a NaN or Inf on any rank is skipped on every rank and said so;
    after `max_consecutive_skipped_steps` of them in a row (0: never) the step raises instead
    (chain.nonfinite_skip: no collective of its own where the chain reduces a grad norm).

    `max_attention_logits` (chain.qk_clip, for --log-max-attention-logit and --qk-clip):
    each step reduces the forward's max attention logits, and a step that updates the weights
    clips the main weights' q and k rows (MuonClip) before installing them.

    The check interval (its Muon parts' `check_interval`, --muon-check-interval): on every N-th
    iteration that updates the weights, the Muon parts compare the owner exchange with the
    reference before applying anything; then the param sync runs in full at once
    (megatron.training's force_param_sync) and replicas and compute weights are checked. One
    line: `muon check at iteration K: max |owner - reference| = X over M matrices; replicas
    equal; compute weights equal`, or every rank raises naming what differs. `iteration` is
    Megatron's: every call of step, skipped steps too, continued from a checkpoint's step count.

    `gather_inside_backward` (--muon-gather-inside-backward; chain.backward_gather): matrices of
    the Muon parts' first exchanges gather during backward, as Megatron-FSDP reduces their
    gradients, and the step forms their updates on the owners.

    Checkpoints (chain.checkpointed): `sharded_state_dict` / `load_state_dict` in Megatron's
    `fsdp_dtensor` format, and torch's pair (the same dict). `report_interval`: chain.timed_step's (outside Megatron).
    """

    def __init__(self, optimizer, model_chunks, max_consecutive_skipped_steps: int = 10,
                 max_attention_logits=None, report_interval: int = 0,
                 gather_inside_backward: bool = False):
        fsdp_models = [find_megatron_fsdp(chunk) for chunk in model_chunks]
        missing = [i for i, m in enumerate(fsdp_models) if m is None]
        if not model_chunks or missing:
            raise ValueError(
                f"FSDPMuonChainedOptimizer needs Megatron-FSDP model chunks; chunks {missing} of "
                f"{len(model_chunks)} are not wrapped by Megatron-FSDP (use --use-megatron-fsdp)")
        self._skip = NonfiniteSkip(optimizer, max_consecutive_skipped_steps)
        self.optimizer = optimizer
        super().__init__()
        self.model_chunks = list(model_chunks)
        self._fsdp_models = fsdp_models
        self._synced = set()
        # Steps taken, i.e. Adam's step on every param: a checkpoint saves it once (Adam has
        # none where a rank's shard is empty).
        self._successful_steps = 0
        self.max_attention_logits = max_attention_logits
        self._param_names = None
        self.iteration = 0
        self.muon_optimizers = [
            part.optimizer for part in self._parts()
            if isinstance(getattr(part, "optimizer", None), ZeROTensorParallelMuon)]
        self.check_interval = max((muon.check_interval for muon in self.muon_optimizers), default=0)
        for muon in self.muon_optimizers:
            muon.log_checks = False  # one line per check, with the weights' checks: here
        self.backward_gather = BackwardGather(self.muon_optimizers, fsdp_models) \
            if gather_inside_backward else None
        for index, chunk in enumerate(self.model_chunks):
            self._record_grad_syncs(index, chunk)
        inners = [getattr(part, "optimizer", None) for part in self._parts()]
        self._timed = TimedStep(optimizer, [i for i in inners if isinstance(
            i, torch.optim.Optimizer) and i not in self.muon_optimizers], report_interval, self)
        self.phase_times = self._timed.phase_times

    def _record_grad_syncs(self, index, chunk):
        # finalize_model_grads calls chunk.finish_grad_sync(); remember it so the grads are
        # never reduced twice.
        sync = chunk.finish_grad_sync

        @functools.wraps(sync)
        def finish_grad_sync(*args, **kwargs):
            gather = self.backward_gather
            fsdp = self._fsdp_models[index]
            with gather.finish_grad_sync(fsdp) if gather else contextlib.nullcontext():
                result = sync(*args, **kwargs)
            self._synced.add(index)
            return result

        chunk.finish_grad_sync = finish_grad_sync
        if self.backward_gather:
            self.backward_gather.watch_scaling(chunk)

    def step(self):
        if upstream.called_by_fully_shard_optimizer():
            return None  # its construction step, with zero grads: see fully_shard_optimizer below
        # megatron.training sets megatron-core's OptimizerConfig.timers: the phases report there.
        with self._timed.timed(getattr(getattr(self._parts()[0], "config", None), "timers", None)):
            try:
                return self._step()
            finally:
                if self.backward_gather:  # nothing gathered ahead outlives a step, skipped too
                    self.backward_gather.after_step()

    def _step(self):
        self.iteration += 1
        for muon in self.muon_optimizers:
            muon.iteration = self.iteration - 1  # its step counts this one
        checking = self.check_interval and self.iteration % self.check_interval == 0
        for index, (chunk, fsdp) in enumerate(zip(self.model_chunks, self._fsdp_models)):
            if index not in self._synced and not fsdp.model_auto_sync:
                chunk.finish_grad_sync()
        self._synced.clear()
        if self.max_attention_logits is not None:
            self.max_attention_logits.reduce()
        if self.backward_gather:
            self.backward_gather.before_step()
        # Decided here, or inside the chain between its grad norm and its update.
        result = None if self._skip.begin_step() else self._timed.inner_step(self.optimizer)
        if self._skip.end_step():
            return False, None, None  # as Megatron's optimizers report a skipped step
        update_successful = result[0] if isinstance(result, tuple) else True
        if update_successful:
            self._successful_steps += 1
            if self.max_attention_logits is not None:
                self.max_attention_logits.clip_main_weights()
            self._install_weights_for_the_next_forward(force_sync=bool(checking))
            if checking:
                with phase(CHECK):
                    check_after_param_sync(self.model_chunks, self._fsdp_models,
                                           self.muon_optimizers, self.iteration)
        return result

    @property
    def skipped_steps(self) -> int:
        """The steps skipped so far for a NaN or Inf gradient."""
        return self._skip.skipped

    def _install_weights_for_the_next_forward(self, force_sync=False):
        """Copy the main weights into the compute weights, then sync them as megatron-core's
        DistributedOptimizer.step_with_ready_grads does: under ZeRO-1/2 the compute weights are
        unsharded and each rank only installed its own rows, so start_param_sync all-gathers the
        rest (with --overlap-param-gather, always on under ZeRO-3, it starts the first bucket and
        the forward's hooks gather the others, the grad sync having dropped the old gathers;
        no_shard needs nothing). `force_sync` drops and redoes every gather now, as
        megatron.training's force_param_sync: for weights that changed outside a step."""
        with phase(PARAM_SYNC):
            for fsdp in self._fsdp_models:
                fsdp.install_optimized_model_weights()
            for fsdp in self._fsdp_models:
                fsdp.start_param_sync(force_sync=force_sync)

    def _parts(self):
        return getattr(self.optimizer, "chained_optimizers", [self.optimizer])

    def _named_params(self):
        """(checkpoint name, param, part, param group) for every param the chain steps. Names are
        Megatron's for this format (DistributedOptimizer._param_name): the model's parameter
        names, local experts renamed to their global index so expert-parallel ranks never share
        a key."""
        if self._param_names is None:
            by_name = {name: p for chunk in self.model_chunks
                       for name, p in named_main_weights(chunk)}
            # Megatron's models carry a config; a plain module on fully_shard_model has none.
            config = getattr(self.model_chunks[0], "config", None)
            by_name = at_global_expert_index(by_name, getattr(config, "num_moe_experts", None))
            self._param_names = {p: name for name, p in by_name.items()}
        return [(self._param_names[p], p, part, group) for part in self._parts()
                for group in part.optimizer.param_groups for p in group["params"]]

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for fsdp in self._fsdp_models:
            fsdp.zero_grad_buffer()

    # megatron_fsdp.fully_shard_optimizer(optimizer) on this optimizer, which already does what it
    # adds (Automodel calls it on every optimizer of a Megatron-FSDP model): its construction
    # step with zero grads, which would apply weight decay and count a step, is skipped (`step`
    # above; this optimizer creates its own state); its step and zero_grad
    # wrappers, which would sync and install a second time, are not set; its state-dict hook runs.

    def __setattr__(self, name, value):
        if name in ("step", "zero_grad") and upstream.is_fully_shard_optimizer_wrapper(value):
            return
        super().__setattr__(name, value)

    def __getattr__(self, name):
        # Only reached for names not set on the wrapper: param_groups, state_dict, get_lr, ...
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)
