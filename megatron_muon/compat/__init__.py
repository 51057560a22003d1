"""compat: the one boundary with upstream's names. Every private name megatron-muon borrows from
torch, megatron-core, Megatron-FSDP, emerging-optimizers and Megatron-Bridge, and every patch, is
listed and checked in upstream.py (patching.py applies and undoes them; versions.py and
supported_versions.py name the supported ranges); megatron-core's TP helpers (tensor_parallel)
and Newton-Schulz loop (newton_schulz_loop) as ours call them. What the patches do lives with
their concern: fixes/ (released upstream's defects), cpu/ (the CPU layer). Imports nothing else
of megatron_muon."""
