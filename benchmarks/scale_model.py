"""What Muon's optimizer step costs at scale, from the real planning code, with no model allocated.

    python benchmarks/scale_model.py [--models llama-8b llama-70b deepseek-v3 kimi-k2]
        [--world-sizes 8 64 256 1024 2048] [--tensor-parallel 1 2 4 8]
        [--rates FILE.json | --measure-rates FILE.json]
        [--bandwidth-gbps 50] [--tokens-per-step N]

For each model, W ranks and TP size (the dense models' --tensor-parallel; data parallel dp_cp
over W / TP; the MoE's experts over expert parallelism EP = gcd(W, 64) and expert data
parallelism W / EP), megatron-core builds the model on the meta device (shapes only; one TP
rank's part of each tensor-parallel weight), Megatron-FSDP's own bucketing (`_get_parameter_groups`,
`build_data_parallel_buffer_index`) gives the rows each rank's shard holds, and megatron_muon's
planning code (`row_layouts`' RowLayout, `choose_owners`, `batch_matrices`, the owner exchange's
routes) plans the step as ZeROTensorParallelMuon does at construction. From the plan: owners,
Newton-Schulz FLOPs of the busiest rank, bytes per rank, batches; from measured rates: step-time
estimates for owner (ours), allgather (every rank gathers and orthogonalizes every matrix) and
whole-matrix-per-rank (megatron-core's layer-wise placement: whole matrices spread over the ranks by
Newton-Schulz work alone, wherever their rows lie), against Adam's optimizer step and a
forward-backward estimate at each model's own tokens per step (its paper's; --tokens-per-step
sets one for all) and at NVIDIA's Kimi K2 benchmark batch, beside NVIDIA's published figure for
layer-wise Muon; our step with emerging-optimizers' SYRK Newton-Schulz (--muon-use-syrk), and with
Gram Newton-Schulz (--muon-gram-newton-schulz) beside the standard Newton-Schulz floor.
Prints a table, writes benchmarks/results/scale.json and scale.png. The assumptions are printed
with the numbers.
"""

import argparse
import dataclasses
import functools
import json
from pathlib import Path

from megatron_muon.estimate.figures import assumed, mode_figures, plan_model, planned_with_gram
from megatron_muon.estimate.model import (MAX_EXPERT_PARALLEL, MODELS, SEQUENCE_LENGTH,
                                          attention_flops_per_token, expert_parallel, is_dense,
                                          meta_model)
from megatron_muon.estimate.parts import (ELEMENT_BYTES, LATENCY_US_PER_RANK, Planned, Rates,
                                             measure_rates, planned_parts)
from megatron_muon.estimate.step_time import planned_step
from megatron_muon.plan import gram_counts
from megatron_muon.planner.param_tags import is_expert_param

RESULTS = Path(__file__).resolve().parent / "results"
# owner: ours (owners by estimated time); teams: ours with --muon-max-team-size (a matrix too
# large for one rank's share split over a team, plan/team_split.py); owner-by-bytes: byte-first
# owners (our choice before owners by time, and its fallback); whole-matrix-per-rank:
# megatron-core's layer-wise placement.
MODES = ("owner", "teams", "owner-by-bytes", "allgather", "whole-matrix-per-rank")
# --optimizer muon, and --optimizer adaptive_muon's --adaptive-muon-moment2-method values: each
# planned as ZeROTensorParallelMuon plans it (the variants table, owner mode).
VARIANTS = ("muon", "adamuon", "normuon", "namo")

# NVIDIA's published figure for Muon at the flagship's scale (developer blog, 2026-04, Megatron
# Bridge 26.02): layer-wise Muon on Kimi K2, 256 GB300 GPUs, PP4 VP4 DP64 EP64, MXFP8, Bridge's
# benchmark batch (2048 sequences of 4096 tokens): 1029 model TFLOP/s per GPU against AdamW's 1051.
NVIDIA = dict(model="kimi-k2", world=256, tokens_per_step=2048 * 4096, muon_tflops=1029,
              adam_tflops=1051)
# FP8 training (NVIDIA's runs above train in MXFP8) runs forward-backward about 1.5x as fast as
# bf16 (issue 83), while Newton-Schulz stays at the rates' precision.
FP8_SPEEDUP = 1.5
# --muon-gather-inside-backward's window, the last micro-batch's backward: Megatron-FSDP's own
# bytes in it an element of a rank's unsharded weights under ZeRO-3: the weights all-gathered
# again (bf16) and the gradients reduce-scattered (bf16: DistributedDataParallelConfig's
# grad_reduce_in_fp32 default).
FSDP_BACKWARD_BYTES = 2 + 2
# The memory column: bytes per element of each rank's shard at rest (Megatron-FSDP ZeRO-3 with
# bf16 compute weights: the bf16 weight and its fp32 main weight, an fp32 gradient; Adam's two fp32
# moments, Muon's one fp32 momentum), and the working-memory budget that keeps Muon's transient
# under this share of an 80 GB GPU.
WEIGHT_BYTES, GRADIENT_BYTES, ADAM_STATE_BYTES, MUON_STATE_BYTES = 2 + 4, 4, 8, 4
GPU_BYTES, TRANSIENT_SHARE = 80e9, 0.05
# --optimizer-cpu-offload: the host link's rate each way, GB/s (both ways at once): PCIe Gen5 x16
# (64 GB/s raw, about 55 reached by pinned copies) and NVLink-C2C (GH200/GB200: 450 each way).
# Adam's part (core/state_offload.offload_between_steps): its moments come to the device whole
# for its step and go back (ADAM_STATE_BYTES an element each way).
HOST_LINKS_GBPS = {"PCIe": 55.0, "C2C": 450.0}


def with_second_moment(matrices, variant: str):
    """`matrices` as ZeROTensorParallelAdaptiveMuon plans them under --adaptive-muon-moment2-method
    `variant` (SecondMoment.planned, as GroupPlanner._with_second_moment); "muon": as they
    are."""
    from megatron_muon.core.second_moment import SECOND_MOMENTS

    if variant == "muon":
        return matrices
    return [SECOND_MOMENTS[variant].planned(m) for m in matrices]



def fwd_bwd_tflops(rates: Rates, args) -> float:
    """Forward-backward's model TFLOP/s a rank: --fwd-bwd-tflops where given, else the matmul
    rate x --fwd-bwd-efficiency, FP8_SPEEDUP times that with --fwd-bwd-fp8."""
    if args.fwd_bwd_tflops:
        return args.fwd_bwd_tflops
    return rates.matmul_tflops * args.fwd_bwd_efficiency * (FP8_SPEEDUP if args.fwd_bwd_fp8 else 1)


def last_backward(spec, planned, model, rates: Rates, args,
                  micro_batch_tokens: int) -> tuple[float, float]:
    """Where --muon-gather-inside-backward's gathers run (step_time.in_order's `backward`): the
    last micro-batch's backward on a rank (2/3 of the forward-backward of `micro_batch_tokens` a
    data-parallel rank), and the share of the network Megatron-FSDP's own traffic leaves free in
    it (FSDP_BACKWARD_BYTES an element of the rank's unsharded weights, `model`, each all-gather
    and reduce-scatter a ring over its group: dp_cp for the dense weights, expert data
    parallelism for the experts'), 0 where that traffic takes the whole backward."""
    flops = (6 * planned.active + attention_flops_per_token(spec)) * micro_batch_tokens
    seconds = 2 / 3 * flops / planned.tensor_parallel / (fwd_bwd_tflops(rates, args) * 1e12)
    moved = 0.0
    for name, p in model.named_parameters():
        group = planned.ranks // planned.ep if is_expert_param(name, p) else planned.ranks
        moved += p.numel() * FSDP_BACKWARD_BYTES * (group - 1) / group
    return seconds, max(0.0, 1 - moved / (args.bandwidth_gbps * 1e9) / seconds)


def estimate(name: str, world: int, model, rates: Rates, args, tensor_parallel: int = 1) -> dict:
    """One model on `world` ranks, `tensor_parallel` of them a model's TP group (`model`: one TP
    rank's part, meta_model), data parallel over the rest: the plan's figures
    (estimate.figures.plan_model) and the step-time estimates of every mode against Adam's
    step and forward-backward, and ours with --muon-gather-inside-backward (`gather_inside`:
    planned for it, its gathers ahead in the last micro-batch's backward, last_backward, at
    each of --micro-batch-tokens)."""
    spec = MODELS[name]
    planned = plan_model(spec, world, model, rates, args, tensor_parallel)
    parts, ranks = planned.parts, planned.ranks
    result_memory = memory_figures(parts, ranks, planned.all_elements, planned.muon_elements,
                                   planned.adam_elements)
    adam_step = planned.adam_step
    tokens = args.tokens_per_step or spec.tokens_per_step

    def fwd_bwd_seconds(tokens_per_step):
        flops = 6 * planned.active + attention_flops_per_token(spec)
        return flops * tokens_per_step / world / (fwd_bwd_tflops(rates, args) * 1e12)

    fwd_bwd, fwd_bwd_at_nvidia = fwd_bwd_seconds(tokens), fwd_bwd_seconds(NVIDIA["tokens_per_step"])
    result = dict(model=name, world=world, tensor_parallel=tensor_parallel, data_parallel=ranks,
                  expert_parallel=planned.ep, active_params=planned.active,
                  tokens_per_step=tokens, fwd_bwd_ms_at_nvidia_batch=fwd_bwd_at_nvidia * 1e3,
                  muon_matrices=sum(len(part.matrices) for part, _ in parts),
                  layout_seconds=planned.layout_seconds,
                  plan_seconds=sum(part.plan_seconds for part, _ in parts) + (
                      parts.representative()[1].plan_seconds if parts.beside else 0.0),
                  owners=sum(len(set(part.owners["owner"])) for part in parts.representative()),
                  batches=sum(len(part.batches) for part, _ in parts),
                  exchanges=sum(len(part.exchanges) for part in parts.representative()),
                  interleaved=parts.beside is not None,
                  teams=team_figures(planned.team_parts),
                  adam_step_ms=adam_step * 1e3, fwd_bwd_ms=fwd_bwd * 1e3,
                  ns_floor_ms=planned.ideal / (rates.matmul_tflops * 1e12) * 1e3,
                  memory_gb=result_memory, modes={})
    def with_overheads(figures: dict) -> dict:
        step, syrk_step, latency = (figures[key] * 1e-3 for key in ("step_ms", "syrk_step_ms",
                                                                    "latency_ms"))
        return dict(
            figures, overhead=(step - adam_step) / (fwd_bwd + adam_step),
            overhead_with_latency=(step + latency - adam_step) / (fwd_bwd + adam_step),
            syrk_overhead=(syrk_step - adam_step) / (fwd_bwd + adam_step),
            overhead_at_nvidia_batch=(step - adam_step) / (fwd_bwd_at_nvidia + adam_step))

    for mode in MODES:
        result["modes"][mode] = with_overheads(mode_figures(planned, mode, args))
    inside = dataclasses.replace(planned, parts=planned_parts(
        planned.dense, planned.expert, ranks, planned.ep, planned.cost, ahead=True))
    most = inside.parts.most_ahead()
    packed = dict(matrices_ahead=sum(len(part.early) for part in most),
                  matrices=sum(len(part.matrices) for part in most),
                  exchanges_ahead=sum(part.ahead for part in most),
                  exchanges=sum(len(part.exchanges) for part in most))
    result["gather_inside"] = []
    for micro_batch_tokens in args.micro_batch_tokens:
        window = last_backward(spec, planned, model, rates, args, micro_batch_tokens)
        result["gather_inside"].append(dict(
            with_overheads(mode_figures(inside, "owner", args, window)), **packed,
            micro_batch_tokens=micro_batch_tokens, backward_ms=window[0] * 1e3,
            free_share=window[1]))
    gram = planned_with_gram(planned, args)
    counts = gram_counts(m for part, _ in gram.parts for m in part.matrices)
    result["gram"] = dict(with_overheads(mode_figures(gram, "owner", args)),
                          ns_floor_ms=gram.ideal / (rates.matmul_tflops * 1e12) * 1e3,
                          matrices_gram=counts[0], newton_schulz_matrices=sum(counts))
    result["variants"] = {
        variant: variant_figures(parts if variant == "muon" else planned_parts(
            with_second_moment(planned.dense, variant),
            with_second_moment(planned.expert, variant), ranks, planned.ep, planned.cost,
            interleave=False), planned.elementwise, adam_step, fwd_bwd, planned.cost, args, ranks)
        for variant in VARIANTS}
    return result


def team_figures(parts) -> dict:
    """The teams a plan with --muon-max-team-size makes: how many matrices each part splits, the
    largest team, and the process groups created at construction (one per distinct team, here
    in one group of each part: every expert-parallel rank's group makes its own)."""
    from megatron_muon.plan import team_members

    members = [team_members(part.matrices, part.owners["owner"])
               for part in parts.representative()]
    return dict(split=sum(len(teams) for teams in members),
                largest=max([1] + [len(ranks) for teams in members for ranks in teams.values()]),
                groups=sum(len(set(teams.values())) for teams in members))


def variant_figures(parts: Planned, elementwise: float, adam_step: float, fwd_bwd: float, cost,
                    args, ranks: int) -> dict:
    """Our step (owner mode) for one variant's plan: exchanges, collectives and their latency,
    the step, its overhead with latency, and the most working memory a rank holds (GB)."""
    planned = planned_step(parts, "owner", cost, args, ranks)
    step, collectives, latency = (elementwise + planned["seconds"], planned["collectives"],
                                  planned["latency"])
    working = max(parts.owner_working())
    shown = parts.representative()
    return dict(exchanges=sum(len(part.exchanges) for part in shown),
                fewest_exchanges=sum(part.fewest_exchanges() for part in shown),
                collectives=collectives,
                latency_ms=latency * 1e3, step_ms=step * 1e3, working_gb=working / 1e9,
                overhead_with_latency=(step + latency - adam_step) / (fwd_bwd + adam_step))


def memory_figures(parts, world, all_elements, muon_elements, adam_elements) -> dict:
    """GB per rank (the largest rank's of each figure): at rest, and Muon's working memory as
    the plan counts it (plan.working_memory: two exchanges in flight) with the default budget
    (Planned.owner_working: the parts' sum where they run interleaved) and with the one that keeps it
    under TRANSIENT_SHARE of an 80 GB GPU (shown with the parts one after the other: interleaved,
    they would hold both within it too); the most one matrix exchanged alone holds, which no
    budget goes below; with
    --optimizer-cpu-offload, the most state on the device at once, the bytes copied each way per
    step and their time over each host link."""
    from megatron_muon.plan import (OwnedBatches, batch_bytes, batch_matrices, largest_alone,
                                    offload_figures, packed_plan, working_memory)

    budget = int(TRANSIENT_SHARE * GPU_BYTES)
    working, at_budget, alone = parts.owner_working(), [0] * world, 0
    for part, rank_in_part in parts:
        owners = part.owners["owner"]
        batches = batch_matrices(part.matrices, batch_bytes(part.matrices, ELEMENT_BYTES, budget),
                                 ELEMENT_BYTES)
        by_budget = working_memory(part.matrices, owners, packed_plan(
            part.matrices, OwnedBatches(owners, batches), ELEMENT_BYTES, budget, None).exchanges,
            ELEMENT_BYTES)
        for r in range(world):
            at_budget[r] = max(at_budget[r], by_budget[rank_in_part(r)])
        alone = max(alone, largest_alone(part.matrices, owners, ELEMENT_BYTES))
    muon_state = [m * MUON_STATE_BYTES + a * ADAM_STATE_BYTES
                  for m, a in zip(muon_elements, adam_elements)]
    # --optimizer-cpu-offload: Muon's state streamed exchange by exchange; Adam's moments on
    # the device whole for Adam's step, which runs after Muon's.
    offload = offload_figures([(part.matrices, part.offloaded_exchanges(),
                                [rank_in_part(r) for r in range(world)])
                               for part, rank_in_part in parts], ELEMENT_BYTES)
    each_way = max(f.host + a * ADAM_STATE_BYTES for f, a in zip(offload, adam_elements))
    offloaded_peak = max(f.resident + max(f.streamed, a * ADAM_STATE_BYTES)
                         for f, a in zip(offload, adam_elements))
    saved = [e * ADAM_STATE_BYTES - s for e, s in zip(all_elements, muon_state)]
    # A train step peaks at rest + the larger of what forward-backward adds (activations,
    # ZeRO-3's gathered weights) and what the optimizer step adds (Adam's: taken as 0). Muon's
    # peak is at most Adam's where forward-backward adds at least its working memory less the
    # state it saves, on every rank.
    return dict(weights=max(all_elements) * WEIGHT_BYTES / 1e9,
                gradients=max(all_elements) * GRADIENT_BYTES / 1e9,
                adam_state=max(all_elements) * ADAM_STATE_BYTES / 1e9,
                muon_state=max(muon_state) / 1e9,
                muon_working=max(working) / 1e9, muon_working_at_budget=max(at_budget) / 1e9,
                budget=budget / 1e9, largest_alone=alone / 1e9,
                break_even=max(0, max(w - s for w, s in zip(working, saved))) / 1e9,
                offloaded_state=offloaded_peak / 1e9,
                offload_each_way=each_way / 1e9,
                **{f"offload_ms_{link}": each_way / (gbps * 1e9) * 1e3
                   for link, gbps in HOST_LINKS_GBPS.items()})


def _matmul_dtype(rates: Rates) -> str:
    return "bf16" if rates.newton_schulz_precision == "medium" else "fp32"


def assumptions(rates: Rates, args) -> list[str]:
    return [
        f"rates: {rates.device}, measured {rates.measured}"
        + (f" ({rates.table['source']})" if "source" in rates.table else "")
        + f"; {_matmul_dtype(rates)} matmul {rates.matmul_tflops:.1f} TFLOP/s; Adam "
        f"{rates.adam_ns_per_element:.4f} "
        f"ns/element; Muon elementwise {rates.muon_elementwise_ns_per_element:.4f} ns/element",
        f"network: {args.bandwidth_gbps:g} GB/s per rank, each way; a rank's bytes in one "
        "collective move at that rate, the larger of in and out (full duplex)",
        "ZeRO-3 (optim_grads_params), PP = CP = 1; W ranks, TP of them a tensor-parallel group "
        "(each row's TP; the dense models at TP = " + ", ".join(map(str, args.tensor_parallel))
        + ", the MoE models at TP = 1), data parallel over W / TP; a TP rank plans and steps its "
        "TP-local matrices (megatron-core's partition dims) as its TP peers do theirs (under "
        "--muon-tp-mode blockwise each a matrix of its own: batched, and split by teams, as at "
        "TP = 1); TP's own communication in forward-backward left out; the MoE's "
        f"experts over EP = gcd(W, {MAX_EXPERT_PARALLEL}), expert data parallelism W / EP",
        "fp32 main weights and updates (4 bytes/element); Newton-Schulz: "
        f"{args.ns_steps} steps, QKV split (Megatron's defaults), at --muon-fp32-matmul-prec "
        f"{rates.newton_schulz_precision} ({_matmul_dtype(rates)} matmuls), --muon-tp-mode "
        f"{args.muon_tp_mode}",
        "Muon step = the slowest rank's elementwise step, plus the owner step charged in the "
        "order the code runs it (estimate.step_time: the step's own drivers, run_overlapped and "
        "exchange_rounds, give the order): each exchange's gather all-to-all, its owners' "
        "Newton-Schulz (teams' all-reduces inside it) once the gather has ended, its scatter, "
        "the rows applied once the scatter has ended; two exchanges in flight (exchange k + 1's "
        "gather beside exchange k's Newton-Schulz, exchange k's scatter ended before k + 2's "
        "gather); a rank's all-to-alls one after another, each ending with its slowest rank "
        "(each rank's bytes in one direction, the larger of in and out, at the bandwidth); the "
        "dense part (over dp_cp) and the experts' (over expert data parallelism) one after the "
        "other, or, in our owner modes where they are planned together (planner.interleaving: "
        "the expert groups' owners counting each rank's dense load), in rounds, each stage "
        "ending with the slowest rank of every group (the variants table plans the parts "
        "apart); 'G', 'NS', 'S path ms': the gathers', Newton-Schulz's and the scatters' "
        "seconds on the step's critical path; 'NS ms', 'net ms': the most a rank spends in "
        "Newton-Schulz and moving bytes; 'lat ms' and "
        "'+ latency': each collective's latency besides "
        f"({args.latency_us_per_rank:g} us per rank of its group: an all-to-all's gather and "
        "scatter per exchange, an all-gather per matrix in allgather mode; nccl-tests' "
        "alltoall_perf at 128 ranks over sockets, NVIDIA/nccl-tests#78: an upper figure)",
        "teams (--muon-max-team-size W, plan/team_split.py): a matrix too large for the step split "
        "over a team along its long side, sized and placed by seconds with its all-reduces "
        "weighed (each member: its share of X X^T and B X and all of A A, or, with its share "
        "shorter than the Gram side, 6 g^2 l with the Gram matrix applied twice; "
        f"newton_schulz_tp's norm and {args.ns_steps} Gram all-reduces, {args.gram_bytes} "
        "bytes an element, each with its k ranks' latency); a team on as few nodes as hold it "
        f"({args.gpus_per_node} ranks a node, megatron-core's rank order: a TP rank's dp_cp "
        "ranks TP apart, an expert group's EP apart), its all-reduces in two tiers "
        "(plan.tiered_seconds: a ring inside each node at "
        f"{rates.table.get('node_all_reduce_gbps', args.bandwidth_gbps):g} GB/s, then one "
        "between nodes over each member's share at the network's rate); the busiest rank's "
        "FLOPs count each member's repeated A A where it forms it; 'ideal' is the whole "
        "matrices' FLOPs over W, and 'NS floor ms' those FLOPs at the matmul rate (the standard "
        "Newton-Schulz spread perfectly); the optimizer sizes them alike with its measured "
        "rates (no latency; inside a node at the rate it measures over its group)",
        "Adam step = Adam's elementwise step over each rank's shard of all params (memory-bound, "
        "no communication)",
        "--optimizer-cpu-offload (plan.offload_figures): Muon's state streamed to the device "
        "exchange by exchange, two in flight, at the default budget; Adam's moments to the "
        "device whole for its step (offload_between_steps); each way at "
        + ", ".join(f"{link} {gbps:g} GB/s" for link, gbps in HOST_LINKS_GBPS.items()),
        "forward-backward = (6 x active params (without the embedding lookup) + core "
        "attention's FLOPs (estimate.model.attention_flops_per_token: causal, as "
        "num_floating_point_operations counts them)) a token x tokens per step, in sequences "
        f"of {SEQUENCE_LENGTH}, / W / {fwd_bwd_tflops(rates, args):.4g} TFLOP/s ("
        + ("--fwd-bwd-tflops" if args.fwd_bwd_tflops else
           f"matmul rate x {args.fwd_bwd_efficiency:g}"
           + (f" x {FP8_SPEEDUP:g} for FP8 (--fwd-bwd-fp8)" if args.fwd_bwd_fp8 else ""))
        + "); tokens per step "
        + (f"{args.tokens_per_step} for every model" if args.tokens_per_step else
           "each model's own: " + ", ".join(f"{name} {MODELS[name][2] / 1e6:.1f}M"
                                           for name in args.models)
           + " (DeepSeek-V3's and Kimi K2's reports; 4M for the Llamas)"),
        "overhead = (Muon step - Adam step) / (forward-backward + Adam step): the extra time of "
        "a training step, as NVIDIA's figure (1051 / 1029 model TFLOP/s - 1 = 2.1%); "
        f"'@NVIDIA batch' at its benchmark's {NVIDIA['tokens_per_step'] / 1e6:.1f}M tokens",
        "--muon-gather-inside-backward ('gather_inside'): ours planned for it (the batches "
        "whose owners' held matrices, old momentum beside gradient, fit what Muon's state saves "
        "them, taken in the order their gradients become final, first, in exchanges of their "
        "own); each such exchange's gather carries twice the "
        "update's columns and starts once the last of its matrices' gradients is reduced in the "
        "last micro-batch's backward (its matrices taken as spread evenly over it in the "
        "model's order, backward running from the last layer): 2/3 of the forward-backward of "
        + " or ".join(map(str, args.micro_batch_tokens))
        + " tokens a data-parallel rank (--micro-batch-tokens), beside "
        f"Megatron-FSDP's own ZeRO-3 traffic there ({FSDP_BACKWARD_BYTES} bytes an element of "
        "a rank's unsharded weights: the weights all-gathered again and the gradients "
        "reduce-scattered, bf16, each a ring over its group), at the share of the network that "
        "traffic leaves free, the whole network after backward's end; only what runs after "
        "backward's end is on the step; its scatter and the other exchanges as at the step",
        "SYRK: our step with --muon-use-syrk (emerging-optimizers' Triton kernel): each matrix "
        "in its own call (the kernel takes no batch), at the plain call's measured rate on the "
        "FLOPs it keeps ((3m^2 n + m^3) / (4m^2 n + 2m^3) of them: X X^T and A A at half); the "
        "same owners",
        f"memory per rank, GB: weights {WEIGHT_BYTES} bytes/element (bf16 compute weight + fp32 "
        f"main weight), gradients {GRADIENT_BYTES} (fp32), state Adam {ADAM_STATE_BYTES} (two "
        f"fp32 moments), Muon {MUON_STATE_BYTES} per Muon element (one fp32 momentum) and Adam's "
        f"on the rest; Muon's working memory as the plan counts it (plan.working_memory: update "
        f"rows, exchange buffers, assembled matrices, results, fp32 Newton-Schulz's 3mn + 2m^2, "
        f"two exchanges in flight) at --muon-max-exchange-bytes' default and at "
        f"{TRANSIENT_SHARE:.0%} of an {GPU_BYTES / 1e9:g} GB GPU; Adam's working memory taken as "
        "0 (fused multi-tensor Adam works in small chunks); activations, ZeRO-3's gathered "
        "weights and communication buffers not counted (the same for both)",
    ]


def _line(values, columns) -> str:
    """One table row: each value at its column's (name, width, alignment)."""
    return " ".join(f"{v:{align}{width}}" for v, (_, width, align) in zip(values, columns))


def print_table(results, notes):
    print("\nAssumptions:")
    for note in notes:
        print(f"  - {note}")
    columns = [("model", 12, "<"), ("W", 5, ">"), ("TP", 3, ">"), ("EP", 3, ">"),
               ("tokens", 7, ">"),
               ("plan s", 7, ">"), ("owners", 7, ">"), ("batches", 8, ">"), ("exch", 5, ">"),
               ("mode", 22, "<"), ("busiest NS GF", 14, ">"), ("ideal GF", 10, ">"),
               ("x ideal", 8, ">"), ("NS floor ms", 12, ">"),
               ("max in MB", 10, ">"), ("NS ms", 9, ">"), ("net ms", 9, ">"),
               ("G path ms", 10, ">"), ("NS path ms", 11, ">"), ("S path ms", 10, ">"),
               ("coll", 5, ">"),
               ("lat ms", 8, ">"), ("step ms", 9, ">"), ("SYRK ms", 9, ">"),
               ("Adam ms", 9, ">"), ("fwd-bwd ms", 11, ">"), ("overhead", 9, ">"),
               ("+ latency", 10, ">"),
               ("SYRK", 7, ">"), ("@NVIDIA batch", 14, ">")]

    line = functools.partial(_line, columns=columns)
    header = line([name for name, _, _ in columns])
    print("\n" + header + "\n" + "-" * len(header))
    for r in results:
        for mode, m in r["modes"].items():
            print(line([r["model"], r["world"], r["tensor_parallel"], r["expert_parallel"],
                        f"{r['tokens_per_step'] / 1e6:.1f}M", f"{r['plan_seconds']:.2f}",
                        r["owners"], r["batches"], r["exchanges"], mode,
                        f"{m['busiest_ns_gflop']:.0f}", f"{m['ideal_ns_gflop']:.0f}",
                        f"{m['busiest_over_ideal']:.2f}", f"{r['ns_floor_ms']:.4g}",
                        f"{m['max_received_mb']:.0f}", f"{m['ns_ms']:.4g}",
                        f"{m['network_ms']:.4g}", f"{m['path_gather_ms']:.4g}",
                        f"{m['path_newton_schulz_ms']:.4g}", f"{m['path_scatter_ms']:.4g}",
                        m["collectives"], f"{m['latency_ms']:.4g}",
                        f"{m['step_ms']:.4g}",
                        f"{m['syrk_step_ms']:.4g}", f"{r['adam_step_ms']:.4g}",
                        f"{r['fwd_bwd_ms']:.4g}", f"{m['overhead']:.2%}",
                        f"{m['overhead_with_latency']:.2%}",
                        f"{m['syrk_overhead']:.2%}", f"{m['overhead_at_nvidia_batch']:.2%}"]))


def print_beside_nvidia(results, rates: Rates):
    """Muon's share of the step where NVIDIA published one, beside it, saying what differs."""
    published = NVIDIA["adam_tflops"] / NVIDIA["muon_tflops"] - 1
    rows = [r for r in results if r["model"] == NVIDIA["model"] and r["world"] == NVIDIA["world"]]
    print(f"\nMuon's share of a training step beside NVIDIA's published {published:.1%} "
          "(layer-wise Muon, Kimi K2, 256 GB300 GPUs, PP4 VP4 DP64 EP64, MXFP8, "
          f"{NVIDIA['tokens_per_step'] / 1e6:.1f}M tokens per step):")
    for r in rows:
        ours, layer_wise = r["modes"]["owner"], r["modes"]["whole-matrix-per-rank"]
        print(f"  here, {r['model']} at W={r['world']} (EP {r['expert_parallel']}, ZeRO-3, no "
              f"pipeline stages, {rates.device} rates, {_matmul_dtype(rates)} Newton-Schulz): "
              f"ours {ours['overhead']:.2%} at its {r['tokens_per_step'] / 1e6:.1f}M tokens, "
              f"{ours['overhead_at_nvidia_batch']:.2%} at NVIDIA's batch, with SYRK "
              f"{ours['syrk_overhead']:.2%}; the layer-wise placement of whole matrices "
              f"{layer_wise['overhead']:.2%} / {layer_wise['overhead_at_nvidia_batch']:.2%}")


def print_gather_inside(results):
    print("\nOurs with --muon-gather-inside-backward beside ours (owner mode): its gathers in the "
          "last micro-batch's backward, beside Megatron-FSDP's ZeRO-3 traffic; G / NS / S: the "
          "gathers', Newton-Schulz's and the scatters' ms on the critical path after backward:")
    columns = [("model", 12, "<"), ("W", 5, ">"), ("TP", 3, ">"), ("ahead", 13, ">"),
               ("mb tokens", 10, ">"), ("bwd ms", 8, ">"), ("free", 6, ">"),
               ("G / NS / S ms", 22, ">"), ("step ms", 8, ">"), ("owner step", 11, ">"),
               ("overhead", 9, ">"), ("owner", 7, ">")]
    print(_line([name for name, _, _ in columns], columns))
    for r in results:
        ours = r["modes"]["owner"]
        for inside in r["gather_inside"]:
            path = " / ".join(f"{inside[f'path_{stage}_ms']:.1f}"
                              for stage in ("gather", "newton_schulz", "scatter"))
            print(_line([r["model"], r["world"], r["tensor_parallel"],
                         f"{inside['matrices_ahead']}/{inside['matrices']} in "
                         f"{inside['exchanges_ahead']}/{inside['exchanges']}",
                         inside["micro_batch_tokens"], f"{inside['backward_ms']:.0f}",
                         f"{inside['free_share']:.0%}", path, f"{inside['step_ms']:.1f}",
                         f"{ours['step_ms']:.1f}", f"{inside['overhead']:.2%}",
                         f"{ours['overhead']:.2%}"], columns))


def print_gram(results):
    print("\nOurs with --muon-gram-newton-schulz beside ours (owner mode), and the Newton-Schulz "
          "floors (total FLOPs / W at the matmul rate), standard's and Gram's; overheads at each "
          "model's own batch / NVIDIA's:")
    columns = [("model", 12, "<"), ("W", 5, ">"), ("TP", 3, ">"), ("Gram on", 10, ">"),
               ("floor ms", 9, ">"), ("Gram floor", 11, ">"), ("step ms", 8, ">"),
               ("Gram step", 10, ">"), ("overhead", 16, ">"), ("Gram overhead", 16, ">")]
    print(_line([name for name, _, _ in columns], columns))
    for r in results:
        ours, gram = r["modes"]["owner"], r["gram"]
        print(_line([r["model"], r["world"], r["tensor_parallel"],
                     f"{gram['matrices_gram']}/{gram['newton_schulz_matrices']}",
                     f"{r['ns_floor_ms']:.1f}",
                     f"{gram['ns_floor_ms']:.1f}", f"{ours['step_ms']:.1f}",
                     f"{gram['step_ms']:.1f}",
                     f"{ours['overhead']:.2%} / {ours['overhead_at_nvidia_batch']:.2%}",
                     f"{gram['overhead']:.2%} / {gram['overhead_at_nvidia_batch']:.2%}"],
                    columns))


def print_variants_table(results):
    columns = [("model", 12, "<"), ("W", 5, ">"), ("TP", 3, ">"), ("variant", 8, "<"),
               ("exch", 5, ">"),
               ("at least", 9, ">"), ("coll", 5, ">"), ("lat ms", 8, ">"), ("step ms", 9, ">"),
               ("work GB", 8, ">"), ("overhead + latency", 19, ">")]
    line = functools.partial(_line, columns=columns)
    header = line([name for name, _, _ in columns])
    print("\nThe Muon family, ours (owner mode), each planned as it runs (its second moment's "
          "columns travelling and held; 'at least': the exchanges its budgets allow at fewest, "
          "plan.fewest_exchanges; latency counted; the variants' elementwise second moment "
          "taken at Muon's elementwise rate):")
    print(header + "\n" + "-" * len(header))
    for r in results:
        for variant, v in r["variants"].items():
            print(line([r["model"], r["world"], r["tensor_parallel"], variant, v["exchanges"],
                        v["fewest_exchanges"],
                        v["collectives"],
                        f"{v['latency_ms']:.4g}", f"{v['step_ms']:.4g}", f"{v['working_gb']:.2f}",
                        f"{v['overhead_with_latency']:.2%}"]))


def print_memory_table(results):
    columns = [("model", 12, "<"), ("W", 5, ">"), ("TP", 3, ">"), ("EP", 3, ">"),
               ("weights", 8, ">"),
               ("grads", 7, ">"), ("Adam state", 11, ">"), ("Muon state", 11, ">"),
               ("Muon work", 10, ">"), ("at 5% budget", 13, ">"), ("one alone", 10, ">"),
               ("Muon <= Adam if fwd-bwd adds", 29, ">"), ("offloaded: state", 17, ">"),
               ("each way", 9, ">")] + [(f"{link} ms", 9, ">") for link in HOST_LINKS_GBPS]

    line = functools.partial(_line, columns=columns)
    header = line([name for name, _, _ in columns])
    print("\nMemory per rank, GB (the largest rank's of each figure; activations not counted; "
          "offloaded: the most state on the device at once with --optimizer-cpu-offload, the "
          "GB copied each way per step, and its ms at each host link's rate):")
    print(header + "\n" + "-" * len(header))
    for r in results:
        m = r["memory_gb"]
        print(line([r["model"], r["world"], r["tensor_parallel"], r["expert_parallel"]] + [
            f"{m[key]:.2f}" for key in (
            "weights", "gradients", "adam_state", "muon_state", "muon_working",
            "muon_working_at_budget", "largest_alone", "break_even", "offloaded_state",
            "offload_each_way")] + [f"{m[f'offload_ms_{link}']:.1f}" for link in HOST_LINKS_GBPS]))


def plot(results, path, caption):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["model"], r["tensor_parallel"]) for r in results))
    columns = min(4, len(panels))
    fig, axes = plt.subplots(-(-len(panels) // columns), columns,
                             figsize=(5 * columns, 4.2 * -(-len(panels) // columns)),
                             squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (model, tensor_parallel) in zip(axes.flat, panels):
        rows = [r for r in results
                if (r["model"], r["tensor_parallel"]) == (model, tensor_parallel)]
        for mode in MODES:
            ax.plot([r["world"] for r in rows], [100 * r["modes"][mode]["overhead"] for r in rows],
                    marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks W (data parallel W / TP)")
        ax.set_ylabel("Muon's extra step time, % of Adam's training step")
        ax.set_title(f"{model}, TP = {tensor_parallel}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(caption, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def command_line() -> argparse.ArgumentParser:
    """The scale model's command line (`make scale SCALE_ARGS="..."`)."""
    from megatron.core.optimizer import OptimizerConfig

    from megatron_muon.core.settings import TP_MODES

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[8, 64, 256, 1024, 2048])
    parser.add_argument("--tensor-parallel", nargs="+", type=int, default=[1],
                        help="TP sizes for the dense models (each W a multiple of it; the MoE "
                        "models at TP = 1, their experts at expert TP = 1)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--rates", type=Path, help="a JSON of rates (e.g. measured on a GPU with "
                        "--measure-rates); default: measure them here first")
    source.add_argument("--measure-rates", type=Path, help="measure the rates here, write them "
                        "to this JSON, and go on with them")
    parser.add_argument("--bandwidth-gbps", type=float, default=None,
                        help="per rank, each way (default: the rates file's all_to_all_gbps, "
                        "measured by a run, else 50)")
    parser.add_argument("--gpus-per-node", type=int, default=8,
                        help="ranks a node (teams' all-reduces inside one at the rates file's "
                        "node_all_reduce_gbps)")
    parser.add_argument("--latency-us-per-rank", type=float, default=LATENCY_US_PER_RANK,
                        help="a collective's latency per rank of its group, microseconds")
    parser.add_argument("--tokens-per-step", type=int, default=None,
                        help="for every model (default: each model's own, from its report)")
    parser.add_argument("--fwd-bwd-efficiency", type=float, default=0.5,
                        help="forward-backward's share of the measured matmul rate")
    rate = parser.add_mutually_exclusive_group()
    rate.add_argument("--fwd-bwd-fp8", action="store_true",
                      help=f"forward-backward in FP8: {FP8_SPEEDUP:g} x its bf16 rate "
                      "(Newton-Schulz at the rates' precision)")
    rate.add_argument("--fwd-bwd-tflops", type=float, default=None,
                      help="forward-backward's model TFLOP/s a rank, in place of the matmul rate "
                      "x --fwd-bwd-efficiency")
    parser.add_argument("--micro-batch-tokens", type=int, nargs="+",
                        default=[SEQUENCE_LENGTH, 4 * SEQUENCE_LENGTH],
                        help="tokens a data-parallel rank's micro-batch (--micro-batch-size x "
                        "--seq-length), each estimated: the last one's backward is where "
                        "--muon-gather-inside-backward's gathers run")
    parser.add_argument("--ns-steps", type=int, default=5)
    parser.add_argument("--muon-tp-mode", choices=TP_MODES, default=OptimizerConfig.muon_tp_mode,
                        help="as Megatron's flag (default: the installed megatron-core's)")
    return parser


def main():
    args = command_line().parse_args()

    if args.rates:
        table = json.loads(args.rates.read_text())
    else:
        print("measuring rates on this machine ...", flush=True)
        table = measure_rates(args.ns_steps, report=functools.partial(print, flush=True))
        if args.measure_rates:
            args.measure_rates.write_text(json.dumps(table, indent=1))
    rates = Rates(table)
    vars(args).update(vars(assumed(rates, args.ns_steps, args.muon_tp_mode, args.bandwidth_gbps,
                                   args.gpus_per_node, args.latency_us_per_rank)))

    import torch.distributed as dist

    from megatron_muon.tools.testing import init_parallel_state

    # megatron-core builds models under its parallel state: one process, TP = EP = 1.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    init_parallel_state()
    results = []
    for name, tensor_parallel in ((name, tp) for name in args.models
                                  for tp in (args.tensor_parallel if is_dense(MODELS[name]) else [1])):
        models = {}
        for world in (w for w in args.world_sizes if w % tensor_parallel == 0):
            ep = expert_parallel(MODELS[name], world // tensor_parallel)
            if ep not in models:
                models[ep] = meta_model(MODELS[name], ep, tensor_parallel)
            results.append(estimate(name, world, models[ep], rates, args, tensor_parallel))
            r = results[-1]
            print(f"planned {name} at W={world}, TP={tensor_parallel}: {r['muon_matrices']} "
                  "matrices, Megatron-FSDP "
                  f"layout {r['layout_seconds']:.2f} s, megatron_muon plan "
                  f"{r['plan_seconds']:.2f} s; with teams {r['teams']['split']} matrices split, "
                  f"the largest team {r['teams']['largest']} ranks", flush=True)
    notes = assumptions(rates, args)
    print_table(results, notes)
    print_beside_nvidia(results, rates)
    print_gather_inside(results)
    print_gram(results)
    print_variants_table(results)
    print_memory_table(results)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "scale.json").write_text(json.dumps(dict(assumptions=notes, rates=table,
                                                        results=results), indent=1))
    plot(results, RESULTS / "scale.png", f"rates: {rates.device} ({rates.measured}); network "
         f"{args.bandwidth_gbps:g} GB/s per rank; tokens per step: "
         f"{args.tokens_per_step or 'each model its own'}; "
         "estimates, not measurements (assumptions: scale.json)")
    print(f"\nwrote {RESULTS / 'scale.json'} and {RESULTS / 'scale.png'}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
