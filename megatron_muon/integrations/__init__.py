"""integrations: what every front end shares. The factory (megatron-core's
get_megatron_optimizer signature), the muon_* settings with their defaults and checks
(muon_settings), Megatron's flags (arguments), the one table of refusals (rules), and the state
a front end keeps over one run (run_state). Imports the layers below it."""
