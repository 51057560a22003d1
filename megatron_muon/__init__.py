"""Muon for Megatron-FSDP."""

from .chained import FSDPMuonChainedOptimizer
from .factory import get_megatron_optimizer
from .zero_muon import ZeROTensorParallelMuon

__all__ = ["FSDPMuonChainedOptimizer", "ZeROTensorParallelMuon", "get_megatron_optimizer"]
