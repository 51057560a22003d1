"""`megatron_muon.bridge.install(cfg)`: Muon on Megatron-FSDP through Megatron-Bridge
(integrations/bridge.py), at the path users and recipes import; import it before megatron.bridge
on a machine without CUDA."""

from .integrations.bridge import (ChecksummedCheckpointManager, MuonOptimizerConfig, install,
                                  muon_on_megatron_fsdp)

__all__ = ["ChecksummedCheckpointManager", "MuonOptimizerConfig", "install",
           "muon_on_megatron_fsdp"]
