"""Small megatron-core GPTs (local spec, no TransformerEngine) in FullyShardedDataParallel, on CPU
or GPU, for the tests and the benchmark."""

from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,
                                                      get_gpt_layer_local_spec)
from megatron.core.optimizer import OptimizerConfig
from megatron.core.tensor_parallel import random as tp_random
from megatron.core.transformer import MLATransformerConfig, TransformerConfig

from ..cpu.training_compat import apply_megatron_training_compat


@dataclass(frozen=True)
class GPTShape:
    layers: int = 2
    hidden: int = 32
    ffn: int = 48
    heads: int = 4
    vocab: int = 64
    seq: int = 16
    micro_batch: int = 2


TINY = GPTShape()

# The flagship models' layers at TINY's size, as gpt() settings. Kimi K2's (DeepSeek-V3's)
# multi-latent attention: q and kv through low-rank projections (each latent normalized) and a
# rope part; DeepSeek-V2-Lite's, whose q has no low-rank projection (linear_q_proj; megatron-core's
# local spec then refuses the latents' norms). Their widths differ, so that Megatron-FSDP's shards
# cut them unevenly.
MLA = dict(multi_latent_attention=True, q_lora_rank=20, kv_lora_rank=12, qk_head_dim=8,
           qk_pos_emb_head_dim=4, v_head_dim=6, rope_type="rope", normalization="RMSNorm",
           qk_layernorm=True)
MLA_WITHOUT_Q_LORA = {**MLA, "q_lora_rank": None, "qk_layernorm": False}
# Their MoE (with num_experts): fine-grained routed experts (top-2) beside a shared expert, the
# first layer dense.
FINE_GRAINED_MOE = dict(moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=24,
                        moe_layer_freq=[0, 1])
KIMI_K2_LIKE = {**MLA, **FINE_GRAINED_MOE}
DEEPSEEK_LIKE = {**MLA_WITHOUT_Q_LORA, **FINE_GRAINED_MOE}


_parallel_layout = None  # the layout megatron-core's process groups were last built for


def init_parallel_state(expert_parallel: int = 1, tensor_parallel: int = 1, replicas: int = 1,
                        expert_tensor_parallel: int | None = None, context_parallel: int = 1):
    """megatron-core's process groups; `replicas` > 1 is HSDP's number of optimizer instances;
    `expert_tensor_parallel` defaults, as in Megatron, to `tensor_parallel`.
    The groups of the last layout are kept (a process running many cases builds them once per
    layout: torch never ends a gloo group's polling thread, and a process that built hundreds
    spent most of its time in them); the RNG states are reset every time."""
    global _parallel_layout
    apply_megatron_training_compat()
    layout = (torch.distributed.get_world_size(), expert_parallel, tensor_parallel, replicas,
              expert_tensor_parallel, context_parallel)
    if layout != _parallel_layout or not parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
        # A fake process group (no data moves) cannot back megatron-core's extra gloo groups.
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel, expert_model_parallel_size=expert_parallel,
            context_parallel_size=context_parallel,
            expert_tensor_parallel_size=expert_tensor_parallel,
            num_distributed_optimizer_instances=replicas,
            create_gloo_process_groups=torch.distributed.get_backend() != "fake")
        _parallel_layout = layout
    tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    tp_random.model_parallel_cuda_manual_seed(123)


def gpt(shape: GPTShape = TINY, num_experts=None, **settings):
    """`settings`: further TransformerConfig settings (MLATransformerConfig's with
    multi_latent_attention). Layers as megatron-core's local spec builds them, per layer where the
    settings make layers differ (moe_layer_freq) or make them MLA (get_gpt_decoder_block_spec)."""
    torch.manual_seed(0)
    mla = settings.get("multi_latent_attention", False)
    config = (MLATransformerConfig if mla else TransformerConfig)(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        ffn_hidden_size=shape.ffn,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
        # Its expert layers tag their weights allreduce=False from it, which Megatron DDP reads.
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        num_moe_experts=num_experts, moe_router_topk=2,
        # megatron-core's local experts add their bias in place on a custom-Function view
        # (in MLP.forward), which autograd refuses: MoE models here have no linear biases.
        add_bias_linear=num_experts is None,
        use_cpu_initialization=True, gradient_accumulation_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
        apply_rope_fusion=False, hidden_dropout=0.0, attention_dropout=0.0, **settings)
    if mla or "moe_layer_freq" in settings:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                          normalization=config.normalization)
    else:
        spec = get_gpt_layer_local_spec(num_experts=num_experts)
    return GPTModel(config, spec, vocab_size=shape.vocab, max_sequence_length=shape.seq)


def fsdp_gpt(shape: GPTShape = TINY, strategy="optim_grads_params", num_experts=None,
             outer_strategy="no_shard", overlap=False, main_params_dtype=torch.float32,
             **settings):
    """The GPT in FullyShardedDataParallel; HSDP (with `outer_strategy` across the replicas) when
    init_parallel_state was given replicas; `overlap`: --overlap-grad-reduce and
    --overlap-param-gather; `main_params_dtype`: --megatron-fsdp-main-params-dtype (None: no
    main weight buffer); `settings`: further TransformerConfig settings."""
    model = gpt(shape, num_experts, **settings)
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True, use_distributed_optimizer=True,
        data_parallel_sharding_strategy=strategy,
        overlap_grad_reduce=overlap, overlap_param_gather=overlap,
        num_distributed_optimizer_instances=parallel_state.get_data_parallel_world_size(
            with_context_parallel=True) // parallel_state.get_data_parallel_world_size(
            with_context_parallel=True, partial_data_parallel=True),
        outer_dp_sharding_strategy=outer_strategy,
        megatron_fsdp_main_params_dtype=main_params_dtype)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return FullyShardedDataParallel(model.config, ddp_config, model, device=device)


def ddp_gpt(shape: GPTShape = TINY, use_distributed_optimizer=False, layer_wise=False,
            num_experts=None, **settings):
    """The GPT in megatron-core's DistributedDataParallel (Megatron DDP: whole weights on every
    rank), wrapped as megatron.training wraps it: buffers laid out for megatron-core's
    distributed optimizer, or for its layer-wise one (Muon's)."""
    from megatron.training.training import wrap_model_chunks_with_ddp

    model = gpt(shape, num_experts, **settings)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer)
    return wrap_model_chunks_with_ddp([model], model.config, ddp_config,
                                      use_layer_wise_distributed_optimizer=layer_wise)[0]


def hugging_face_model(kind: str, **config):
    """A Hugging Face `{kind}ForCausalLM` (Llama, Qwen3, ...) built from `{kind}Config(**config)`,
    no download, and its decoder layer class (a Megatron-FSDP unit)."""
    import importlib

    import transformers

    model = getattr(transformers, f"{kind}ForCausalLM")(getattr(transformers, f"{kind}Config")(**config))
    modeling = importlib.import_module(f"transformers.models.{kind.lower()}.modeling_{kind.lower()}")
    return model, getattr(modeling, f"{kind}DecoderLayer")


def optimizer_config(optimizer="muon", **overrides):
    settings = dict(optimizer=optimizer, lr=0.01, use_distributed_optimizer=True,
                    muon_fp32_matmul_prec="highest")
    return OptimizerConfig(**{**settings, **overrides})


def lm_loss(model, step, rank, shape: GPTShape = TINY):
    """Mean LM loss on a random batch fixed by (step, rank)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return loss_on(model, torch.randint(0, shape.vocab, (shape.micro_batch, shape.seq), generator=g,
                                        device="cpu"))


def loss_on(model, tokens):
    """Mean next-token loss of `model` on a batch of token sequences (drawn on the CPU, so every
    machine trains on the same ones)."""
    batch, seq = tokens.shape
    device = next(model.parameters()).device
    tokens = tokens.to(device)
    position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(batch, -1)
    mask = torch.tril(torch.ones(seq, seq, dtype=torch.bool, device=device)).logical_not().view(
        1, 1, seq, seq)
    losses = model(tokens, position_ids, mask, labels=torch.roll(tokens, -1, dims=1))
    return losses.float().mean()
