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
layer-wise Muon; and our step with emerging-optimizers' SYRK Newton-Schulz (--muon-use-syrk).
Prints a table, writes benchmarks/results/scale.json and scale.png. The assumptions are printed
with the numbers.
"""

import argparse
import bisect
import dataclasses
import functools
import json
import math
import os
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
ELEMENT_BYTES = 4  # fp32 main weights, momentum and updates
# owner: ours (owners by estimated time); teams: ours with --muon-max-team-size (a matrix too
# large for one rank's share split over a team, plan/teams.py); owner-by-bytes: byte-first owners
# (our choice before owners by time, and its fallback); whole-matrix-per-rank: megatron-core's
# layer-wise placement.
MODES = ("owner", "teams", "owner-by-bytes", "allgather", "whole-matrix-per-rank")
# --optimizer muon, and --optimizer adaptive_muon's --adaptive-muon-moment2-method values: each
# planned as ZeROTensorParallelMuon plans it (the variants table, owner mode).
VARIANTS = ("muon", "adamuon", "normuon", "namo")

# name -> (megatron-core TransformerConfig settings, GPTModel settings, tokens per step)
MODELS = {
    "llama-8b": (dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                      ffn_hidden_size=14336), dict(vocab_size=128256), 4 << 20),
    "llama-70b": (dict(num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8,
                       ffn_hidden_size=28672), dict(vocab_size=128256), 4 << 20),
    # DeepSeek-V3: 61 layers (3 dense), MLA, 256 routed experts (top-8) + 1 shared, no MTP;
    # its report's batch: 15360 sequences of 4096 tokens.
    "deepseek-v3": (dict(num_layers=61, hidden_size=7168, num_attention_heads=128,
                         ffn_hidden_size=18432, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
                         qk_pos_emb_head_dim=64, v_head_dim=128, num_moe_experts=256,
                         moe_router_topk=8, moe_ffn_hidden_size=2048,
                         moe_shared_expert_intermediate_size=2048, moe_layer_freq=[0] * 3 + [1] * 58),
                    dict(vocab_size=129280), 15360 * 4096),
    # Kimi K2: DeepSeek-V3's layout with 64 heads, 384 routed experts (top-8) + 1 shared, one
    # dense first layer, a 163840-token vocabulary; its report's batch: 67M tokens (16384 x 4096).
    "kimi-k2": (dict(num_layers=61, hidden_size=7168, num_attention_heads=64,
                     ffn_hidden_size=18432, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
                     qk_pos_emb_head_dim=64, v_head_dim=128, num_moe_experts=384,
                     moe_router_topk=8, moe_ffn_hidden_size=2048,
                     moe_shared_expert_intermediate_size=2048, moe_layer_freq=[0] + [1] * 60),
                dict(vocab_size=163840), 16384 * 4096),
}
# Bridge's Kimi K2 and DeepSeek-V3 performance recipes: EP 64.
MAX_EXPERT_PARALLEL = 64
# NVIDIA's published figure for Muon at the flagship's scale (developer blog, 2026-04, Megatron
# Bridge 26.02): layer-wise Muon on Kimi K2, 256 GB300 GPUs, PP4 VP4 DP64 EP64, MXFP8, Bridge's
# benchmark batch (2048 sequences of 4096 tokens): 1029 model TFLOP/s per GPU against AdamW's 1051.
NVIDIA = dict(model="kimi-k2", world=256, tokens_per_step=2048 * 4096, muon_tflops=1029,
              adam_tflops=1051)
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
# A collective's latency, beside its bytes at the bandwidth: this many microseconds per rank of
# its group (an all-to-all of small messages is a send and a receive with each peer; a ring
# all-gather N - 1 steps). nccl-tests' alltoall_perf took 324 us at 512 bytes over 128 ranks, 16
# per node (NVIDIA/nccl-tests#78: NCCL 2.8.4 over sockets, an old and slow network: an upper
# figure for InfiniBand), 2.5 us per rank.
LATENCY_US_PER_RANK = 2.5


def is_dense(model: str) -> bool:
    return "num_moe_experts" not in MODELS[model][0]


def expert_parallel(model: str, world: int) -> int:
    return 1 if is_dense(model) else math.gcd(world, MAX_EXPERT_PARALLEL)


def meta_model(name: str, expert_parallel_size: int, tensor_parallel: int = 1):
    """megatron-core's GPTModel (local spec, Llama-style: RMSNorm, SwiGLU, no biases, untied
    output) on the meta device, with the experts one expert-parallel rank holds and each
    tensor-parallel weight cut to one TP rank's part (tensor_parallel_part)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    settings, model_settings, _ = MODELS[name]
    is_mla = "q_lora_rank" in settings
    config_class = MLATransformerConfig if is_mla else TransformerConfig
    with torch.device("meta"):
        config = config_class(**settings, add_bias_linear=False, gated_linear_unit=True,
                              normalization="RMSNorm", use_cpu_initialization=True,
                              perform_initialization=False)
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
        if is_mla:
            # The attention kernel has no weights; megatron-core's local one cannot take MLA's
            # head sizes (TransformerEngine's can), so it is left out.
            for layer in spec.layer_specs:
                layer.submodules.self_attention.submodules.core_attention = IdentityOp
        model = GPTModel(config, spec, max_sequence_length=4096, position_embedding_type="rope",
                         share_embeddings_and_output_weights=False, **model_settings)
    for module in model.modules():
        if hasattr(module, "local_experts"):  # this expert-parallel rank's experts only
            module.local_experts = module.local_experts[: len(module.local_experts) // expert_parallel_size]
    if tensor_parallel > 1:
        for p in model.parameters():
            p.data = torch.empty(tensor_parallel_part(p, tensor_parallel), device="meta")
    return model


def tensor_parallel_part(p, tensor_parallel: int) -> tuple[int, ...]:
    """The shape of one TP rank's part of `p`: megatron-core tags a tensor-parallel weight
    (tensor_model_parallel) with the dim its TP ranks split (partition_dim: 0 for column-parallel
    layers, QKV's query groups and fc1's gate and up together, and the vocabulary; 1 for
    row-parallel ones), whatever the TP size it was built with."""
    shape = list(p.shape)
    if tensor_parallel > 1 and getattr(p, "tensor_model_parallel", False):
        if shape[p.partition_dim] % tensor_parallel:
            raise ValueError(f"{tuple(p.shape)} does not split over TP = {tensor_parallel}")
        shape[p.partition_dim] //= tensor_parallel
    return tuple(shape)


def fsdp_rows(model, world: int, expert_world: int) -> dict:
    """{param: rows of each rank's shard}, from Megatron-FSDP's bucketing (FSDP units: the
    transformer layers, as megatron-core's adapter sets them) and buffer index (ZeRO-3): each
    bucket padded to the group size, cut into equal shards. Experts are sharded over the expert
    data-parallel group."""
    from types import SimpleNamespace

    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import (
        BucketingPolicy, _get_parameter_groups, build_data_parallel_buffer_index)
    from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayer

    strategy = "optim_grads_params"
    policy = BucketingPolicy(suggested_bucket_size=None, data_parallel_sharding_strategy=strategy,
                             fsdp_unit_modules=[TransformerLayer, MoETransformerLayer])
    groups, _, _ = _get_parameter_groups(model, policy, {})
    rows = {}
    for bucket_id, group in enumerate(groups):
        size = expert_world if group.is_expert_param else world
        items, bucket, _ = build_data_parallel_buffer_index(
            [p.shape for p in group.params], 0, size, True,
            SimpleNamespace(data_parallel_sharding_strategy=strategy), bucket_id=bucket_id,
            chunk_size_factor=group.chunk_size_factor)
        shard = bucket.size // size
        for item_id, p in enumerate(group.params):
            start, stop = items[item_id].global_data_index, items[item_id].global_data_index + p.numel()
            row = p.shape[1:].numel()
            held = [0] * size
            for rank in range(start // shard, min(size, (stop - 1) // shard + 1)):
                elements = min(stop, (rank + 1) * shard) - max(start, rank * shard)
                assert elements % row == 0, "Megatron-FSDP cut a row"
                held[rank] = elements // row
            rows[p] = held
    return rows


def muon_matrices(model, rows: dict, tp_mode: str, tensor_parallel: int = 1):
    """(dense, expert) Muon matrices, each [Matrix], as megatron_muon's factory and
    ZeROTensorParallelMuon make them under `--muon-tp-mode tp_mode` (QKV split into q, k, v
    blocks; a stack of experts split into its matrices; in duplicated mode, a matrix with a
    partition dim gathered over its TP ranks, as newton_schulz_tp does), `model` one TP rank's
    part of a model over `tensor_parallel` ranks (the experts' TP size 1)."""
    from megatron_muon.compat.tensor_parallel import orthogonalized_partition_dim
    from megatron_muon.integrations.factory import is_expert_param, is_scalar_param, tag_params
    from megatron_muon.plan import RowLayout, orthogonalization_key, qkv_row_blocks, split_matrices

    tag_params([model])
    dense, expert = [], []
    for name, p in model.named_parameters():
        if is_scalar_param(p):
            continue
        split_shapes = p.qkv_split_shapes if getattr(p, "is_qkv", False) else None
        blocks = qkv_row_blocks(p.shape[0], split_shapes) if split_shapes else None
        tp_size = 1 if is_expert_param(name, p) else tensor_parallel
        key = orthogonalization_key(p, bool(split_shapes), tp_size, tp_mode)
        partition_dim = orthogonalized_partition_dim(tp_mode, p)
        tp_gather = None if partition_dim is None else (partition_dim, tp_size)
        (expert if is_expert_param(name, p) else dense).extend(
            dataclasses.replace(matrix, tp_gather=tp_gather)
            for _, matrix in split_matrices(RowLayout(tuple(rows[p])),
                                            getattr(p, "num_stacked_experts", 1),
                                            p.shape[-1], key, blocks))
    return dense, expert


class Rates:
    """Measured rates: Newton-Schulz TFLOP/s as a function of the FLOPs of one call (batched
    calls are one call), interpolated log-log between measured points and flat beyond them; a
    bf16 matmul's TFLOP/s; seconds per element of Adam's step and of Muon's elementwise part."""

    def __init__(self, table: dict):
        self.table = table
        points = sorted(table["newton_schulz"])
        self._log_flops = [math.log(gflop * 1e9) for gflop, _ in points]
        self._log_rate = [math.log(tflops * 1e12) for _, tflops in points]

    def newton_schulz_seconds(self, flops: float) -> float:
        if flops <= 0:
            return 0.0
        x, xs, ys = math.log(flops), self._log_flops, self._log_rate
        i = min(max(bisect.bisect(xs, x), 1), len(xs) - 1)
        t = min(max((x - xs[i - 1]) / (xs[i] - xs[i - 1]), 0.0), 1.0)
        return flops / math.exp(ys[i - 1] + t * (ys[i] - ys[i - 1]))

    def __getattr__(self, name):
        return self.table[name]


def measure_rates(ns_steps: int) -> dict:
    """The rates on this machine, with the calls the optimizers make: TensorParallelMuon's
    orthogonalize (at Megatron's default precision, medium: bf16 matmuls; fp32 where bf16
    matmuls are emulated), and a matmul, torch's AdamW (foreach) and Muon's elementwise step
    as a run's rates file times them (megatron_muon.step.rates_file.device_rates)."""
    from emerging_optimizers import utils as eo_utils
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    from megatron_muon.compat.cpu import fast_newton_schulz_precision
    from megatron_muon.plan import ns_flops
    from megatron_muon.distribution.measured_cost import median_seconds
    from megatron_muon.step.rates_file import device_rates

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    big = device.type == "cuda"
    param = torch.nn.Parameter(torch.zeros(1, 1, device=device))
    muon = TensorParallelMuon([param], lr=0.01, num_ns_steps=ns_steps)
    shapes = [(1, 256, 256), (1, 512, 512), (8, 512, 512), (1, 1024, 1024), (4, 1024, 1024),
              (1, 1024, 4096), (1, 2048, 2048)]
    if big:
        shapes += [(8, 2048, 2048), (1, 4096, 14336), (1, 8192, 8192), (1, 8192, 28672)]
    newton_schulz, precision = [], fast_newton_schulz_precision()
    with eo_utils.fp32_matmul_precision(precision):
        for batch, rows, cols in shapes:
            x = torch.randn(batch, rows, cols, device=device).squeeze(0)
            flops = batch * ns_flops(rows, cols, ns_steps)
            s = median_seconds(lambda: muon.orthogonalize(param, x), device)
            newton_schulz.append([flops / 1e9, flops / s / 1e12])
            print(f"  Newton-Schulz {batch}x{rows}x{cols}: {flops / s / 1e12:.3f} TFLOP/s", flush=True)
    return dict(device=torch.cuda.get_device_name() if big else f"CPU ({os.cpu_count()} cores, "
                f"{torch.get_num_threads()} threads)", measured=time.strftime("%Y-%m-%d"),
                newton_schulz_precision=precision, newton_schulz=newton_schulz,
                **device_rates(muon, device, precision))


def step_cost(rates: Rates, args):
    """The planner's StepCost from the rates: a Newton-Schulz call's seconds at the rate of its
    FLOPs (a batched call is one call), the network's bandwidth per rank."""
    from megatron_muon.plan import StepCost

    return StepCost(lambda matrix, count: rates.newton_schulz_seconds(
        count * matrix.ns_flops(args.ns_steps)), args.bandwidth_gbps * 1e9)


class Part:
    """One exchange group's Muon matrices (dense over dp_cp, or experts over expert data
    parallelism) planned as ZeROTensorParallelMuon plans them (its defaults, the rates standing
    for what it measures): owners and batches (`owned`), then exchanges packed within each
    rank's budget (`pack`, as planned_parts calls it), how long one rank took to plan them, and
    the owners of the other placements. `base`: {mode: each rank's load in the dense part}
    (plan.rank_loads: seconds for "owner", FLOPs for "owner-by-bytes"), for an expert part
    planned beside it (distribution.interleaving); None: planned alone. `nodes`: the node of
    each of its ranks (plan.Nodes), where teams' blocks go (plan.TeamRule)."""

    def __init__(self, matrices, world, cost, team_cost=None, base=None, nodes=None):
        from megatron_muon.plan import (choose_owners, owned_batches, whole_matrix_owners,
                                        with_teams)

        start = time.perf_counter()
        if team_cost:  # --muon-max-team-size W: the plan sizes each team
            matrices = [matrix for _, _, matrix in with_teams(matrices, world, world, team_cost)]
        self.matrices, self.world, self.cost, self.nodes = matrices, world, cost, nodes
        base = base or {}
        self.owned = owned_batches(matrices, ELEMENT_BYTES, cost=cost, base=base.get("owner"),
                                   nodes=nodes)
        self.batches = self.owned.batches
        self.plan_seconds = time.perf_counter() - start
        self.owners = {"owner": self.owned.owners,
                       "owner-by-bytes": choose_owners(matrices, ELEMENT_BYTES,
                                                       base=base.get("owner-by-bytes"),
                                                       nodes=nodes)}
        if not base:  # megatron-core's placement: the parts apart
            self.owners["whole-matrix-per-rank"] = whole_matrix_owners(matrices, nodes)

    def loads(self) -> dict:
        """Each rank's load in this part as the owners of "owner" and "owner-by-bytes" weigh it
        (plan.rank_loads): the `base` of a part planned beside it."""
        from megatron_muon.plan import rank_loads

        return {"owner": rank_loads(self.matrices, self.owned.owners, self.batches,
                                    ELEMENT_BYTES, self.cost),
                "owner-by-bytes": rank_loads(self.matrices, self.owners["owner-by-bytes"],
                                             self.batches, ELEMENT_BYTES, None)}

    def pack(self, headroom: int, saved: list[int] | None = None,
             reserved: list[int] | None = None) -> None:
        """The exchanges at the default budget with `headroom` and each rank's `saved` (None:
        its saving in this part), `reserved` taken off where this part runs interleaved with
        another (plan.packed_beside; `fits`: whether every rank holds both within its budget
        apart), and, for the offloaded state, without them, as ZeROTensorParallelMuon plans them
        then; with one rank's routes through every exchange, as it builds them at
        construction."""
        from megatron_muon.distribution.exchange import OwnerRoutes
        from megatron_muon.plan import packed_beside, packed_plan

        start = time.perf_counter()
        if reserved is None:
            plan, self.fits = packed_plan(self.matrices, self.owned, ELEMENT_BYTES, None,
                                          headroom, saved), True
        else:
            plan, fits = packed_beside(self.matrices, self.owned, ELEMENT_BYTES, None, headroom,
                                       saved, reserved)
            self.fits = all(fits)
        self.exchanges, self.budgets = plan.exchanges, plan.budgets
        self.__dict__.pop("fewest_exchanges", None)
        for batches in self.exchanges:
            OwnerRoutes(self.matrices, self.owned.owners, batches, 0)
        self.plan_seconds += time.perf_counter() - start

    @functools.cached_property
    def fewest_exchanges(self) -> int:
        """The fewest exchanges its budgets allow (plan.fewest_exchanges)."""
        from megatron_muon.plan import fewest_exchanges

        return fewest_exchanges(self.matrices, self.owned.owners, self.batches, ELEMENT_BYTES,
                                self.budgets)

    @functools.cached_property
    def offloaded_exchanges(self) -> list:
        """The exchanges with the state offloaded (each rank's saving its budget)."""
        from megatron_muon.plan import packed_plan

        return packed_plan(self.matrices, self.owned, ELEMENT_BYTES, None, None).exchanges


class Planned(list):
    """planned_parts' [(Part, rank of dp_cp -> its rank in the part)], the dense part first, the
    experts' (one standing for every expert data-parallel group) planned apart; and `beside`:
    {EP rank: its expert group's Part planned beside the dense part} where the parts run
    interleaved (distribution.interleaving), else None."""

    beside: dict | None = None
    ep: int = 1
    headroom: int = 0  # the parts' apart (_pack)


def planned_parts(dense, expert, world: int, ep: int, cost, expert_cost=None,
                  expert_rank: int | None = None, teams=None,
                  interleave: bool = True) -> Planned:
    """(Part, rank of dp_cp -> its rank in the part) for the dense matrices and the experts (rank
    r of dp_cp is rank r // EP of its expert data-parallel group: megatron-core's order, expert
    parallelism varying fastest), packed as the factory packs its dense and expert Muon parts
    apart (share_headroom): a rank's budget is its saving over both parts plus the headroom over
    both. The experts part stands for the expert data-parallel group of expert-parallel rank
    `expert_rank` (dp_cp ranks r with r % EP == expert_rank), or where None for every group at
    once: each of its ranks the least saving of the dp_cp ranks it stands for. `expert_cost`:
    the experts' StepCost where it is not `cost` (a run measures one per group). `teams`: teams
    split what one rank's share cannot hold (Part): teams(ranks, stride) gives (the StepCost
    owners weigh, the cost teams are sized by, plan.Nodes) for a part of `ranks` whose ranks lie
    `stride` dp_cp ranks apart (1 for the dense part, EP for an expert group: megatron-core's
    order). Then, `interleave`, as the factory plans them together (distribution.interleave):
    `beside` (Planned)."""
    def part(matrices, ranks, stride, part_cost, base=None):
        planned = teams(ranks, stride) if teams else (part_cost, None, None)
        return Part(matrices, ranks, *planned[:2], base, planned[2])

    parts = Planned([(part(dense, world, 1, cost), lambda r: r)])
    parts.ep = ep
    if expert:
        parts.append((part(expert, world // ep, ep, expert_cost or cost), lambda r: r // ep))
    _pack(parts, world, ep, expert_rank)
    if expert and interleave:
        loads = parts[0][0].loads()
        beside = {e: part(expert, world // ep, ep, expert_cost or cost,
                          {mode: load[e::ep] for mode, load in loads.items()})
                  for e in range(ep)}
        parts.beside = _beside(parts, beside, world, ep, expert_rank)
    return parts


def nodes_in_rank_order(ranks: int, stride: int, rates: Rates, args):
    """The node of each rank of a group whose ranks lie `stride` ranks apart from rank 0 (a TP
    rank's dp_cp group: TP apart; an expert group: EP x TP), `args.gpus_per_node` to a node,
    all-reducing at the rates file's `node_all_reduce_gbps` inside one (plan.Nodes); None where
    the file has none, or one rank a node."""
    from megatron_muon.plan import Nodes

    gbps = rates.table.get("node_all_reduce_gbps")
    if not gbps or stride >= args.gpus_per_node:
        return None
    return Nodes(tuple(r * stride // args.gpus_per_node for r in range(ranks)), gbps * 1e9)


def _pack(parts, world: int, ep: int, expert_rank: int | None, groups=None) -> None:
    """Pack `parts` as share_headroom does: each rank's budget its saving over the dense part
    and its expert group's plus the headroom, the most any rank's batches alone need beyond its
    saving in either part (`parts.headroom`). Apart, the experts' part is `parts`' own, for the
    groups `expert_rank` says (planned_parts). Or `groups`: {EP rank: its expert group's Part
    planned beside the dense part}, interleaved: the dense part packed as apart, each group
    beside the dense part's working memory on its ranks, its headroom (the group's most)
    covering that and its own batches alone."""
    from megatron_muon.plan import alone_working, state_saved, working_memory

    dense = parts[0][0]
    members = [(dense, lambda r: r)] + ([(part, lambda r, e=e: r // ep if r % ep == e else None)
                                         for e, part in groups.items()] if groups else parts[1:])
    saving, need, alone_of = [0] * world, [0] * world, {}
    for part, rank_in_part in members:
        saved = state_saved(part.matrices, ELEMENT_BYTES)
        alone_of[id(part)] = alone_working(part.matrices, part.owned.owners, part.batches,
                                           ELEMENT_BYTES)
        for r in range(world):
            if rank_in_part(r) is not None:
                saving[r] += saved[rank_in_part(r)]
                need[r] = max(need[r], alone_of[id(part)][rank_in_part(r)])
    if not groups:
        parts.headroom = max([0] + [n - s for n, s in zip(need, saving)])
    held = None
    for part, rank_in_part in members:
        ranks = [r for r in range(world) if rank_in_part(r) is not None]
        if part is dense or not groups:
            in_part = [None] * part.world
            for r in ranks:
                if part is dense or expert_rank is None or r % ep == expert_rank:
                    q = rank_in_part(r)
                    in_part[q] = saving[r] if in_part[q] is None else min(in_part[q], saving[r])
            part.pack(parts.headroom, in_part)
            held = working_memory(dense.matrices, dense.owned.owners, dense.exchanges,
                                  ELEMENT_BYTES)
            continue
        alone = alone_of[id(part)]
        beside = max([parts.headroom] + [held[r] + alone[rank_in_part(r)] - saving[r]
                                          for r in ranks])
        part.pack(beside, [saving[r] for r in ranks], [held[r] for r in ranks])


def _beside(parts, beside: dict, world: int, ep: int, expert_rank: int | None):
    """`beside`, each expert group's Part planned beside the dense part as
    distribution.interleave plans it (owners counting its ranks' dense loads), packed beside
    the dense part's working memory; or None where some rank cannot hold both (the parts then
    packed apart again, the experts' for `expert_rank` as planned_parts says)."""
    _pack(parts, world, ep, None, beside)
    if parts[0][0].fits and all(part.fits for part in beside.values()):
        return beside
    _pack(parts, world, ep, expert_rank)
    return None


def with_second_moment(matrices, variant: str):
    """`matrices` as ZeROTensorParallelAdaptiveMuon plans them under --adaptive-muon-moment2-method
    `variant` (SecondMoment.planned, as GroupPlanner._with_second_moment); "muon": as they
    are."""
    from megatron_muon.core.second_moment import SECOND_MOMENTS

    if variant == "muon":
        return matrices
    return [SECOND_MOMENTS[variant].planned(m) for m in matrices]


def part_step(part: Part, mode: str, cost, args) -> dict:
    """One part's figures in `mode`: per rank (rank_figures), the seconds of its slowest rank
    (its all-to-alls synchronize the part) with and without the SYRK kernel, its collectives
    and their latency."""
    figures = rank_figures(part, mode, cost, args.ns_steps, args.gram_bytes)
    collectives, latency = collective_latency(part, mode, args.latency_us_per_rank, args.ns_steps)
    return dict(figures=figures, collectives=collectives, latency=latency,
                seconds=max(f["ns_seconds"] + f["network_seconds"] for f in figures),
                syrk_seconds=max(f["syrk_seconds"] + f["network_seconds"] for f in figures))


# The modes whose owners a part planned beside the dense part changes (Part's `base`).
JOINT_MODES = ("owner", "owner-by-bytes", "teams")


def planned_step(planned: Planned, mode: str, cost, args, ranks: int) -> dict:
    """`planned`'s step in `mode`: each rank's figures over the parts it steps (the dense part
    and its expert group's), the step's seconds with and without the SYRK kernel, and the
    collectives and their latency of the dense part and of one expert group (the groups run side
    by side). The parts one after the other (each its slowest rank: its all-to-alls synchronize
    it, the groups side by side), or, where they run interleaved (planned.beside, the owner
    modes), both in rounds: each rank's parts together, its slowest rank's (exact where each
    part is one exchange; with more, a round's scatters wait for its slowest rank in that round,
    which this leaves out)."""
    together = planned.beside is not None and mode in JOINT_MODES
    dense = planned[0][0]
    if together:
        experts = planned.beside
        expert_of = lambda r: (experts[r % planned.ep], r // planned.ep)  # noqa: E731
    elif len(planned) > 1:
        experts = {None: planned[1][0]}
        expert_of = lambda r: (planned[1][0], planned[1][1](r))  # noqa: E731
    else:
        experts, expert_of = {}, None
    figures = {id(part): part_step(part, mode, cost, args)
               for part in [dense, *experts.values()]}
    per_rank = []
    for r in range(ranks):
        sums = dict(figures[id(dense)]["figures"][r])
        if expert_of:
            part, q = expert_of(r)
            for key, value in figures[id(part)]["figures"][q].items():
                sums[key] += value
        per_rank.append(sums)
    parts = [figures[id(part)] for part in experts.values()]

    def slowest(rank_key, part_key):
        """Together: the slowest rank's `rank_key` seconds and network; apart: the dense part's
        `part_key` (its slowest rank's) and the slowest expert group's."""
        if together:
            return max(f[rank_key] + f["network_seconds"] for f in per_rank)
        return figures[id(dense)][part_key] + max([f[part_key] for f in parts], default=0.0)

    return dict(per_rank=per_rank, together=together,
                seconds=slowest("ns_seconds", "seconds"),
                syrk_seconds=slowest("syrk_seconds", "syrk_seconds"),
                collectives=figures[id(dense)]["collectives"] + max(
                    [f["collectives"] for f in parts], default=0),
                latency=figures[id(dense)]["latency"] + max([f["latency"] for f in parts],
                                                            default=0.0))


def syrk_share(matrix) -> float:
    """The share of its Newton-Schulz FLOPs a matrix keeps with emerging-optimizers' SYRK kernel
    (newton_schulz_step_tsyrk): per step X X^T (2m^2 n) and A A (2m^3) are symmetric and cost half,
    B X (2m^2 n) does not: (3m^2 n + m^3) / (4m^2 n + 2m^3), m the smaller side."""
    def flops(m, n, syrk):
        return (3 * m * m * n + m ** 3) if syrk else (4 * m * m * n + 2 * m ** 3)

    blocks = [(min(rows, matrix.cols), max(rows, matrix.cols))
              for rows in matrix.row_blocks or (matrix.shape[0],)]
    return sum(flops(m, n, True) for m, n in blocks) / sum(flops(m, n, False) for m, n in blocks)


def collective_latency(part: Part, mode: str, us_per_rank: float,
                       ns_steps: int = 5) -> tuple[int, float]:
    """One step's collectives of `part` in `mode` and their latency, seconds: an all-gather per
    matrix in allgather mode, else each exchange's gather and scatter all-to-alls, and the
    all-reduces of the teams of the rank that takes the longest in them
    (plan.team_all_reduces); each costs `us_per_rank` per rank of its group."""
    from megatron_muon.plan import team_all_reduces

    if mode == "allgather":
        return len(part.matrices), len(part.matrices) * part.world * us_per_rank * 1e-6
    count = 2 * len(part.exchanges)
    teams = team_all_reduces(part.matrices, _owners(part, mode), ns_steps).values()
    slowest = max(teams, default=[], key=lambda calls: sum(size for _, size, _ in calls))
    return (count + len(slowest),
            (count * part.world + sum(size for _, size, _ in slowest)) * us_per_rank * 1e-6)


def _owners(part: Part, mode: str) -> list[int]:
    """The owners `mode` plans: a team Part's owners are ours ("owner")."""
    return part.owners["owner" if mode == "teams" else mode]


def rank_figures(part: Part, mode: str, cost, ns_steps: int, gram_bytes: int = 4) -> list[dict]:
    """Per rank of `part`: Newton-Schulz FLOPs (a team member's: plan.newton_schulz_flops) and
    seconds (and seconds with the SYRK kernel: each owned matrix in its own call, at the plain
    call's rate on the FLOPs it keeps), bytes received and sent over the network: the
    exchange's, and its teams' all-reduces' between nodes (plan.ring_bytes of each Gram matrix,
    `gram_bytes` an element, each way, over the nodes its team is on: part.nodes, else one a
    rank); and its network seconds, those bytes' at the bandwidth and the all-reduces' inside
    nodes at theirs (plan.tiered_seconds)."""
    from megatron_muon.plan import (newton_schulz_flops, newton_schulz_seconds, owner_traffic,
                                    ring_bytes, team_all_reduces, tiered_seconds)

    world, matrices = part.world, part.matrices
    flops = [m.ns_flops(ns_steps) for m in matrices]
    if mode == "allgather":  # every rank gathers every matrix (padded shards) and runs it alone
        per_matrix = sum(cost.call_seconds(m, 1) for m in matrices)
        ns_flops, ns_seconds = [sum(flops)] * world, [per_matrix] * world
        syrk_seconds = [sum(cost.call_seconds(m, 1) * syrk_share(m) for m in matrices)] * world
        moved = sum((m.layout.ranks - 1) * m.layout.max_rows * m.cols * ELEMENT_BYTES
                    for m in matrices if len(m.layout.rows) > 1)
        received = sent = [moved] * world
    else:
        owners = _owners(part, mode)
        ns_flops = newton_schulz_flops(matrices, owners, ns_steps, world)
        syrk_seconds = [0.0] * world
        for matrix, owner in zip(matrices, owners):
            syrk_seconds[owner] += cost.call_seconds(matrix, 1) * syrk_share(matrix)
        # an owner's matrices of one batch: one batched call (plan.newton_schulz_seconds)
        ns_seconds = newton_schulz_seconds(matrices, owners, part.batches, cost)
        received, sent = owner_traffic(matrices, owners, ELEMENT_BYTES)
    network = [max(into, out) / cost.bytes_per_second for into, out in zip(received, sent)]
    for rank, calls in (team_all_reduces(matrices, owners, ns_steps, part.nodes).items()
                        if mode != "allgather" else ()):
        wire = round(sum(ring_bytes(elements * spanned / k, spanned, gram_bytes)
                         for elements, k, spanned in calls))
        received[rank] += wire
        sent[rank] += wire
        network[rank] += sum(tiered_seconds(elements, k, spanned, gram_bytes,
                                            cost.bytes_per_second, part.nodes)
                             for elements, k, spanned in calls)
    return [dict(ns_flops=ns_flops[r], ns_seconds=ns_seconds[r], syrk_seconds=syrk_seconds[r],
                 received=received[r], sent=sent[r], network_seconds=network[r])
            for r in range(world)]


def estimate(name: str, world: int, model, rates: Rates, args, tensor_parallel: int = 1) -> dict:
    """One model on `world` ranks, `tensor_parallel` of them a model's TP group (`model`: one TP
    rank's part, meta_model), data parallel over the rest: the plan's figures and the step-time
    estimates. Each rank of a TP group plans and steps its own TP-local matrices alike, so one
    of them stands for all."""
    from megatron_muon.integrations.factory import is_scalar_param, is_expert_param
    from megatron_muon.plan import team_step_cost

    ranks = world // tensor_parallel  # dp_cp: data parallel, what the plan spreads over
    ep = expert_parallel(name, ranks)
    start = time.perf_counter()
    rows = fsdp_rows(model, ranks, ranks // ep)
    layout_seconds = time.perf_counter() - start
    dense, expert = muon_matrices(model, rows, args.muon_tp_mode, tensor_parallel)
    cost = step_cost(rates, args)
    parts = planned_parts(dense, expert, ranks, ep, cost)
    # Teams sized, and their blocks placed, with their all-reduces weighed (with their latency);
    # reported below with Newton-Schulz at the rates and the all-reduces' bytes over the network
    # (rank_figures) and their latency (collective_latency).
    def teams(group_ranks, stride):
        nodes = nodes_in_rank_order(group_ranks, stride * tensor_parallel, rates, args)
        plan_cost = team_step_cost(cost, args.ns_steps, args.gram_bytes,
                                   args.latency_us_per_rank * 1e-6, nodes=nodes)
        return plan_cost, lambda matrix, k: plan_cost.call_seconds(matrix, 1), nodes

    team_parts = planned_parts(dense, expert, ranks, ep, cost, teams=teams)

    muon_elements, adam_elements, all_elements = [0] * ranks, [0] * ranks, [0] * ranks
    active = 0
    settings = MODELS[name][0]
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
                ep * settings["moe_router_topk"] / settings["num_moe_experts"] if experts else 1)

    result_memory = memory_figures(parts, ranks, all_elements, muon_elements, adam_elements)
    adam_step = max(all_elements) * rates.adam_ns_per_element * 1e-9
    tokens = args.tokens_per_step or MODELS[name][2]

    def fwd_bwd_seconds(tokens_per_step):
        return 6 * active * tokens_per_step / world / (
            rates.matmul_tflops * 1e12 * args.fwd_bwd_efficiency)

    fwd_bwd, fwd_bwd_at_nvidia = fwd_bwd_seconds(tokens), fwd_bwd_seconds(NVIDIA["tokens_per_step"])
    result = dict(model=name, world=world, tensor_parallel=tensor_parallel, data_parallel=ranks,
                  expert_parallel=ep, active_params=active,
                  tokens_per_step=tokens, fwd_bwd_ms_at_nvidia_batch=fwd_bwd_at_nvidia * 1e3,
                  muon_matrices=sum(len(part.matrices) for part, _ in parts),
                  layout_seconds=layout_seconds,
                  plan_seconds=sum(part.plan_seconds for part, _ in parts) + (
                      representative(parts)[1].plan_seconds if parts.beside else 0.0),
                  owners=sum(len(set(part.owners["owner"])) for part in representative(parts)),
                  batches=sum(len(part.batches) for part, _ in parts),
                  exchanges=sum(len(part.exchanges) for part in representative(parts)),
                  interleaved=parts.beside is not None,
                  teams=team_figures(team_parts),
                  adam_step_ms=adam_step * 1e3, fwd_bwd_ms=fwd_bwd * 1e3,
                  memory_gb=result_memory, modes={})
    elementwise = max((muon_elements[r] * rates.muon_elementwise_ns_per_element
                       + adam_elements[r] * rates.adam_ns_per_element) * 1e-9 for r in range(ranks))
    # The ideal: every rank total / W of the Newton-Schulz FLOPs of the matrices whole (a TP
    # group's ranks each their own TP-local matrices' share: total / data parallel).
    ideal = sum(sum(m.ns_flops(args.ns_steps) for m in part.matrices) * ranks / part.world
                for part, _ in parts) / ranks
    for mode in MODES:
        planned = planned_step(team_parts if mode == "teams" else parts, mode, cost, args, ranks)
        per_rank, collectives, latency = (planned[key] for key in ("per_rank", "collectives",
                                                                   "latency"))
        step, syrk_step = (elementwise + planned[key] for key in ("seconds", "syrk_seconds"))
        network = [f["network_seconds"] for f in per_rank]
        result["modes"][mode] = dict(
            busiest_ns_gflop=max(f["ns_flops"] for f in per_rank) / 1e9,
            ideal_ns_gflop=ideal / 1e9,
            busiest_over_ideal=max(f["ns_flops"] for f in per_rank) / ideal,
            max_received_mb=max(f["received"] for f in per_rank) / 1e6,
            ns_ms=max(f["ns_seconds"] for f in per_rank) * 1e3, network_ms=max(network) * 1e3,
            collectives=collectives, latency_ms=latency * 1e3,
            step_ms=step * 1e3, syrk_step_ms=syrk_step * 1e3,
            overhead=(step - adam_step) / (fwd_bwd + adam_step),
            overhead_with_latency=(step + latency - adam_step) / (fwd_bwd + adam_step),
            syrk_overhead=(syrk_step - adam_step) / (fwd_bwd + adam_step),
            overhead_at_nvidia_batch=(step - adam_step) / (fwd_bwd_at_nvidia + adam_step),
            interleaved=planned["together"])
    result["variants"] = {
        variant: variant_figures(parts if variant == "muon" else planned_parts(
            with_second_moment(dense, variant), with_second_moment(expert, variant), ranks, ep,
            cost, interleave=False), elementwise, adam_step, fwd_bwd, cost, args, ranks)
        for variant in VARIANTS}
    return result


def team_figures(parts) -> dict:
    """The teams a plan with --muon-max-team-size makes: how many matrices each part splits, the
    largest team, and the process groups created at construction (one per distinct team, here
    in one group of each part: every expert-parallel rank's group makes its own)."""
    from megatron_muon.plan import team_members

    members = [team_members(part.matrices, part.owners["owner"])
               for part in representative(parts)]
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
    working = max(owner_working(parts))
    shown = representative(parts)
    return dict(exchanges=sum(len(part.exchanges) for part in shown),
                fewest_exchanges=sum(part.fewest_exchanges for part in shown),
                collectives=collectives,
                latency_ms=latency * 1e3, step_ms=step * 1e3, working_gb=working / 1e9,
                overhead_with_latency=(step + latency - adam_step) / (fwd_bwd + adam_step))


def representative(parts: Planned) -> list:
    """The dense part and one expert group's as the owner step runs them (planned beside the
    dense part where parts.beside, else the part standing for every group)."""
    if parts.beside:
        return [parts[0][0], next(iter(parts.beside.values()))]
    return [part for part, _ in parts]


def owner_working(parts: Planned) -> list[int]:
    """Each dp_cp rank's working memory in the owner step (plan.working_memory of each part it
    steps): the parts' sum where they run interleaved (parts.beside), else their largest."""
    from megatron_muon.plan import working_memory

    def held(part):
        return working_memory(part.matrices, part.owned.owners, part.exchanges, ELEMENT_BYTES)

    dense = held(parts[0][0])
    if parts.beside:
        groups = {e: held(part) for e, part in parts.beside.items()}
        return [d + groups[r % parts.ep][r // parts.ep] for r, d in enumerate(dense)]
    return [max([d] + [held(part)[to_part(r)] for part, to_part in parts[1:]])
            for r, d in enumerate(dense)]


def memory_figures(parts, world, all_elements, muon_elements, adam_elements) -> dict:
    """GB per rank (the largest rank's of each figure): at rest, and Muon's working memory as
    the plan counts it (plan.working_memory: two exchanges in flight) with the default budget
    (owner_working: the parts' sum where they run interleaved) and with the one that keeps it
    under TRANSIENT_SHARE of an 80 GB GPU (shown with the parts one after the other: interleaved,
    they would hold both within it too); the most one matrix exchanged alone holds, which no
    budget goes below; with
    --optimizer-cpu-offload, the most state on the device at once, the bytes copied each way per
    step and their time over each host link."""
    from megatron_muon.plan import (OwnedBatches, batch_bytes, batch_matrices, largest_alone,
                                    offload_figures, packed_plan, working_memory)

    budget = int(TRANSIENT_SHARE * GPU_BYTES)
    working, at_budget, alone = owner_working(parts), [0] * world, 0
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
    offload = offload_figures([(part.matrices, part.offloaded_exchanges,
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
        f"network: {args.bandwidth_gbps:g} GB/s per rank, each way; a rank's bytes move at that "
        "rate, the larger of in and out (full duplex)",
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
        "Muon step = the slowest rank's elementwise step, plus for each exchange group (dense "
        "matrices over dp_cp, experts over expert data parallelism) its slowest rank's "
        "Newton-Schulz + network (the group's all-to-alls synchronize it), nothing overlapped (an "
        "upper bound: the exchange overlaps the next batch's gather with compute); in our owner "
        "modes the dense and expert parts are planned together and run interleaved "
        "(distribution.interleaving: the expert groups' owners counting each rank's dense load, "
        "the parts' exchanges in rounds), so there the slowest rank's both parts together "
        "(exact for one exchange a part; the variants table plans the parts apart, an upper "
        "bound); 'lat ms' and "
        "'+ latency': each collective's latency besides "
        f"({args.latency_us_per_rank:g} us per rank of its group: an all-to-all's gather and "
        "scatter per exchange, an all-gather per matrix in allgather mode; nccl-tests' "
        "alltoall_perf at 128 ranks over sockets, NVIDIA/nccl-tests#78: an upper figure)",
        "teams (--muon-max-team-size W, plan/teams.py): a matrix too large for the step split "
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
        "matrices' FLOPs over W; the optimizer sizes them alike with its measured rates (no "
        "latency; inside a node at the rate it measures over its group)",
        "Adam step = Adam's elementwise step over each rank's shard of all params (memory-bound, "
        "no communication)",
        "--optimizer-cpu-offload (plan.offload_figures): Muon's state streamed to the device "
        "exchange by exchange, two in flight, at the default budget; Adam's moments to the "
        "device whole for its step (offload_between_steps); each way at "
        + ", ".join(f"{link} {gbps:g} GB/s" for link, gbps in HOST_LINKS_GBPS.items()),
        "forward-backward = 6 x active params (without the embedding lookup) x tokens per step / "
        f"W / (matmul rate x {args.fwd_bwd_efficiency:g}); attention's own FLOPs left out (a "
        "shorter step: the overhead is overstated); tokens per step "
        + (f"{args.tokens_per_step} for every model" if args.tokens_per_step else
           "each model's own: " + ", ".join(f"{name} {MODELS[name][2] / 1e6:.1f}M"
                                           for name in args.models)
           + " (DeepSeek-V3's and Kimi K2's reports; 4M for the Llamas)"),
        "overhead = (Muon step - Adam step) / (forward-backward + Adam step): the extra time of "
        "a training step, as NVIDIA's figure (1051 / 1029 model TFLOP/s - 1 = 2.1%); "
        f"'@NVIDIA batch' at its benchmark's {NVIDIA['tokens_per_step'] / 1e6:.1f}M tokens",
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
               ("x ideal", 8, ">"),
               ("max in MB", 10, ">"), ("NS ms", 9, ">"), ("net ms", 9, ">"), ("coll", 5, ">"),
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
                        f"{m['busiest_over_ideal']:.2f}",
                        f"{m['max_received_mb']:.0f}", f"{m['ns_ms']:.4g}",
                        f"{m['network_ms']:.4g}", m["collectives"], f"{m['latency_ms']:.4g}",
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


def main():
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
    parser.add_argument("--ns-steps", type=int, default=5)
    parser.add_argument("--muon-tp-mode", choices=TP_MODES, default=OptimizerConfig.muon_tp_mode,
                        help="as Megatron's flag (default: the installed megatron-core's)")
    args = parser.parse_args()

    if args.rates:
        table = json.loads(args.rates.read_text())
    else:
        print("measuring rates on this machine ...", flush=True)
        table = measure_rates(args.ns_steps)
        if args.measure_rates:
            args.measure_rates.write_text(json.dumps(table, indent=1))
    rates = Rates(table)
    args.bandwidth_gbps = args.bandwidth_gbps or table.get("all_to_all_gbps") or 50.0
    args.gram_bytes = 2 if rates.newton_schulz_precision == "medium" else 4  # bf16 Gram matrices

    import torch.distributed as dist

    from megatron_muon.tools.testing import init_parallel_state

    # megatron-core builds models under its parallel state: one process, TP = EP = 1.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    init_parallel_state()
    results = []
    for name, tensor_parallel in ((name, tp) for name in args.models
                                  for tp in (args.tensor_parallel if is_dense(name) else [1])):
        models = {}
        for world in (w for w in args.world_sizes if w % tensor_parallel == 0):
            ep = expert_parallel(name, world // tensor_parallel)
            if ep not in models:
                models[ep] = meta_model(name, ep, tensor_parallel)
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
