"""MuonClip's measurement on local attention: each layer's per-head max attention logit, reduced
over the data-parallel ranks in one all-reduce, equals the unsharded model's on the same batch."""

import math

import pytest
import torch
from megatron.core import parallel_state

from fsdp_models import global_batch_loss
from megatron_muon import get_megatron_optimizer
from megatron_muon.observe.collectives import Traffic, observed
from megatron_muon.chain.qk_clip import (_core_attentions, observe_max_attention_logits,
                                        reduce_max_attention_logits, take_max_attention_logit)
from megatron_muon.tools.testing import TINY, fsdp_gpt, gpt, init_parallel_state, optimizer_config


def _per_layer(model):
    return [a.current_max_attn_logits for a in _core_attentions([model])]


def _measured_as_unsharded(rank, world_size, tensor_parallel, layer_scaling):
    init_parallel_state(tensor_parallel=tensor_parallel)
    # Query-key layer scaling divides QK^T by the layer number and has the softmax multiply it back.
    settings = dict(log_max_attention_logit=True, apply_query_key_layer_scaling=layer_scaling)
    model = fsdp_gpt(**settings)
    get_megatron_optimizer(optimizer_config(), [model])  # registers the measurement
    unsharded = gpt(**settings)  # whole on every data-parallel rank
    observe_max_attention_logits([unsharded])
    by_definition = _max_logits_by_definition(unsharded)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    for step in range(2):  # two micro-batches: the maximum over both (TP peers read the same)
        global_batch_loss(model, step, dp_rank, dp_size)
        global_batch_loss(unsharded, step, 0, 1)
    with observed(Traffic()) as traffic:
        largest = reduce_max_attention_logits([model], _data_parallel_group())
    assert traffic.by_name == {"allreduce_": 1}
    got, expected = _per_layer(model), _per_layer(unsharded)
    assert len(got) == TINY.layers and all(g is not None for g in got)
    for g, e, d in zip(got, expected, by_definition):  # with TP, this rank's heads in all
        assert g.shape == (TINY.heads // tensor_parallel,) and torch.equal(g, e), (g, e)
        assert torch.allclose(g, d, rtol=1e-6, atol=0), (g, d)
    assert largest == max(t.max().item() for t in got)
    assert take_max_attention_logit([model]) == largest
    assert all(t is None for t in _per_layer(model))


def _max_logits_by_definition(model):
    """Per layer, max over the unmasked positions of q.k / sqrt(head dim) per head (the
    logit: TINY sets no other softmax scale), from the query and key each local attention
    receives (independent of the measurement's hook)."""
    maxima = []
    for core_attention in _core_attentions([model]):
        maxima.append(torch.full((TINY.heads // core_attention.config.tensor_model_parallel_size,),
                                 float("-inf")))

        def record(module, args, kwargs, layer=len(maxima) - 1):
            query, key, _, mask = args[:4]  # [s, b, heads, d]; mask [1, 1, sq, sk], True: masked
            logits = torch.einsum("qbhd,kbhd->bhqk", query, key) / math.sqrt(query.shape[-1])
            batch_max = logits.masked_fill(mask, float("-inf")).amax(dim=(0, 2, 3))
            maxima[layer] = torch.maximum(maxima[layer], batch_max.detach())

        core_attention.register_forward_pre_hook(record, with_kwargs=True)
    return maxima


def _data_parallel_group():
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


@pytest.mark.parametrize("world_size, tensor_parallel, layer_scaling",
                         [(2, 1, False), (4, 1, False), (4, 2, False), (2, 1, True)])
def test_max_attention_logits_are_the_unsharded_models(distributed, world_size, tensor_parallel,
                                                      layer_scaling):
    distributed(_measured_as_unsharded, world_size, tensor_parallel, layer_scaling)
