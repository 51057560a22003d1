"""Muon for Megatron-FSDP."""

# First: an installed version lacking a name the package borrows fails here, with every such
# name listed.
from .compat import upstream  # noqa: F401  isort: skip
from .chain.chained import FSDPMuonChainedOptimizer
from .core.zero_adaptive_muon import ZeROTensorParallelAdaptiveMuon
from .core.zero_muon import ZeROTensorParallelMuon
from .integrations.factory import get_megatron_optimizer

__all__ = ["FSDPMuonChainedOptimizer", "ZeROTensorParallelAdaptiveMuon", "ZeROTensorParallelMuon",
           "get_megatron_optimizer"]
