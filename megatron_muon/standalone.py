"""`megatron_muon.standalone.muon_optimizer(model, ...)`: Muon and AdamW on a model wrapped by
Megatron-FSDP outside Megatron (front_ends/standalone.py), at the path users import; and
`step_report(optimizer)`: its last step's phase times (with `report_interval`) and scalars."""

from .front_ends.standalone import muon_optimizer
from .reporting.step_report import report as step_report

__all__ = ["muon_optimizer", "step_report"]
