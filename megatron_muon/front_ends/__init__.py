"""front_ends: where users start, each on its own: megatron.training's switch (megatron_lm),
Megatron-Bridge (bridge), models outside Megatron (standalone, with placement) and NeMo
Automodel (automodel, on standalone). A front end imports integrations/ and the layers below,
never another front end (tests/test_layers.py). Users import them by their public paths
(megatron_muon.training, .bridge, .standalone, .automodel)."""
