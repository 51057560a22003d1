"""An exchange group's Muon matrices planned as ZeROTensorParallelMuon plans them at construction
(Part), the dense and expert parts packed and interleaved as the factory does (planned_parts),
from rates measured on a device (Rates)."""

import bisect
import math
import time

import torch

from ..cpu.torch_compat import fast_newton_schulz_precision
from ..distribution.exchange import OwnerRoutes
from ..observe.measured_cost import median_seconds
from ..plan import (Nodes, StepCost, alone_working, choose_owners, fewest_exchanges, ns_flops,
                    owned_batches, packed_beside, packed_plan, rank_loads, state_saved,
                    whole_matrix_owners, with_teams, working_memory)
from ..reporting.rates_file import device_name, device_rates

ELEMENT_BYTES = 4  # fp32 main weights, momentum and updates
# A collective's latency, beside its bytes at the bandwidth: this many microseconds per rank of
# its group (an all-to-all of small messages is a send and a receive with each peer; a ring
# all-gather N - 1 steps). nccl-tests' alltoall_perf took 324 us at 512 bytes over 128 ranks, 16
# per node (NVIDIA/nccl-tests#78: NCCL 2.8.4 over sockets, an old and slow network: an upper
# figure for InfiniBand), 2.5 us per rank.
LATENCY_US_PER_RANK = 2.5


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
        t = min(max((x - xs[i - 1]) / ((xs[i] - xs[i - 1]) or 1.0), 0.0), 1.0)  # 1 point: flat
        return flops / math.exp(ys[i - 1] + t * (ys[i] - ys[i - 1]))

    def __getattr__(self, name):
        return self.table[name]


# The calls measure_rates times (batch, rows, cols): a spread from 256 x 256 up, and on a GPU
# Llama's and DeepSeek's largest.
SHAPES = [(1, 256, 256), (1, 512, 512), (8, 512, 512), (1, 1024, 1024), (4, 1024, 1024),
          (1, 1024, 4096), (1, 2048, 2048)]
GPU_SHAPES = [(8, 2048, 2048), (1, 4096, 14336), (1, 8192, 8192), (1, 8192, 28672)]


def measure_rates(ns_steps: int, shapes=None, report=print, device_too: bool = True) -> dict:
    """The rates on this machine, with the calls the optimizers make: TensorParallelMuon's
    orthogonalize on `shapes` (default SHAPES, and GPU_SHAPES on a GPU; calls of equal FLOPs
    averaged), at Megatron's default precision (medium: bf16 matmuls; fp32 where bf16 matmuls
    are emulated), each call's rate given to `report`; and, `device_too`, a matmul, torch's
    AdamW (foreach) and Muon's elementwise step as a run's rates file times them
    (megatron_muon.reporting.rates_file.device_rates)."""
    from emerging_optimizers import utils as eo_utils
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon


    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    big = device.type == "cuda"
    param = torch.nn.Parameter(torch.zeros(1, 1, device=device))
    muon = TensorParallelMuon([param], lr=0.01, num_ns_steps=ns_steps)
    shapes = shapes or SHAPES + (GPU_SHAPES if big else [])
    by_flops, precision = {}, fast_newton_schulz_precision()
    with eo_utils.fp32_matmul_precision(precision):
        for batch, rows, cols in shapes:
            x = torch.randn(batch, rows, cols, device=device).squeeze(0)
            flops = batch * ns_flops(rows, cols, ns_steps)
            s = median_seconds(lambda: muon.orthogonalize(param, x), device)
            by_flops.setdefault(flops, []).append(flops / s / 1e12)
            if report:
                report(f"  Newton-Schulz {batch}x{rows}x{cols}: {flops / s / 1e12:.3f} TFLOP/s")
    newton_schulz = [[flops / 1e9, sum(rates) / len(rates)]
                     for flops, rates in sorted(by_flops.items())]
    return dict(device=device_name(device), measured=time.strftime("%Y-%m-%d"),
                newton_schulz_precision=precision, newton_schulz=newton_schulz,
                **(device_rates(muon, device, precision) if device_too else {}))


def step_cost(rates: Rates, args):
    """The planner's StepCost from the rates: a Newton-Schulz call's seconds at the rate of its
    FLOPs (a batched call is one call), the network's bandwidth per rank."""
    return StepCost(lambda matrix, count: rates.newton_schulz_seconds(
        count * matrix.ns_flops(args.ns_steps)), args.bandwidth_gbps * 1e9)


class Part:
    """One exchange group's Muon matrices (dense over dp_cp, or experts over expert data
    parallelism) planned as ZeROTensorParallelMuon plans them (its defaults, the rates standing
    for what it measures): owners and batches (`owned`), then exchanges packed within each
    rank's budget (`pack`, as planned_parts calls it), how long one rank took to plan them, and
    the owners of the other placements. `base`: {mode: each rank's load in the dense part}
    (plan.rank_loads: seconds for "owner", FLOPs for "owner-by-bytes"), for an expert part
    planned beside it (planner.interleaving); None: planned alone. `nodes`: the node of
    each of its ranks (plan.Nodes), where teams' blocks go (plan.TeamRule)."""

    def __init__(self, matrices, world, cost, team_cost=None, base=None, nodes=None):
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
        return {"owner": rank_loads(self.matrices, self.owned.owners, self.batches,
                                    ELEMENT_BYTES, self.cost),
                "owner-by-bytes": rank_loads(self.matrices, self.owners["owner-by-bytes"],
                                             self.batches, ELEMENT_BYTES, None)}

    def pack(self, headroom: int, saved: list[int] | None = None,
             reserved: list[int] | None = None, ahead: bool = False) -> None:
        """The exchanges at the default budget with `headroom` and each rank's `saved` (None:
        its saving in this part), `reserved` taken off where this part runs interleaved with
        another (plan.packed_beside; `fits`: whether every rank holds both within its budget
        apart), `ahead`: with the gather inside backward's batches first (`early`, in its
        first `ahead` exchanges), and, for the offloaded state, without them, as
        ZeROTensorParallelMuon plans them then; with one rank's routes through every exchange,
        as it builds them at construction."""
        start = time.perf_counter()
        if reserved is None:
            plan, self.fits = packed_plan(self.matrices, self.owned, ELEMENT_BYTES, None,
                                          headroom, saved, ahead=ahead), True
        else:
            plan, fits = packed_beside(self.matrices, self.owned, ELEMENT_BYTES, None, headroom,
                                       saved, reserved, ahead)
            self.fits = all(fits)
        self.exchanges, self.budgets = plan.exchanges, plan.budgets
        self.ahead, self.early = plan.ahead, plan.early
        for batches in self.exchanges:
            OwnerRoutes(self.matrices, self.owned.owners, batches, 0)
        self.plan_seconds += time.perf_counter() - start

    def fewest_exchanges(self) -> int:
        """The fewest exchanges its budgets allow (plan.fewest_exchanges)."""
        return fewest_exchanges(self.matrices, self.owned.owners, self.batches, ELEMENT_BYTES,
                                self.budgets)

    def offloaded_exchanges(self) -> list:
        """Its exchanges with the state offloaded (each rank's saving its budget)."""
        return packed_plan(self.matrices, self.owned, ELEMENT_BYTES, None, None).exchanges

    def working(self) -> list[int]:
        """Each of its ranks' working memory in the owner step (plan.working_memory)."""
        return working_memory(self.matrices, self.owned.owners, self.exchanges, ELEMENT_BYTES)


class Planned(list):
    """planned_parts' [(Part, rank of dp_cp -> its rank in the part)], the dense part first, the
    experts' (one standing for every expert data-parallel group) planned apart; and `beside`:
    {EP rank: its expert group's Part planned beside the dense part} where the parts run
    interleaved (planner.interleaving), else None."""

    beside: dict | None = None
    ep: int = 1
    headroom: int = 0  # the parts' apart (_pack)
    ahead: bool = False  # packed for the gather inside backward (planned_parts)

    def representative(self) -> list[Part]:
        """The dense part and one expert group's as the owner step runs them (planned beside
        the dense part where `beside`, else the part standing for every group)."""
        if self.beside:
            return [self[0][0], next(iter(self.beside.values()))]
        return [part for part, _ in self]

    def most_ahead(self) -> list[Part]:
        """The dense part and the expert group gathering the most exchanges inside backward (of
        those planned beside the dense part, else the part standing for every group): each
        group packs its own (Part.pack), and a step waits for the slowest."""
        if self.beside:
            return [self[0][0], max(self.beside.values(), key=lambda part: part.ahead)]
        return [part for part, _ in self]

    def owner_working(self) -> list[int]:
        """Each dp_cp rank's working memory in the owner step (Part.working of each part it
        steps): the parts' sum where they run interleaved (`beside`), else their largest."""
        dense = self[0][0].working()
        if self.beside:
            groups = {e: part.working() for e, part in self.beside.items()}
            return [d + groups[r % self.ep][r // self.ep] for r, d in enumerate(dense)]
        others = [(part.working(), to_part) for part, to_part in self[1:]]
        return [max([d] + [held[to_part(r)] for held, to_part in others])
                for r, d in enumerate(dense)]


def planned_parts(dense, expert, world: int, ep: int, cost, expert_cost=None,
                  expert_rank: int | None = None, teams=None,
                  interleave: bool = True, ahead: bool = False) -> Planned:
    """(Part, rank of dp_cp -> its rank in the part) for the dense matrices and the experts
    (dp_cp rank r is rank r // EP of its expert data-parallel group: megatron-core's order),
    packed as the factory packs its parts apart (share_headroom: a rank's budget its saving
    over both parts plus the headroom over both), the experts' part standing for the group of
    expert-parallel rank `expert_rank` (None: for every group, each rank the least saving of
    those it stands for). `expert_cost`: the experts' StepCost where not `cost`. `teams`:
    teams(ranks, stride) gives (the StepCost owners weigh, the cost teams are sized by,
    plan.Nodes) for a part whose ranks lie `stride` dp_cp ranks apart. Then, `interleave`, as
    the factory plans them together (distribution.interleave): `beside` (Planned). `ahead`:
    packed for --muon-gather-inside-backward (Part.pack)."""
    def part(matrices, ranks, stride, part_cost, base=None):
        planned = teams(ranks, stride) if teams else (part_cost, None, None)
        return Part(matrices, ranks, *planned[:2], base, planned[2])

    parts = Planned([(part(dense, world, 1, cost), lambda r: r)])
    parts.ep, parts.ahead = ep, ahead
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
            part.pack(parts.headroom, in_part, ahead=parts.ahead)
            held = dense.working()
            continue
        alone = alone_of[id(part)]
        beside = max([parts.headroom] + [held[r] + alone[rank_in_part(r)] - saving[r]
                                          for r in ranks])
        part.pack(beside, [saving[r] for r in ranks], [held[r] for r in ranks], parts.ahead)


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
