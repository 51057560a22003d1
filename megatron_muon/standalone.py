"""`megatron_muon.standalone.muon_optimizer(model, ...)`: Muon and AdamW on a model wrapped by
Megatron-FSDP outside Megatron (integrations/standalone.py), at the path users import."""

from .integrations.standalone import muon_optimizer

__all__ = ["muon_optimizer"]
