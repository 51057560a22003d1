"""Small models wrapped by real Megatron-FSDP, and the unsharded reference they must match."""

import contextlib
import copy
import functools
import importlib
import weakref
from types import SimpleNamespace
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
# Megatron-FSDP as megatron-core ships and uses it.
from megatron.core.distributed.fsdp.src import megatron_fsdp
from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import \
    gather_and_compute_chunk_metadata
from megatron.core.optimizer.emerging_optimizers import TensorParallelAdaptiveMuon, TensorParallelMuon
from megatron.core.utils import unwrap_model
from megatron.training.checkpointing import preprocess_fsdp_dtensor_state_dict
from torch.distributed.device_mesh import init_device_mesh
from megatron_muon.compat import upstream
from megatron_muon.core.gram_newton_schulz import route_newton_schulz_through_it
from megatron_muon.core.settings import tensor_parallel_muon_settings
from megatron_muon.fixes import upstream_fixes
from megatron_muon.plan import GramSchedule, offload_figures
from megatron_muon.plan import team_split as plan_teams
from megatron_muon.chain.model_chunks import find_megatron_fsdp
from megatron_muon.tools.testing import TINY, GPTShape, loss_on
from torch.distributed.tensor import DTensor, Shard

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
# Megatron-FSDP by where it comes from: megatron-core's copy, or the standalone package (its own
# range, megatron-muon[fsdp]: 0.6's code is megatron-core 0.19.2's, 0.5's older), None where absent.
MEGATRON_FSDP = {"megatron-core": megatron_fsdp,
                 "megatron-fsdp": importlib.util.find_spec("megatron_fsdp")
                 and importlib.import_module("megatron_fsdp")}
QKV_SPLIT = [4, 2, 2]  # q, k, v rows per query group; 2 groups below
# A working-memory budget that holds all four same_shape_linears in one batch: what Muon's state
# saves a rank of such tiny matrices (the default) keeps each alone.
ONE_BATCH = 1 << 20
MUON_KWARGS = dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.01,
                   fp32_matmul_prec="highest", split_qkv=True,
                   is_qkv_fn=lambda p: getattr(p, "is_qkv", False), qkv_split_shapes=QKV_SPLIT)
# --optimizer adaptive_muon's second moment (a beta2 off megatron-core's default).
ADAPTIVE_KWARGS = dict(beta2=0.9, eps=1e-8)


class Net(torch.nn.Module):
    """Shapes chosen so Megatron-FSDP's shards are uneven and, at W=4, some ranks hold nothing."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 2 * sum(QKV_SPLIT), bias=False)
        self.qkv.weight.is_qkv = True
        self.up = torch.nn.Linear(16, 40)
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


def step_beside_reference(fsdp, params, names, ref_params, opts, step: int, rank: int) -> None:
    """One training step of the Megatron-FSDP model (its `params`, stepped by `opts` with the
    reference's optimizers) and of the unsharded reference (`ref_params` by name; `names`:
    {id(param): its name there}), which sees exactly the gradient the sharded run reduced."""
    x, y = batch(step, rank)
    torch.nn.functional.mse_loss(fsdp(x), y).backward()
    if not fsdp.model_auto_sync:
        fsdp.finish_grad_sync()
    for p in params:
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        ref_params[names[id(p)]].grad = full_tensor(grad, p)
    for opt in opts:
        opt.step()
    fsdp.install_optimized_model_weights()
    fsdp.zero_grad_buffer()
    for opt in opts:
        opt.zero_grad()


def assert_offload_as_planned(muon, fraction, case):
    """The step copied this rank's offloaded state to the device and back, as plan.offload counts
    it, and never held more of it there at once than the plan's two exchanges."""
    (planned,) = offload_figures([(plan.matrices, [routes.batches for routes in plan.routes],
                                   [plan.rank]) for plan in muon.plans], 4, fraction)
    host = muon.host_state
    assert host.moved_to_device == host.moved_to_host == planned.host, (case, planned)
    # Muon's owner step brings every exchange's momentum but each group's first one exchange
    # ahead (an adaptive variant's state comes as it is read).
    first = sum(offload_figures([(plan.matrices, [plan.routes[0].batches], [plan.rank])], 4,
                                fraction)[0].host for plan in muon.plans if plan.routes)
    muon_owner_step = muon.dist_mode == "owner" and muon.second_moment is None
    ahead = (0 if not muon_owner_step else planned.host - first if fraction == 1.0
             else host.moved_ahead)
    assert host.moved_ahead == ahead, (case, host.moved_ahead, ahead)
    assert (host.most_on_device > 0) == (planned.host > 0), (case, planned)
    assert host.most_on_device <= planned.streamed, (case, host.most_on_device, planned)


def make_models(strategy: str, world_size: int, unit_modules: bool = True, outer: str | None = None,
                main_params_dtype: torch.dtype | None = torch.float32):
    """(reference Net, Megatron-FSDP-wrapped copy) with identical initial weights; `outer`, if
    given, is HSDP's outer strategy over 2 replicas; `main_params_dtype` None: no main weight
    buffer, the compute weights' buffer is the main weights (--megatron-fsdp-main-params-dtype
    auto on this fp32 model)."""
    torch.manual_seed(0)
    ref = Net()
    unsharded = copy.deepcopy(ref)
    unsharded.qkv.weight.is_qkv = True  # deepcopy drops Parameter attributes
    units = [torch.nn.Linear] if unit_modules else [Net]
    return ref, fully_shard(unsharded, strategy, world_size, units, outer, main_params_dtype)


def fully_shard(module, strategy: str, world_size: int, unit_modules, outer: str | None = None,
                main_params_dtype: torch.dtype | None = torch.float32,
                package: str = "megatron-core"):
    """`module` wrapped by real Megatron-FSDP (`package`'s, MEGATRON_FSDP) on CPU over all ranks
    (TP=1); with `outer`, HSDP: 2 replicas (outer strategy `outer`) of world_size / 2 shards."""
    fsdp = MEGATRON_FSDP[package]
    hsdp = {}
    if outer is None:
        mesh = _fsdp_mesh(world_size)
    else:
        mesh, hybrid_group = _hsdp_mesh(world_size)
        hsdp = dict(dp_outer_dim="dp_outer", outer_dp_sharding_strategy=outer,
                    hybrid_fsdp_group=hybrid_group)
    return fsdp.fully_shard_model(
        module, device_mesh=mesh, dp_shard_dim="dp_cp", tp_dim="tp", zero_dp_strategy=strategy,
        device=torch.device("cpu"), fsdp_unit_modules=unit_modules,
        mixed_precision_policy=fsdp.MixedPrecisionPolicy(main_params_dtype=main_params_dtype),
        **hsdp)


# One mesh per process and layout, as in training. With a second, equal mesh the ranks hung:
# torch 2.8 gives each new 2-D mesh new process groups, also for a dim over all ranks (2.14 reuses
# the default group there, but not for HSDP's dims), and DTensor's sharding-propagation cache,
# which compares meshes by ranks and dim names only, hands DTensors made by ops (zeros_like of a
# rank's missing grad) an earlier, equal mesh: ranks then called a collective on different groups.
@functools.cache
def _fsdp_mesh(world_size: int):
    return init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp_cp", "tp"))


@functools.cache
def _hsdp_mesh(world_size: int):
    mesh = init_device_mesh("cpu", (2, world_size // 2, 1), mesh_dim_names=("dp_outer", "dp_cp", "tp"))
    return mesh, upstream.flatten_mesh(mesh["dp_outer", "dp_cp"], "hsdp").get_group()


# {id(param): (the param, weakly; (offset, rows) of each rank of its shards' group)}, from
# megatron_fsdp's DCP chunk offsets: fixed for the param's life, so each full_tensor of it after
# the first is one tensor all-gather.
_CHUNKS: dict[int, tuple[weakref.ref, list[tuple[int, int]]]] = {}


def full_tensor(t: torch.Tensor, param: DTensor) -> torch.Tensor:
    """The whole (TP-local) matrix of an uneven Shard(0)/Replicate DTensor laid out like `param`
    (TP=1 when it is sharded over several mesh dims, HFSDP): its data-parallel shards ordered by
    megatron_fsdp's own DCP chunk offsets (independent of the optimizer's row-layout code)."""
    tp_dim = getattr(getattr(param, "megatron_fsdp_dist_index", None), "tp_dim", None)
    names = t.device_mesh.mesh_dim_names or (None,) * t.device_mesh.ndim
    shard_dims = [i for i, pl in enumerate(t.placements) if pl == Shard(0) and names[i] != tp_dim]
    if not shard_dims:
        return t.to_local().clone()
    group = t.device_mesh.get_group(shard_dims[0]) if len(shard_dims) == 1 else dist.group.WORLD
    local = t.to_local().detach()
    known, chunks = _CHUNKS.get(id(param), (None, None))
    if known is None or known() is not param:
        chunks = [None] * dist.get_world_size(group)
        offset = gather_and_compute_chunk_metadata(param).offsets[0]
        dist.all_gather_object(chunks, (offset, len(local)), group=group)
        _CHUNKS[id(param)] = (weakref.ref(param), chunks)
    assert chunks[dist.get_rank(group)][1] == len(local), "not laid out like param"
    padded = local.new_zeros((max(rows for _, rows in chunks), *local.shape[1:]))
    padded[:len(local)] = local
    gathered = [torch.empty_like(padded) for _ in chunks]
    dist.all_gather(gathered, padded, group=group)
    pieces = sorted(((start, whole[:rows]) for (start, rows), whole in zip(chunks, gathered)),
                    key=lambda piece: (piece[0], -len(piece[1])))
    rows, position = [], pieces[0][0]  # offsets count TP's rows before these
    for start, piece in pieces:
        if start == position and len(piece):  # replicas repeat a shard
            rows.append(piece)
            position += len(piece)
    return torch.cat(rows)


def same_shape_linears(world_size: int):
    """Four 16x16 matrices on Megatron-FSDP (ZeRO-3), a unit each: every one crosses the shard
    boundary."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(*[torch.nn.Linear(16, 16, bias=False) for _ in range(4)])
    return fully_shard(module, "optim_grads_params", world_size, [torch.nn.Linear])


def matrices_per_newton_schulz_call(fsdp, optimizer) -> list[int]:
    """One step of `optimizer` on `fsdp`: how many matrices each Newton-Schulz call took."""
    calls = []
    orthogonalize = optimizer.orthogonalize

    def counted(p, grad, **kwargs):
        calls.append(grad.shape[0] if grad.dim() == 3 else 1)
        return orthogonalize(p, grad, **kwargs)

    optimizer.orthogonalize = counted
    fsdp(torch.randn(6, 16)).square().mean().backward()
    fsdp.finish_grad_sync()
    optimizer.step()
    return calls


def split_params(module):
    named = list(module.named_parameters())
    return [p for _, p in named if p.dim() == 2], [p for _, p in named if p.dim() != 2]


def teams_of_two():
    """plan.team_sizes splitting the largest matrix a team may split in two, whatever balance
    says (the tiny GPT's matrices are too even for a team to pay): for tests about what a team
    does."""
    def largest_in_two(matrices, ranks, max_team, cost=None):
        splittable = [i for i, matrix in enumerate(matrices) if plan_teams.can_split(matrix)]
        largest = max(splittable, default=None, key=lambda i: matrices[i].ns_flops(steps=1))
        return [2 if i == largest else 1 for i in range(len(matrices))]

    return mock.patch.object(plan_teams, "team_sizes", largest_in_two)


@contextlib.contextmanager
def every_batch_that_fits_ahead(sharing: bool = True):
    """packed_plan taking ahead every batch whose owners can hold it, though carrying them
    twice as wide adds collectives to the step (a tiny model's few exchanges: the plan would
    gather more at the step, test_plan.py's subject), the rest joining their exchanges where
    they fit (`sharing`: an exchange gathering some matrices ahead and others at the step) or
    apart: for tests about what a gather ahead computes."""
    def shares(plan) -> bool:
        return any(batch[0] not in plan.early for exchange in plan.exchanges[:plan.ahead]
                   for batch in exchange)

    with mock.patch("megatron_muon.plan.owner_plan.step_collectives",
                    lambda matrices, owners, exchanges, early=frozenset(): 0), \
            mock.patch("megatron_muon.plan.owner_plan._better",
                       lambda plan, than, matrices: bool(plan.early) and (
                           shares(plan) == sharing or not than.early)):
        yield


def muon_param_groups(matrices):
    """The matrices in two param groups whose lr, weight decay and momentum differ, as Megatron's
    per-param overrides make them: each matrix must be stepped with its own group's."""
    return [{"params": matrices[::2]},
            {"params": matrices[1::2], "lr": 0.05, "weight_decay": 0.1, "momentum": 0.8}]


def with_gram_newton_schulz(optimizer, scaled: bool = True):
    """megatron-core's single-device `optimizer` (TensorParallelMuon, or its adaptive variant:
    `scaled` False) with its Newton-Schulz routed through Gram Newton-Schulz as
    --muon-gram-newton-schulz routes ours (core.gram_newton_schulz, gram-newton-schulz's
    restart), for the reference of a run with it."""
    settings = tensor_parallel_muon_settings(MUON_KWARGS)
    optimizer.gram = GramSchedule(settings["num_ns_steps"])
    route_newton_schulz_through_it(optimizer, settings, scaled)
    return optimizer


def reference_optimizers(ref, moment2_method=None):
    """megatron-core's optimizers on the unsharded model: TensorParallelMuon, or with
    `moment2_method` TensorParallelAdaptiveMuon (--optimizer adaptive_muon, as
    megatron_muon.fixes.upstream_fixes repairs it), and Adam for the rest."""
    matrices, vectors = split_params(ref)
    if moment2_method is None:
        muon = TensorParallelMuon(muon_param_groups(matrices), **MUON_KWARGS)
    else:
        upstream_fixes.apply()
        muon = TensorParallelAdaptiveMuon(muon_param_groups(matrices), **MUON_KWARGS,
                                          **ADAPTIVE_KWARGS, moment2_method=moment2_method)
    return [muon, torch.optim.Adam(vectors, lr=0.01, foreach=False)]


class ForwardReads:
    """The weights the model's forward computes with: forward pre-hooks on every module holding
    params, registered after Megatron-FSDP's (which all-gather ZeRO-3's weights), record each
    param as its module sees it. Names are those of Megatron-FSDP's main weights."""

    def __init__(self, megatron_fsdp):
        self.megatron_fsdp = megatron_fsdp
        self.seen = {}
        for prefix, module in megatron_fsdp.module.named_modules():
            names = [name for name, _ in module.named_parameters(recurse=False)]
            if names:
                module.register_forward_pre_hook(functools.partial(self._record, prefix, names))

    def _record(self, prefix, names, module, args):
        for name in names:
            self.seen[f"{prefix}.{name}" if prefix else name] = getattr(module, name).detach().clone()

    def assert_main_weights(self, when: str):
        """The last forward read the optimizer's main weights, bit for bit (collective)."""
        main = dict(self.megatron_fsdp.param_and_grad_buffer.optimizer_named_parameters)
        assert self.seen.keys() == main.keys(), when
        stale = [name for name in sorted(main)
                 if not torch.equal(self.seen[name], full_tensor(main[name], main[name]))]
        assert not stale, f"{when}: the forward read stale weights for {stale}"


def checkpoint_state(model, optimizer, is_loading):
    """What megatron.training saves and loads in the fsdp_dtensor format (generate_state_dict,
    then preprocess_fsdp_dtensor_state_dict: global expert keys and uneven-DTensor chunks)."""
    state = {"model": unwrap_model(model).state_dict_for_save_checkpoint(),
             "optimizer": optimizer.sharded_state_dict({}, is_loading=is_loading)}
    args = SimpleNamespace(swiglu=False, num_experts=model.config.num_moe_experts)
    return state, preprocess_fsdp_dtensor_state_dict(args, state, model)


def save_checkpoint(model, optimizer, path):
    dcp.save(checkpoint_state(model, optimizer, is_loading=False)[1], checkpoint_id=path)


def load_checkpoint(model, optimizer, path):
    raw, preprocessed = checkpoint_state(model, optimizer, is_loading=True)
    dcp.load(preprocessed, checkpoint_id=path)  # in place, into the tensors of `raw`
    # megatron.training then calls the model's load_state_dict, whose Megatron-FSDP post-load hook
    # installs the loaded main weights as the weights the model computes with.
    find_megatron_fsdp(model).install_optimized_model_weights()
    optimizer.load_state_dict(raw["optimizer"])


GLOBAL_BATCH = 4  # sequences


def global_batch_loss(model, step, rank, world_size, shape: GPTShape = TINY):
    """Mean LM loss on this rank's slice of a global batch fixed by step (GLOBAL_BATCH
    sequences): the same data, hence the same mean gradient, at world sizes 1, 2 and 4."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, shape.vocab, (GLOBAL_BATCH, shape.seq), generator=g, device="cpu")
    per_rank = len(tokens) // world_size
    return loss_on(model, tokens[rank * per_rank:(rank + 1) * per_rank])
