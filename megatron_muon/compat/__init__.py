"""compat: the one boundary with upstream. Every private name megatron-muon borrows from torch,
megatron-core, Megatron-FSDP, emerging-optimizers and Megatron-Bridge, and every patch, is listed
and checked in upstream.py (patching.py applies and undoes them; versions.py names the supported
ranges); upstream_fixes.py repairs released upstream where the installed code has a defect;
cpu.py and cpu_training.py give NCCL's and CUDA's semantics on gloo and CPU. Imports nothing else
of megatron_muon."""
