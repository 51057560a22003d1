"""distribution: the collectives. Megatron-FSDP's DTensor main weights as rows of matrices
(dtensor_rows), the exchange that gathers each matrix's rows to its owner and sends its update's
rows back (exchange), the process groups of teams and the nodes they go on (team_groups), and
every rank's verdict of a check agreed on (agreement). No optimizer math and no planning: it
moves rows as a plan says. Imports plan, compat and observe."""
