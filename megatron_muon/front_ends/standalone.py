"""Muon for a plain PyTorch or Hugging Face model sharded by Megatron-FSDP outside Megatron
(`megatron_fsdp.fully_shard_model`): ZeROTensorParallelMuon on the matrices front_ends.placement
picks, torch's AdamW on the rest, stepped under FSDPMuonChainedOptimizer's contract.

    model = megatron_fsdp.fully_shard_model(model, ..., zero_dp_strategy="optim_grads_params")
    optimizer = megatron_muon.standalone.muon_optimizer(model, lr=0.02, adamw_lr=3e-4)
    loss.backward(); optimizer.step(); optimizer.zero_grad()
"""

import torch
import torch.distributed as dist

from ..chain.chained import FSDPMuonChainedOptimizer
from ..chain.model_chunks import find_megatron_fsdp
from ..compat import upstream
from ..core.state_offload import offload_between_steps
from ..core.zero_adaptive_muon import ZeROTensorParallelAdaptiveMuon
from ..core.zero_muon import ZeROTensorParallelMuon
from ..fixes import upstream_fixes
from .placement import place


class _Part:
    """One optimizer of the chain, shaped as megatron-core's chain parts are (`optimizer`,
    `init_state_fn`, `config`), which FSDPMuonChainedOptimizer's checkpoints read."""

    config = None

    def __init__(self, optimizer, init_state_fn):
        self.optimizer, self.init_state_fn = optimizer, init_state_fn

    def step(self):
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none=set_to_none)


def _adamw_zero_state(optimizer, config=None):
    """AdamW's moments, zero, for params that have none yet (megatron-core's init_state_fn for
    Adam): every rank then checkpoints the same keys."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state[p]:
                optimizer.state[p]["exp_avg"] = torch.zeros_like(p)
                optimizer.state[p]["exp_avg_sq"] = torch.zeros_like(p)


class MuonAndAdamW:
    """The two optimizers stepped one after the other (either may be absent: a model with no
    matrix, or nothing but matrices)."""

    def __init__(self, parts):
        self.chained_optimizers = list(parts)

    @property
    def param_groups(self):
        return [group for part in self.chained_optimizers for group in part.optimizer.param_groups]

    @property
    def state(self):
        """Each param's state, from the optimizer that steps it (torch's checkpoint functions
        and megatron_fsdp's fully_shard_optimizer's hook read it)."""
        return {p: state for part in self.chained_optimizers
                for p, state in part.optimizer.state.items()}

    def step(self):
        for part in self.chained_optimizers:
            part.step()

    def zero_grad(self, set_to_none: bool = True):
        for part in self.chained_optimizers:
            part.zero_grad(set_to_none=set_to_none)


class StandaloneMuonOptimizer(FSDPMuonChainedOptimizer, torch.optim.Optimizer):
    """The step contract of FSDPMuonChainedOptimizer, with torch's optimizer conventions outside
    Megatron: a torch.optim.Optimizer to the tools that ask (torch.distributed.checkpoint.
    state_dict takes nothing else; torch's own __init__ does not run: the state and param
    groups are the two optimizers'); every param's state exists from construction (Muon's
    momentum, AdamW's moments and step, zero), so those tools never step it to create them; and
    `state_dict()` / `load_state_dict()` in torch's format (state by param index over the param
    groups, Muon's then AdamW's, and the groups' hyperparameters), which torch's
    get_optimizer_state_dict / set_optimizer_state_dict, megatron_fsdp's fully_shard_optimizer
    hook and NeMo Automodel's checkpointer read and write. Megatron's `sharded_state_dict` stays
    as it is."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._create_missing_state()

    def state_dict(self):
        state, param_groups, offset = {}, [], 0
        for part in self._parts():
            saved = part.optimizer.state_dict()
            state.update({offset + index: value for index, value in saved["state"].items()})
            param_groups += [{**group, "params": [offset + i for i in group["params"]]}
                             for group in saved["param_groups"]]
            offset += sum(len(group["params"]) for group in part.optimizer.param_groups)
        return self._through_post_hooks({"state": state, "param_groups": param_groups})

    def load_state_dict(self, state_dict):
        """What `state_dict` made; then the weights are installed and synced, so the next forward
        reads them whatever ran before."""
        # Each optimizer its groups, in order, and their params' state: torch's load_state_dict
        # matches params by position, whatever the keys (indices, or torch's DCP's names).
        groups = iter(state_dict["param_groups"])
        for part in self._parts():
            saved_groups = [next(groups) for _ in part.optimizer.param_groups]
            keys = {key for group in saved_groups for key in group["params"]}
            part.optimizer.load_state_dict({
                "state": {key: value for key, value in state_dict["state"].items() if key in keys},
                "param_groups": saved_groups})
        # The step count, which AdamW keeps per param (Muon keeps none: a model without AdamW's
        # params restarts its count, which only the check interval reads).
        steps = [value["step"] for value in state_dict["state"].values() if "step" in value]
        self._successful_steps = self.iteration = int(max(steps, default=0))
        self._set_step_counts()
        self._install_weights_for_the_next_forward(force_sync=True)


def muon_optimizer(model, *, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                   weight_decay: float = 0.1, adamw_lr: float = 3e-4,
                   adamw_betas: tuple[float, float] = (0.9, 0.95), adamw_eps: float = 1e-8,
                   adamw_weight_decay: float = 0.1, muon: tuple[str, ...] = (),
                   adamw: tuple[str, ...] = (), qkv_splits: dict | None = None,
                   fp32_matmul_prec: str = "medium", max_consecutive_skipped_steps: int = 10,
                   moment2_method: str | None = None, offload: bool | float = False,
                   report_interval: int = 0, **muon_kwargs) -> StandaloneMuonOptimizer:
    """Muon + AdamW for `model`, a module wrapped by Megatron-FSDP's `fully_shard_model`.

    Which parameters get Muon: front_ends.placement.place (2-D hidden Linear weights; `muon` and
    `adamw` name overrides; `qkv_splits` {name pattern: (q, k, v rows per query group)} for fused
    projections), said on rank 0 at start. `lr`, `momentum`, `nesterov`, `weight_decay`,
    `fp32_matmul_prec` and `muon_kwargs` (ZeROTensorParallelMuon's and TensorParallelMuon's
    other arguments: scale_mode, num_ns_steps, dist_mode, ...) are Muon's; `adamw_*` AdamW's.
    `moment2_method` ("adamuon", "normuon" or "namo") makes it adaptive Muon
    (ZeROTensorParallelAdaptiveMuon; `beta2` and `eps` among `muon_kwargs`). `offload`: keep
    the optimizers' state (Muon's momentum, AdamW's moments) in host memory between steps, all
    of it (True) or that share (a fraction, picked param by param as Megatron's
    --optimizer-offload-fraction picks; core/state_offload.py); every update stays the same.
    `report_interval` N: every step timed in Megatron's phases, and every N-th one's
    (`megatron_muon.standalone.step_report(optimizer)` at any time) logged on rank 0.
    `optimizer.step()` syncs the gradients (unless the model or the caller already did), steps
    both, installs the weights the next forward reads and starts their gather, once."""
    if not 0 <= float(offload) <= 1:
        raise ValueError(f"muon_optimizer: offload must be True, False or a fraction in [0, 1] "
                         f"(the share of the state in host memory), got {offload!r}")
    fsdp = find_megatron_fsdp(model)
    if fsdp is None:
        raise TypeError(f"{type(model).__name__} is not wrapped by Megatron-FSDP: call "
                        "megatron_fsdp.fully_shard_model on it first")
    upstream_fixes.apply()
    placement = place(fsdp.module, muon, adamw, qkv_splits)
    main_weights = dict(fsdp.param_and_grad_buffer.optimizer_named_parameters)
    for name, rows in placement.qkv_splits.items():  # read through the main weight's orig_param
        main_weights[name].orig_param.is_qkv = True
        main_weights[name].orig_param.qkv_split_shapes = list(rows)
    parts = []
    if placement.muon:
        params = [main_weights[name] for name in placement.muon]
        variant = {} if moment2_method is None else {"moment2_method": moment2_method}
        muon_class = ZeROTensorParallelAdaptiveMuon if variant else ZeROTensorParallelMuon
        parts.append(_Part(muon_class(
            params, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
            fp32_matmul_prec=fp32_matmul_prec, split_qkv=bool(placement.qkv_splits),
            is_qkv_fn=lambda p: getattr(p, "is_qkv", False),
            param_names={main_weights[name]: name for name in placement.muon}, **variant,
            offload_fraction=float(offload), **muon_kwargs),
            upstream.eopt_init_state_fn))
    if placement.adamw:
        adamw = torch.optim.AdamW(
            [main_weights[name] for name in placement.adamw], lr=adamw_lr, betas=adamw_betas,
            eps=adamw_eps, weight_decay=adamw_weight_decay, foreach=True)
        adamw.host_state = offload_between_steps(adamw, float(offload))
        parts.append(_Part(adamw, _adamw_zero_state))
    if not dist.is_initialized() or dist.get_rank() == 0:
        for line in placement.describe():
            print(line, flush=True)
    return StandaloneMuonOptimizer(MuonAndAdamW(parts), [model], max_consecutive_skipped_steps,
                                   report_interval=report_interval)
