"""step: what Megatron's training loop steps. FSDPMuonChainedOptimizer (chained) runs
Megatron-FSDP's step contract around the Muon + Adam chain: the grad sync, the NaN/Inf skip
(nonfinite_skip), MuonClip (qk_clip), the weights' checks after the param sync (weights_check),
checkpoints and their checksums (checksums), a Megatron DDP checkpoint read into a Megatron-FSDP
run (ddp_checkpoint) and ours into a Megatron DDP run (checkpoint_for_ddp), the step in timed
phases (timed_step), the rates it measured as the scale model's file (rates_file). Imports the
layers below it."""
