"""estimate: what Muon's optimizer step costs a model at any W, from the real planning code and
measured rates, with no model allocated (megatron-core builds it on the meta device): the model
(model), its parts planned as the optimizer plans them (parts), the planned step's time
(step_time) and the figures of a model at W (figures). `make scale` (benchmarks/scale_model.py)
tabulates it for the flagship models; the self-test prints it for the user's model at their
rates (`--estimate-model`). Imports the layers below it."""
