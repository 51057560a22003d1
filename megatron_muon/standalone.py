"""`megatron_muon.standalone.muon_optimizer(model, ...)`: Muon and AdamW on a model wrapped by
Megatron-FSDP outside Megatron (integrations/standalone.py), at the path users import; and
`step_report(optimizer)`: its last step's phase times (with `report_interval`) and scalars."""

from .integrations.standalone import muon_optimizer
from .distribution.step_report import report as step_report

__all__ = ["muon_optimizer", "step_report"]
