"""The models the scale estimate plans (estimate) as megatron-core builds them: on the meta
device (shapes only), one TP rank's part of each tensor-parallel weight, the rows each rank's
Megatron-FSDP shard holds, and the Muon matrices ZeROTensorParallelMuon makes of them."""

import dataclasses
import math
from typing import NamedTuple

import torch

from ..compat import upstream
from ..compat.tensor_parallel import orthogonalized_partition_dim
from ..plan import RowLayout, orthogonalization_key, qkv_row_blocks, split_matrices
from ..planner.param_tags import is_expert_param, is_scalar_param, tag_params


class ModelSpec(NamedTuple):
    """A model as the estimate builds it: megatron-core TransformerConfig settings, GPTModel
    settings, and the tokens of one step (its report's batch)."""

    config: dict
    gpt: dict
    tokens_per_step: int


MODELS = {
    "llama-8b": ModelSpec(dict(num_layers=32, hidden_size=4096, num_attention_heads=32,
                               num_query_groups=8, ffn_hidden_size=14336),
                          dict(vocab_size=128256), 4 << 20),
    "llama-70b": ModelSpec(dict(num_layers=80, hidden_size=8192, num_attention_heads=64,
                                num_query_groups=8, ffn_hidden_size=28672),
                           dict(vocab_size=128256), 4 << 20),
    # DeepSeek-V3: 61 layers (3 dense), MLA, 256 routed experts (top-8) + 1 shared, no MTP;
    # its report's batch: 15360 sequences of 4096 tokens.
    "deepseek-v3": ModelSpec(dict(num_layers=61, hidden_size=7168, num_attention_heads=128,
                                  ffn_hidden_size=18432, q_lora_rank=1536, kv_lora_rank=512,
                                  qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
                                  num_moe_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048,
                                  moe_shared_expert_intermediate_size=2048,
                                  moe_layer_freq=[0] * 3 + [1] * 58),
                             dict(vocab_size=129280), 15360 * 4096),
    # Kimi K2: DeepSeek-V3's layout with 64 heads, 384 routed experts (top-8) + 1 shared, one
    # dense first layer, a 163840-token vocabulary; its report's batch: 67M tokens (16384 x 4096).
    "kimi-k2": ModelSpec(dict(num_layers=61, hidden_size=7168, num_attention_heads=64,
                              ffn_hidden_size=18432, q_lora_rank=1536, kv_lora_rank=512,
                              qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
                              num_moe_experts=384, moe_router_topk=8, moe_ffn_hidden_size=2048,
                              moe_shared_expert_intermediate_size=2048,
                              moe_layer_freq=[0] + [1] * 60),
                         dict(vocab_size=163840), 16384 * 4096),
}
# Bridge's Kimi K2 and DeepSeek-V3 performance recipes: EP 64.
MAX_EXPERT_PARALLEL = 64
LLAMA_STYLE = dict(add_bias_linear=False, gated_linear_unit=True, normalization="RMSNorm")
# Megatron's model flags (megatron.training.arguments) the self-test takes for the user's own
# model: megatron-core's TransformerConfig fields of the same names, but --num-experts'
# (num_moe_experts) and --vocab-size's (GPTModel's vocab_size).
MODEL_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
               "num_query_groups", "num_experts", "moe_ffn_hidden_size", "moe_router_topk",
               "moe_shared_expert_intermediate_size", "vocab_size")
REQUIRED_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size")


def spec_from_flags(flags: dict, swiglu: bool) -> ModelSpec | None:
    """The model Megatron's flags (`flags`: MODEL_FLAGS' names, None where not given) describe,
    with the defaults megatron.training's validate_args gives them: --ffn-hidden-size 4 x
    hidden (with --swiglu 8/3 x, a multiple of 64 below), query groups as heads, an expert's
    --moe-ffn-hidden-size the dense one's, top-2 routing; SwiGLU only with `swiglu`; no biases
    (Llama-style). None where none is given."""
    given = {"num_moe_experts" if flag == "num_experts" else flag: value
             for flag, value in flags.items() if value is not None}
    if not given:
        return None
    missing = [f"--{flag.replace('_', '-')}" for flag in REQUIRED_FLAGS if flag not in given]
    if missing:
        raise ValueError(f"the model to estimate needs {', '.join(missing)} (Megatron's flags)")
    vocab_size = given.pop("vocab_size")
    hidden = given["hidden_size"]
    config = dict(ffn_hidden_size=int(4 * hidden * 2 / 3 / 64) * 64 if swiglu else 4 * hidden,
                  num_query_groups=given["num_attention_heads"], gated_linear_unit=swiglu)
    config.update(given)
    if "num_moe_experts" in config:
        config = {"moe_ffn_hidden_size": config["ffn_hidden_size"], "moe_router_topk": 2, **config}
    return ModelSpec(config, dict(vocab_size=vocab_size), 0)


# The sequences a step's tokens come in: DeepSeek-V3's and Kimi K2's reports train at 4096, and
# NVIDIA's benchmark batch is 2048 of them; the Llamas' 4M tokens are taken so too.
SEQUENCE_LENGTH = 4096


def attention_flops_per_token(spec: ModelSpec, sequence_length: int = SEQUENCE_LENGTH) -> float:
    """Core attention's forward-backward FLOPs a token (Q K^T and its softmax times V, causal), as
    megatron.training's num_floating_point_operations counts them: 3 (forward and backward) x
    the sequence length x heads x (the query-key head dim, MLA's rope part too, + the value
    head dim), a layer; the projections are among the active params' matmuls already."""
    config = spec.config
    heads = config["num_attention_heads"]
    head_dim = config.get("kv_channels") or config["hidden_size"] // heads
    query_key = config.get("qk_head_dim", head_dim) + config.get("qk_pos_emb_head_dim", 0)
    value = config.get("v_head_dim", head_dim)
    return 3 * sequence_length * heads * (query_key + value) * config["num_layers"]


def is_dense(spec: ModelSpec) -> bool:
    return "num_moe_experts" not in spec.config


def expert_parallel(spec: ModelSpec, world: int) -> int:
    """An MoE's EP on `world` data-parallel ranks: the most dividing both, up to 64."""
    if is_dense(spec):
        return 1
    return math.gcd(world, MAX_EXPERT_PARALLEL, spec.config["num_moe_experts"])


def meta_model(spec: ModelSpec, expert_parallel_size: int, tensor_parallel: int = 1):
    """megatron-core's GPTModel (local spec, Llama-style unless `spec` says otherwise: RMSNorm,
    SwiGLU, no biases, untied output) on the meta device, with the experts one expert-parallel
    rank holds and each tensor-parallel weight cut to one TP rank's part
    (tensor_parallel_part)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    settings, model_settings, _ = spec
    is_mla = "q_lora_rank" in settings
    config_class = MLATransformerConfig if is_mla else TransformerConfig
    with torch.device("meta"):
        config = config_class(**{**LLAMA_STYLE, **settings}, use_cpu_initialization=True,
                              perform_initialization=False)
        layers = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                            normalization="RMSNorm")
        if is_mla:
            # The attention kernel has no weights; megatron-core's local one cannot take MLA's
            # head sizes (TransformerEngine's can), so it is left out.
            for layer in layers.layer_specs:
                layer.submodules.self_attention.submodules.core_attention = IdentityOp
        model = GPTModel(config, layers, max_sequence_length=4096, position_embedding_type="rope",
                         share_embeddings_and_output_weights=False, **model_settings)
    for module in model.modules():
        if hasattr(module, "local_experts"):  # this expert-parallel rank's experts only
            held = len(module.local_experts) // expert_parallel_size
            module.local_experts = module.local_experts[:held]
    if tensor_parallel > 1:
        for p in model.parameters():
            p.data = torch.empty(tensor_parallel_part(p, tensor_parallel), device="meta")
    return model


def tensor_parallel_part(p, tensor_parallel: int) -> tuple[int, ...]:
    """The shape of one TP rank's part of `p`: megatron-core tags a tensor-parallel weight
    (tensor_model_parallel) with the dim its TP ranks split (partition_dim: 0 for column-parallel
    layers, QKV's query groups and fc1's gate and up together, and the vocabulary; 1 for
    row-parallel ones), whatever the TP size it was built with."""
    shape = list(p.shape)
    if tensor_parallel > 1 and getattr(p, "tensor_model_parallel", False):
        if shape[p.partition_dim] % tensor_parallel:
            raise ValueError(f"{tuple(p.shape)} does not split over TP = {tensor_parallel}")
        shape[p.partition_dim] //= tensor_parallel
    return tuple(shape)


def fsdp_rows(model, world: int, expert_world: int) -> dict:
    """{param: rows of each rank's shard}, from Megatron-FSDP's bucketing (FSDP units: the
    transformer layers, as megatron-core's adapter sets them) and buffer index (ZeRO-3): each
    bucket padded to the group size, cut into equal shards. Experts are sharded over the expert
    data-parallel group."""
    from types import SimpleNamespace

    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import (
        BucketingPolicy, build_data_parallel_buffer_index)
    from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayer

    strategy = "optim_grads_params"
    policy = BucketingPolicy(suggested_bucket_size=None, data_parallel_sharding_strategy=strategy,
                             fsdp_unit_modules=[TransformerLayer, MoETransformerLayer])
    groups, _, _ = upstream.megatron_fsdp_parameter_groups(model, policy, {})
    rows = {}
    for bucket_id, group in enumerate(groups):
        size = expert_world if group.is_expert_param else world
        items, bucket, _ = build_data_parallel_buffer_index(
            [p.shape for p in group.params], 0, size, True,
            SimpleNamespace(data_parallel_sharding_strategy=strategy), bucket_id=bucket_id,
            chunk_size_factor=group.chunk_size_factor)
        shard = bucket.size // size
        for item_id, p in enumerate(group.params):
            start = items[item_id].global_data_index
            stop = start + p.numel()
            row = p.shape[1:].numel()
            held = [0] * size
            for rank in range(start // shard, min(size, (stop - 1) // shard + 1)):
                elements = min(stop, (rank + 1) * shard) - max(start, rank * shard)
                assert elements % row == 0, "Megatron-FSDP cut a row"
                held[rank] = elements // row
            rows[p] = held
    return rows


def with_gram(matrices: list, schedule) -> list:
    """`matrices` under --muon-gram-newton-schulz (`schedule`, a plan.GramSchedule): each one
    Newton-Schulz gets whole (no TP gather, or over one rank) with the schedule, which runs
    where it costs fewer FLOPs (planner.group_planner's _with_gram)."""
    return [dataclasses.replace(matrix, gram=schedule)
            if (matrix.tp_gather or (0, 1))[1] == 1 else matrix for matrix in matrices]


def muon_matrices(model, rows: dict, tp_mode: str, tensor_parallel: int = 1):
    """(dense, expert) Muon matrices, each [Matrix], as megatron_muon's factory and
    ZeROTensorParallelMuon make them under `--muon-tp-mode tp_mode` (QKV split into q, k, v
    blocks; a stack of experts split into its matrices; in duplicated mode, a matrix with a
    partition dim gathered over its TP ranks, as newton_schulz_tp does), `model` one TP rank's
    part of a model over `tensor_parallel` ranks (the experts' TP size 1)."""
    tag_params([model])
    dense, expert = [], []
    for name, p in model.named_parameters():
        if is_scalar_param(p):
            continue
        split_shapes = p.qkv_split_shapes if getattr(p, "is_qkv", False) else None
        blocks = qkv_row_blocks(p.shape[0], split_shapes) if split_shapes else None
        tp_size = 1 if is_expert_param(name, p) else tensor_parallel
        key = orthogonalization_key(p, bool(split_shapes), tp_size, tp_mode)
        partition_dim = orthogonalized_partition_dim(tp_mode, p)
        tp_gather = None if partition_dim is None else (partition_dim, tp_size)
        (expert if is_expert_param(name, p) else dense).extend(
            dataclasses.replace(matrix, tp_gather=tp_gather)
            for _, matrix in split_matrices(RowLayout(tuple(rows[p])),
                                            getattr(p, "num_stacked_experts", 1),
                                            p.shape[-1], key, blocks))
    return dense, expert
