"""Imported by the suites' forkserver (tests/conftest.py, tests_bridge/bridge_ranks.py) after
their other preloads, before it forks any rank: what every rank of a training run otherwise pays
once in its own process, paid once in the server. A W=2 demo run of 6 iterations
(e2e_harness.training_log) took 3.9 s without it on 2 cores, 2.0 s with it.

- megatron.training builds its tokenizer through megatron.core.tokenizers.text, which imports
  transformers: about 0.8 s of a run.
- megatron-core compiles its jit fusions (bias-GeLU, bias-dropout-add) with torch.compile, and
  the first compile in a process initializes inductor (its pattern matcher, the hashes of torch's
  own source that key its cache): about 1 s of a run. A compiled function of the same kind leaves
  that done. Nothing compiled here reaches a rank's model: each rank compiles megatron-core's
  functions itself, as it did before.
- No compile workers: rank_processes.preload has set TORCHINDUCTOR_COMPILE_THREADS 1 before
  the server started (tests/conftest.py's server starts no thread).
- What the server imported is frozen (gc.freeze), in it and so in every process it forks:
  Megatron-FSDP collects garbage whenever it builds a model (ParamAndGradBuffer's
  _init_each_parameter_group_buffers), which scanned every object of torch, megatron and
  transformers again each time, about 0.5 s of CPU per build in every rank."""

import gc

import megatron.core.tokenizers.text  # noqa: F401
import torch

torch.compile(lambda x, bias: torch.nn.functional.gelu(x + bias, approximate="tanh"))(
    torch.zeros(4, 8), torch.zeros(8))

gc.freeze()
