"""Teams (--muon-max-team-size): a matrix whose Newton-Schulz alone exceeds its share split over
a team of ranks along its long side (row blocks of a tall matrix, column blocks of a wide one),
orthogonalized in megatron-core's "distributed" form. The plan's choice on shapes alone; the
team's Newton-Schulz against megatron-core's TensorParallelMuon in tp_mode "distributed" over a
group of the same size (bit for bit) and against single-device Muon (within the fp32 reordering
bound); whole steps on Megatron-FSDP with uneven shards, HSDP and the state offloaded; what a
step does against what the plan counts; the check interval on a team."""

import copy
import dataclasses
from collections import Counter
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from emerging_optimizers import utils as eo_utils
from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon
from torch.utils.flop_counter import FlopCounterMode

from fsdp_models import (MUON_KWARGS, assert_offload_as_planned, batch, full_tensor, fully_shard,
                         make_models, muon_param_groups, reference_optimizers, split_params,
                         step_beside_reference, with_gram_newton_schulz)
from megatron_muon import ZeROTensorParallelMuon, get_megatron_optimizer
from megatron_muon.core.checks import MuonCheckError
from megatron_muon.core.settings import tensor_parallel_muon_settings
from megatron_muon.compat import upstream
from megatron_muon.compat.newton_schulz_loop import distributed_newton_schulz
from megatron_muon.core.team_newton_schulz import (orthogonalized_by_team, reordering_bound,
                                                   team_orthogonalize)
from megatron_muon.observe.collectives import Traffic, observed
from megatron_muon.observe.measured_cost import node_bytes_per_second
from megatron_muon.reporting.rates_file import rates_table
from megatron_muon.plan import (Matrix, Nodes, RowLayout, StepCost, applies_gram_twice,
                                batch_matrices, choose_owners, choose_owners_by_time,
                                newton_schulz_flops, ring_bytes, team_all_reduces, team_blocks,
                                team_members, team_sizes, tiered_seconds, whole_matrix_owners,
                                with_teams)
from megatron_muon.plan.layouts import team_ns_flops
from megatron_muon.reporting.step_report import step_scalars
from megatron_muon.tools.testing import (TINY, fsdp_gpt, init_parallel_state, lm_loss,
                                         optimizer_config)
from tolerances import ATOL, muon_drift, reordering_error

STEPS = 4
# A one-layer GPT whose fc1 and fc2 (32x the model's width) teams split at W=4: by halves, the
# four blocks and the rest fit four ranks (at 8x the whole matrices go to two ranks already).
TEAM_GPT = dataclasses.replace(TINY, layers=1, ffn=32 * TINY.hidden)


def _matrix(rows, cols, shards=4, **fields):
    q, r = divmod(rows, shards)
    layout = RowLayout(tuple([q + 1] * r + [q] * (shards - r)))
    return Matrix(layout, cols, fields.pop("batch_key", (None, False)), **fields)


def test_a_dominant_tall_matrix_goes_to_the_smallest_team_within_the_share():
    big, small = _matrix(4096, 256), _matrix(256, 256)
    matrices = [big] + [small] * 6
    share = sum(m.ns_flops(1) for m in matrices) / 4
    sizes = team_sizes(matrices, ranks=4, max_team=4)
    assert sizes[1:] == [1] * 6  # within the share alone
    k = sizes[0]
    assert k > 1 and team_blocks(big, k, 0)[0][1].ns_flops(1) <= share
    assert team_blocks(big, k - 1, 0)[0][1].ns_flops(1) > share or k == 2
    assert team_sizes(matrices, ranks=4, max_team=1) == [1] * 7  # the flag keeps them whole


def test_only_plainly_orthogonalized_matrices_are_split():
    ranks = 4
    for matrix in (_matrix(4096, 256, batch_key=None),  # QKV split or TP Newton-Schulz
                   _matrix(4096, 256, state_cols=1)):  # a second moment beside it
        assert team_sizes([matrix, _matrix(8, 8)], ranks, ranks) == [1, 1]
    # A wide matrix: its long side, its columns, in blocks; each block all of its rows.
    wide = _matrix(256, 4096)
    (k, _) = team_sizes([wide, _matrix(8, 8)], ranks, ranks)
    blocks = team_blocks(wide, k, 0)
    assert k > 1 and [start for start, _ in blocks] == [0] * k
    assert [b.shape for _, b in blocks] == [(256, 4096 // k)] * k
    assert all(b.layout == wide.layout and b.team.dim == 1 for _, b in blocks)
    # A wide matrix of fewer rows than ranks still splits its columns over all of them.
    assert team_sizes([_matrix(4, 4096, shards=8), _matrix(4, 4, shards=8)], 8, 8) == [8, 1]


def test_blocks_cover_the_matrix_and_batch_together():
    big = _matrix(1001, 64, shards=8)
    planned = with_teams([big, _matrix(64, 64, shards=8), big], ranks=8, max_team=3)
    firsts = [(index, start, m.shape[0]) for index, start, m in planned if index == 0]
    assert [start for _, start, _ in firsts] == [0, 334, 668] and sum(r for *_, r in firsts) == 1001
    matrices = [m for _, _, m in planned]
    # Every team one batch, whatever the bytes allow; its blocks' layouts are the matrix's rows.
    teams = [b for b in batch_matrices(matrices, 1, 4) if matrices[b[0]].team]
    assert sorted(len(b) for b in teams) == [3, 3]
    assert {matrices[b[0]].team.team for b in teams} == {0, 2}
    held = [sum(matrices[i].layout.held(r) for i in teams[0]) for r in range(8)]
    assert held == list(big.layout.rows)
    # A member's part: its rows' share of X X^T and B X, and the whole A A.
    assert sum(matrices[i].ns_flops(1) for i in teams[0]) == big.ns_flops(1) + 2 * 2 * 64 ** 3


def test_a_member_shorter_than_the_gram_side_applies_it_twice():
    """A square matrix over 4: each member's 64 of 256 columns cost 6 g^2 l an iteration (X X^T,
    A X, A (bX + cAX)), together the whole matrix's 6 g^3, where forming A A would cost each
    4 g^2 l + 2 g^3 (2.5x the whole in all)."""
    square = _matrix(256, 256)
    blocks = [block for _, block in team_blocks(square, 4, 0)]
    assert [block.ns_flops(1) for block in blocks] == [6 * 256 ** 2 * 64] * 4
    assert sum(block.ns_flops(1) for block in blocks) == square.ns_flops(1)
    tall = [block for _, block in team_blocks(_matrix(1024, 256), 2, 0)]  # 512 rows each
    assert [block.ns_flops(1) for block in tall] == [4 * 256 ** 2 * 512 + 2 * 256 ** 3] * 2


def test_every_owner_choice_puts_a_teams_blocks_on_distinct_ranks():
    """By bytes every column block of a wide matrix would go to the rank holding most of its
    rows, all to one rank: the team would not be split."""
    wide = Matrix(RowLayout((200,) + (8,) * 7), 4096, (None, False))
    matrices = [m for _, _, m in with_teams([wide] + [_matrix(64, 64, shards=8)] * 8, 8, 8)]
    k = sum(1 for m in matrices if m.team)
    assert k > 1
    cost = StepCost(lambda matrix, count: count * matrix.ns_flops(1) * 1e-12, 1e9)
    batches = batch_matrices(matrices, 1 << 30, 4)
    for owners in (choose_owners(matrices, 4), whole_matrix_owners(matrices),
                   choose_owners_by_time(matrices, batches, 4, cost)):
        assert len({o for m, o in zip(matrices, owners) if m.team}) == k, owners


def test_teams_go_on_as_few_nodes_as_hold_them():
    """Eight ranks on four nodes of two: every owner choice keeps a team of two on one node and a
    team of four on two (the fewest that hold it), and a move off the busiest rank keeps it so.
    Without the nodes, the owners by time below spread them (the test fails without TeamRule's
    nodes)."""
    nodes = Nodes((0, 0, 1, 1, 2, 2, 3, 3), 1e12)
    tall = _matrix(4096, 64, shards=8)
    matrices = ([block for _, block in team_blocks(tall, 4, 0)]
                + [block for _, block in team_blocks(tall, 2, 1)] + [_matrix(64, 64, shards=8)] * 6)
    cost = StepCost(lambda matrix, count: count * matrix.ns_flops(1) * 1e-12, 1e9)
    batches = batch_matrices(matrices, 1 << 30, 4)
    spread = []
    for owners in (choose_owners(matrices, 4, nodes=nodes), whole_matrix_owners(matrices, nodes),
                   choose_owners_by_time(matrices, batches, 4, cost, nodes=nodes),
                   choose_owners_by_time(matrices, batches, 4, cost)):
        members = team_members(matrices, owners)
        assert sorted(len(ranks) for ranks in members.values()) == [2, 4], owners
        spread.append(sorted(len({nodes.of_rank[r] for r in ranks}) for ranks in members.values()))
    assert spread[:3] == [[1, 2]] * 3 and spread[3] != [1, 2]


def test_an_all_reduce_inside_nodes_costs_their_rate_and_a_ring_at_one_rate():
    """tiered_seconds: at one rate for both tiers it is the ring over all k ranks; a team of 16 on
    two nodes of 8 moves 2 * 7/8 of the tensor over NVLink and 1/8 of it over the network."""
    elements, gram_bytes = 1 << 20, 2
    same = Nodes(tuple(r // 8 for r in range(16)), 50e9)
    ring = ring_bytes(elements, 16, gram_bytes) / 50e9
    assert tiered_seconds(elements, 16, 2, gram_bytes, 50e9, same) == pytest.approx(ring)
    assert tiered_seconds(elements, 16, 16, gram_bytes, 50e9, None) == pytest.approx(ring)
    fast = Nodes(same.of_rank, 450e9)
    expected = (2 * 7 / 8 * elements * gram_bytes / 450e9 + elements / 8 * gram_bytes / 50e9)
    assert tiered_seconds(elements, 16, 2, gram_bytes, 50e9, fast) == pytest.approx(expected)
    assert fast.fewest(16) == 2 and fast.fewest(9) == 2 and fast.fewest(8) == 1


def _team_newton_schulz_as_megatron_core_distributed(rank, world_size, dim, rows):
    # Split along its long side; `rows` of it a member: more than the Gram side's 6 (A A formed,
    # as upstream) or fewer (the Gram matrix applied twice).
    shape = [rows * world_size, 6][::1 if dim == 0 else -1]
    full = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    block = full.chunk(world_size, dim)[rank]
    group = dist.new_group(list(range(world_size)))
    p = torch.nn.Parameter(block.clone())
    p.partition_dim = dim
    reference = TensorParallelMuon([p], pg_collection=SimpleNamespace(tp=group, gtp_remat=None),
                                   tp_mode="distributed", fp32_matmul_prec="highest")
    settings = tensor_parallel_muon_settings({})
    twice = applies_gram_twice(6, rows)
    # Single-device Muon's rows, within what reordering (or associating) fp32 sums changes.
    bound = muon_drift([1.0], full.shape, reordering_error(max(full.shape))) + ATOL
    with eo_utils.fp32_matmul_precision("highest"):
        expected = reference.orthogonalize(p, block)
        with FlopCounterMode(display=False) as counted:
            ours = team_orthogonalize(block, tuple(full.shape), dim, group, settings)
        assert counted.get_total_flops() == team_ns_flops(6, rows, settings["num_ns_steps"])
        if twice:  # the same polynomial, associated otherwise
            assert 0 < (ours - expected).abs().max() <= bound
        else:
            assert torch.equal(ours, expected)
        # newton_schulz_tp's loop, step by upstream's step: upstream's result, bit for bit.
        assert torch.equal(distributed_newton_schulz(block, 5, "quintic", group, dim),
                           upstream.newton_schulz_tp(block, 5, "quintic", group, dim,
                                                     tp_mode="distributed"))
        fp32_whole = reference.scaled_orthogonalize_fn(full, None, None)
        whole = fp32_whole.chunk(world_size, dim)[rank]
        assert (ours - whole).abs().max() <= bound
    if twice:  # in bf16 as far from fp32's result as bf16 Newton-Schulz on the whole matrix is
        with eo_utils.fp32_matmul_precision("medium"):
            bf16 = team_orthogonalize(block, tuple(full.shape), dim, group, settings)
            bf16_whole = reference.scaled_orthogonalize_fn(full, None, None)
        error = (bf16_whole - fp32_whole).abs().max()  # over the whole matrix
        assert (bf16 - whole).abs().max() <= 2 * error
        # Broken: without the team's all-reduce each member orthogonalizes its rows alone; with
        # another member's block it returns that block's rows.
        with mock.patch.object(dist, "all_reduce"):
            alone = team_orthogonalize(block, tuple(full.shape), dim, group, settings)
        assert (alone - expected).abs().max() > bound
        swapped = full.chunk(world_size, dim)[world_size - 1 - rank]
        assert not torch.equal(
            team_orthogonalize(swapped, tuple(full.shape), dim, group, settings), expected)


@pytest.mark.parametrize("world_size, dim, rows", [(2, 0, 8), (4, 0, 8), (2, 1, 8), (4, 1, 8),
                                                   (2, 0, 3), (4, 1, 2)])
def test_team_newton_schulz_is_megatron_cores_distributed_form(distributed, world_size, dim,
                                                               rows):
    distributed(_team_newton_schulz_as_megatron_core_distributed, world_size, dim, rows)


class WideNet(torch.nn.Module):
    """A wide matrix (12 x 192, bias beside it: uneven shards) with 99% of the Newton-Schulz
    FLOPs: a team splits its columns."""

    def __init__(self):
        super().__init__()
        self.wide = torch.nn.Linear(192, 12)
        self.head = torch.nn.Linear(12, 5)

    def forward(self, x):
        return self.head(torch.tanh(self.wide(x.repeat(1, 12))))


def _models(net, strategy, world_size):
    """(reference, Megatron-FSDP copy, the matrix a team splits): fsdp_models' Net (its 40 x 16
    `up`, 69% of the FLOPs: row blocks; "tall-hsdp": two replicas of it, HSDP) or WideNet (column
    blocks)."""
    if net.startswith("tall"):
        outer = "no_shard" if net == "tall-hsdp" else None
        return (*make_models(strategy, world_size, unit_modules=True, outer=outer), "up.weight")
    torch.manual_seed(0)
    ref = WideNet()
    fsdp = fully_shard(copy.deepcopy(ref), strategy, world_size, [torch.nn.Linear])
    return ref, fsdp, "wide.weight"


def _teams_step_as_single_device_muon(rank, world_size, strategy, owner_choice, net,
                                      offload=0.0, gram=False):
    """(`gram`: --muon-gram-newton-schulz, the team's and the reference's.)"""
    ref, fsdp, split = _models(net, strategy, world_size)
    ref_opts = reference_optimizers(ref)
    if gram:
        with_gram_newton_schulz(ref_opts[0])
    ref_params = dict(ref.named_parameters())
    matrices, vectors = split_params(fsdp)
    # By time on two hosts of two ranks (by name): the rate inside a node is measured for the
    # teams, a send between ranks 0 and 1 agreed over the group, and written for make scale.
    with mock.patch("socket.gethostname", return_value=f"node{rank // 2}"):
        muon = ZeROTensorParallelMuon(muon_param_groups(matrices), max_team_size=world_size,
                                      owner_choice=owner_choice, offload_fraction=offload,
                                      gram_newton_schulz=gram, **MUON_KWARGS)
    if owner_choice == "time":
        (rate,) = muon.planner.node_rates
        rates = [None] * world_size
        dist.all_gather_object(rates, rate)
        assert 0 < rate < float("inf") and rates == [rate] * world_size
        chain = SimpleNamespace(muon_optimizers=[muon])
        assert rates_table(chain)["node_all_reduce_gbps"] == rate / 1e9
        # One rank a node: nothing to measure, nothing sent.
        assert node_bytes_per_second(dist.group.WORLD, Nodes(tuple(range(world_size)), 1.0),
                                     torch.device("cpu"), []) is None
    (plan,) = muon.plans
    teamed = {plan.param_of(i) for i, m in enumerate(plan.matrices) if m.team}
    names = {id(p): n.removeprefix("module.") for n, p in fsdp.named_parameters()}
    # By FLOPs (owners by bytes) the matrix is split, each block on its own rank. By time,
    # measured here, so small a matrix may cost more split than whole (each iteration's
    # all-reduce, a call's fixed cost): then it stays whole, bit for bit.
    assert {names[id(p)] for p in teamed} == {split} or (owner_choice == "time" and not teamed)
    members = len({o for i, o in enumerate(plan.owners) if plan.matrices[i].team})
    assert members > 1 or not teamed
    assert len(plan.team_groups) == (members > 1 and rank in {
        o for i, o in enumerate(plan.owners) if plan.matrices[i].team})
    opts = [muon, torch.optim.Adam(vectors, lr=0.01, foreach=False)]
    lrs = []
    for step in range(STEPS):
        step_beside_reference(fsdp, matrices + vectors, names, ref_params, ref_opts + opts, step,
                              rank)
        lrs.append(muon.group_of(next(iter(teamed), matrices[0]))["lr"])
        for p in matrices + vectors:
            diff = (full_tensor(p, p) - ref_params[names[id(p)]]).abs().max().item()
            if p in teamed and members > 1:  # the Gram's sums in another order: their bound
                bound = muon_drift(lrs, p.shape, reordering_error(max(p.shape))) + ATOL
                assert diff <= bound, (step, diff, bound)
            else:  # every other matrix whole on its owner, as before: bit for bit
                assert diff == 0, (names[id(p)], step, diff)
        assert_offload_as_planned(muon, offload, f"teams {net} W={world_size} step {step}")


# HSDP (2 replicas x 2 shards: the results go to both replicas); the last two: the momentum in
# host memory between steps (--optimizer-cpu-offload), a team's rows (a column block's: strided)
# brought to the device and back.
@pytest.mark.parametrize("world_size, strategy, owner_choice, net, offload", [
    (2, "optim_grads_params", "bytes", "tall", 0.0),
    (2, "optim_grads_params", "time", "tall", 0.0),
    (4, "optim", "bytes", "tall", 0.0), (4, "optim_grads_params", "bytes", "tall", 0.0),
    (2, "optim_grads_params", "bytes", "wide", 0.0),
    (4, "optim_grads_params", "bytes", "wide", 0.0), (4, "optim", "time", "wide", 0.0),
    (4, "optim_grads_params", "bytes", "tall-hsdp", 0.0),
    (4, "optim_grads_params", "bytes", "tall", 1.0),
    (2, "optim_grads_params", "bytes", "wide", 1.0)])
def test_a_step_with_a_team_matches_single_device_muon(distributed, world_size, strategy,
                                                       owner_choice, net, offload):
    distributed(_teams_step_as_single_device_muon, world_size, strategy, owner_choice, net,
                offload)


# Under --muon-gram-newton-schulz (the team and the reference: Gram Newton-Schulz on the whole
# matrix, the team's Gram matrices summed once at the start and once a restart).
@pytest.mark.parametrize("world_size, net", [(2, "tall"), (4, "wide")])
def test_a_step_with_a_gram_team_matches_single_device_gram_muon(distributed, world_size, net):
    distributed(_teams_step_as_single_device_muon, world_size, "optim_grads_params", "bytes",
                net, 0.0, True)


def _refused_beside(rank, world_size):
    ref, fsdp = make_models("optim_grads_params", world_size, unit_modules=True)
    matrices, _ = split_params(fsdp)
    before = [p.to_local().clone() for p in matrices]
    for settings, flag in (({"dist_mode": "allgather"}, "--muon-dist-mode allgather"),):
        with pytest.raises(ValueError, match=f"--muon-max-team-size 2 does not run with {flag}"):
            ZeROTensorParallelMuon(muon_param_groups(matrices), max_team_size=2, **settings,
                                   **MUON_KWARGS)
    with pytest.raises(ValueError, match=r"max_team_size \(--muon-max-team-size\) must be"):
        ZeROTensorParallelMuon(muon_param_groups(matrices), max_team_size=0, **MUON_KWARGS)
    assert all(torch.equal(a, p.to_local()) for a, p in zip(before, matrices))


def test_teams_are_refused_beside_what_they_do_not_run_with_yet(distributed):
    distributed(_refused_beside, 2)


class _Calls(Traffic):
    """Traffic, and each all-reduce's (elements, group size)."""

    def reset(self) -> None:
        super().reset()
        self.all_reduces: Counter = Counter()

    def collective(self, call) -> None:
        super().collective(call)
        if call.name == "allreduce_" and call.group_size > 1:
            self.all_reduces.update((t.numel(), call.group_size) for t in call.tensors)


def _step_counts(model, optimizer, rank):
    """(FLOPs of matrix products, collectives) of the second step (the first creates state)."""
    for step in range(2):
        optimizer.zero_grad()
        lm_loss(model, step, rank, TEAM_GPT).backward()
        model.finish_grad_sync()
        with FlopCounterMode(display=False) as flops, observed(_Calls()) as calls:
            assert optimizer.step()[0]
    return flops.get_total_flops(), calls


def _a_step_does_what_the_plan_counts(rank, world_size, gram=False):
    init_parallel_state()
    counts = {}
    # Teams sized by FLOPs (owners by bytes): by time they follow this machine's measured rates.
    teams = dict(muon_max_team_size=world_size, muon_owner_choice="bytes")
    # Two ranks a node (0 and 2, 1 and 3), as hosts name them: each team of two on one node
    # (plan.TeamRule; by bytes alone the teams are 0 and 1, 2 and 3).
    for name, settings in (("teams", teams), ("adam", {})):
        settings = {**settings, "muon_gram_newton_schulz": gram} if name == "teams" else settings
        model = fsdp_gpt(TEAM_GPT)
        with mock.patch("socket.gethostname", return_value=f"node{rank % 2}"), \
                mock.patch("builtins.print"):
            optimizer = get_megatron_optimizer(
                optimizer_config(**({"optimizer": "adam"} if name == "adam" else {})), [model],
                **settings)
        counts[name] = _step_counts(model, optimizer, rank)
        if name == "teams":
            (plan,) = [plan for muon in optimizer.muon_optimizers for plan in muon.plans]
            members = team_members(plan.matrices, plan.owners)
            assert len(members) == 2  # fc1 and fc2 split
            assert {tuple(r % 2 for r in ranks) for ranks in members.values()} <= {(0, 0), (1, 1)}
            steps = optimizer.muon_optimizers[0].newton_schulz_settings["num_ns_steps"]
            flops = newton_schulz_flops(plan.matrices, plan.owners, steps, world_size)[rank]
            all_reduces = Counter((elements, k) for elements, k, _ in team_all_reduces(
                plan.matrices, plan.owners, steps).get(rank, []))
            all_to_alls = sum(route.moves for routes in plan.routes
                              for route in (routes.gather, routes.scatter))
            received = plan.bytes_received()
            scalars, exchanges = step_scalars(optimizer), len(plan.routes)
            loads = newton_schulz_flops(plan.matrices, plan.owners, 1, world_size)
    (ours, ours_calls), (adams, adam_calls) = counts["teams"], counts["adam"]
    assert adams == 0 and ours == flops, (ours, flops)  # Newton-Schulz's products, to the FLOP
    assert ours_calls.by_name == adam_calls.by_name + Counter(
        alltoall_base_=all_to_alls, allreduce_=all_reduces.total())
    assert ours_calls.all_reduces == adam_calls.all_reduces + all_reduces
    assert ours_calls.received_bytes - adam_calls.received_bytes == received
    # What the run's logs say of the step (step_report): the same counts.
    assert {name: scalars[name] for name in ("muon/collectives", "muon/bytes-received")} == {
        "muon/collectives": (ours_calls.by_name - adam_calls.by_name).total(),
        "muon/bytes-received": ours_calls.received_bytes - adam_calls.received_bytes}
    assert scalars["muon/exchanges"] == exchanges and scalars["muon/skipped-steps"] == 0
    assert scalars["muon/newton-schulz-busiest-over-mean"] == max(loads) / (sum(loads) / 4)


@pytest.mark.parametrize("gram", [False, True], ids=["standard", "gram"])
def test_a_step_with_teams_does_what_the_plan_counts(distributed, gram):
    """The FLOPs of its matrix products (torch's FlopCounterMode), its collectives and the
    elements and group of each all-reduce, and the bytes it receives: on every rank of W=4, what
    the plan (plan.newton_schulz_flops, plan.team_all_reduces, the routes) counts; on two
    nodes of two ranks (their host names), each team on one. (`gram`: the teams under
    --muon-gram-newton-schulz: 3 all-reduces a team, not 6.)"""
    distributed(_a_step_does_what_the_plan_counts, 4, gram)


def _checked_with_teams(rank, world_size, corruption):
    """The check interval every step beside an unchecked twin: it changes no update, and its
    worst difference stays within the reordering bound; a corrupted team result is caught."""
    runs = []
    for check_interval in (1, 0):
        _, fsdp = make_models("optim_grads_params", world_size, unit_modules=True)
        matrices, _ = split_params(fsdp)
        names = {p: n for n, p in fsdp.named_parameters()}
        runs.append((fsdp, matrices, ZeROTensorParallelMuon(
            muon_param_groups(matrices), max_team_size=world_size, owner_choice="bytes",
            check_interval=check_interval, param_names=names, **MUON_KWARGS)))
    (fsdp, matrices, checked), (_, twins, plain) = runs
    (plan,) = checked.plans
    team = next(m for m in plan.matrices if m.team)
    bound = reordering_bound(team, checked.newton_schulz_settings)
    for step in range(2):
        x, y = batch(step, rank)
        torch.nn.functional.mse_loss(fsdp(x), y).backward()
        fsdp.finish_grad_sync()
        for p, q in zip(matrices, twins):
            q.grad = p.grad
        if corruption:
            def corrupted(muon, plan, owned, fulls):
                results = orthogonalized_by_team(muon, plan, owned, fulls)
                return [results[0] + corruption] + results[1:]

            with mock.patch("megatron_muon.core.zero_muon.orthogonalized_by_team", corrupted):
                with pytest.raises(MuonCheckError, match=r"module\.up\.weight: shape \(\d+, 16\)"):
                    checked.step()
            return
        checked.step()
        plain.step()
        assert all(torch.equal(p.to_local(), q.to_local()) for p, q in zip(matrices, twins))
        assert checked.last_check.iteration == step + 1
        assert 0 <= checked.last_check.worst <= bound, (checked.last_check, bound)
        for optimizer in (checked, plain):
            optimizer.zero_grad()
        fsdp.zero_grad_buffer()


@pytest.mark.parametrize("corruption", [0.0, 0.1])  # the bound here: 0.0149
def test_the_check_interval_holds_a_team_to_the_whole_matrix(distributed, corruption):
    distributed(_checked_with_teams, 4, corruption)
