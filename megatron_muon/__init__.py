"""Muon for Megatron-FSDP."""
