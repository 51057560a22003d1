"""`megatron_muon.training.install()`: the switch that lets megatron.training train Muon on
Megatron-FSDP (integrations/megatron_lm.py), at the path users and scripts import."""

from .integrations.megatron_lm import MUON_OPTIMIZERS, install, uninstall

__all__ = ["MUON_OPTIMIZERS", "install", "uninstall"]
