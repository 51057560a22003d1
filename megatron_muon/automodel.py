"""`megatron_muon.automodel.MegatronFSDPMuonConfig`: NeMo Automodel's optimizer config for Muon on
Megatron-FSDP (front_ends/automodel.py), the `_target_` its YAML names."""

from .front_ends.automodel import MegatronFSDPMuonConfig

__all__ = ["MegatronFSDPMuonConfig"]
