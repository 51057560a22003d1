"""integrations: the entry points, Megatron-shaped and short. The factory (megatron-core's
get_megatron_optimizer signature), megatron.training's switch (megatron_lm) and flags
(arguments), the one table of refusals (rules), Megatron-Bridge (bridge), NeMo Automodel
(automodel) and models outside Megatron (standalone, placement). Users import them by their
public paths (megatron_muon.training, .bridge, .standalone, .automodel, .arguments)."""
