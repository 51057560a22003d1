"""Phase 3: the factory on real megatron-core objects (a tiny GPT in FullyShardedDataParallel)."""

import contextlib

import pytest
import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_muon import FSDPMuonChainedOptimizer, ZeROTensorParallelMuon, get_megatron_optimizer
from megatron_muon.compat import upstream
from fsdp_models import STRATEGIES, teams_of_two
from megatron_muon.plan import team_members
from megatron_muon.tools import testing
from megatron_muon.tools.testing import (fsdp_gpt, gpt, init_parallel_state, lm_loss,
                                         optimizer_config)
from tolerances import ATOL, muon_drift, reordering_error


def _part(optimizer, cls):
    (part,) = _parts(optimizer, cls)
    return part


def _parts(optimizer, cls):
    return [p.optimizer for p in optimizer.optimizer.chained_optimizers
            if isinstance(p.optimizer, cls)]


def _routes_and_trains(rank, world_size):
    init_parallel_state()
    model = fsdp_gpt()
    optimizer = get_megatron_optimizer(optimizer_config(), [model])
    assert isinstance(optimizer, FSDPMuonChainedOptimizer)
    muon, adam = _part(optimizer, ZeROTensorParallelMuon), _part(optimizer, torch.optim.Adam)
    names = {id(p): n for n, p in model.named_parameters()}
    muon_names = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    adam_names = {names[id(p)] for g in adam.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        # megatron-core's rule: word embeddings and the output layer are tagged; learned position
        # embeddings are not, and go to Muon there too.
        wants_muon = p.dim() == 2 and "word_embeddings" not in name and "output_layer" not in name
        assert (name in muon_names) == wants_muon and (name in adam_names) != wants_muon, name
    assert any("linear_qkv" in n for n in muon_names)
    assert muon.dp_group is ProcessGroupCollection.use_mpu_process_groups().dp_cp
    assert muon.dist_mode == "owner"

    _assert_loss_falls(model, optimizer, rank)


def _assert_loss_falls(model, optimizer, rank):
    losses = []
    for _ in range(4):
        optimizer.zero_grad()
        loss = lm_loss(model, 0, rank)  # the same batch every step: the loss must fall
        loss.backward()
        update_successful, _, _ = optimizer.step()
        assert update_successful
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses


def _scalar_part_steps_foreach_exactly(rank, world_size, offload):
    """The scalar optimizer (AdamW) steps its DTensor shards in one foreach call per op
    (factory._foreach_over_dtensors) and makes what torch's per-param loop makes on the full
    tensors, bit for bit; with `offload` (optimizer_cpu_offload) its moments live in host memory
    between steps (core/state_offload.offload_between_steps), each copied to the device and back
    once per step."""
    from fsdp_models import full_tensor

    init_parallel_state()
    model = fsdp_gpt()
    optimizer = get_megatron_optimizer(
        optimizer_config(clip_grad=0.0, optimizer_cpu_offload=offload,
                         optimizer_offload_fraction=1.0), [model])
    adam = _part(optimizer, torch.optim.Adam)
    assert all(group["foreach"] for group in adam.param_groups)
    references = []
    for group in adam.param_groups:
        params = [torch.nn.Parameter(full_tensor(p, p)) for p in group["params"]]
        per_param_loop = {**group, "params": params, "foreach": False}
        references.append((group["params"], params, type(adam)([per_param_loop])))
    for step in range(3):  # the third reads the moments the second left in host memory
        optimizer.zero_grad()
        lm_loss(model, step, rank).backward()
        model.finish_grad_sync()
        for shards, params, _ in references:
            for shard, param in zip(shards, params):
                param.grad = full_tensor(
                    shard.grad if shard.grad is not None else torch.zeros_like(shard), shard)
        optimizer.step()
        for shards, params, reference in references:
            reference.step()
            for shard, param in zip(shards, params):
                assert torch.equal(full_tensor(shard, shard), param.detach())
    moments = sum(adam.state[p][key].to_local().nbytes for p in adam.state
                  for key in ("exp_avg", "exp_avg_sq"))
    host = adam.host_state
    params = sum(len(group["params"]) for group in adam.param_groups)
    assert moments > 0 and len(host.params) == (params if offload else 0)
    assert host.moved_to_device == host.moved_to_host == host.most_on_device == (
        moments if offload else 0)


@pytest.mark.parametrize("world_size, offload", [(1, False), (2, False), (2, True)])
def test_scalar_part_steps_foreach_exactly(distributed, world_size, offload):
    distributed(_scalar_part_steps_foreach_exactly, world_size, offload)


def _falls_through(rank, world_size):
    init_parallel_state()
    adam_on_fsdp = get_megatron_optimizer(optimizer_config("adam"), [fsdp_gpt()])
    assert not isinstance(adam_on_fsdp, FSDPMuonChainedOptimizer)
    muon_unsharded = get_megatron_optimizer(optimizer_config(use_distributed_optimizer=False), [gpt()])
    assert not isinstance(muon_unsharded, FSDPMuonChainedOptimizer)
    assert not any(isinstance(p.optimizer, ZeROTensorParallelMuon)
                   for p in muon_unsharded.chained_optimizers)


def _experts_gather_over_expert_dp(rank, world_size):
    init_parallel_state(expert_parallel=world_size)
    model = fsdp_gpt(num_experts=4)  # local experts carry '.experts.' in their names
    optimizer = get_megatron_optimizer(optimizer_config(), [model])
    groups = ProcessGroupCollection.use_mpu_process_groups()
    muon_parts = [p.optimizer for p in optimizer.optimizer.chained_optimizers
                  if isinstance(p.optimizer, ZeROTensorParallelMuon)]
    by_group = {id(m.dp_group): m for m in muon_parts}
    expert = by_group[id(groups.expt_dp)]
    dense = by_group[id(groups.dp_cp)]
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(".experts." in names[id(p)] for g in expert.param_groups for p in g["params"])
    assert not any(".experts." in names[id(p)] for g in dense.param_groups for p in g["params"])
    _assert_loss_falls(model, optimizer, rank)


@pytest.mark.parametrize("world_size", [1, 2])
def test_muon_on_fsdp_routes_matrices_to_muon_and_trains(distributed, world_size):
    distributed(_routes_and_trains, world_size)


def test_other_requests_fall_through_to_megatron_core(distributed):
    distributed(_falls_through, 2)


def test_expert_matrices_gather_over_expert_data_parallel_group(distributed):
    distributed(_experts_gather_over_expert_dp, 2)


def _tag_as_megatron_core(ref, name, model_param, config):
    """The tags megatron-core's own Muon path gives a model param, by its name (as
    _get_megatron_emerging_optimizer does; independent of ours), and its TP partition dim."""
    if "experts" in name and "shared" not in name:
        ref.expert_tp = True
    shapes = upstream.get_qkv_split_shapes(config)
    if "linear_qkv.weight" in name and ref.dim() == 2 and ref.shape[0] % sum(shapes) == 0:
        ref.is_qkv, ref.qkv_split_shapes = True, shapes
    if hasattr(model_param, "partition_dim"):
        ref.partition_dim = model_param.partition_dim


def _matches_reference_muon(rank, world_size, tensor_parallel, expert_parallel, tp_mode, outer,
                            dist_mode, strategy="optim_grads_params", flagship=None,
                            moment2_method=None, offload_fraction=None, teams=False):
    """Every Muon matrix equals megatron-core's TensorParallelMuon run on the full (TP-local)
    matrices with the same gradients: dense matrices sharded over dp_cp, experts over expt_dp
    (expert TP 1, as MoE runs usually have it, also beside TP 2), TP Newton-Schulz over the tp
    group, experts' over expt_tp; with `outer`, HSDP over 2 replicas; `flagship`, the name of a
    megatron_muon.tools.testing model's settings (MLA, shared experts, a dense first layer), with 4
    experts; `moment2_method`: --optimizer adaptive_muon against megatron-core's
    TensorParallelAdaptiveMuon (repaired); `offload_fraction`: with optimizer_cpu_offload;
    `teams`: --muon-max-team-size over all of dp_cp, the group's largest matrix split in two
    (fsdp_models.teams_of_two), within the reordering bound of the reference's (the Gram's sums
    in another order), every other matrix bit for bit. Returns whether some rank's shard of a
    Muon matrix is empty, and whether some matrix's shards are uneven."""
    from megatron.core.optimizer.emerging_optimizers import (TensorParallelAdaptiveMuon,
                                                             TensorParallelMuon)

    from fsdp_models import full_tensor
    from megatron_muon.chain.model_chunks import named_main_weights

    init_parallel_state(expert_parallel=expert_parallel, tensor_parallel=tensor_parallel,
                        replicas=2 if outer else 1, expert_tensor_parallel=1)
    settings = getattr(testing, flagship) if flagship else {}
    experts = 4 if expert_parallel > 1 or flagship else None
    model = fsdp_gpt(num_experts=experts, outer_strategy=outer or "no_shard", strategy=strategy,
                     **settings)
    if tensor_parallel > 1 and experts:
        # megatron-core's MoE layer trains with TP only under sequence parallelism, which its
        # torch LayerNorm (no TE or apex) lacks. The gradients are this test's given, so eval
        # mode serves (no dropout here either way; only the router's aux loss is left out).
        model.eval()
    # No clipping: the reference gets the gradients unscaled.
    adaptive = dict(optimizer="adaptive_muon", adaptive_muon_moment2_method=moment2_method)
    offload = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=offload_fraction)
    config = optimizer_config(muon_tp_mode=tp_mode, clip_grad=0.0,
                              **(adaptive if moment2_method else {}),
                              **(offload if offload_fraction is not None else {}))
    split = dict(muon_max_team_size=world_size // tensor_parallel, muon_owner_choice="bytes")
    with teams_of_two() if teams else contextlib.nullcontext():
        optimizer = get_megatron_optimizer(config, [model], muon_dist_mode=dist_mode,
                                           **(split if teams else {}))
    if flagship:
        _muon_and_scalar_split_as_megatron_cores(model, optimizer, settings, experts)
    parts = _parts(optimizer, ZeROTensorParallelMuon)
    # With experts in owner mode and the state on the device, the dense and expert parts step
    # in rounds (planner.interleaving): equal to the reference too.
    interleaved = experts and dist_mode == "owner" and offload_fraction is None
    assert [part.interleaved is not None for part in parts] == [bool(interleaved)] * len(parts)
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    names = {p: name for name, p in named_main_weights(model)}
    pairs, ref_groups = [], []
    for part in parts:
        for group in part.param_groups:
            ref_params = []
            for p in group["params"]:
                ref = torch.nn.Parameter(full_tensor(p, p))
                _tag_as_megatron_core(ref, names[p], p.orig_param, model.config)
                pairs.append((p, ref))
                ref_params.append(ref)
            ref_groups.append({"params": ref_params, "lr": group["lr"],
                               "weight_decay": group["weight_decay"]})
    reference_class = TensorParallelAdaptiveMuon if moment2_method else TensorParallelMuon
    reference = reference_class(ref_groups, **upstream.EMERGING_OPTIMIZERS[
        config.optimizer].config_to_kwargs(config, [model], pg_collection))
    teamed = {plan.param_of(i) for part in parts for plan in part.plans
              for i, matrix in enumerate(plan.matrices)
              if matrix.team and matrix.team.team in team_members(plan.matrices, plan.owners)}
    if teams:  # some rank's TP-local matrices are split
        assert _on_some_rank(bool(teamed))
    lrs = []
    for step in range(3):
        optimizer.zero_grad()
        with model.no_sync():  # as megatron's schedules mark the last micro-batch, whose
            pass               # backward also reduces across HSDP's replicas
        lm_loss(model, step, rank).backward()
        model.finish_grad_sync()
        for p, ref in pairs:
            ref.grad = full_tensor(p.grad if p.grad is not None else torch.zeros_like(p), p)
        optimizer.step()
        reference.step()
        lrs.append(ref_groups[0]["lr"])
        worst = max((full_tensor(p, p) - ref).abs().max().item() for p, ref in pairs
                    if p not in teamed)
        assert worst == 0, f"step {step}: max |diff| {worst}"
        for p, ref in pairs:
            if p in teamed:
                diff = (full_tensor(p, p) - ref).abs().max().item()
                bound = muon_drift(lrs, ref.shape, reordering_error(max(ref.shape))) + ATOL
                assert diff <= bound, (names[p], step, diff, bound)
    if offload_fraction:  # some state of this rank's went to host memory and back
        assert any(part.host_state.moved_to_host for part in parts) or not any(
            p.to_local().numel() for p, _ in pairs)
    return _empty_and_uneven_shards([p for p, _ in pairs])


def _empty_and_uneven_shards(params) -> tuple[bool, bool]:
    """Over all ranks: whether a non-empty matrix has an empty shard on some rank, and whether
    some matrix's shards hold different numbers of rows."""
    rows = torch.tensor([[p.to_local().shape[0] for p in params]], dtype=torch.float64)
    every_rank = [torch.zeros_like(rows) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(every_rank, rows)
    rows = torch.cat(every_rank)  # [rank, matrix]
    return bool((rows == 0).any()), bool((rows.amax(dim=0) != rows.amin(dim=0)).any())


def _muon_and_scalar_split_as_megatron_cores(model, optimizer, settings, experts):
    """The params Muon steps are those megatron-core's own Muon factory gives Muon on the
    unsharded model (its own rules: 2-D, not embedding or output layer, not the router's...)."""
    from megatron_muon.chain.model_chunks import named_main_weights

    ours = {name.removeprefix("module.module.")
            for part in _parts(optimizer, ZeROTensorParallelMuon)
            for name, p in named_main_weights(model) if _steps(part, p)}
    unsharded = gpt(num_experts=experts, **settings)
    reference = get_megatron_optimizer(optimizer_config(use_distributed_optimizer=False),
                                       [unsharded])
    muon_params = {p for part in reference.chained_optimizers
                   if type(part.optimizer).__name__ == "TensorParallelMuon"
                   for group in part.optimizer.param_groups for p in group["params"]}
    theirs = {name for name, p in unsharded.named_parameters() if p in muon_params}
    assert ours == theirs, (ours ^ theirs)
    assert any("linear_kv_up_proj" in name for name in ours), ours
    assert any("shared_experts" in name for name in ours), ours


def _on_some_rank(flag: bool) -> bool:
    found = torch.tensor([int(flag)])
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return bool(found.item())


def _steps(part, p) -> bool:
    return any(p is q for group in part.param_groups for q in group["params"])


@pytest.mark.parametrize("tensor_parallel, expert_parallel, tp_mode, outer, dist_mode, offload", [
    # experts over expt_dp (2 ranks), dense over dp_cp (4 ranks); the state in host memory
    (1, 2, "duplicated", None, "owner", None), (1, 2, "duplicated", None, "allgather", 1.0),
    # TP=2 x DP=2
    (2, 1, "duplicated", None, "owner", None), (2, 1, "duplicated", None, "allgather", None),
    (2, 1, "distributed", None, "owner", 0.5),
    # TP=2 for dense matrices, experts over EP=2 with expert TP 1
    pytest.param(2, 2, "duplicated", None, "owner", None, marks=pytest.mark.slow),
    # HSDP: 2 replicas x 2 shards (allgather under HSDP: test_numerics)
    (1, 2, "duplicated", "no_shard", "owner", 1.0),
    pytest.param(1, 1, "duplicated", "optim", "owner", None, marks=pytest.mark.slow),
])
def test_matches_reference_muon_on_full_matrices(distributed, tensor_parallel, expert_parallel,
                                                 tp_mode, outer, dist_mode, offload):
    """(`offload`: optimizer_offload_fraction with optimizer_cpu_offload.)"""
    # TP with experts in processes of their own: after another case's layout in the same
    # processes, the reference's gathers (fsdp_models.full_tensor) hang.
    fresh = tensor_parallel > 1 and expert_parallel > 1
    distributed(_matches_reference_muon, 4, tensor_parallel, expert_parallel, tp_mode, outer,
                dist_mode, "optim_grads_params", None, None, offload, fresh=fresh)


def test_teams_split_tp_local_matrices_under_blockwise_tp(distributed):
    """TP=2 x DP=2, --muon-tp-mode blockwise (Megatron's default): a TP-local matrix is a matrix
    of its own to TensorParallelMuon, so a team over dp_cp may split it; against the reference,
    its matrices within the reordering bound, the rest bit for bit."""
    # In processes of their own, as the TP cases with experts: after the cases above, the
    # reference's gathers (fsdp_models.full_tensor) hang.
    distributed(_matches_reference_muon, 4, 2, 1, "blockwise", None, "owner",
                "optim_grads_params", None, None, None, True, fresh=True)


@pytest.mark.parametrize("moment2_method, tensor_parallel, expert_parallel, tp_mode, outer", [
    ("normuon", 2, 1, "distributed", None), ("adamuon", 1, 2, "duplicated", "no_shard"),
    ("namo", 2, 2, "duplicated", None)])
def test_adaptive_muon_matches_reference_adaptive_muon_on_full_matrices(
        distributed, moment2_method, tensor_parallel, expert_parallel, tp_mode, outer):
    """--optimizer adaptive_muon through the factory: TP=2 (its Newton-Schulz over TP, the QKV
    split, Muon's scale by the TP-unsharded shape), experts over EP=2, HSDP (each case a fresh
    pool: three, for the main suite's time)."""
    # In processes of their own: after the cases above, the reference's gathers
    # (fsdp_models.full_tensor) hung, under TP=2 and under EP=2 alike.
    distributed(_matches_reference_muon, 4, tensor_parallel, expert_parallel, tp_mode, outer,
                "owner", "optim_grads_params", None, moment2_method, fresh=True)


# Kimi K2's and DeepSeek's layers (megatron_muon.tools.testing: MLA with and without a q low rank, 4
# routed experts top-2 beside a shared expert, the first layer dense), every sharding strategy,
# experts over expert-parallel 2 (at EP=1 the reference's gathers of the experts' gradients,
# fsdp_models.full_tensor, hang; so do they under TP=2 x EP=2 with torch 2.8 and megatron-core
# 0.19.0): (world size, strategy, model).
FLAGSHIP_CASES = [
    *[(2, strategy, "KIMI_K2_LIKE") for strategy in STRATEGIES],
    (2, "optim_grads_params", "DEEPSEEK_LIKE"),
    (4, "optim_grads_params", "KIMI_K2_LIKE"), (4, "optim", "DEEPSEEK_LIKE"),
    (4, "optim_grads", "KIMI_K2_LIKE"), (4, "no_shard", "DEEPSEEK_LIKE"),
]


def _flagship_cases(rank, world_size):
    empty = uneven = False
    for size, strategy, model in FLAGSHIP_CASES:
        if size == world_size:
            found = _matches_reference_muon(rank, world_size, 1, 2, "duplicated", None, "owner",
                                            strategy, model)
            empty, uneven = empty or found[0], uneven or found[1]
    assert uneven, "no case shards a Muon matrix unevenly"
    if world_size == 4:
        assert empty, "no case leaves a rank an empty shard of a Muon matrix"


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_kimi_k2_and_deepseek_like_mla_shared_experts_and_dense_first_layer_match_reference_muon(
        distributed, world_size):
    # In processes of their own: after another layout in the same processes the reference's
    # gathers of the experts' gradients hung (seen at torch 2.8 and megatron-core 0.19.0).
    distributed(_flagship_cases, world_size, fresh=True)



def test_muon_leaves_to_the_scalar_optimizer_what_megatron_cores_own_muon_does():
    """Which params go to the scalar optimizer is megatron-core's own rule, as the installed
    version states it (0.19: not 2-D, or embedding or output; main also a param marked
    use_muon=False, as Mamba's and GDN's in_proj are), with stacked experts Muon's."""
    from megatron_muon.planner.param_tags import is_scalar_param

    (theirs,) = [key.predicate.fn for key in
                 upstream.EMERGING_OPTIMIZERS["muon"].default_param_overrides]

    def param(*shape, **tags):
        p = torch.nn.Parameter(torch.zeros(*shape, device="cpu"))
        for tag, value in tags.items():
            setattr(p, tag, value)
        return p

    params = [param(4, 4), param(4), param(4, 4, is_embedding_or_output_parameter=True),
              param(4, 4, use_muon=False), param(4, 4, use_muon=True)]
    assert [is_scalar_param(p) for p in params] == [theirs(p) for p in params]
    assert is_scalar_param(param(2, 4, 4)) and not is_scalar_param(
        param(2, 4, 4, num_stacked_experts=2))
