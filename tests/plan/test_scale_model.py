"""The scale estimate (megatron_muon.estimate: `make scale`, the self-test) plans from shapes
alone what a real run plans: the rows it derives from Megatron-FSDP's bucketing are the rows each
rank's main weights hold, and its plan has the matrices and owners ZeROTensorParallelMuon
chose."""

import builtins
import json
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from megatron.core import parallel_state

from megatron_muon import get_megatron_optimizer
from megatron_muon.chain.model_chunks import named_main_weights
from megatron_muon.reporting.rates_file import rates_table
from megatron_muon.estimate.model import (fsdp_rows, muon_matrices, tensor_parallel_part,
                                          with_gram)
from megatron_muon.plan import GramSchedule, gram_counts
from megatron_muon.estimate.parts import Part, Planned, Rates, planned_parts
from megatron_muon.estimate.step_time import (APPLIED, GATHER, GATHER_AHEAD, GROUP,
                                              NEWTON_SCHULZ, READY, SCATTER, collective_latency,
                                              exchange_order, in_order, planned_step, syrk_share)
from megatron_muon.tools.testing import (GPTShape, fsdp_gpt, gpt, init_parallel_state,
                                         optimizer_config)
from megatron_muon.core.zero_muon import ZeROTensorParallelMuon

# Uneven shards at W=4: widths 48 and 96 (biases too) in one bucket per layer.
SHAPE = GPTShape(layers=2, hidden=48, ffn=96, heads=4, vocab=72, seq=16)


def _plans_what_the_run_planned(rank, world_size, expert_parallel, owner_choice, tp_mode,
                                tensor_parallel, gram=False):
    init_parallel_state(expert_parallel=expert_parallel, tensor_parallel=tensor_parallel)
    num_experts = 4 if expert_parallel > 1 else None
    model = fsdp_gpt(SHAPE, num_experts=num_experts)
    config = optimizer_config(**({"muon_tp_mode": tp_mode} if tp_mode else {}))
    with mock.patch.object(builtins, "print"):  # --muon-gram-newton-schulz's line
        optimizer = get_megatron_optimizer(config, [model], muon_owner_choice=owner_choice,
                                           muon_gram_newton_schulz=gram)
    reference = gpt(SHAPE, num_experts=num_experts)  # the same TP-local shapes, never sharded
    main_weights = {name.removeprefix("module.module."): main_weight
                    for name, main_weight in named_main_weights(model)}
    for name, p in reference.named_parameters():
        # The scale model's TP-local part of the whole (TP = 1) weight is megatron-core's.
        whole = torch.empty(main_weights[name].shape, device="meta")
        tags = ("tensor_model_parallel", "partition_dim")
        whole.__dict__.update({key: getattr(p, key) for key in tags if hasattr(p, key)})
        assert tensor_parallel_part(whole, tensor_parallel) == tuple(p.shape), name
    data_parallel = world_size // tensor_parallel
    derived = fsdp_rows(reference, data_parallel, data_parallel // expert_parallel)
    by_name = {name: derived[p] for name, p in reference.named_parameters()}
    dense_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    expert_rank = parallel_state.get_expert_data_parallel_rank()
    for name, main_weight in named_main_weights(model):
        name = name.removeprefix("module.module.")
        local = main_weight.to_local()
        rows = local.numel() // max(1, local.shape[1:].numel()) if local.dim() > 1 else local.numel()
        group_rank = expert_rank if ".experts." in name else dense_rank
        assert by_name[name][group_rank] == rows, (name, by_name[name], rank, rows)

    dense, expert = muon_matrices(reference, derived, config.muon_tp_mode, tensor_parallel)
    if gram:  # as the scale model plans --muon-gram-newton-schulz (estimate.figures)
        schedule = GramSchedule(config.muon_num_ns_steps)
        dense, expert = with_gram(dense, schedule), with_gram(expert, schedule)
        assert gram_counts(dense)[0] > 0 and gram_counts(expert)[0] > 0
    muons = [part.optimizer for part in optimizer.chained_optimizers
             if isinstance(part.optimizer, ZeROTensorParallelMuon)]
    assert len(muons) == (2 if expert else 1)
    plans = [muon.plans[0] for muon in muons]
    # The run's measured rates stand in for the scale model's (StepCost), or none: by bytes.
    assert [plan.cost is None for plan in plans] == [owner_choice == "bytes"] * len(plans)
    # Planned as the factory plans the parts: the expert part beside the dense part
    # (planner.interleaving) where every rank holds both, each rank's budget its saving
    # over both parts plus the headroom over both.
    parts = planned_parts(dense, expert, data_parallel, expert_parallel, plans[0].cost,
                          plans[-1].cost,
                          expert_rank=parallel_state.get_expert_model_parallel_rank())
    assert (parts.beside is not None) == (muons[0].interleaved is not None) == bool(expert)
    modelled = [parts[0][0]] + ([] if not expert else [
        parts.beside[parallel_state.get_expert_model_parallel_rank()] if parts.beside
        else parts[1][0]])
    mode = "owner" if owner_choice == "time" else "owner-by-bytes"
    for plan, part in zip(plans, modelled):
        assert sorted(zip(plan.matrices, plan.owners), key=repr) == sorted(
            zip(part.matrices, part.owners[mode]), key=repr)
        # The exchanges too (where the model's matrices are the run's in the same order: here
        # every part).
        assert plan.matrices == part.matrices
        assert [route.batches for route in plan.routes] == part.exchanges
    # What the run measured, as its rates file says it (reporting.rates_file): the scale model's
    # rates give each measured call back, and the all-to-all as its bandwidth.
    table = rates_table(optimizer) if owner_choice == "time" else None
    assert (table is None) == (owner_choice == "bytes")
    if table is not None:
        rates = Rates(json.loads(json.dumps(table)))  # through JSON, as a file
        measured = {}  # {FLOPs of a call: its seconds, each shape's}
        for muon in muons:
            for calls, _ in muon.planner.measured:
                for flops, seconds in calls:
                    measured.setdefault(flops, []).append(seconds)
        assert measured and all(
            rates.newton_schulz_seconds(flops) == pytest.approx(sum(times) / len(times))
            for flops, times in measured.items())
        assert rates.all_to_all_gbps > 0 and rates.newton_schulz_precision == "highest"
        assert min(rates.matmul_tflops, rates.adam_ns_per_element,
                   rates.muon_elementwise_ns_per_element) > 0


# Each --muon-tp-mode that plans differently: duplicated gathers over the one TP rank; None is
# the installed megatron-core's default (blockwise on 0.19, duplicated on 0.20), here at TP = 2
# (the scale model's TP rows: TP-local matrices, under blockwise batched as at TP = 1); and
# --muon-gram-newton-schulz (`gram`: the MLPs' 96 x 48 and 48 x 96 matrices and the experts').
@pytest.mark.parametrize("world_size, expert_parallel, owner_choice, tp_mode, tensor_parallel, "
                         "gram", [(4, 1, "time", None, 2, False),
                                  (4, 2, "time", "blockwise", 1, False),
                                  (4, 2, "bytes", "duplicated", 1, False),
                                  (4, 2, "time", "blockwise", 1, True)])
def test_scale_model_plans_what_a_run_plans(distributed, world_size, expert_parallel, owner_choice,
                                           tp_mode, tensor_parallel, gram):
    distributed(_plans_what_the_run_planned, world_size, expert_parallel, owner_choice, tp_mode,
                tensor_parallel, gram)


@pytest.mark.parametrize("rows, cols, blocks, kept", [
    (256, 256, None, 4 / 6),  # square: (3 + 1) / (4 + 2)
    (2048, 7168, None, (3 * 7168 + 2048) / (4 * 7168 + 2 * 2048)),  # a DeepSeek-V3 expert
    (7168, 2048, None, (3 * 7168 + 2048) / (4 * 7168 + 2 * 2048)),  # m is the smaller side
    (48, 32, (32, 16),  # a QKV split: a 32 x 32 block and a 16 x 32 one
     (4 * 32 ** 3 + 16 * 16 * (3 * 32 + 16)) / (6 * 32 ** 3 + 16 * 16 * (4 * 32 + 2 * 16)))])
def test_the_syrk_kernel_keeps_the_share_of_flops_its_symmetric_products_leave(rows, cols,
                                                                             blocks, kept):
    """X X^T and A A at half, B X whole, per row block of a QKV split."""
    from megatron_muon.plan import Matrix, RowLayout

    matrix = Matrix(RowLayout((rows,)), cols, row_blocks=blocks)
    assert syrk_share(matrix) == pytest.approx(kept)


def test_each_collective_costs_its_latency_per_rank_of_its_group():
    """The scale model's latency (collective_latency): each exchange's gather and scatter
    all-to-alls, or one all-gather per matrix in allgather mode, LATENCY_US_PER_RANK per rank."""
    from megatron_muon.plan import Matrix, RowLayout

    matrices = [Matrix(RowLayout((3, 1, 0, 4)), 8) for _ in range(5)]
    part = Part(matrices, 4, None)
    part.pack(headroom=0)
    exchanges = len(part.exchanges)
    assert exchanges >= 1
    count, seconds = collective_latency(part, "owner", 2.5)
    assert count == 2 * exchanges and seconds == pytest.approx(2 * exchanges * 4 * 2.5e-6)
    assert collective_latency(part, "allgather", 1.0) == (5, pytest.approx(20e-6))


def test_an_owner_pays_its_gather_then_newton_schulz_then_its_scatter():
    """One matrix, three rows on rank 0 (its owner) and one on rank 1: rank 0 receives a row in
    the gather and sends it back in the scatter, one after the other with Newton-Schulz between,
    as owner_exchange runs them (a rank's bytes as the larger of in and out over the whole
    step, as the model charged them before, leaves one of the two out)."""
    from megatron_muon.plan import Matrix, RowLayout, StepCost

    row_bytes = 8 * 4
    cost = StepCost(lambda matrix, count: 1e-3 * count, row_bytes / 1e-3)  # 1 ms: a call, a row
    part = Part([Matrix(RowLayout((3, 1)), 8)], 2, cost)
    part.pack(headroom=0)
    step = planned_step(Planned([(part, lambda r: r)]), "owner", cost,
                        SimpleNamespace(ns_steps=5, gram_bytes=2, latency_us_per_rank=0.0), 2)
    assert part.owners["owner"] == [0]
    assert step["seconds"] == pytest.approx(3e-3)
    assert step["path"] == pytest.approx(dict(gather=1e-3, newton_schulz=1e-3, scatter=1e-3))
    assert [f["network_seconds"] for f in step["per_rank"]] == pytest.approx([2e-3, 2e-3])


def test_exchanges_are_charged_in_the_order_the_step_runs_them():
    """Two in flight (exchange.run_overlapped): exchange k + 1's gather runs beside exchange k's
    Newton-Schulz, and exchange k's scatter ends before k + 2's gather starts; in rounds
    (exchange_rounds) both parts' gathers first, then each one's Newton-Schulz and scatter. An
    all-to-all ends with its slowest rank; the critical path's seconds add up to the step."""
    g, n, s, a = GATHER, NEWTON_SCHULZ, SCATTER, APPLIED
    assert exchange_order([3], together=False) == [
        (g, 0, 0), (g, 0, 1), (n, 0, 0), (s, 0, 0), (a, 0, 0), (g, 0, 2), (n, 0, 1), (s, 0, 1),
        (a, 0, 1), (n, 0, 2), (s, 0, 2), (a, 0, 2)]
    assert exchange_order([2, 1], together=True) == [
        (g, 0, 0), (g, 1, 0), (g, 0, 1), (n, 0, 0), (s, 0, 0), (n, 1, 0), (s, 1, 0), (a, 0, 0),
        (a, 1, 0), (n, 0, 1), (s, 0, 1), (a, 0, 1)]
    assert exchange_order([1, 2], together=False)[4:] == [
        (g, 1, 0), (g, 1, 1), (n, 1, 0), (s, 1, 0), (a, 1, 0), (n, 1, 1), (s, 1, 1), (a, 1, 1)]
    # Two ranks, seconds per exchange and rank. Rank 0: G1 ends at 2 (rank 0's 2), G2 at 5
    # (after G1; rank 0's 3), NS1 to 7, S1 issued at 7 ends at 8 (rank 1's, from 5: 7); G3
    # from 8 to 12 (rank 1's 4); NS2 to 8 (rank 1's to 10), S2 after G3: 13; NS3 to 14, S3 16.
    stages = {(0, k): {g: gather, n: newton_schulz, s: scatter} for k, (gather, newton_schulz,
              scatter) in enumerate([([2, 1], [5, 1], [1, 2]), ([3, 0], [0, 2], [0, 1]),
                                     ([1, 4], [1, 1], [2, 2])])}
    step = in_order(exchange_order([3], together=False), stages, 2)
    # The path: G1 2, NS1 5, S1 1 (rank 0's), G3 4, S2 1, NS3 1, S3 2.
    assert step == pytest.approx(dict(seconds=16, gather=6, newton_schulz=6, scatter=4))
    # Each rank its own process group (expert groups side by side): an all-to-all ends with its
    # group's slowest rank, and a group that moves nothing issues none. Rank 0 ends at 12
    # (G3 at 9, NS3 to 10, S3 from 10), rank 1 too (S2 from 8 after G3, NS3 9 to 10, S3 10-12).
    for exchange in stages.values():
        exchange[GROUP] = [0, 1]
    apart = in_order(exchange_order([3], together=False), stages, 2)
    assert apart["seconds"] == pytest.approx(12)
    assert sum(apart[stage] for stage in (g, n, s)) == pytest.approx(12)


def test_a_gather_inside_backward_is_charged_only_where_backward_leaves_the_network_free():
    """--muon-gather-inside-backward: an exchange's gather ahead (GATHER_AHEAD) starts once its
    last gradient is reduced (READY: the share of the last micro-batch's backward left then)
    and runs beside Megatron-FSDP's own traffic at the share of the network it leaves free
    until backward ends, at the whole network after; only what runs after backward's end is on
    the critical path, and the next gather waits for it. Where backward leaves nothing free, it
    is charged as at the step. The rest of its exchange gathers at the step, and its
    Newton-Schulz waits for both."""
    a, g, n, s = GATHER_AHEAD, GATHER, NEWTON_SCHULZ, SCATTER
    stages = {(0, 0): {a: [2, 1], g: [0, 0], n: [1.5, 1.5], s: [1, 1], READY: [0.5, 0.5]},
              (0, 1): {g: [1, 1], n: [1, 2], s: [1, 1]}}
    order = exchange_order([2], together=False)
    # Backward 8 s, half the network free: ready at -4, rank 0's 2 s take 4: ends at 0, hidden.
    # Then G2 0-1, NS1 0-1.5, S1 1.5-2.5, NS2 to 3.5 and 4.5, S2 4.5-5.5: on the path NS1,
    # S1, rank 1's NS2 and S2.
    assert in_order(order, stages, 2, backward=(8.0, 0.5)) == pytest.approx(
        dict(seconds=5.5, gather=0, newton_schulz=3.5, scatter=2))
    # A quarter free: 1 s of rank 0's 2 moves before backward's end, 1 after; G2 1-2, NS1
    # 1-2.5, S1 2.5-3.5, NS2 to 4.5 and 5.5, S2 5.5-6.5.
    assert in_order(order, stages, 2, backward=(8.0, 0.25)) == pytest.approx(
        dict(seconds=6.5, gather=1, newton_schulz=3.5, scatter=2))
    # Nothing free, or ready only at backward's end: as at the step (G1 0-2, G2 2-3, NS1
    # 2-3.5, S1 3.5-4.5, NS2 to 5.5 and 6.5, S2 6.5-7.5).
    at_the_step = dict(seconds=7.5, gather=2, newton_schulz=3.5, scatter=2)
    assert in_order(order, stages, 2, backward=(8.0, 0.0)) == pytest.approx(at_the_step)
    stages[0, 0][READY] = [0.0, 0.0]
    assert in_order(order, stages, 2, backward=(8.0, 0.5)) == pytest.approx(at_the_step)
    stages[0, 0][READY] = [None, None]  # nothing ahead: the gather at the step
    stages[0, 0][a], stages[0, 0][g] = [0, 0], [2, 1]
    assert in_order(order, stages, 2, backward=(8.0, 0.5)) == pytest.approx(at_the_step)
    # Half ahead, hidden (ready at -4, ends at 0), the rest at the step: G1 0-1, G2 1-2, NS1
    # 1-2.5, S1 2.5-3.5, NS2 to 4.5 and 5.5, S2 5.5-6.5.
    stages[0, 0].update({a: [2, 1], g: [1, 1], READY: [0.5, 0.5]})
    assert in_order(order, stages, 2, backward=(8.0, 0.5)) == pytest.approx(
        dict(seconds=6.5, gather=1, newton_schulz=3.5, scatter=2))


def test_the_plan_packed_for_the_gather_inside_backward_carries_momentum_beside_gradient():
    """A part packed `ahead` (as the factory packs it under --muon-gather-inside-backward): its
    first exchanges' gathers carry twice the columns (old momentum beside the gradient) and are
    ready once the first of their matrices in the model's order is reduced; the rest, and every
    exchange of the part packed as before, gather at the step with the update's columns."""
    from megatron_muon.estimate.step_time import exchange_costs
    from megatron_muon.plan import (Matrix, RowLayout, StepCost, gather_traffic, owner_traffic,
                                    scatter_traffic)

    cost = StepCost(lambda matrix, count: 1e-3 * count, 32 / 1e-3)
    matrices = [Matrix(RowLayout((2, 2)), 8, batch_key=i) for i in range(6)]
    args = SimpleNamespace(ns_steps=5, gram_bytes=2, latency_us_per_rank=0.0)
    for ahead in (False, True):
        part = Part(matrices, 2, cost)
        part.pack(headroom=0, ahead=ahead)
        step = planned_step(Planned([(part, lambda r: r)]), "owner", cost, args, 2)
        received = [0, 0]
        for k, (batches, costs) in enumerate(zip(part.exchanges,
                                                  exchange_costs(part, "owner", cost, 5))):
            held = [i for batch in batches for i in batch]
            owners = [part.owners["owner"][i] for i in held]
            gathered = [matrices[i].carrying_momentum() if i in part.early else matrices[i]
                        for i in held]
            for moved, direction in ((gathered, gather_traffic),
                                     ([matrices[i] for i in held], scatter_traffic)):
                into, _ = owner_traffic(moved, owners, 4, direction)
                received = [a + b for a, b in zip(received, into)]
            early = [i for i in held if i in part.early]
            assert costs[READY] == [min(early) / 6 if early else None] * 2
            assert bool(early) == (k < part.ahead)
        # Each rank owns 3 matrices and holds 2 of each one's 4 rows (64 bytes plain each way).
        # Ahead, each owns one whose whole carried matrix (256 bytes) fits its saving (384),
        # the last two in the model's order, final first: the first exchange, apart (no gather
        # at the step: fewer collectives than the rest joining it), which gathers their 2 rows
        # from the other twice as wide, ready with 4/6 of backward left.
        assert part.ahead == ahead and part.early == ({4, 5} if ahead else set())
        assert not ahead or part.exchanges[0] == [[5], [4]]
        assert received == [384 + 64 * ahead] * 2
        assert [f["received"] for f in step["per_rank"]] == received


def test_the_table_names_the_expert_group_gathering_the_most_ahead():
    """Each expert group beside the dense part packs its own gathers ahead; make scale's table
    counts the dense part's and the group's gathering the most (Planned.most_ahead), not EP
    rank 0's, which may gather none where another does."""
    dense, first, second = (SimpleNamespace(ahead=k) for k in (1, 0, 2))
    planned = Planned([(dense, lambda r: r)])
    planned.beside = {0: first, 1: second}
    assert planned.representative() == [dense, first]
    assert planned.most_ahead() == [dense, second]
    planned.beside = None  # apart: the part standing for every group
    planned.append((first, lambda r: r))
    assert planned.most_ahead() == [dense, first]


def test_megatron_flags_give_the_model_megatron_builds_from_them():
    """The self-test's model from Megatron's flags: the defaults megatron.training's
    validate_args fills in (an FFN of 4 x hidden, 8/3 x with --swiglu as a multiple of 64; as many
    query groups as heads; an expert's FFN the dense one's, top-2 routing), a clear error
    naming the flags a model needs, and None where no flag is given."""
    from megatron_muon.estimate.model import MODEL_FLAGS, spec_from_flags

    none = dict.fromkeys(MODEL_FLAGS)
    llama = dict(none, num_layers=32, hidden_size=4096, num_attention_heads=32, vocab_size=32000)
    assert spec_from_flags(none, swiglu=False) is None
    swiglu = spec_from_flags(llama, swiglu=True)
    assert swiglu.config == dict(num_layers=32, hidden_size=4096, num_attention_heads=32,
                                 num_query_groups=32, ffn_hidden_size=10880,
                                 gated_linear_unit=True)
    assert swiglu.gpt == dict(vocab_size=32000)
    assert spec_from_flags(llama, swiglu=False).config["ffn_hidden_size"] == 16384
    moe = spec_from_flags(dict(llama, num_experts=8, num_query_groups=8), swiglu=False).config
    assert (moe["num_moe_experts"], moe["moe_ffn_hidden_size"], moe["moe_router_topk"],
            moe["num_query_groups"]) == (8, 16384, 2, 8)
    with pytest.raises(ValueError, match="needs --num-attention-heads, --vocab-size"):
        spec_from_flags(dict(none, num_layers=2, hidden_size=64), swiglu=False)


def test_one_measured_call_gives_every_call_its_rate():
    """A model whose Muon matrices all share one shape gives the self-test's estimate one timed
    call: every call is taken at its rate (no interpolation between two points)."""
    rates = Rates({"newton_schulz": [[1.0, 2.0]]})  # 1 GFLOP at 2 TFLOP/s
    assert [rates.newton_schulz_seconds(flops) for flops in (1e9, 1e12)] == pytest.approx(
        [5e-4, 0.5])


def test_forward_backward_runs_at_the_rate_the_user_chooses():
    """The scale model's forward-backward rate: by default the matmul rate x --fwd-bwd-efficiency
    (as before), FP8_SPEEDUP times it with --fwd-bwd-fp8, or --fwd-bwd-tflops; the assumptions
    printed and saved beside the tables say which."""
    from benchmarks import scale_model
    from megatron_muon.estimate.figures import assumed

    table = json.loads((Path(scale_model.__file__).parent / "rates" / "h100.json").read_text())
    rates = Rates(table)

    def chosen(*flags):
        args = scale_model.command_line().parse_args(list(flags))
        vars(args).update(vars(assumed(rates)))
        note = next(line for line in scale_model.assumptions(rates, args)
                    if line.startswith("forward-backward"))
        return scale_model.fwd_bwd_tflops(rates, args), note

    bf16, note = chosen()
    assert bf16 == rates.matmul_tflops * 0.5 and "matmul rate x 0.5)" in note
    fp8, note = chosen("--fwd-bwd-fp8")
    assert fp8 == bf16 * scale_model.FP8_SPEEDUP and "for FP8 (--fwd-bwd-fp8)" in note
    given, note = chosen("--fwd-bwd-tflops", "700")
    assert given == 700 and "700 TFLOP/s (--fwd-bwd-tflops)" in note
    with pytest.raises(SystemExit):  # one rate or the other
        chosen("--fwd-bwd-fp8", "--fwd-bwd-tflops", "700")
