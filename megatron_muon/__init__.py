"""Muon for Megatron-FSDP."""

# First: an installed version lacking a name the package borrows fails here, with every such
# name listed.
from . import upstream  # noqa: F401  isort: skip
from .chained import FSDPMuonChainedOptimizer
from .factory import get_megatron_optimizer
from .zero_adaptive_muon import ZeROTensorParallelAdaptiveMuon
from .zero_muon import ZeROTensorParallelMuon

__all__ = ["FSDPMuonChainedOptimizer", "ZeROTensorParallelAdaptiveMuon", "ZeROTensorParallelMuon",
           "get_megatron_optimizer"]
