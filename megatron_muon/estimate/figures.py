"""What Muon's step costs one model on W ranks, from the plan ZeROTensorParallelMuon makes at
construction and rates measured on a device: the figures `make scale` tabulates
(benchmarks/scale_model.py) and the self-test prints for the user's model (estimated_steps)."""

import dataclasses
import time
from types import SimpleNamespace

from ..plan import GramSchedule, team_step_cost
from ..planner.param_tags import is_expert_param, is_scalar_param
from .model import ModelSpec, expert_parallel, fsdp_rows, meta_model, muon_matrices, with_gram
from .parts import (LATENCY_US_PER_RANK, Planned, Rates, nodes_in_rank_order, planned_parts,
                    step_cost)
from .step_time import planned_step


def assumed(rates: Rates, ns_steps: int = 5, muon_tp_mode: str | None = None,
            bandwidth_gbps: float | None = None, gpus_per_node: int = 8,
            latency_us_per_rank: float = LATENCY_US_PER_RANK) -> SimpleNamespace:
    """What the estimate assumes beside the rates (the scale model's flags): the network's GB/s
    per rank (default: the rates' all_to_all_gbps, else 50), a Gram element's bytes in teams'
    all-reduces (bf16 at precision medium), --muon-tp-mode (default: megatron-core's)."""
    from megatron.core.optimizer import OptimizerConfig

    return SimpleNamespace(
        ns_steps=ns_steps, muon_tp_mode=muon_tp_mode or OptimizerConfig.muon_tp_mode,
        bandwidth_gbps=bandwidth_gbps or rates.table.get("all_to_all_gbps") or 50.0,
        gram_bytes=2 if rates.newton_schulz_precision == "medium" else 4,
        gpus_per_node=gpus_per_node, latency_us_per_rank=latency_us_per_rank)


@dataclasses.dataclass
class PlannedModel:
    """One model planned on `world` ranks (plan_model): its Muon matrices, their parts without
    and with teams, each dp_cp rank's elements, the active params a token's matmuls use, the
    ideal Newton-Schulz FLOPs a rank (total / W), the elementwise part and Adam's step (s)."""

    world: int
    tensor_parallel: int
    ranks: int  # dp_cp
    ep: int
    rows: dict
    dense: list
    expert: list
    cost: object
    parts: Planned
    team_parts: Planned
    all_elements: list
    muon_elements: list
    adam_elements: list
    active: float
    layout_seconds: float
    ideal: float
    elementwise: float
    adam_step: float


def plan_model(spec: ModelSpec, world: int, model, rates: Rates, args, tensor_parallel: int = 1,
               ep: int | None = None) -> PlannedModel:
    """`model` (one TP rank's part, meta_model, with the experts of one of `ep` expert-parallel
    ranks: default model.expert_parallel's) on `world` ranks, `tensor_parallel` of them a
    model's TP group, data parallel over the rest, planned as a run plans it. Each rank of a TP
    group plans and steps its own TP-local matrices alike, so one of them stands for all."""
    ranks = world // tensor_parallel  # dp_cp: data parallel, what the plan spreads over
    ep = ep or expert_parallel(spec, ranks)
    start = time.perf_counter()
    rows = fsdp_rows(model, ranks, ranks // ep)
    layout_seconds = time.perf_counter() - start
    dense, expert = muon_matrices(model, rows, args.muon_tp_mode, tensor_parallel)
    cost = step_cost(rates, args)
    parts = planned_parts(dense, expert, ranks, ep, cost)

    # Teams sized, and their blocks placed, with their all-reduces weighed (with their latency);
    # reported with Newton-Schulz at the rates and the all-reduces' bytes over the network
    # (step_time.exchange_costs) and their latency (step_time.collective_latency).
    def teams(group_ranks, stride):
        nodes = nodes_in_rank_order(group_ranks, stride * tensor_parallel, rates, args)
        plan_cost = team_step_cost(cost, args.ns_steps, args.gram_bytes,
                                   args.latency_us_per_rank * 1e-6, nodes=nodes)
        return plan_cost, lambda matrix, k: plan_cost.call_seconds(matrix, 1), nodes

    team_parts = planned_parts(dense, expert, ranks, ep, cost, teams=teams)
    muon_elements, adam_elements, all_elements = [0] * ranks, [0] * ranks, [0] * ranks
    active = 0
    for param_name, p in model.named_parameters():
        experts = is_expert_param(param_name, p)
        held, width = rows[p], p.shape[1:].numel()
        stepped_by = adam_elements if is_scalar_param(p) else muon_elements
        for r in range(ranks):
            elements = held[r // ep if experts else r] * width
            all_elements[r] += elements
            stepped_by[r] += elements
        if param_name != "embedding.word_embeddings.weight":  # a lookup, not a matmul
            tp_parts = tensor_parallel if getattr(p, "tensor_model_parallel", False) else 1
            active += p.numel() * tp_parts * (
                ep * spec.config["moe_router_topk"] / spec.config["num_moe_experts"]
                if experts else 1)
    elementwise = max((muon_elements[r] * rates.muon_elementwise_ns_per_element
                       + adam_elements[r] * rates.adam_ns_per_element) * 1e-9 for r in range(ranks))
    return PlannedModel(world, tensor_parallel, ranks, ep, rows, dense, expert, cost, parts,
                        team_parts, all_elements, muon_elements, adam_elements, active,
                        layout_seconds, _ideal(parts, ranks, args.ns_steps), elementwise,
                        max(all_elements) * rates.adam_ns_per_element * 1e-9)


def _ideal(parts: Planned, ranks: int, steps: int) -> float:
    """The ideal Newton-Schulz FLOPs a rank: total / W of the matrices whole, each by the
    Newton-Schulz it runs (a TP group's ranks each their own TP-local matrices' share: total /
    data parallel)."""
    return sum(sum(m.ns_flops(steps) for m in part.matrices) * ranks / part.world
               for part, _ in parts) / ranks


def planned_with_gram(planned: PlannedModel, args) -> PlannedModel:
    """`planned` under --muon-gram-newton-schulz (args.ns_steps iterations, gram-newton-schulz's
    restart: GramSchedule's default): its matrices with the schedule where Newton-Schulz gets
    them whole (model.with_gram), their parts planned again, the ideal by what runs. Without
    teams (`team_parts` the same parts: the scale model's teams under Gram are not planned
    yet)."""
    schedule = GramSchedule(args.ns_steps)
    dense, expert = with_gram(planned.dense, schedule), with_gram(planned.expert, schedule)
    parts = planned_parts(dense, expert, planned.ranks, planned.ep, planned.cost)
    return dataclasses.replace(planned, dense=dense, expert=expert, parts=parts,
                               team_parts=parts, ideal=_ideal(parts, planned.ranks, args.ns_steps))


def mode_figures(planned: PlannedModel, mode: str, args,
                 backward: tuple[float, float] = (0.0, 0.0)) -> dict:
    """The step in `mode` (step_time.planned_step; "teams": the parts with teams): the busiest
    rank's Newton-Schulz FLOPs beside the ideal, the most bytes a rank receives, the most
    Newton-Schulz and network seconds a rank spends, collectives and their latency, the step
    (the elementwise part added) with the plain and the SYRK Newton-Schulz, and where the
    slowest rank's owner step went (waiting for gathers, in Newton-Schulz, waiting for
    scatters), ms; parts packed for the gather inside backward gathering ahead in `backward`
    (step_time.in_order)."""
    step = planned_step(planned.team_parts if mode == "teams" else planned.parts, mode,
                        planned.cost, args, planned.ranks, backward)
    per_rank = step["per_rank"]
    busiest = max(f["ns_flops"] for f in per_rank)
    return dict(busiest_ns_gflop=busiest / 1e9, ideal_ns_gflop=planned.ideal / 1e9,
                busiest_over_ideal=busiest / planned.ideal,
                max_received_mb=max(f["received"] for f in per_rank) / 1e6,
                ns_ms=max(f["ns_seconds"] for f in per_rank) * 1e3,
                network_ms=max(f["network_seconds"] for f in per_rank) * 1e3,
                collectives=step["collectives"], latency_ms=step["latency"] * 1e3,
                **{f"path_{stage}_ms": seconds * 1e3 for stage, seconds in step["path"].items()},
                step_ms=(planned.elementwise + step["seconds"]) * 1e3,
                syrk_step_ms=(planned.elementwise + step["syrk_seconds"]) * 1e3,
                interleaved=step["together"])


def estimated_steps(spec: ModelSpec, world: int, rates: Rates, args, tensor_parallel: int = 1,
                    expert_parallel_size: int | None = None, scales=(1, 4, 16),
                    gram: bool = False) -> list[dict]:
    """`spec`'s step at `world` ranks and `scales` times them (EP `expert_parallel_size`, default
    model.expert_parallel's), a dict a W: its layout, Adam's step and ours (ms, latency counted)
    whole-matrix and with teams (--muon-max-team-size), each with its busiest/ideal, and with
    `gram` ours with --muon-gram-newton-schulz ("gram": planned_with_gram)."""
    models, rows = {}, []
    for w in (world * scale for scale in scales):
        ep = expert_parallel_size or expert_parallel(spec, w // tensor_parallel)
        if ep not in models:
            models[ep] = meta_model(spec, ep, tensor_parallel)
        planned = plan_model(spec, w, models[ep], rates, args, tensor_parallel, ep)
        row = dict(world=w, tensor_parallel=tensor_parallel, data_parallel=planned.ranks,
                   expert_parallel=ep, adam_step_ms=planned.adam_step * 1e3)
        modes = [("owner", planned, "owner"), ("teams", planned, "teams")]
        if gram:
            modes.append(("gram", planned_with_gram(planned, args), "owner"))
        for name, plan, mode in modes:
            figures = mode_figures(plan, mode, args)
            row[name] = dict(step_ms=figures["step_ms"] + figures["latency_ms"],
                             busiest_over_ideal=figures["busiest_over_ideal"])
        rows.append(row)
    return rows


def newton_schulz_shapes(spec: ModelSpec, tensor_parallel: int, tp_mode: str) -> list:
    """The distinct Newton-Schulz calls (1, rows, cols) of `spec`'s Muon matrices (a QKV block
    each), one TP rank's under --muon-tp-mode `tp_mode`: what measure_rates times for it."""
    model = meta_model(spec, 1, tensor_parallel)
    dense, expert = muon_matrices(model, fsdp_rows(model, 1, 1), tp_mode, tensor_parallel)
    return sorted({(1, rows, m.cols) for m in dense + expert
                   for rows in m.row_blocks or (m.shape[0],)})
