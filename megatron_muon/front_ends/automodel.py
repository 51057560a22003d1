"""Muon for NeMo Automodel's Megatron-FSDP strategy: an optimizer config its recipes' YAML names.

    distributed:
      strategy: megatron_fsdp
    optimizer:
      _target_: megatron_muon.automodel.MegatronFSDPMuonConfig
      lr: 0.02
      adamw_lr: 3.0e-4

It builds megatron_muon.standalone.muon_optimizer on each model part (Muon on the hidden matrices,
AdamW on the rest, by the part's module names); Automodel's recipe then hands it to
megatron_fsdp's fully_shard_optimizer, which leaves its step contract as it is. Not named Muon:
Automodel replaces any optimizer class named Muon, NorMuon, Dion or Dion2 with microsoft/dion's
(components/optim/dion.py, is_dion_optimizer), which refuses Megatron-FSDP.
"""

from dataclasses import dataclass, field

from nemo_automodel.components.optim.optimizer import OptimizerConfig

from ..chain.model_chunks import find_megatron_fsdp
from .standalone import muon_optimizer


@dataclass
class MegatronFSDPMuonConfig(OptimizerConfig):
    """muon_optimizer's arguments (megatron_muon.standalone), as YAML gives them: `muon` and
    `adamw` are name patterns that override the placement, `qkv_splits` maps a pattern to the
    q, k, v rows per query group of a fused projection, `moment2_method` ("adamuon",
    "normuon", "namo") makes it adaptive Muon, `offload` keeps the state in host memory between
    steps (true, or the share of it: a fraction), `report_interval` N logs every N-th step's
    phase times and scalars (standalone's), `muon_kwargs` passes the rest of
    ZeROTensorParallelMuon's (scale_mode, num_ns_steps, ...). Automodel's LR scheduler keeps
    AdamW's learning rate at adamw_lr / lr of Muon's (its lr_mult)."""

    lr: float = 0.02
    momentum: float = 0.95
    nesterov: bool = True
    weight_decay: float = 0.1
    adamw_lr: float = 3e-4
    adamw_betas: tuple[float, float] = (0.9, 0.95)
    adamw_eps: float = 1e-8
    adamw_weight_decay: float = 0.1
    muon: list[str] = field(default_factory=list)
    adamw: list[str] = field(default_factory=list)
    qkv_splits: dict[str, list[int]] = field(default_factory=dict)
    fp32_matmul_prec: str = "medium"
    max_consecutive_skipped_steps: int = 10
    moment2_method: str | None = None
    offload: bool | float = False
    report_interval: int = 0
    muon_kwargs: dict = field(default_factory=dict)

    def __post_init__(self):
        super().__post_init__()
        if self.param_group_overrides:
            raise ValueError("optimizer.param_group_overrides: MegatronFSDPMuonConfig places "
                             "parameters by name with optimizer.muon and optimizer.adamw, and "
                             "sets AdamW's learning rate with optimizer.adamw_lr")

    def build(self, model, *, device_mesh=None, is_peft=False):
        """One optimizer per model part (`model.parts`, or the model), each part wrapped by
        Megatron-FSDP."""
        parts = getattr(model, "parts", [model])
        if not all(find_megatron_fsdp(part) for part in parts):
            raise ValueError(
                "MegatronFSDPMuonConfig steps a model on Megatron-FSDP: set distributed.strategy: "
                "megatron_fsdp and run on more than one rank (at world size 1 Automodel does not "
                "wrap the model)")
        return [muon_optimizer(
            part, lr=self.lr, momentum=self.momentum, nesterov=self.nesterov,
            weight_decay=self.weight_decay, adamw_lr=self.adamw_lr,
            adamw_betas=tuple(self.adamw_betas), adamw_eps=self.adamw_eps,
            adamw_weight_decay=self.adamw_weight_decay, muon=tuple(self.muon),
            adamw=tuple(self.adamw),
            qkv_splits={pattern: tuple(rows) for pattern, rows in self.qkv_splits.items()},
            fp32_matmul_prec=self.fp32_matmul_prec,
            max_consecutive_skipped_steps=self.max_consecutive_skipped_steps,
            moment2_method=self.moment2_method, offload=self.offload,
            report_interval=self.report_interval, **self.muon_kwargs)
            for part in parts]

    def _build_optimizer(self, params, *, foreach=None):
        raise TypeError("MegatronFSDPMuonConfig builds from the model (its Megatron-FSDP "
                        "modules' names decide Muon or AdamW), not from a list of parameters: "
                        "call build(model)")
