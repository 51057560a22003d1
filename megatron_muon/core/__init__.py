"""core: the optimizers. ZeROTensorParallelMuon (zero_muon) and ZeROTensorParallelAdaptiveMuon
(zero_adaptive_muon) step Megatron-FSDP's sharded main weights, with the math from
emerging-optimizers and megatron-core (muon_math, syrk, team_newton_schulz), each adaptive
variant behind the SecondMoment contract (second_moment), their settings checked (settings),
the offloaded state (state_offload) and the check interval's owner check (owner_check, checks).
Imports the layers below it."""
