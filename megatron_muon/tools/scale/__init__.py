"""The scale estimate: what Muon's optimizer step costs a model at any W, from the real planning
code and measured rates, with no model allocated (megatron-core builds it on the meta device).
`make scale` (benchmarks/scale_model.py) tabulates it for the flagship models; the self-test
prints it for the user's model at their rates (`--estimate-model`)."""
