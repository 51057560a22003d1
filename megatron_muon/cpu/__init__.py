"""cpu: the CPU layer, NCCL's and CUDA's semantics on gloo and a CPU, so that the suite proves
on CPU what runs on GPUs: torch's and Megatron-FSDP's collectives and kernels (torch_compat:
async work, streams and events, PREMUL_SUM and AVG as NCCL does them, MLA's local attention,
bf16 matmul emulation), and megatron.training's and Bridge's start-up without CUDA
(training_compat). Inert with CUDA; every patch listed in compat.upstream. Imports compat."""
