"""distribution: Megatron-FSDP's DTensor main weights as rows of matrices (dtensor_rows), the
exchange's collectives that gather a matrix to its owner and send its rows back (exchange), and
what an optimizer plans once at construction, per exchange group (group_planner, with the rates
measured_cost takes); the step's phases and timers (phases) and what a step reports of its plans
(step_report). No optimizer math: it moves and plans rows. Imports plan and compat only."""
