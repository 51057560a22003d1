"""A tiny GPT trained by Megatron-Bridge's own pretrain(cfg, forward_step) on its mock data, with
Muon on Megatron-FSDP through megatron_muon.bridge, or (--ddp) megatron-core's Muon on Megatron DDP
as Bridge builds it without megatron-muon. Run under torchrun; prints each iteration's exact loss
and grad norm on the last rank:
` iteration N | exact values | lm loss: <repr> | grad norm: <repr> |`."""

import argparse
import os
import types

import megatron_muon.bridge  # first: on CPU, Bridge's GPU-only imports need its stand-ins
from megatron_muon.chain import qk_clip
from megatron_muon.compat import upstream

from megatron.bridge.models.gpt_provider import GPTModelProvider, local_layer_spec  # noqa: E402
from megatron.bridge.training.callbacks import Callback  # noqa: E402
from megatron.bridge.training.config import (  # noqa: E402
    CheckpointConfig, ConfigContainer, DistributedDataParallelConfig, DistributedInitConfig,
    GPTDatasetConfig, LoggerConfig, OptimizerConfig, RNGConfig, SchedulerConfig, TokenizerConfig,
    TrainingConfig, ValidationConfig)
from megatron.bridge.training.gpt_step import forward_step  # noqa: E402
from megatron.bridge.training.pretrain import pretrain  # noqa: E402


def config(args) -> ConfigContainer:
    model = GPTModelProvider(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
        seq_length=32, vocab_size=128, make_vocab_size_divisible_by=128,
        transformer_layer_spec=local_layer_spec, transformer_impl="local",
        gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        cross_entropy_loss_fusion=False, attention_dropout=0.0, hidden_dropout=0.0,
        bf16=False, fp16=False, params_dtype=None,
        qk_clip=args.qk_clip, qk_clip_threshold=args.qk_clip_threshold, qk_clip_alpha=0.5,
        log_max_attention_logit=args.qk_clip)
    optimizer = OptimizerConfig(
        optimizer="muon", lr=0.01, min_lr=0.01, weight_decay=0.01, bf16=False, fp16=False,
        clip_grad=1.0, use_distributed_optimizer=not args.ddp, muon_momentum=0.9,
        muon_fp32_matmul_prec="highest", muon_scalar_optimizer="adam")
    ddp = DistributedDataParallelConfig(
        use_megatron_fsdp=not args.ddp, use_distributed_optimizer=not args.ddp,
        data_parallel_sharding_strategy=args.strategy, grad_reduce_in_fp32=True,
        overlap_grad_reduce=False, overlap_param_gather=False, check_for_nan_in_grad=False)
    return ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=args.iters, global_batch_size=4, micro_batch_size=1,
                             exit_signal_handler=False),
        validation=ValidationConfig(eval_interval=None, eval_iters=0),
        optimizer=optimizer,
        scheduler=SchedulerConfig(lr_decay_style="constant", lr_warmup_iters=0,
                                  override_opt_param_scheduler=True,
                                  start_weight_decay=0.01, end_weight_decay=0.01),
        ddp=ddp,
        dataset=GPTDatasetConfig(random_seed=1234, seq_length=32, blend=None, blend_per_split=None,
                                 split="1,0,0", reset_position_ids=False,
                                 reset_attention_mask=False, eod_mask_loss=False,
                                 dataloader_type="single", num_workers=0),
        logger=LoggerConfig(log_interval=1),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=128),
        checkpoint=CheckpointConfig(save=args.save, load=args.load,
                                    save_interval=args.save_interval,
                                    ckpt_format="fsdp_dtensor" if not args.ddp else "torch_dist"),
        rng=RNGConfig(seed=1234),
        dist=DistributedInitConfig(distributed_backend="gloo", use_megatron_fsdp=not args.ddp),
        mixed_precision=None,
    )


class ExactValues(Callback):
    """Each iteration's loss and grad norm to every digit, on the last rank; first, which
    optimizer Bridge built."""

    def __init__(self, observe_local_attention: bool):
        self.observe_local_attention = observe_local_attention

    def on_train_start(self, context):
        print(f"optimizer: {type(context.optimizer).__name__}", flush=True)
        if self.observe_local_attention:
            # megatron-core's clip_qk reads the logits TransformerEngine's attention records;
            # megatron-muon's recorder gives megatron-core's local attention the same attribute
            # (our factory installs it for Megatron-FSDP; here for the DDP reference).
            qk_clip.observe_max_attention_logits(context.model)

    def on_train_step_end(self, context):
        import torch.distributed as dist

        if dist.get_rank() != dist.get_world_size() - 1 or not context.loss_dict:
            return
        loss = next(iter(context.loss_dict.values()))
        loss = loss[0] / loss[1] if loss.numel() == 2 else loss
        iteration = context.state.train_state.step + 1  # as Bridge logs it
        print(f" iteration {iteration:8d} | exact values | lm loss: {float(loss)!r} | "
              f"grad norm: {context.grad_norm!r} |", flush=True)


def _megatron_cores_clip_qk_in_fp32(model, log_max_only=False):
    """megatron-core's clip_qk on DDP chunks of an fp32 model: it reaches the layers through
    chunk.module.module (DDP, then bf16's Float16Module), which an fp32 model lacks."""
    from megatron.core.optimizer.qk_clip import clip_qk
    from megatron.core.utils import unwrap_model

    return clip_qk([types.SimpleNamespace(module=types.SimpleNamespace(module=unwrap_model(chunk)))
                    for chunk in model], log_max_only)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="optim_grads_params")
    parser.add_argument("--ddp", action="store_true", help="megatron-core's Muon on Megatron DDP")
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--qk-clip", action="store_true")
    parser.add_argument("--qk-clip-threshold", type=float, default=100.0)
    parser.add_argument("--save")
    parser.add_argument("--load")
    parser.add_argument("--no-load-optim", action="store_true", help="cfg.checkpoint.load_optim False")
    parser.add_argument("--adam", action="store_true", help="megatron-core's Adam in place of muon")
    parser.add_argument("--save-interval", type=int, default=None)
    parser.add_argument("--check-interval", type=int, default=0, help="muon_check_interval")
    parser.add_argument("--moment2-method", help="adaptive_muon's, in place of muon")
    parser.add_argument("--offload", action="store_true",
                        help="optimizer_cpu_offload, all of the state (optimizer_offload_fraction 1)")
    parser.add_argument("--tensorboard-dir",
                        help="cfg.logger's, with timing_log_level 2 and log_timers_to_tensorboard")
    args = parser.parse_args()
    cfg = config(args)
    if args.tensorboard_dir:
        cfg.logger.tensorboard_dir, cfg.logger.timing_log_level = args.tensorboard_dir, 2
        cfg.logger.log_timers_to_tensorboard = True
    if args.offload:
        cfg.optimizer.optimizer_cpu_offload, cfg.optimizer.optimizer_offload_fraction = True, 1.0
    cfg.checkpoint.load_optim = not args.no_load_optim
    if args.adam:
        cfg.optimizer.optimizer = "adam"
    if args.moment2_method:
        cfg.optimizer.optimizer = "adaptive_muon"
        cfg.optimizer.adaptive_muon_moment2_method = args.moment2_method
    megatron_muon.bridge.install(cfg)
    if args.check_interval:  # a field of the MuonOptimizerConfig install() put in place
        cfg.optimizer.muon_check_interval = args.check_interval
    if args.ddp and args.qk_clip:
        upstream.patch("megatron.bridge.training.train.clip_qk", _megatron_cores_clip_qk_in_fp32)
    pretrain(cfg, forward_step, callbacks=[ExactValues(observe_local_attention=args.qk_clip
                                                       and args.ddp)])


if __name__ == "__main__":
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    main()
