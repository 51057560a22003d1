"""Each unsupported or inconsistent setup is refused at construction, before any state exists,
with one error naming the setting (or Megatron flag) and the parameter."""

import types

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from megatron_muon import (ZeROTensorParallelAdaptiveMuon, ZeROTensorParallelMuon,
                           get_megatron_optimizer)
from megatron_muon.tools.testing import optimizer_config


@pytest.fixture(scope="module", autouse=True)
def one_rank_group(tmp_path_factory):
    """A 1-rank gloo group in this process, for DTensors; gone after this module."""
    store = torch.distributed.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def matrix(shape=(6, 4), placements=(Shard(0),), mesh_dims=("dp",), **tags):
    mesh = init_device_mesh("cpu", (1,) * len(mesh_dims), mesh_dim_names=mesh_dims)
    p = torch.nn.Parameter(DTensor.from_local(torch.randn(shape), mesh, list(placements)))
    for name, value in tags.items():
        setattr(p, name, value)
    return p


def refused(error, match, params, optimizer_class=ZeROTensorParallelMuon, **kwargs):
    """The construction fails with `error` matching `match`, and leaves the params as they were."""
    before = [p.to_local().clone() if isinstance(p, DTensor) else p.detach().clone() for p in params]
    with pytest.raises(error, match=match):
        optimizer_class(params, **kwargs)
    after = [p.to_local() if isinstance(p, DTensor) else p.detach() for p in params]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_a_model_not_yet_wrapped_by_megatron_fsdp():
    refused(TypeError, "wrap the model with Megatron-FSDP", [torch.nn.Parameter(torch.randn(6, 4))])


def test_a_vector():
    refused(ValueError, r"2-D matrices .* shape \(6,\)", [matrix((6,))])


def test_a_four_dimensional_weight():
    refused(ValueError, r"2-D matrices .* shape \(2, 3, 4, 5\)", [matrix((2, 3, 4, 5))])


def test_a_three_dimensional_weight_that_is_not_a_stack_of_experts():
    refused(ValueError, r"2-D matrices .* shape \(2, 3, 4\)", [matrix((2, 3, 4))])


def test_stacked_experts_that_do_not_divide_the_rows():
    refused(ValueError, "num_stacked_experts=4 does not divide", [matrix((6, 4), num_stacked_experts=4)])


def test_a_partial_placement():
    refused(ValueError, "unsupported DTensor placements", [matrix(placements=(Partial(),))])


def test_the_name_of_the_param_is_in_the_error():
    p = matrix((6,))
    refused(ValueError, "decoder.final_norm.weight: Muon", [p], param_names={p: "decoder.final_norm.weight"})


def test_mismatched_meshes_inside_one_param_group():
    dense = matrix()
    replicated = matrix(placements=(Replicate(),))
    refused(ValueError, "one param group mixes data-parallel layouts", [dense, replicated])


@pytest.mark.parametrize("setting, value, flag", [
    ("tp_mode", "rowwise", "--muon-tp-mode"),
    ("coefficient_type", "cubic", "--muon-coefficient-type"),
    ("scale_mode", "frobenius", "--muon-scale-mode"),
    ("momentum", 1.0, "--muon-momentum"),
    ("lr", -1.0, "--lr"),
    ("weight_decay", -0.1, "--weight-decay"),
    ("dist_mode", "everywhere", "--muon-dist-mode"),
    ("owner_choice", "flops", "--muon-owner-choice"),
    ("byte_slack", -0.5, "byte_slack"),
    ("max_exchange_bytes", 0, "max_exchange_bytes"),
])
def test_an_unknown_or_out_of_range_setting(setting, value, flag):
    refused(ValueError, f"{setting}.*{flag}|{flag}.*{value!r}", [matrix()], **{setting: value})


@pytest.mark.parametrize("setting, value, flag", [
    ("moment2_method", "adam", "--adaptive-muon-moment2-method"),
    ("beta2", 1.0, "--adaptive-muon-beta2"),
    ("eps", -1e-8, "--adaptive-muon-eps"),
    ("use_syrk", True, "--muon-use-syrk"),
])
def test_an_adaptive_muon_setting_it_cannot_run(setting, value, flag):
    refused(ValueError, flag, [matrix()], ZeROTensorParallelAdaptiveMuon, **{setting: value})


def test_namo_with_l2_weight_decay():
    refused(ValueError, "'namo' needs decoupled weight decay", [matrix()],
            ZeROTensorParallelAdaptiveMuon, moment2_method="namo",
            use_decoupled_weight_decay=False)


def test_qkv_split_without_a_qkv_predicate():
    refused(ValueError, "split_qkv .*needs is_qkv_fn", [matrix()], split_qkv=True)


def test_qkv_split_on_a_matrix_the_split_does_not_tile():
    # 6 rows cannot be whole groups of q 4 + k 2 + v 2 rows.
    refused(ValueError, "split_qkv .* tile its 6 rows.*pass --muon-no-split-qkv", [matrix(is_qkv=True)],
            split_qkv=True,
            is_qkv_fn=lambda p: getattr(p, "is_qkv", False), qkv_split_shapes=[4, 2, 2])


def test_fp16_through_the_factory():
    chunk = types.SimpleNamespace(install_optimized_model_weights=None, finish_grad_sync=None)
    with pytest.raises(ValueError, match=r"does not support: OptimizerConfig.fp16 \(use bf16 or fp32"):
        get_megatron_optimizer(optimizer_config(fp16=True), [chunk])


@pytest.mark.parametrize("precision, refusal", [
    ("medium", r"--muon-use-syrk needs CUDA \(a Triton kernel\); the params are on cpu"),
    ("highest", r"--muon-use-syrk runs a bf16 kernel.*--muon-fp32-matmul-prec medium, not highest")])
def test_syrk_where_it_cannot_run(precision, refusal):
    refused(ValueError, refusal, [matrix()], use_syrk=True, fp32_matmul_prec=precision)


def _syrk_under_tensor_parallelism(rank, world_size):
    from megatron_muon.core import syrk
    from megatron_muon.tools.testing import fsdp_gpt, init_parallel_state

    init_parallel_state(tensor_parallel=2)
    model = fsdp_gpt()
    def local(p):
        return p.to_local() if isinstance(p, DTensor) else p.detach()

    weights = [local(p).clone() for p in model.parameters()]
    if syrk.tensor_parallel_muon_takes_syrk():
        pytest.skip("this megatron-core's TensorParallelMuon runs the kernel in every TP mode")
    for tp_mode, refusal in [
            ("duplicated", r"--muon-use-syrk with --muon-tp-mode duplicated under tensor "
                           r"parallelism 2.*use --muon-tp-mode blockwise"),
            ("blockwise", r"--muon-use-syrk needs CUDA")]:  # past the TP check: the machine's
        with pytest.raises(ValueError, match=refusal):
            get_megatron_optimizer(optimizer_config(muon_tp_mode=tp_mode,
                                                    muon_fp32_matmul_prec="medium"),
                                   [model], muon_use_syrk=True)
    assert all(torch.equal(a, local(b)) for a, b in zip(weights, model.parameters()))


def test_syrk_in_a_tensor_parallel_mode_upstream_cannot_pass_it_to(distributed):
    distributed(_syrk_under_tensor_parallelism, 2)


def _experts_without_an_expert_group(rank, world_size):
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_muon.tools.testing import fsdp_gpt, init_parallel_state

    init_parallel_state()
    model = fsdp_gpt(num_experts=2)
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    pg_collection.expt_dp = None
    with pytest.raises(ValueError, match=r"experts\..*need an expert data-parallel group"):
        get_megatron_optimizer(optimizer_config(), [model], pg_collection=pg_collection)


def test_expert_params_without_an_expert_group(distributed):
    distributed(_experts_without_an_expert_group, 1)


@pytest.mark.parametrize("hook", ["pre_weight_update_fn_inplace", "post_weight_update_fn_inplace"])
def test_a_weight_update_hook_that_needs_the_whole_param(hook):
    """OrthogonalizedOptimizer.step calls these around p -= lr * update with the whole param (e.g.
    MuonHyperball keeps its norm); on sharded rows that cannot hold, so it is refused, not dropped."""
    hooked = type("HyperballMuon", (ZeROTensorParallelMuon,), {hook: lambda self, p, *update: None})
    p = matrix()
    before = p.to_local().clone()
    with pytest.raises(NotImplementedError, match=f"HyperballMuon.{hook}: .*whole param"):
        hooked([p])
    assert torch.equal(p.to_local(), before)


def test_orthogonalize_receives_its_param_groups_options():
    """As in OrthogonalizedOptimizer.step, orthogonalize gets the options of the param's group
    (Megatron's lr_mult, wd_mult, ...), and one batched call never mixes two groups."""
    seen = []

    class Recording(ZeROTensorParallelMuon):
        def orthogonalize(self, p, grad, **options):
            seen.append((grad.dim(), options.get("tag"), options["lr"]))
            return super().orthogonalize(p, grad, **options)

    first, second = [matrix() for _ in range(2)], [matrix() for _ in range(2)]
    groups = [dict(params=first, tag="a", lr=0.1), dict(params=second, tag="b", lr=0.2)]
    # medium, owners by bytes: batched calls, no probe, nothing measured; a budget that holds
    # every matrix (what Muon's state saves of these tiny ones would keep each alone)
    muon = Recording(groups, fp32_matmul_prec="medium", owner_choice="bytes",
                     max_exchange_bytes=1 << 30)
    for p in first + second:
        p.grad = DTensor.from_local(torch.randn(6, 4), p.device_mesh, p.placements)
    muon.step()
    assert sorted(seen) == [(3, "a", 0.1), (3, "b", 0.2)], seen  # a batch per group
