"""Megatron's tags on the params Muon steps, as megatron-core's Muon path sets and reads them:
which params are experts' (their exchange group is expert data parallelism), the QKV split's
shapes, a grouped GEMM's expert count, and which params the scalar optimizer steps."""

from ..compat import upstream


def is_expert_param(name, param) -> bool:
    """Megatron's expert flag (allreduce=False on the model param, which Megatron-FSDP's main
    weight keeps as `orig_param`), or Megatron-FSDP's own rule, which picks the expert mesh:
    '.experts.' in the name. Local-spec experts carry only the name."""
    model_param = getattr(param, "orig_param", param)
    return not getattr(model_param, "allreduce", True) or ".experts." in name


def tag_params(model_chunks):
    """The tags megatron-core's Muon path sets, set on the main weights the optimizer sees, and
    the expert count of a grouped GEMM's single grouped weight (TE GroupedLinear with
    `single_grouped_weight`): Muon orthogonalizes each expert's matrix apart."""
    for chunk in model_chunks:
        for module in chunk.modules():
            if getattr(module, "single_grouped_weight", False):
                module.weight.num_stacked_experts = module.num_gemms
        qkv_split_shapes = upstream.get_qkv_split_shapes(chunk.config)
        for name, param in chunk.named_parameters():
            param.allreduce = not is_expert_param(name, param)  # read by upstream.get_param_groups
            if not param.allreduce:
                param.expert_tp = True
            if ("linear_qkv.weight" in name and param.dim() == 2
                    and param.shape[0] % sum(qkv_split_shapes) == 0):
                param.is_qkv = True
                param.qkv_split_shapes = qkv_split_shapes


def is_scalar_param(param) -> bool:
    """megatron-core's rule for what Muon leaves to the scalar optimizer (not 2-D, or embedding
    or output; on megatron-core main also a param marked use_muon=False), except that a stack
    of expert matrices is Muon's."""
    return (upstream.is_muon_excluded(param)
            and not getattr(param, "num_stacked_experts", None))
