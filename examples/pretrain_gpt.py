"""Pretrain a small megatron-core GPT on Megatron-FSDP with megatron.training, Muon by default.

    torchrun --nproc-per-node 2 examples/pretrain_gpt.py [megatron flags...]

Trains on a synthetic Markov-chain corpus (examples/synthetic_data.py), with the defaults below;
any Megatron flag given on the command line overrides them (e.g. `--optimizer adam`). Runs on GPUs
(NCCL) as is, and on CPU (gloo) when CUDA is absent; on a CPU without native bf16 matmuls
Newton-Schulz runs in fp32 unless --muon-fp32-matmul-prec says otherwise (it says so at start).
After Megatron's log line, each iteration's loss and grad norm are printed to every digit.
"""

import functools
import inspect
import sys

import megatron.training.training
import torch
from megatron.core.enums import ModelType
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,
                                                      get_gpt_layer_local_spec)
from megatron.training import get_args, pretrain
from megatron.training.argument_utils import (core_transformer_config_from_args,
                                              pretrain_cfg_container_from_args)
from megatron.training.arguments import parse_and_validate_args
from megatron.training.utils import print_rank_last

import megatron_muon.training
from megatron_muon.cpu import torch_compat
from megatron_muon.compat import upstream
from megatron_muon.arguments import add_muon_args
from synthetic_data import markov_chain_datasets

DEMO_DEFAULTS = dict(
    # Model: 4 layers, hidden 256, 4 heads, vocabulary 1024, sequences of 256 tokens.
    num_layers=4, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=4,
    seq_length=256, max_position_embeddings=256, vocab_size=1024,
    tokenizer_type='NullTokenizer', transformer_impl='local',
    # Optimizer and schedule.
    optimizer='muon', lr=3e-3, min_lr=3e-4, lr_decay_style='cosine', lr_warmup_fraction=0.1,
    weight_decay=0.01, clip_grad=1.0, train_iters=100, micro_batch_size=4,
    # Megatron-FSDP, ZeRO-3.
    use_megatron_fsdp=True, data_parallel_sharding_strategy='optim_grads_params',
    ckpt_format='fsdp_dtensor',
    # Logging and evaluation: log every iteration, evaluate only at the end.
    log_interval=1, eval_interval=100, eval_iters=2, num_workers=0,
    # Fused kernels that need apex/TransformerEngine (the masked softmax one is used in bf16 and
    # its extension is built only with them), or torch.compile (a C++ toolchain) on CPU.
    gradient_accumulation_fusion=False, no_persist_layer_norm=True, masked_softmax_fusion=False,
    bias_dropout_fusion=False, bias_gelu_fusion=False,
    # RoPE's fused kernel (--position-embedding-type rope) is TransformerEngine's: on where
    # megatron-core finds it (its own test in TransformerConfig).
    apply_rope_fusion=(rope_utils.fused_apply_rotary_pos_emb is not None
                       or rope_utils.fused_apply_rotary_pos_emb_thd is not None),
)


PRECISION_FLAG = '--muon-fp32-matmul-prec'


def add_demo_args(parser):
    """Muon's flags, and the demo's defaults in place of Megatron's (the command line wins)."""
    add_muon_args(parser)
    parser.add_argument('--no-use-megatron-fsdp', dest='use_megatron_fsdp', action='store_false',
                        help='Train with Megatron DDP instead, e.g. to compare with the unsharded '
                        'model (also pass --ckpt-format torch_dist).')
    # Megatron's medium (bf16), or fp32 where bf16 matmuls are emulated: 7x faster per iteration
    # there (docs/newton-schulz-precision.md).
    parser.set_defaults(**DEMO_DEFAULTS, muon_fp32_matmul_prec=torch_compat.fast_newton_schulz_precision())
    # Local-spec experts with linear biases fail in backward without expert parallelism (MLP.forward
    # adds the bias in place to the view _ReduceFromModelParallelRegion returns): MoE, no biases.
    if parser.parse_known_args()[0].num_experts:
        parser.set_defaults(add_bias_linear=False)
    return parser


def model_provider(pre_process=True, post_process=True, config=None, pg_collection=None,
                   vp_stage=None):
    args = get_args()
    config = config or core_transformer_config_from_args(args)
    if args.multi_latent_attention or args.moe_layer_freq != 1:
        # Layers that differ (dense first layers) or are MLA: megatron-core's per-layer specs,
        # as Megatron-LM's pretrain_gpt.py builds them.
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                          normalization=args.normalization, vp_stage=vp_stage)
    else:
        spec = get_gpt_layer_local_spec(num_experts=args.num_experts,
                                        moe_grouped_gemm=args.moe_grouped_gemm)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.vocab_size, max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process, post_process=post_process,
        position_embedding_type=args.position_embedding_type,
        pg_collection=pg_collection, vp_stage=vp_stage)


def train_valid_test_datasets_provider(num_samples):
    args = get_args()
    return markov_chain_datasets(num_samples, args.seq_length, args.vocab_size, seed=args.seed)


# Every rank builds the (deterministic) datasets, so tensor-parallel ranks read the same batches
# from their own loaders instead of only TP rank 0 having one.
train_valid_test_datasets_provider.is_distributed = True


def loss_func(loss_mask, output_tensor):
    """Sum of token losses and token count; Megatron averages over the global batch."""
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(output_tensor.view(-1).float() * loss_mask)
    num_tokens = loss_mask.sum().to(torch.int)
    return loss, num_tokens, {'lm loss': torch.stack([loss.detach(), num_tokens.float()])}


def forward_step(data_iterator, model):
    device = torch.cuda.current_device() if torch.cuda.is_available() else 'cpu'
    batch = {key: value.to(device, non_blocking=True) for key, value in next(data_iterator).items()}
    # The loss mask too, as Megatron-LM's pretrain_gpt.py passes it: multi-token prediction's
    # layers (--mtp-num-layers) weigh their losses by it.
    output_tensor = model(batch['tokens'], batch['position_ids'], batch['attention_mask'],
                          labels=batch['labels'], loss_mask=batch['loss_mask'])
    return output_tensor, functools.partial(loss_func, batch['loss_mask'])


def refuse_a_save_that_would_hang(args):
    """megatron-core 0.19.2's own optimizers on Megatron-FSDP (Adam here: its
    DistributedOptimizer) save fsdp_dtensor state only for the params that have some, and torch's
    Adam has none where a rank's shard is empty, so the ranks wait in different collectives until
    the timeout (10 minutes on gloo). Muon's chain gives every param state before it saves."""
    if args.optimizer != 'muon' and args.use_megatron_fsdp and args.save:
        raise SystemExit(
            f'pretrain_gpt.py: --optimizer {args.optimizer} on Megatron-FSDP cannot --save: '
            f'megatron-core 0.19.2 saves its optimizer state only for params whose shard on a rank '
            f'is non-empty, and the ranks then hang in different collectives. Train it without '
            f'--save, or with --no-use-megatron-fsdp --ckpt-format torch_dist.')


def refuse_layer_wise_muon_in_fp32(args):
    """megatron-core 0.19.2's own Muon with --use-distributed-optimizer on Megatron DDP
    (LayerWiseDistributedOptimizer) cannot be built in fp32: it chains raw torch optimizers, which
    carry no config, and megatron-core's ChainedOptimizer stops on a bare AssertionError
    (in ChainedOptimizer.__init__) when it chains it with its Adam part.
    tests/integrations/test_megatron_core_paths.py shows megatron-core's own factory failing alike."""
    if args.use_layer_wise_distributed_optimizer and not (args.bf16 or args.fp16):
        raise SystemExit(
            'pretrain_gpt.py: --optimizer muon --use-distributed-optimizer on Megatron DDP '
            '(megatron-core\'s LayerWiseDistributedOptimizer) fails in fp32 in megatron-core '
            '0.19.2: its parts carry no config and ChainedOptimizer asserts they share one. Add '
            '--bf16, drop --use-distributed-optimizer, or use Megatron-FSDP (the default).')


def refuse_what_megatron_core_cannot_do(args):
    refuse_a_save_that_would_hang(args)
    refuse_layer_wise_muon_in_fp32(args)


def say_newton_schulz_runs_in_fp32(args, argv):
    """One line at start when the demo, not the command line, chose fp32 Newton-Schulz."""
    chosen = not any(arg.split('=')[0] == PRECISION_FLAG for arg in argv)
    if (args.rank == 0 and chosen and args.optimizer in megatron_muon.training.MUON_OPTIMIZERS
            and torch_compat.bf16_matmul_is_emulated()):
        print(f'pretrain_gpt.py: Newton-Schulz in fp32 ({PRECISION_FLAG} '
              f'{args.muon_fp32_matmul_prec}): this CPU has no native bf16 matmul, so Megatron\'s '
              f'default (medium: bf16) would be emulated, about 100x slower; {PRECISION_FLAG} '
              f'medium asks for it anyway.', flush=True)


def log_exact_values(training_log):
    """megatron.training's training_log, then the iteration's values as computed, on a line of
    their own: Megatron prints the loss with 7 digits and the grad norm with 3, and two values
    2e-7 apart can print as 0.695 and 0.696. Printed to every digit (Python's repr), runs can be
    compared by value. The loss is the iteration's own (Megatron's line shows the mean since the
    last log line; and its second line of a run, the mean of the first two iterations)."""
    parameters = inspect.signature(training_log)

    @functools.wraps(training_log)
    def logged(*args, **kwargs):
        result = training_log(*args, **kwargs)
        given = parameters.bind(*args, **kwargs).arguments
        values = {**given['loss_dict'], 'grad norm': given['grad_norm']}
        if get_args().log_max_attention_logit:
            values['max attention logit'] = given['max_attention_logit']
        values = {key: None if value is None else float(value) for key, value in values.items()}
        print_rank_last(f' iteration {given["iteration"]:8d} | exact values | '
                        + ' | '.join(f'{key}: {value!r}' for key, value in values.items()) + ' |')
        return result

    return logged


def main():
    megatron_muon.training.install()  # Before Megatron parses its arguments.
    args = parse_and_validate_args(extra_args_provider=add_demo_args)
    say_newton_schulz_runs_in_fp32(args, sys.argv[1:])
    refuse_what_megatron_core_cannot_do(args)
    upstream.patch('megatron.training.training.training_log',
                   log_exact_values(megatron.training.training.training_log))
    pretrain(pretrain_cfg_container_from_args(args), train_valid_test_datasets_provider,
             ModelType.encoder_or_decoder, forward_step, model_provider=model_provider)


if __name__ == '__main__':
    main()
