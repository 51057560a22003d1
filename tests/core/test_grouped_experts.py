"""Grouped-GEMM experts (one weight holding every expert's matrix, stacked along dim 0) are
orthogonalized expert by expert, on real Megatron-FSDP, bit-identical to single-device Muon on
each expert's own matrix."""

import copy

import pytest
import torch
from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

from fsdp_models import MUON_KWARGS, full_tensor, fully_shard
from megatron_muon import ZeROTensorParallelMuon

EXPERTS = 3


class GroupedLinear(torch.nn.Module):
    """The weight layout of TE's GroupedLinear with a single grouped weight (megatron-core's
    grouped-GEMM experts): `num_gemms` expert matrices, fused (E*out, in) or stacked (E, out, in).
    Token t goes to expert t % E."""

    def __init__(self, in_features, out_features, stacked):
        super().__init__()
        self.num_gemms, self.single_grouped_weight = EXPERTS, True
        shape = (EXPERTS, out_features, in_features) if stacked else (EXPERTS * out_features, in_features)
        self.weight = torch.nn.Parameter(torch.randn(shape) / in_features ** 0.5)

    def forward(self, x):
        experts = self.weight.view(EXPERTS, -1, x.shape[-1])
        return torch.einsum("ti,toi->to", x, experts[torch.arange(x.shape[0]) % EXPERTS])


class MoENet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = GroupedLinear(16, 10, stacked=False)  # 30 rows: shards cut through experts
        self.fc2 = GroupedLinear(10, 7, stacked=True)    # shards hold whole experts
        self.head = torch.nn.Linear(7, 5, bias=False)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def _tag(chunk):
    """The factory's tags (its `config` only names the attention shape)."""
    from types import SimpleNamespace

    from megatron_muon.planner.param_tags import tag_params

    chunk.config = SimpleNamespace(num_attention_heads=4, num_query_groups=2, kv_channels=8)
    tag_params([chunk])
    return chunk


def _compare(rank, world_size, strategy, dist_mode):
    torch.manual_seed(0)
    ref = MoENet()
    fsdp = fully_shard(copy.deepcopy(ref), strategy, world_size, [GroupedLinear, torch.nn.Linear])
    _tag(fsdp)
    params = dict(fsdp.named_parameters())
    names = {id(p): n.removeprefix("module.") for n, p in params.items()}
    opt = ZeROTensorParallelMuon(list(params.values()), dist_mode=dist_mode, **MUON_KWARGS)
    # The reference: every expert its own matrix.
    ref_matrices = {name: [torch.nn.Parameter(m.detach().clone().view(-1, m.shape[-1])) for m in
                           (p.view(EXPERTS, -1, p.shape[-1]).unbind() if p.dim() == 3 or "fc" in name
                            else [p])]
                    for name, p in ref.named_parameters()}
    ref_opt = TensorParallelMuon([m for ms in ref_matrices.values() for m in ms], **MUON_KWARGS)
    for step in range(4):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(6, 16, generator=g), torch.randn(6, 5, generator=g)
        torch.nn.functional.mse_loss(fsdp(x), y).backward()
        if not fsdp.model_auto_sync:
            fsdp.finish_grad_sync()
        for p in params.values():
            grad = full_tensor(p.grad if p.grad is not None else torch.zeros_like(p), p)
            for m, rows in zip(ref_matrices[names[id(p)]], grad.view(-1, grad.shape[-1]).chunk(
                    len(ref_matrices[names[id(p)]]))):
                m.grad = rows.clone()
        opt.step()
        ref_opt.step()
        fsdp.install_optimized_model_weights()
        fsdp.zero_grad_buffer()
        for p in params.values():
            expected = torch.cat(list(ref_matrices[names[id(p)]])).view(p.shape)
            diff = (full_tensor(p, p) - expected).abs().max().item()
            assert diff == 0, f"{strategy} {dist_mode} W={world_size} {names[id(p)]} step {step}: {diff}"


def _every_case(rank, world_size):
    for strategy in ("no_shard", "optim", "optim_grads_params"):
        for dist_mode in ("owner", "allgather"):
            _compare(rank, world_size, strategy, dist_mode)


@pytest.mark.parametrize("world_size", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_grouped_experts_are_orthogonalized_one_by_one(distributed, world_size):
    distributed(_every_case, world_size)


def test_fused_orthogonalization_would_differ():
    """The test above can fail: orthogonalizing the fused matrix is not the per-expert update."""
    g = torch.randn(EXPERTS * 10, 16, generator=torch.Generator().manual_seed(0))
    kwargs = {**MUON_KWARGS, "split_qkv": False}
    fused = TensorParallelMuon([torch.nn.Parameter(torch.zeros(30, 16))], **kwargs)
    apart = TensorParallelMuon([torch.nn.Parameter(torch.zeros(10, 16)) for _ in range(EXPERTS)], **kwargs)
    fused.param_groups[0]["params"][0].grad = g.clone()
    for p, rows in zip(apart.param_groups[0]["params"], g.chunk(EXPERTS)):
        p.grad = rows.clone()
    fused.step()
    apart.step()
    together = torch.cat([p.detach() for p in apart.param_groups[0]["params"]])
    assert not torch.allclose(fused.param_groups[0]["params"][0].detach(), together, atol=1e-3)


def test_factory_tags_grouped_weights_and_gives_them_to_muon():
    from megatron_muon.planner.param_tags import is_scalar_param

    chunk = torch.nn.Module()
    chunk.moe = MoENet()
    assert is_scalar_param(chunk.moe.fc2.weight)  # 3-D: megatron-core's Muon leaves it to Adam
    _tag(chunk)
    assert chunk.moe.fc1.weight.num_stacked_experts == chunk.moe.fc2.weight.num_stacked_experts == EXPERTS
    assert not is_scalar_param(chunk.moe.fc2.weight) and not is_scalar_param(chunk.moe.fc1.weight)
    assert not hasattr(chunk.moe.head.weight, "num_stacked_experts")
