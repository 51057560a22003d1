"""get_megatron_optimizer with megatron-core's signature (placeholder: forwards to megatron-core)."""

from megatron.core.optimizer import get_megatron_optimizer as _core_get_megatron_optimizer


def get_megatron_optimizer(config, model_chunks, config_overrides=None, use_gloo_process_groups=True,
                           pg_collection=None, dump_param_to_param_group_map=None):
    return _core_get_megatron_optimizer(
        config, model_chunks, config_overrides=config_overrides,
        use_gloo_process_groups=use_gloo_process_groups, pg_collection=pg_collection,
        dump_param_to_param_group_map=dump_param_to_param_group_map)
