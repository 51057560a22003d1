"""observe: what a run measures of itself, used by the optimizers, the chain and the estimate:
the step's phases, each a profiler range and a Megatron timer, and PhaseTimes where no Megatron
timers run (phases); the rates owners by time are chosen with, measured where the optimizer
runs, at construction (measured_cost); every collective a step sends and the exchange's buffers
alive at once, for tests and benchmarks (collectives). Imports plan and the layers below it."""
