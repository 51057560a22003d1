"""FSDPMuonChainedOptimizer's checkpoints: its state in Megatron's `fsdp_dtensor` format (Muon's
momentum apart from Adam's moments), torch's state_dict pair over the same dict, and the step
counts each part keeps."""

import collections

import torch
from torch.utils.hooks import RemovableHandle

from ..core.zero_muon import ZeROTensorParallelMuon


class CheckpointedChain:
    """The checkpoint half of FSDPMuonChainedOptimizer (chain.chained), which provides
    `_named_params`, `_parts`, `_successful_steps`, `iteration` and
    `_install_weights_for_the_next_forward`."""

    def __init__(self) -> None:
        self._state_dict_post_hooks = collections.OrderedDict()

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, **kwargs):
        """The optimizer's part of a Megatron `fsdp_dtensor` checkpoint: each param's state under
        its name, as DTensors sharded like the param (DCP reshards them to another world size),
        and the step count once. Muon's momentum sits under "muon", apart from the other parts'
        "state": Megatron's checkpoint code rewrites "state" in Adam's terms
        (handle_swiglu_in_state_dict splits a gated fc1's exp_avg and exp_avg_sq into halves and
        would fail on a momentum), while Muon orthogonalizes the whole fc1 matrix.

        Params without state first get the parts' zero state (`init_state_fn`, what Megatron wants
        before a load): every rank then holds the same keys, empty tensors where its shard is
        empty, which the per-DTensor collectives of saving and loading need (Adam creates state
        only for non-empty shards). No optimizer step runs and nothing communicates, so this
        changes no param, momentum, moment or step count, on any rank, also when loading."""
        # With the step count too: a load that finds no checkpoint (Megatron then trains from
        # scratch) leaves this state as it is, and Adam expects a step beside its moments.
        self._create_missing_state()
        sections = {"state": {}, "muon": {}}
        for name, p, part, _ in self._named_params():
            sections[self._section(part)][name] = {
                key: value for key, value in part.optimizer.state[p].items() if key != "step"}
        # The step count is host metadata, the same for every rank and device.
        return {**sections, "step": torch.tensor(self._successful_steps, device="cpu")}

    @staticmethod
    def _section(part) -> str:
        return "muon" if isinstance(part.optimizer, ZeROTensorParallelMuon) else "state"

    def state_dict(self):
        """torch's convention, for tools outside megatron.training: what `load_state_dict` takes
        back, i.e. `sharded_state_dict()` (the state's tensors themselves, as torch's optimizers
        return theirs), through the hooks registered with `register_state_dict_post_hook`."""
        return self._through_post_hooks(self.sharded_state_dict())

    def _through_post_hooks(self, state_dict):
        for hook in list(self._state_dict_post_hooks.values()):
            state_dict = hook(self, state_dict) or state_dict
        return state_dict

    def load_state_dict(self, state_dict):
        """Load what `sharded_state_dict` made (DCP has usually filled its tensors in place),
        the step count included (`_set_step_counts`). The main weights are the
        model's: its load_state_dict installs them (Megatron-FSDP's post-load hook), and they
        are installed and synced here once more, so the next forward reads them whatever ran
        before (a process that trained first has its ZeRO-1/2 compute weights gathered)."""
        named_params = self._named_params()
        missing = [name for name, _, part, _ in named_params
                   if name not in state_dict[self._section(part)]]
        if missing:
            raise KeyError(f"the checkpoint has no optimizer state for {missing}")
        self._successful_steps = int(state_dict["step"])
        self.iteration = self._successful_steps
        for name, p, part, _ in named_params:
            part.optimizer.state[p].update(state_dict[self._section(part)][name])
        self._set_step_counts()
        self._install_weights_for_the_next_forward(force_sync=True)

    def _create_missing_state(self):
        """Every param's state, zero where it has none yet (the parts' `init_state_fn`), and the
        step count beside it: no step runs, no value changes."""
        for part in self._parts():
            part.init_state_fn(part.optimizer, part.config)
        self._set_step_counts()

    def _set_step_counts(self):
        """Each param's step, the count of steps taken, where its optimizer keeps it: the param
        group's (TE FusedAdam) or each param's state (torch Adam; Muon keeps none)."""
        for _, p, part, group in self._named_params():
            if "step" in group:
                group["step"] = self._successful_steps
            elif isinstance(part.optimizer, torch.optim.Adam):  # AdamW too
                on_param = group.get("capturable") or group.get("fused")
                part.optimizer.state[p]["step"] = torch.tensor(
                    float(self._successful_steps), dtype=torch.float32,
                    device=p.device if on_param else "cpu")

    def register_state_dict_post_hook(self, hook, prepend: bool = False):
        """torch.optim.Optimizer's: `hook(optimizer, state_dict)` after each `state_dict()`,
        returning a replacement or None."""
        handle = RemovableHandle(self._state_dict_post_hooks)
        self._state_dict_post_hooks[handle.id] = hook
        if prepend:
            self._state_dict_post_hooks.move_to_end(handle.id, last=False)
        return handle
