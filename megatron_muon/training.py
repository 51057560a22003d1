"""`megatron_muon.training.install()`: the switch that lets megatron.training train Muon on
Megatron-FSDP (front_ends/megatron_lm.py), at the path users and scripts import."""

from .front_ends.megatron_lm import MUON_OPTIMIZERS, install, uninstall

__all__ = ["MUON_OPTIMIZERS", "install", "uninstall"]
