"""Small models wrapped by real Megatron-FSDP, and the unsharded reference they must match."""

import copy

import megatron_fsdp
import torch
import torch.distributed as dist
from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon
from torch.distributed.device_mesh import init_device_mesh
from megatron_fsdp.uneven_dtensor import gather_and_compute_chunk_metadata
from torch.distributed.tensor import DTensor, Shard

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
QKV_SPLIT = [4, 2, 2]  # q, k, v rows per query group; 3 groups below
MUON_KWARGS = dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.01,
                   fp32_matmul_prec="highest", split_qkv=True,
                   is_qkv_fn=lambda p: getattr(p, "is_qkv", False), qkv_split_shapes=QKV_SPLIT)


class Net(torch.nn.Module):
    """Shapes chosen so Megatron-FSDP's shards are uneven and, at W=4, some ranks hold nothing."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 3 * sum(QKV_SPLIT), bias=False)
        self.qkv.weight.is_qkv = True
        self.up = torch.nn.Linear(24, 40)
        self.down = torch.nn.Linear(40, 9, bias=False)
        self.tiny = torch.nn.Linear(9, 3)
        self.head = torch.nn.Linear(3, 5)

    def forward(self, x):
        h = self.qkv(x)
        h = torch.tanh(self.up(h))
        h = torch.tanh(self.down(h))
        return self.head(torch.tanh(self.tiny(h)))


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 16, generator=g), torch.randn(6, 5, generator=g)


def make_models(strategy: str, world_size: int, unit_modules: bool = True):
    """(reference Net, Megatron-FSDP-wrapped copy) with identical initial weights."""
    torch.manual_seed(0)
    ref = Net()
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp_cp", "tp"))
    unsharded = copy.deepcopy(ref)
    unsharded.qkv.weight.is_qkv = True  # deepcopy drops Parameter attributes
    fsdp = megatron_fsdp.fully_shard_model(
        unsharded, device_mesh=mesh, dp_shard_dim="dp_cp", tp_dim="tp", zero_dp_strategy=strategy,
        device=torch.device("cpu"),
        fsdp_unit_modules=[torch.nn.Linear] if unit_modules else [Net])
    fsdp.ddp_config.gradient_reduce_div_fusion = False  # gloo has no PREMUL_SUM
    return ref, fsdp


def full_tensor(t: torch.Tensor, param: DTensor) -> torch.Tensor:
    """The whole (TP-local) matrix of an uneven Shard(0)/Replicate DTensor laid out like `param`:
    its data-parallel shards ordered by megatron_fsdp's own DCP chunk offsets (independent of the
    optimizer's row-layout code)."""
    shard_dims = [i for i, pl in enumerate(t.placements) if pl == Shard(0)]
    if not shard_dims:
        return t.to_local().clone()
    group = t.device_mesh.get_group(shard_dims[0])  # Megatron-FSDP's dp dim comes first
    offset = gather_and_compute_chunk_metadata(param).offsets[0]
    pieces = [None] * dist.get_world_size(group)
    dist.all_gather_object(pieces, (offset, t.to_local().detach().clone()), group=group)
    return torch.cat([rows for _, rows in sorted(pieces, key=lambda piece: piece[0])])


def split_params(module):
    named = list(module.named_parameters())
    return [p for _, p in named if p.dim() == 2], [p for _, p in named if p.dim() != 2]


def reference_optimizers(ref):
    matrices, vectors = split_params(ref)
    return [TensorParallelMuon(matrices, **MUON_KWARGS), torch.optim.Adam(vectors, lr=0.01, foreach=False)]
