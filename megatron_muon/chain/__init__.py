"""chain: what Megatron's training loop steps. FSDPMuonChainedOptimizer (chained) runs
Megatron-FSDP's step contract around the Muon + Adam chain: the grad sync, the NaN/Inf skip
(nonfinite_skip), MuonClip (qk_clip), the weights' checks after the param sync (weights_check),
the model's chunks and names (model_chunks), the step in timed phases (timed_step). Imports the
layers below it."""
