"""A GPT pretrain script written the way Megatron-LM's own `pretrain_gpt.py` is (core_r0.19.0):
it parses its arguments itself, chaining its own extra_args_provider, and provides the model,
the batches, the loss and the datasets (megatron-core's
MockGPTDataset with --mock-data). The only lines megatron-muon adds are the README's, marked
"megatron-muon". tests/e2e/test_e2e_training.py runs it with torchrun.
"""

from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.training import get_args, get_tokenizer, pretrain, print_rank_0
from megatron.training.argument_utils import (core_transformer_config_from_args,
                                              pretrain_cfg_container_from_args)
from megatron.training.arguments import parse_and_validate_args

import megatron_muon.training  # megatron-muon
from megatron_muon.integrations.arguments import add_muon_args  # megatron-muon


def add_script_args(parser):
    """The script's own flags (Megatron-LM's pretrain_gpt.py passes add_modelopt_args here)."""
    group = parser.add_argument_group(title='script')
    group.add_argument('--script-note', default='', help='An argument of the script itself.')
    return parser


def model_provider(pre_process=True, post_process=True, config=None, pg_collection=None,
                   vp_stage=None):
    args = get_args()
    print_rank_0('building GPT model ...')
    return GPTModel(
        config=config or core_transformer_config_from_args(args),
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process, post_process=post_process,
        position_embedding_type=args.position_embedding_type,
        pg_collection=pg_collection, vp_stage=vp_stage)


def get_batch(data_iterator):
    """This rank's micro-batch on its device (tensor and context parallel size 1: every rank reads
    its own loader, which Megatron-LM's get_batch_on_this_tp_rank/cp_rank reduce to)."""
    device = torch.cuda.current_device()
    batch = {key: value.to(device, non_blocking=True) for key, value in next(data_iterator).items()}
    return batch['tokens'], batch['labels'], batch['loss_mask'], batch.get('attention_mask'), \
        batch['position_ids']


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {'lm loss': torch.cat([loss.clone().detach().view(1),
                                                    num_tokens.view(1)])}


def forward_step(data_iterator, model):
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
    return output_tensor, partial(loss_func, loss_mask)


def is_dataset_built_on_rank():
    return parallel_state.get_tensor_model_parallel_rank() == 0


def train_valid_test_datasets_provider(train_val_test_num_samples):
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=None, blend_per_split=None,
        split=args.split, path_to_cache=args.data_cache_path, tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader)
    print_rank_0('> building train, validation, and test datasets for GPT ...')
    return BlendedMegatronDatasetBuilder(MockGPTDataset, train_val_test_num_samples,
                                         is_dataset_built_on_rank, config).build()


def extra_args_provider(parser):  # megatron-muon: chain the script's provider with Muon's flags
    return add_muon_args(add_script_args(parser))


if __name__ == '__main__':
    train_valid_test_datasets_provider.is_distributed = True
    megatron_muon.training.install()  # megatron-muon
    args = parse_and_validate_args(extra_args_provider=extra_args_provider,
                                   args_defaults={'tokenizer_type': 'NullTokenizer'})
    pretrain(pretrain_cfg_container_from_args(args), train_valid_test_datasets_provider,
             ModelType.encoder_or_decoder, forward_step, model_provider=model_provider)
