"""A tiny megatron-core GPT (local spec, no TransformerEngine) in FullyShardedDataParallel on CPU."""

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig
from megatron.core.tensor_parallel import random as tp_random
from megatron.core.transformer import TransformerConfig

from megatron_muon.cpu import apply_megatron_training_compat

VOCAB, SEQ = 64, 16


def init_parallel_state(expert_parallel: int = 1):
    apply_megatron_training_compat()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=expert_parallel)
    tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    tp_random.model_parallel_cuda_manual_seed(123)


def gpt(num_experts=None):
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
        num_moe_experts=num_experts, moe_router_topk=2,
        # megatron-core's local experts add their bias in place on a custom-Function view
        # (mlp.py:354), which autograd refuses: MoE models here have no linear biases.
        add_bias_linear=num_experts is None,
        use_cpu_initialization=True, gradient_accumulation_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
        apply_rope_fusion=False, hidden_dropout=0.0, attention_dropout=0.0)
    return GPTModel(config, get_gpt_layer_local_spec(num_experts=num_experts), vocab_size=VOCAB,
                    max_sequence_length=SEQ)


def fsdp_gpt(strategy="optim_grads_params", num_experts=None):
    model = gpt(num_experts)
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True, use_distributed_optimizer=True,
        data_parallel_sharding_strategy=strategy, gradient_reduce_div_fusion=False,
        overlap_grad_reduce=False, overlap_param_gather=False)
    return FullyShardedDataParallel(model.config, ddp_config, model, device=torch.device("cpu"))


def optimizer_config(optimizer="muon", **overrides):
    settings = dict(optimizer=optimizer, lr=0.01, use_distributed_optimizer=True,
                    muon_fp32_matmul_prec="highest")
    return OptimizerConfig(**{**settings, **overrides})


def lm_loss(model, step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(2, -1)
    mask = torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)).logical_not().view(1, 1, SEQ, SEQ)
    losses = model(tokens, position_ids, mask, labels=torch.roll(tokens, -1, dims=1))
    return losses.float().mean()
