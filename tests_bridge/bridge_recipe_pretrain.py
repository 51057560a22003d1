"""Megatron-Bridge's own Kimi K2 and DeepSeek-V3 recipes, shrunk in place on the
ConfigContainer they return to a CPU size (2 layers, the first dense, MLA, 4 routed experts top-2
beside a shared expert, over expert-parallel 2), trained by Bridge's pretrain on its mock data at
W=2: Muon on Megatron-FSDP through megatron_muon.bridge.install, or (--ddp) megatron-core's Muon on
Megatron DDP as Bridge builds it. Prints bridge_pretrain's exact values on the last rank."""

import argparse
import os
from unittest import mock

import megatron_muon.bridge  # first: on CPU, Bridge's GPU-only imports need its stand-ins
import torch
import transformers
from bridge_pretrain import ExactValues, _megatron_cores_clip_qk_in_fp32
from megatron_muon.compat import upstream

from megatron.bridge import AutoBridge  # noqa: E402
from megatron.bridge.recipes.deepseek.h100.deepseek_v3 import (  # noqa: E402
    deepseek_v3_pretrain_1024gpu_h100_bf16_config)
from megatron.bridge.recipes.kimi.h100.kimi_k2 import (  # noqa: E402
    kimi_k2_pretrain_512gpu_h100_bf16_config)
from megatron.bridge.training.config import LoggerConfig  # noqa: E402
from megatron.bridge.training.gpt_step import forward_step  # noqa: E402
from megatron.bridge.training.pretrain import pretrain  # noqa: E402

RECIPES = {"kimi_k2": kimi_k2_pretrain_512gpu_h100_bf16_config,
           "deepseek_v3": deepseek_v3_pretrain_1024gpu_h100_bf16_config}

# The recipes read their model's config.json from the Hugging Face Hub; the test runs offline with
# its architecture fields (Kimi K2's config names DeepSeek-V3's architecture).
HUB_CONFIGS = {
    "moonshotai/Kimi-K2-Instruct": dict(
        model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=163840,
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1,
        n_routed_experts=384, routed_scaling_factor=2.827, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=1, topk_group=1,
        num_experts_per_tok=8, first_k_dense_replace=1, norm_topk_prob=True,
        max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=50000.0,
        rope_scaling=dict(type="yarn", factor=32.0, original_max_position_embeddings=4096,
                          beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        tie_word_embeddings=False),
}
# DeepSeek-V3's differs from Kimi K2's where it matters before the shrink (the router's groups).
HUB_CONFIGS["deepseek-ai/DeepSeek-V3"] = {
    **HUB_CONFIGS["moonshotai/Kimi-K2-Instruct"], "vocab_size": 129280, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
    "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3, "rope_theta": 10000.0,
    "rope_scaling": dict(type="yarn", factor=40.0, original_max_position_embeddings=4096,
                         beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)}


def _from_hub_config(path, **kwargs):
    config = dict(HUB_CONFIGS[path])
    return AutoBridge.from_hf_config(transformers.AutoConfig.for_model(config.pop("model_type"),
                                                                       **config))


def config(args):
    with mock.patch.object(AutoBridge, "from_hf_pretrained", _from_hub_config):
        cfg = RECIPES[args.recipe]()
    shrink(cfg, args)
    return cfg


def shrink(cfg, args) -> None:
    """The recipe's ConfigContainer, in place, at CPU size and in fp32, on local (non-TE) layers;
    what is left of it: the provider Bridge built from the model's config (MLA with its q low
    rank, the router, RoPE scaling, norms), its MoE dispatcher, optimizer (Kimi K2's dist_muon;
    DeepSeek-V3's Adam made Muon) and DDP settings."""
    model = cfg.model
    for field, value in dict(
            num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
            num_query_groups=4, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
            v_head_dim=16, q_lora_rank=model.q_lora_rank and 32,
            num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=128,
            moe_shared_expert_intermediate_size=128, moe_layer_freq=[0, 1],
            moe_grouped_gemm=False, moe_permute_fusion=False, moe_router_fusion=False,
            moe_shared_expert_overlap=False, moe_flex_dispatcher_backend=None,
            seq_length=32, vocab_size=128, make_vocab_size_divisible_by=128,
            tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
            expert_model_parallel_size=2, expert_tensor_parallel_size=1,
            sequence_parallel=False, pipeline_dtype=None, pipeline_model_parallel_layout=None,
            mtp_num_layers=None, transformer_impl="local", cuda_graph_impl="none",
            gradient_accumulation_fusion=False, bias_activation_fusion=False,
            bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
            apply_rope_fusion=False, cross_entropy_loss_fusion=False,
            cross_entropy_fusion_impl="native", attention_dropout=0.0, hidden_dropout=0.0,
            bf16=False, fp16=False, params_dtype=torch.float32).items():
        setattr(model, field, value)
    if model.moe_router_num_groups:  # DeepSeek-V3's group-limited routing: 2 groups, top-1 group
        model.moe_router_num_groups = min(model.moe_router_num_groups, 2)
        model.moe_router_group_topk = 1
    # Selective recompute is not tried on CPU yet.
    model.recompute_granularity = model.recompute_method = model.recompute_num_layers = None
    if model.moe_token_dispatcher_type == "flex":  # DeepSeek-V3's DeepEP: GPU-only
        model.moe_token_dispatcher_type = "alltoall"
    if args.qk_clip_threshold:
        model.qk_clip = model.log_max_attention_logit = True
        model.qk_clip_threshold, model.qk_clip_alpha = args.qk_clip_threshold, 0.5
    cfg.mixed_precision = None
    cfg.comm_overlap = None
    # Two micro-batches per rank: the experts' buffer (expert parallel = data parallel) reduces
    # over one rank, which released Megatron-FSDP rescales at every micro-batch
    # (megatron_muon.fixes.upstream_fixes).
    cfg.train.train_iters, cfg.train.global_batch_size, cfg.train.micro_batch_size = args.iters, 4, 1
    cfg.train.manual_gc, cfg.train.exit_signal_handler = False, False
    cfg.validation.eval_interval, cfg.validation.eval_iters = None, 0
    cfg.dataset.seq_length, cfg.dataset.num_workers, cfg.dataset.split = 32, 0, "1,0,0"
    cfg.tokenizer.vocab_size = 128
    cfg.logger = LoggerConfig(log_interval=1)
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.checkpoint.ckpt_format = "torch_dist" if args.ddp else "fsdp_dtensor"
    optimizer = cfg.optimizer
    optimizer.optimizer = "muon" if args.ddp or optimizer.optimizer == "adam" else optimizer.optimizer
    optimizer.lr = optimizer.min_lr = 0.01  # constant: the recipes' 2000 warmup steps barely move
    optimizer.bf16 = optimizer.fp16 = False
    # DeepSeek-V3's Adam keeps bf16 gradients and moments in the precision-aware optimizer, which
    # Muon refuses: fp32, as Kimi K2's Muon recipe has it.
    optimizer.use_precision_aware_optimizer = False
    optimizer.main_grads_dtype = optimizer.exp_avg_dtype = optimizer.exp_avg_sq_dtype = torch.float32
    optimizer.muon_fp32_matmul_prec = "highest"
    cfg.scheduler.lr_decay_style, cfg.scheduler.lr_warmup_iters = "constant", 0
    ddp = cfg.ddp
    ddp.use_megatron_fsdp = cfg.dist.use_megatron_fsdp = not args.ddp
    ddp.use_distributed_optimizer = optimizer.use_distributed_optimizer = not args.ddp
    ddp.data_parallel_sharding_strategy = args.strategy if not args.ddp else "no_shard"
    ddp.overlap_grad_reduce = ddp.overlap_param_gather = False
    ddp.check_for_nan_in_grad = False
    if args.bucket_size:
        ddp.bucket_size = args.bucket_size


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", choices=RECIPES, default="kimi_k2")
    parser.add_argument("--strategy", default="optim_grads_params")
    parser.add_argument("--ddp", action="store_true", help="megatron-core's Muon on Megatron DDP")
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--bucket-size", type=int, help="cfg.ddp.bucket_size")
    parser.add_argument("--qk-clip-threshold", type=float,
                        help="MuonClip on MLA (cfg.model.qk_clip) at this threshold")
    args = parser.parse_args()
    cfg = config(args)
    megatron_muon.bridge.install(cfg)
    if args.ddp and args.qk_clip_threshold:
        upstream.patch("megatron.bridge.training.train.clip_qk", _megatron_cores_clip_qk_in_fp32)
    pretrain(cfg, forward_step, callbacks=[ExactValues(
        observe_local_attention=bool(args.ddp and args.qk_clip_threshold))])


if __name__ == "__main__":
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    main()
