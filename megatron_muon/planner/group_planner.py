"""What ZeROTensorParallelMuon plans at construction, once: its params' exchange groups (dense
params over dp_cp, experts over expert data parallelism), each param's row layout learned in one
collective, the matrices it orthogonalizes, same-shape batches (batched where exact or faster),
the rates owners by time are chosen with (measured_cost), and the owners and exchanges
(plan.owner_plan) within the working-memory budget: a GroupPlan per exchange group."""

import dataclasses
import math
import statistics
from collections import Counter

import torch
import torch.distributed as dist
from emerging_optimizers import utils as eo_utils
from torch.distributed.tensor import DTensor

from ..compat import tensor_parallel, upstream
from ..distribution.dtensor_rows import (ParamAttributes, as_rows, data_parallel_dims,
                                         data_parallel_layout, num_experts, shard_index,
                                         tp_local_rows)
from ..distribution.exchange import all_gather_ints
from ..distribution.team_groups import create_team_groups, group_nodes
from ..observe.measured_cost import measure, node_bytes_per_second, seconds_beyond_noise
from ..plan import (Matrix, Nodes, RowLayout, StepCost, batch_bytes, batch_matrices, cost_key,
                    flops_cost, gram_counts, orthogonalization_key, owned_batches, owner_bytes,
                    per_exchange_bytes, qkv_row_blocks, row_layouts, split_matrices, team_step_cost,
                    with_teams)
from .group_plan import Draft, GroupPlan
from .planned_muon import PlannedMuon

class GroupPlanner:
    """Plans a ZeROTensorParallelMuon's exchange groups (`plan`), using what the optimizer
    knows: its settings, its TP groups and QKV split, and its orthogonalize, which the rates
    time. Fills `held_rows` ({param: (start, stop, rows) of
    its TP-local matrix this rank holds}) and `batched_newton_schulz` ({(shape, batch key):
    whether same-shape matrices run in one batched call}). `reserved`: what this rank holds of
    another part's exchanges, which run interleaved with this one's
    (planner.interleaving), None where they run apart."""

    def __init__(self, muon: PlannedMuon) -> None:
        self.muon = muon
        self.held_rows: dict[DTensor, tuple[int, int, int]] = {}
        self.batched_newton_schulz: dict[tuple, bool] = {}
        self.reserved: int | None = None
        # What owners by time measured, per group: ([(FLOPs, seconds) of each shape's call as
        # the step makes it, all its iterations], the all-to-all's bytes per second); a rates
        # file's (reporting.rates_file).
        self.measured: list[tuple[list[tuple[int, float]], float]] = []
        self.node_rates: list[float] = []  # per group with teams: inside a node, bytes a second
        # The gather inside backward's batches packed first (Draft.packed), set by the factory
        # where the part gathers so (chain.backward_gather.reasons) before it packs again.
        self.ahead = False

    def plan(self, byte_slack: float | None, max_exchange_bytes: int | None,
             headroom: bool = True) -> list[GroupPlan]:
        """Every exchange group's plan. Under the default budget, `headroom`: a rank's budget
        is its saving plus what the step must exceed a rank's saving anyway (packed); False
        (the state offloaded: device memory first): each rank's saving in the group."""
        self.drafts = [self._draft_group(params, group, byte_slack, max_exchange_bytes)
                       for (group, _), params in self._exchange_groups().items()]
        if self.muon.max_team_size > 1:
            create_team_groups(self.drafts)
        self._max_exchange_bytes = max_exchange_bytes
        self._with_headroom = headroom and max_exchange_bytes is None
        self.headroom = 0
        plans = self.packed()
        if (dist.get_rank() == 0 and self.muon.dist_mode == "owner"
                and max_exchange_bytes is not None):
            _say_which_go_alone(self.muon, plans, max_exchange_bytes)
        _say_where_gram_runs(self.muon, plans)
        return plans

    def saving(self) -> int:
        """What Muon's state saves this rank against Adam's, over its groups (plan.state_saved)."""
        return sum(draft.saved()[draft.rank] for draft in self.drafts)

    def need(self) -> int:
        """The most this rank's batches alone need in any of its groups (plan.alone_working)."""
        return max([0] + [draft.alone()[draft.rank] for draft in self.drafts])

    def packed(self, saving: int | None = None, need: int | None = None,
               least_headroom: int = 0) -> list[GroupPlan]:
        """The groups' plans: a rank's budget is its `saving` over every group it steps
        (whichever Muon part steps them, one after the other or interleaved; None: this
        planner's)
        plus the headroom, the most any rank's `need` (None: this planner's) exceeds its
        saving (plan.rank_budgets), at least `least_headroom`. Each group gathers its ranks'
        savings and headroom (one collective) and passes the largest headroom on to the next
        group; `headroom`: the last. With `reserved`, each rank's budget less that (gathered
        with them). With `ahead`, the gather inside backward's batches first (Draft.packed)."""
        if not self._with_headroom and self.reserved is None:
            return [draft.packed(self._max_exchange_bytes, None, ahead=self.ahead)
                    for draft in self.drafts]
        saving = self.saving() if saving is None else saving
        need = self.need() if need is None else need
        self.headroom, plans = max(least_headroom, need - saving, 0), []
        for draft in self.drafts:
            table = all_gather_ints([saving, self.headroom, self.reserved or 0], draft.group,
                                    draft.params[0].to_local().device)
            reserved = None if self.reserved is None else [row[2] for row in table]
            if not self._with_headroom:
                plans.append(draft.packed(self._max_exchange_bytes, None, None, reserved,
                                          self.ahead))
                continue
            self.headroom = max(row[1] for row in table)
            plans.append(draft.packed(None, self.headroom, [row[0] for row in table], reserved,
                                      self.ahead))
        return plans

    def _exchange_group(self, p: DTensor):
        dims = data_parallel_dims(p)
        size = math.prod(p.device_mesh.size(dim) for dim in dims)
        dp_group = self.muon.dp_group
        if dp_group is not None:
            if dp_group.size() != size:
                raise ValueError(
                    f"{self.muon.name_of(p)}: dp_group has {dp_group.size()} ranks but the param "
                    f"is data-parallel over {size} ({p.device_mesh})")
            return dp_group
        if len(dims) == 1:
            return p.device_mesh.get_group(dims[0])
        names = p.device_mesh.mesh_dim_names
        return upstream.flatten_mesh(p.device_mesh[tuple(names[dim] for dim in dims)]).get_group()

    def _exchange_groups(self) -> dict:
        """{(process group, data-parallel layout): its params}: dense params over dp_cp, experts
        over expert data parallelism, each exchanged within its group."""
        by_group: dict[tuple[dist.ProcessGroup, tuple], list[DTensor]] = {}
        for p in (p for group in self.muon.param_groups for p in group["params"]):
            by_group.setdefault((self._exchange_group(p), data_parallel_layout(p)), []).append(p)
        return by_group

    @staticmethod
    def _learn_layouts(params: list, group) -> list[RowLayout]:
        """Each param's row layout over `group`: which shard each rank holds and how many rows
        (one collective for all of them, at construction, never per step)."""
        table = all_gather_ints(
            [shard_index(params[0])] + [as_rows(p.to_local()).shape[0] for p in params],
            group, params[0].to_local().device)
        return row_layouts([row[0] for row in table], [row[1:] for row in table],
                           [tp_local_rows(p) for p in params])

    def _draft_group(self, params: list, group, byte_slack: float | None,
                     max_exchange_bytes: int | None) -> Draft:
        layouts = self._learn_layouts(params, group)
        rank = dist.get_rank(group)
        whole = []  # (param index, first row in it, matrix)
        for index, (p, layout) in enumerate(zip(params, layouts)):
            self.held_rows[p] = (*layout.row_range(rank), layout.num_rows)
            cols = p.to_local().shape[-1]
            whole.extend((index, start, _with_gram(self.muon, _with_tp_gather(
                self.muon, self._with_second_moment(matrix), p), p))
                         for start, matrix in split_matrices(layout, num_experts(p), cols,
                                                             self._batch_key(p),
                                                             self._row_blocks(p)))
        matrices = [matrix for _, _, matrix in whole]
        representatives = {}  # a matrix and its param of each cost key, in plan order
        for index, _, matrix in whole:
            representatives.setdefault(cost_key(matrix), (matrix, params[index]))
        batchable = self._batchable(matrices, representatives)
        element_bytes = params[0].element_size()
        cost = None
        if self.muon.dist_mode == "owner" and self.muon.owner_choice == "time":
            cost = self._measure_cost(matrices, representatives, batchable, group, element_bytes,
                                      batch_bytes(matrices, element_bytes, max_exchange_bytes))
        self.batched_newton_schulz.update((key[:2], True) for key in batchable)
        nodes = self._nodes(group, cost, params[0]) if self.muon.max_team_size > 1 else None
        matrices, pieces, cost = _split_over_teams(whole, layouts, rank, group.size(), self.muon,
                                                   cost, nodes)
        # TP ranks hold equally shaped TP-local matrices laid out alike and agree on the
        # measured cost, so they pick the same owners: TP Newton-Schulz then meets its TP peers
        # on the same matrix.
        choosing = dict(byte_slack=byte_slack, max_exchange_bytes=max_exchange_bytes, nodes=nodes)
        owned = owned_batches(matrices, element_bytes, cost=cost, **choosing)
        return Draft(params, matrices, pieces, owned, group, cost, choosing)

    def _nodes(self, group, cost: StepCost | None, param: DTensor) -> Nodes:
        """The nodes of `group`'s ranks (distribution.team_groups.group_nodes), with the rate
        measured between two ranks of one node (measured_cost.node_bytes_per_second, agreed with
        the TP peers of `param`'s group), else the group's; without a measured cost nothing
        weighs seconds: the nodes place teams, no more."""
        nodes = group_nodes(group, cost.bytes_per_second if cost else math.inf)
        if cost is None:
            return nodes
        tp_group = self.muon.tp_group_of(ParamAttributes(param))
        rate = node_bytes_per_second(group, nodes, self.muon.device(), [tp_group])
        if rate is None:
            return nodes
        self.node_rates.append(rate)
        return dataclasses.replace(nodes, bytes_per_second=rate)

    @torch.no_grad()
    def _measure_cost(self, matrices: list[Matrix], representatives: dict, batchable: set,
                      group, element_bytes: int, max_batch_bytes: int) -> StepCost:
        """The group's StepCost from measured_cost.measure: each shape's Newton-Schulz call as the
        step makes it: on one matrix, or, where it is batched (`_batchable`), on as many as an
        owner gets of its largest batch spread over the group (at least 2). A shape's seconds
        follow its FLOPs unless its own rate stands apart beyond the noise
        (measured_cost.seconds_beyond_noise). One all-to-all gives the bandwidth. The figures'
        median spread is the StepCost's: owners leave byte-first only for a gain that outlasts it
        (plan.choose_owners_by_time)."""
        largest_batch: dict = {}
        for batch in batch_matrices(matrices, max_batch_bytes, element_bytes):
            key = cost_key(matrices[batch[0]])
            largest_batch[key] = max(largest_batch.get(key, 0), len(batch))
        # Batched calls are timed only where a batch holds two matrices or more (a sample of at
        # most max_batch_bytes of owner_bytes then; a shape whose batches hold one never runs
        # batched).
        timed_batched = {key for key in batchable if largest_batch[key] > 1}
        runs = []
        for key, (matrix, p) in representatives.items():
            count = (max(2, math.ceil(largest_batch[key] / group.size()))
                     if key in timed_batched else 1)
            device = p.to_local().device
            sample = torch.randn((count, *matrix.shape), device=device,
                                 generator=torch.Generator(device).manual_seed(0))
            orthogonalize = self.muon.orthogonalize_full
            matrices_in = sample if key in timed_batched else sample[0]  # as the step calls it
            runs.append((count, lambda p=p, full=matrices_in: orthogonalize(p, full)))
        first_param = next(iter(representatives.values()))[1]
        tp_group = self.muon.tp_group_of(ParamAttributes(first_param))
        with eo_utils.fp32_matmul_precision(self.muon.fp32_matmul_prec):
            per_matrix, bytes_per_second = measure(runs, group, [tp_group], self.muon.device())
        calls = dict(zip(representatives, per_matrix))
        steps = self.muon.newton_schulz_settings["num_ns_steps"]
        self.measured.append(([
            (count * matrix.ns_flops(steps), count * measured.seconds)
            for (count, _), (matrix, _), measured in zip(runs, representatives.values(), per_matrix)
        ], bytes_per_second))
        seconds = seconds_beyond_noise(  # FLOPs of one iteration: the step count scales all alike
            {key: matrix.ns_flops(steps=1) for key, (matrix, _) in representatives.items()}, calls)
        return StepCost(lambda matrix, count: count * seconds[cost_key(matrix)], bytes_per_second,
                        spread=statistics.median(m.spread for m in per_matrix))

    def _with_second_moment(self, matrix: Matrix) -> Matrix:
        """`matrix` with the columns of state an adaptive variant's second moment sends beside its
        rows and holds per row (core/second_moment.py's SecondMoment)."""
        moment = self.muon.second_moment
        return matrix if moment is None else moment.planned(matrix)

    def _row_blocks(self, p) -> tuple[int, ...] | None:
        """Rows of the q, k and v blocks Newton-Schulz sees for a QKV-split param (for its cost)."""
        attrs = ParamAttributes(p)
        if not self.muon.splits_qkv(attrs):
            return None
        shapes = getattr(attrs, "qkv_split_shapes", None) or self.muon.qkv_split_shapes
        return qkv_row_blocks(tp_local_rows(p), shapes)

    def _batch_key(self, p) -> tuple | None:
        attrs = ParamAttributes(p)
        tp_group = self.muon.tp_group_of(attrs)
        return orthogonalization_key(attrs, self.muon.splits_qkv(attrs),
                                     tp_group.size() if tp_group is not None else 1,
                                     self.muon.tp_mode)

    def _batchable(self, matrices: list[Matrix], representatives: dict) -> set:
        """The cost keys whose same-shape matrices an owner orthogonalizes in one batched call:
        shapes two of the group's matrices share, that orthogonalize alike, at `medium`/`low`/
        `high` (bf16/tf32 matmuls), where batched kernels round differently by less than that
        precision's own error (docs/design.md, "Library"). Never at fp32 `highest`, which
        promises megatron-core's bits: neither batched GEMM kernels nor the batched norm
        reproduce per-matrix calls bit for bit, and where they differ depends on the values (on
        an H200: 2.5e-5 on the self-test's second 1024x1024 linear_proj, 0 on random pairs of
        that shape), so no probe at construction can prove a shape safe."""
        if self.muon.use_syrk or self.muon.fp32_matmul_prec == "highest":  # syrk: 2-D only
            return set()
        counts = Counter(cost_key(matrix) for matrix in matrices)
        return {key for key, (matrix, _) in representatives.items()
                if matrix.batch_key is not None and counts[key] > 1}


def _say_which_go_alone(muon: PlannedMuon, plans: list[GroupPlan], max_exchange_bytes: int) -> None:
    """One line on rank 0: the matrices that alone need more than half of the working-memory
    budget the user set (each goes alone in its batch), the largest named with its size.
    Under the default budget (what Muon's state saves a rank, and what the step needs
    anyway) the line would tell the user nothing to act on."""
    needs = [(owner_bytes(matrix, plan.param_of(i).element_size()), plan, i)
             for plan in plans for i, matrix in enumerate(plan.matrices)]
    alone = [need for need in needs if need[0] > per_exchange_bytes(max_exchange_bytes)]
    if not alone:
        return
    largest, plan, i = max(alone, key=lambda item: item[0])
    rows, cols = plan.matrices[i].shape
    print(f"megatron-muon: {len(alone)} Muon matrices each need more than half of "
          f"--muon-max-exchange-bytes ({max_exchange_bytes / 2**20:.1f} MiB) and are "
          f"orthogonalized alone; the largest, {muon.name_of(plan.param_of(i))} "
          f"({rows}x{cols}, {rows * cols * plan.param_of(i).element_size() / 2**20:.1f} "
          f"MiB), needs {largest / 2**20:.1f} MiB on its owner", flush=True)


def _with_tp_gather(muon: PlannedMuon, matrix: Matrix, p: DTensor) -> Matrix:
    """`matrix` with what emerging_optimizers' newton_schulz_tp all-gathers before
    Newton-Schulz: in duplicated mode, a matrix TensorParallelMuon.orthogonalize hands a TP
    partition (compat.tensor_parallel.orthogonalize_partition)."""
    partition = tensor_parallel.orthogonalize_partition(
        muon.tp_mode, muon.pg_collection, ParamAttributes(p))
    if muon.tp_mode != "duplicated" or partition is None:
        return matrix
    partition_dim, tp_group = partition
    return dataclasses.replace(matrix, tp_gather=(partition_dim, tp_group.size()))


def _with_gram(muon: PlannedMuon, matrix: Matrix, p: DTensor) -> Matrix:
    """`matrix` with the Gram schedule its owner runs where it takes fewer FLOPs
    (--muon-gram-newton-schulz), where Newton-Schulz gets it whole: no TP partition handed to
    it, or a TP group of one (core.gram_newton_schulz.scaled_orthogonalize_fn)."""
    partition = tensor_parallel.orthogonalize_partition(
        muon.tp_mode, muon.pg_collection, ParamAttributes(p))
    whole = partition is None or tensor_parallel.newton_schulz_gets_it_whole(*partition[::-1])
    if muon.gram is None or not whole:
        return matrix
    return dataclasses.replace(matrix, gram=muon.gram)


def _say_where_gram_runs(muon: PlannedMuon, plans: list[GroupPlan]) -> None:
    """One line on rank 0: of the matrices Newton-Schulz runs on (a QKV split's blocks each), how
    many take Gram Newton-Schulz, and why the others do not: their shape (Gram would cost as many
    FLOPs or more) or a TP partition (Newton-Schulz over the TP group). Nothing without
    --muon-gram-newton-schulz."""
    if dist.get_rank() != 0 or muon.gram is None:
        return
    gram, by_shape, partitioned = gram_counts(
        matrix for plan in plans for matrix in plan.matrices)
    total = gram + by_shape + partitioned
    why = [f"{by_shape} by their shape (square or nearly: no fewer FLOPs)"] if by_shape else []
    if partitioned:
        why.append(f"{partitioned} partitioned over tensor parallelism under --muon-tp-mode "
                   f"{muon.tp_mode}")
    rest = f"; standard Newton-Schulz on {', '.join(why)}" if why else ""
    print(f"megatron-muon: --muon-gram-newton-schulz: {type(muon).__name__}: Gram Newton-Schulz "
          f"on {gram} of {total} matrices{rest}", flush=True)


def _with_teams_cost(cost: StepCost | None, matrices: list[Matrix], muon: PlannedMuon,
                     nodes: Nodes | None) -> tuple:
    """(what teams are sized by, what owners by time weigh): every matrix's FLOPs at the measured
    rate of the group's largest (whole or a member's part: a small matrix's measured call is
    mostly fixed cost, which a split does not shrink), a team's all-reduces at the measured
    all-to-all bandwidth, no latency (the Gram matrix bf16 at `medium`, newton_schulz's cast,
    else fp32: plan.team_step_cost, on `nodes`); owners weigh a team's block by it, any other
    matrix by its measured call. Without a measured cost (owners by bytes): FLOPs, and no
    StepCost."""
    if cost is None or muon.max_team_size == 1:
        return flops_cost, cost
    largest = max(matrices, key=lambda matrix: matrix.ns_flops(steps=1))
    per_flop = cost.call_seconds(largest, 1) / max(largest.ns_flops(steps=1), 1)
    by_flops = StepCost(lambda matrix, count: count * matrix.ns_flops(steps=1) * per_flop,
                        cost.bytes_per_second)
    teams = [muon.newton_schulz_settings["num_ns_steps"],
             2 if muon.fp32_matmul_prec == "medium" else 4, 0.0, per_flop, nodes]
    sized = team_step_cost(by_flops, *teams)
    return (lambda matrix, k: sized.call_seconds(matrix, 1)), team_step_cost(cost, *teams)


def _split_over_teams(whole: list[tuple[int, int, Matrix]], layouts: list[RowLayout], rank: int,
                      ranks: int, muon: PlannedMuon, measured: StepCost | None,
                      nodes: Nodes | None) -> tuple:
    """(matrices, pieces, cost): the group's matrices, `whole` ((param index, first row in the
    param, matrix)) with those a team takes split into its blocks (plan.with_teams, sized as
    _with_teams_cost says from the `measured` cost); where this rank's rows of each sit in its
    param's local shard ((param index, first, end): GroupPlan.pieces); the cost owners by time
    weigh them by."""
    sized, cost = _with_teams_cost(measured, [matrix for _, _, matrix in whole], muon, nodes)
    matrices, pieces = [], []
    for j, start, matrix in with_teams([matrix for _, _, matrix in whole], ranks,
                                       muon.max_team_size, sized):
        index, first = whole[j][0], whole[j][1] + start
        matrices.append(matrix)
        pieces.append((index, *layouts[index].local_range(rank, first, first + matrix.shape[0])))
    return matrices, pieces, cost
