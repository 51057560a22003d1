"""`megatron_muon.automodel.MegatronFSDPMuonConfig`: NeMo Automodel's optimizer config for Muon on
Megatron-FSDP (integrations/automodel.py), the `_target_` its YAML names."""

from .integrations.automodel import MegatronFSDPMuonConfig

__all__ = ["MegatronFSDPMuonConfig"]
