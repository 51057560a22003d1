"""Memory, measured (megatron_muon.tools.memory.AllocationTracker on CPU: the profiler's allocation
records): the tracker itself, Newton-Schulz's working set against what the plan counts for it,
and the owner step within --muon-max-exchange-bytes: the plan's own count (plan.working_memory)
bounds what the step really holds, and a small budget changes the plan, which the tracker sees,
with the same weights."""

import contextlib
import io
import time
from contextlib import redirect_stdout
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from emerging_optimizers import utils as eo_utils
from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

from megatron_muon import get_megatron_optimizer
from megatron_muon.tools.memory import PHASES, AllocationTracker, at_rest_bytes, measure_train_step
from megatron_muon.core.gram_newton_schulz import route_newton_schulz_through_it
from megatron_muon.core.settings import tensor_parallel_muon_settings
from megatron_muon.plan import (MAX_EXCHANGE_BYTES, GramSchedule, Matrix, RowLayout,
                                newton_schulz_bytes, state_saved, working_memory)
from megatron_muon.tools.testing import (GPTShape, fsdp_gpt, init_parallel_state, lm_loss,
                                         optimizer_config)
from megatron_muon.core.zero_muon import ZeROTensorParallelMuon

CPU = torch.device("cpu")


def test_the_tracker_gives_each_phase_its_peak_of_live_bytes():
    with AllocationTracker(CPU) as tracker:
        with tracker.phase("a"):
            x, y = torch.empty(1000), torch.empty(2000)
            del x
        with tracker.phase("b"):
            z = torch.empty(500)
            del z
        with tracker.phase("c"):
            pass
    assert tracker.peaks == {"a": 4000 + 8000, "b": 8000 + 2000, "c": 8000}
    assert tracker.starts == {"a": 0, "b": 8000, "c": 8000}
    del y


def newton_schulz_held(shape, device, gram=None) -> tuple[int, int]:
    """(the most TensorParallelMuon.orthogonalize holds at fp32 on one matrix or a batch, result
    included, plan.newton_schulz_bytes of its matrices); through Gram Newton-Schulz with `gram`
    (a plan.GramSchedule) as --muon-gram-newton-schulz routes it."""
    param = torch.nn.Parameter(torch.zeros(shape[-2:], device=device))
    muon = TensorParallelMuon([param], lr=0.1, split_qkv=False, fp32_matmul_prec="highest")
    if gram is not None:
        muon.gram = gram
        route_newton_schulz_through_it(muon, tensor_parallel_muon_settings({}), scaled=True)
    options = {k: v for k, v in muon.param_groups[0].items() if k != "params"}
    update = torch.randn(shape, device=device)
    with eo_utils.fp32_matmul_precision("highest"):
        muon.orthogonalize(param, update, **options)  # first call's one-time allocations
        with AllocationTracker(device) as tracker:
            with tracker.phase("orthogonalize"):
                muon.orthogonalize(param, update, **options)
    matrices = shape[0] if len(shape) == 3 else 1
    planned = matrices * newton_schulz_bytes(Matrix(RowLayout((shape[-2],)), shape[-1],
                                                    gram=gram), 4)
    return tracker.peaks["orthogonalize"] - tracker.starts["orthogonalize"], planned


@pytest.mark.parametrize("shape", [(48, 32), (32, 48), (40, 40), (3, 16, 24), (16, 48), (112, 32)])
def test_newton_schulz_holds_at_most_what_the_plan_counts(shape):
    """One matrix or a batch of three: within plan.newton_schulz_bytes, and not far below it;
    Gram Newton-Schulz too where it runs (its five m x m matrices: 3mn + 2m^2 would not hold
    it), the square one standard."""
    held, planned = newton_schulz_held(shape, CPU)
    assert 0.75 * planned <= held <= planned
    held, planned = newton_schulz_held(shape, CPU, GramSchedule(5))
    assert 0.75 * planned <= held <= planned
    if GramSchedule(5).runs_on(*shape[-2:]):
        m, n = sorted(shape[-2:])
        assert held > (3 * m * n + 2 * m * m) * 4 * (shape[0] if len(shape) == 3 else 1)


SHAPE = GPTShape(layers=2, hidden=64, ffn=256, heads=4, vocab=128, seq=16, micro_batch=2)
LARGE = 1 << 30  # every matrix in one exchange


def _muon(optimizer) -> ZeROTensorParallelMuon:
    return next(part.optimizer for part in optimizer.chained_optimizers
                if isinstance(part.optimizer, ZeROTensorParallelMuon))


def _train_step(model, optimizer, step, rank):
    optimizer.zero_grad()
    lm_loss(model, step, rank, SHAPE).backward()
    model.finish_grad_sync()
    optimizer.step()


def _tracked_muon_step(model, optimizer, step, rank, muon=None) -> int:
    """One train step; the most bytes the Muon part's step (`muon`'s, by default the first's)
    holds beyond those alive when it began."""
    muon = muon or _muon(optimizer)
    untracked = muon.step
    with AllocationTracker(CPU) as tracker, _all_to_alls_released_on_wait():
        def step_tracked(*args, **kwargs):
            with tracker.phase("muon"):
                return untracked(*args, **kwargs)

        muon.step = step_tracked
        optimizer.zero_grad()
        lm_loss(model, step, rank, SHAPE).backward()
        model.finish_grad_sync()
        optimizer.step()
    muon.step = untracked
    return tracker.peaks["muon"] - tracker.starts["muon"]


def _planned(muon) -> int:
    """This rank's working memory by the plan: the largest of its exchange groups' (each group's
    exchanges run after the previous group's have ended)."""
    return max(working_memory(plan.matrices, plan.owners, [r.batches for r in plan.routes], 4)[plan.rank]
               for plan in muon.plans)


class _ReleasedOnWait:
    """A gloo all-to-all's work whose wait() returns once gloo has let go of its tensors. Gloo's
    worker thread drops its references a moment after the work completes, at a time of its own:
    a buffer the exchange has dropped could then be freed on that thread while the next
    exchange's buffers are alive, and the tracker would see both held (4 to 7 times in 200
    all-to-alls here). Waiting until the tensors' use counts are back to what they were before
    the call frees every buffer where the step drops it, as on a GPU, whatever gloo's thread
    does: the measured peak is the step's own."""

    def __init__(self, work, tensors, before):
        self.work, self.tensors, self.before = work, tensors, before

    def wait(self, *args) -> bool:
        self.work.wait(*args)
        self.work = None  # its handle held the tensors too
        deadline = time.monotonic() + 10
        while [t._use_count() for t in self.tensors] != self.before:
            assert time.monotonic() < deadline, "gloo kept an all-to-all's tensors"
            time.sleep(0)
        return True


@contextlib.contextmanager
def _all_to_alls_released_on_wait():
    """The exchange's all-to-alls (dist.all_to_all_single), each _ReleasedOnWait."""
    all_to_all = dist.all_to_all_single

    def released(output, input, *args, async_op=False, **kwargs):
        before = [t._use_count() for t in (output, input)]
        work = _ReleasedOnWait(all_to_all(output, input, *args, async_op=True, **kwargs),
                               (output, input), before)
        if async_op:
            return work
        work.wait()  # as the call itself returns: None

    with mock.patch.object(dist, "all_to_all_single", released):
        yield


def _within_budget(rank, world_size, tp_mode):
    # With Nesterov momentum each update is a tensor of its own (without, the momentum itself):
    # an exchange computes its matrices' updates when it starts and frees them when it ends.
    init_parallel_state()
    runs = {}
    for budget in ("large", "default", "small"):
        model = fsdp_gpt(SHAPE)
        log = io.StringIO()
        with redirect_stdout(log):
            optimizer = get_megatron_optimizer(
                optimizer_config(muon_nesterov=True, muon_tp_mode=tp_mode), [model],
                muon_owner_choice="bytes",
                muon_max_exchange_bytes={"large": LARGE, "default": MAX_EXCHANGE_BYTES,
                                         "small": 1}[budget])
        muon = _muon(optimizer)
        limit = max(plan.budgets[plan.rank] for plan in muon.plans)
        if budget == "large":
            assert "orthogonalized alone" not in log.getvalue() and limit == LARGE
        elif budget == "default":
            # Rank by rank, what Muon's state saves it plus the headroom the step needs anyway
            # (a matrix's need above its owner's saving).
            for plan in muon.plans:
                saved = state_saved(plan.matrices, 4)
                assert all(b >= s for b, s in zip(plan.budgets, saved))
                assert max(b - s for b, s in zip(plan.budgets, saved)) > 0
            assert limit < LARGE and "orthogonalized alone" not in log.getvalue()
        else:
            # Every matrix alone in its batch (each rank's budget what its batches need alone),
            # and rank 0 says so.
            assert ("Muon matrices each need more than half of --muon-max-exchange-bytes"
                    in log.getvalue()) == (rank == 0)
        _train_step(model, optimizer, 0, rank)  # creates the momentum
        measured = _tracked_muon_step(model, optimizer, 1, rank)
        planned = _planned(muon)
        # The plan's count bounds what the step holds, and each rank's budget bounds the plan.
        assert 0 < measured <= planned, (budget, measured, planned)
        assert planned <= limit, (budget, planned)
        runs[budget] = (measured, sum(len(plan.routes) for plan in muon.plans),
                        [p.to_local().clone() for g in muon.param_groups for p in g["params"]])
    # A small budget changes the plan, the tracker sees less held on the rank holding most than
    # with everything in one exchange, and no weight changes under any budget.
    most = torch.tensor([runs["large"][0], runs["small"][0]])
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    assert runs["small"][1] > runs["large"][1] and most[1] < most[0], (runs["large"][:2],
                                                                      runs["small"][:2])
    for weights in (runs["default"][2], runs["small"][2]):
        for a, b in zip(runs["large"][2], weights, strict=True):
            assert torch.equal(a, b)


# megatron-core 0.19's default TP mode, and main's (whose Newton-Schulz all-gathers each
# TP-partitioned matrix first, over one rank too: plan.newton_schulz_bytes counts it).
@pytest.mark.parametrize("world_size, tp_mode", [(2, "blockwise"), (4, "blockwise"),
                                                 (2, "duplicated")])
def test_the_owner_step_holds_what_the_plan_counts_within_the_budget(distributed, world_size,
                                                                     tp_mode):
    distributed(_within_budget, world_size, tp_mode)


def _interleaved_within_budget(rank, world_size):
    """The dense and expert Muon parts stepped in rounds (planner.interleaving) hold both
    parts' exchanges at once: the expert part's step (which runs both) holds at most the two
    parts' counts together (each plan.working_memory), and those stay within the rank's budget
    (its saving over both parts plus the headroom, which covers both parts' batches alone side
    by side)."""
    init_parallel_state(expert_parallel=2)
    model = fsdp_gpt(SHAPE, num_experts=4)
    optimizer = get_megatron_optimizer(optimizer_config(), [model])
    dense, expert = optimizer.muon_optimizers
    assert dense.interleaved is expert.interleaved is not None
    _train_step(model, optimizer, 0, rank)  # creates the momentum
    measured = _tracked_muon_step(model, optimizer, 1, rank, expert)  # its step runs both
    planned = _planned(dense) + _planned(expert)
    assert 0 < measured <= planned, (measured, planned)
    saving = dense.planner.saving() + expert.planner.saving()
    need = dense.planner.need() + expert.planner.need()
    budget = saving + max(expert.planner.headroom, need if need > saving else 0)
    assert planned <= budget, (planned, budget)


def test_dense_and_expert_parts_interleaved_hold_both_within_the_budget(distributed):
    distributed(_interleaved_within_budget, 4)


def _train_step_memory(rank, world_size):
    """measure_train_step's split: the at-rest kinds counted from the tensors (Muon's state one
    momentum, Adam's two moments, over the same main weights), and each phase's peak."""
    init_parallel_state()
    by_optimizer = {}
    for name in ("muon", "adam"):
        model = fsdp_gpt(SHAPE)
        optimizer = get_megatron_optimizer(optimizer_config(name), [model])
        _train_step(model, optimizer, 0, rank)

        def forward_backward():
            optimizer.zero_grad()
            lm_loss(model, 1, rank, SHAPE).backward()
            model.finish_grad_sync()

        by_optimizer[name] = measure_train_step([model], optimizer, forward_backward, CPU)
        assert by_optimizer[name].at_rest == at_rest_bytes([model], optimizer)
    muon, adam = by_optimizer["muon"], by_optimizer["adam"]
    assert muon.at_rest["main weights"] == adam.at_rest["main weights"] > 0
    assert muon.at_rest["gradients"] == adam.at_rest["gradients"] > 0
    # Adam: two fp32 moments per element it holds (and a step count); Muon: one momentum per
    # matrix element, Adam's two on the rest.
    assert adam.at_rest["optimizer state"] >= 2 * adam.at_rest["main weights"] * 0.9
    assert muon.at_rest["optimizer state"] < adam.at_rest["optimizer state"]
    for memory in (muon, adam):
        assert set(memory.phases) == set(PHASES)
        assert memory.phases["forward-backward"] > 0
        assert memory.peak == memory.resting + max(memory.phases.values())


def test_a_train_steps_memory_is_split_by_what_holds_it(distributed):
    distributed(_train_step_memory, 2)
