"""Muon for Megatron-FSDP."""

from .zero_muon import ZeROTensorParallelMuon

__all__ = ["ZeROTensorParallelMuon"]
