"""What tests_gpu's ranks run, forked from launcher.py's server (functions, so that the server's
imports serve them): each sets its device and joins its own process group."""

import gc

import torch
import torch.distributed as dist

OFFLOAD_SHAPE = dict(layers=4, hidden=512, ffn=2048, heads=8, vocab=1024, seq=64)


def offloaded_state_rank(rank, world_size):
    """W=1 on NCCL: a GPT on Megatron-FSDP ZeRO-3 and its Muon chain, with and without the state
    offloaded, three steps each on the same batches: what each measured (bytes allocated between
    steps and at the step's peak, the state's bytes) and whether their weights are equal."""
    from megatron_muon import get_megatron_optimizer
    from megatron_muon.chain.model_chunks import named_main_weights
    from megatron_muon.tools.testing import (GPTShape, fsdp_gpt, init_parallel_state, lm_loss,
                                             optimizer_config)

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    init_parallel_state()
    shape = GPTShape(**OFFLOAD_SHAPE)
    found = {}
    for offload in (False, True):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        model = fsdp_gpt(shape)
        optimizer = get_megatron_optimizer(optimizer_config(
            clip_grad=0.0, optimizer_cpu_offload=offload, optimizer_offload_fraction=1.0), [model])
        for step in range(3):
            optimizer.zero_grad()
            lm_loss(model, step, 0, shape).backward()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            optimizer.step()
            torch.cuda.synchronize()
        state = sum(v.to_local().nbytes if hasattr(v, "to_local") else v.nbytes
                    for part in optimizer.chained_optimizers
                    for s in part.optimizer.state.values() for k, v in s.items() if k != "step")
        found[offload] = dict(
            between=torch.cuda.memory_allocated() - base,
            peak=torch.cuda.max_memory_allocated() - base, state=state,
            weights={n: p.to_local().cpu() for n, p in named_main_weights(model)})
        del model, optimizer
        gc.collect()
        torch.cuda.empty_cache()
    weights = [found[offload].pop("weights") for offload in (False, True)]
    return dict(same=all(torch.equal(weights[0][n], w) for n, w in weights[1].items()),
                without=found[False], offloaded=found[True])


def backward_gather_rank(rank, world_size, moment2_method=None):
    """A GPU per rank on NCCL: a GPT on Megatron-FSDP ZeRO-3 with --overlap-grad-reduce and its
    Muon chain (--optimizer adaptive_muon with `moment2_method`: its second moment's rows read
    on the gather's stream too), three clipped steps on the same batches with and without
    --muon-gather-inside-backward (the exchanges' rows sent from the reduce's stream as each
    bucket's reduce ends): whether every main weight is equal, bit for bit, and how many
    exchanges gathered ahead."""
    from fsdp_models import every_batch_that_fits_ahead
    from megatron_muon import get_megatron_optimizer
    from megatron_muon.chain.model_chunks import named_main_weights
    from megatron_muon.tools.testing import (GPTShape, fsdp_gpt, init_parallel_state, lm_loss,
                                             optimizer_config)

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    init_parallel_state()
    shape = GPTShape(layers=4, hidden=256, ffn=1024, heads=8, vocab=1024, seq=64)
    weights, ahead = [], 0
    for gather in (False, True):
        torch.manual_seed(0)
        model = fsdp_gpt(shape, overlap=True)
        with every_batch_that_fits_ahead():
            chain = get_megatron_optimizer(
                optimizer_config(clip_grad=0.05, **({} if moment2_method is None else dict(
                    optimizer="adaptive_muon", adaptive_muon_moment2_method=moment2_method))),
                [model], muon_max_exchange_bytes=1,
                muon_owner_choice="bytes", muon_gather_inside_backward=gather)
        for step in range(3):
            chain.zero_grad()
            with model.no_sync():
                pass
            lm_loss(model, step, rank, shape).backward()
            if gather:
                ahead += sum(len(muon.ahead.started) for muon in chain.muon_optimizers)
            chain.step()
        torch.cuda.synchronize()
        weights.append({n: p.to_local().cpu() for n, p in named_main_weights(model)})
        del model, chain
        gc.collect()
    return dict(same=all(torch.equal(weights[0][n], w) for n, w in weights[1].items()),
                ahead=ahead)


# Row blocks, column blocks, and 512 of a square matrix's 1024 columns a member (which applies
# the Gram matrix twice): (partition dim, shape).
TEAM_CASES = ((0, (4096, 1024)), (1, (1024, 4096)), (1, (1024, 1024)))


def team_rank(rank, world_size):
    """Two ranks on the one GPU over gloo (NCCL refuses two ranks on one GPU): a team's
    Newton-Schulz (--muon-max-team-size) on CUDA tensors at fp32 and bf16; for each case,
    whether it is megatron-core's distributed form bit for bit, its fp32 distance from the
    whole matrix's, and its bf16 one from the whole's fp32 beside bf16's own error there
    (|bf16 - fp32| of the whole matrix)."""
    from types import SimpleNamespace

    from emerging_optimizers.utils import fp32_matmul_precision
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    from megatron_muon.core.settings import tensor_parallel_muon_settings
    from megatron_muon.core.team_newton_schulz import team_orthogonalize

    torch.cuda.set_device(0)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    team, found = dist.group.WORLD, {}
    for dim, shape in TEAM_CASES:
        full = torch.randn(*shape, device="cuda",
                           generator=torch.Generator("cuda").manual_seed(0))
        part = full.chunk(world_size, dim)[rank]
        p = torch.nn.Parameter(part.clone())
        p.partition_dim = dim
        muon = TensorParallelMuon([p], pg_collection=SimpleNamespace(tp=team, gtp_remat=None),
                                  tp_mode="distributed")
        results = {}
        for precision in ("highest", "medium"):
            with fp32_matmul_precision(precision):
                ours = team_orthogonalize(part, shape, dim, team, tensor_parallel_muon_settings({}))
                results[precision] = dict(
                    ours=ours, exact=torch.equal(ours, muon.orthogonalize(p, part)),
                    whole=muon.scaled_orthogonalize_fn(full, None, None).chunk(world_size, dim)[rank])
        highest, medium = results["highest"], results["medium"]
        found[f"{dim} {shape}"] = dict(
            shape=shape, device=medium["ours"].device.type,
            exact={k: r["exact"] for k, r in results.items()},
            fp32_gap=(highest["ours"] - highest["whole"]).abs().max().item(),
            bf16_gap=(medium["ours"] - highest["whole"]).abs().max().item(),
            bf16_error=(medium["whole"] - highest["whole"]).abs().max().item())
    return found


def estimate_rank(rank, world_size):
    """The self-test's estimate on a GPU (tools/selftest.print_estimates' calls): Newton-Schulz
    timed on CUDA on Llama-8B's shapes, then its step at W=8, 32 and 128 planned from it."""
    from megatron_muon.estimate.figures import assumed, estimated_steps, newton_schulz_shapes
    from megatron_muon.estimate.model import MODELS
    from megatron_muon.estimate.parts import Rates, measure_rates
    from megatron_muon.tools.testing import init_parallel_state

    torch.cuda.set_device(0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    init_parallel_state()
    spec = MODELS["llama-8b"]
    shapes = newton_schulz_shapes(spec, 1, "blockwise")
    table = measure_rates(5, shapes, report=None)
    rates = Rates(table)
    rows = estimated_steps(spec, 8, rates, assumed(rates))
    dist.destroy_process_group()
    return dict(device=table["device"], shapes=shapes, newton_schulz=table["newton_schulz"],
                rows=rows)
