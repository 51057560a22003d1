"""`megatron_muon.bridge.install(cfg)`: Muon on Megatron-FSDP through Megatron-Bridge
(front_ends/bridge.py), at the path users and recipes import; import it before megatron.bridge
on a machine without CUDA."""

from .front_ends.bridge import (ChecksummedCheckpointManager, MuonOptimizerConfig, install,
                                muon_on_megatron_fsdp)

__all__ = ["ChecksummedCheckpointManager", "MuonOptimizerConfig", "install",
           "muon_on_megatron_fsdp"]
