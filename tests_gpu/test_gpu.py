"""What needs CUDA, run wherever a GPU is (`make test-gpu`; `make test` runs it too and shows
why each test skips on a machine without one). The gloo suite in tests/ hides CUDA on purpose.

- every multi-rank code path on CUDA tensors on one GPU, torch's fake process group standing in
  for NCCL (tests/fake_ranks.py): no collective may see a tensor off the GPU;
- batched bf16 Newton-Schulz (`medium`) differs from per-matrix calls by less than bf16's own
  error (docs/design.md, "Library": the contract);
- W=1 on NCCL: the demo trains, in fp32 and bf16, and Muon on Megatron-FSDP ZeRO-3 matches
  megatron-core's own Muon on Megatron DDP over the first iterations (fp32 Newton-Schulz);
- with two GPUs or more, the same comparison at W=2, and Adam's grad norms and losses with
  experts over expert-parallel 2 and two micro-batches per rank equal Megatron DDP's on NCCL
  (the experts' buffer reduces over one rank: fixes.upstream_fixes); with four, the same
  under --ddp-average-in-collective (the experts' scale before the average: upstream_fixes);
- --muon-use-syrk (emerging_optimizers' Triton SYRK kernel): its Newton-Schulz differs from the
  plain bf16 kernel's by less than bf16's own error, and the demo trains with it;
- memory.AllocationTracker reads CUDA's allocator: each phase's peak, and Newton-Schulz within
  what the plan counts for it (plan.newton_schulz_bytes), as on CPU (tests/tools/test_memory.py);
- --optimizer-cpu-offload: the memory allocated between steps falls by the optimizer state's
  size (Muon's momentum, Adam's moments), the step's peak does not rise, and every weight after
  three steps is the run's without offload, bit for bit (W=1 on NCCL);
- a team's Newton-Schulz on CUDA tensors (two ranks over gloo) is megatron-core's distributed
  form;
- --muon-gather-inside-backward: every weight after three clipped steps is the run's without it,
  bit for bit, its rows sent from a stream that waits for each bucket's reduce (W=1 on NCCL; W=2
  with two GPUs);
- the self-test's step estimate times Newton-Schulz on the GPU on a model's shapes and plans
  its step from those rates.

Every rank of every run forks from one server (launcher.py: torch and megatron imported once, no
torchrun), which tests/test_gpu_launches.py holds to on CPU. The demo's command lines are data (DEMO_RUNS): tests/integrations/test_command_lines.py parses each of them
with megatron.training's parser on CPU, so that a flag or value it refuses fails there first."""

import sys

import pytest
import torch

import launcher  # first: every process below starts from its server
from gpu_ranks import backward_gather_rank, estimate_rank, offloaded_state_rank, team_rank

sys.path.insert(0, str(launcher.REPO / "tests" / "tools"))  # test_memory

import demo_log  # noqa: E402
import fake_paths  # noqa: E402
from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz  # noqa: E402
from emerging_optimizers.utils import fp32_matmul_precision  # noqa: E402
from fake_ranks import run_fake_ranks  # noqa: E402
from test_memory import newton_schulz_held  # noqa: E402
from tolerances import ATOL, RTOL, muon_drift, reordering_error  # noqa: E402

from megatron_muon.plan import applies_gram_twice  # noqa: E402
from megatron_muon.tools.memory import AllocationTracker  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (this machine has none)")
COMPARED_ITERATIONS = 5


@pytest.fixture(autouse=True, scope="module")
def one_launcher():
    """Every rank below forks from launcher.py's server, fake_ranks' included."""
    launcher.prepare()


FP32_NEWTON_SCHULZ = ("--muon-fp32-matmul-prec", "highest")
MEGATRON_DDP = ("--no-use-megatron-fsdp", "--ckpt-format", "torch_dist")
# Adam with experts over expert-parallel 2, micro-batches of 4, dropout off; the global batch
# gives two micro-batches per rank at W=2 (16) and at W=4 (32).
EXPERTS = ("--optimizer", "adam", "--num-experts", "4", "--moe-router-topk", "2",
           "--expert-model-parallel-size", "2", "--micro-batch-size", "4", "--hidden-dropout", "0",
           "--attention-dropout", "0")
ACCUMULATED_EXPERTS = (*EXPERTS, "--global-batch-size", "16")
AVERAGED_EXPERTS = (*EXPERTS, "--global-batch-size", "32", "--ddp-average-in-collective")
# The demo's flags in each run below (the training length and world size aside).
DEMO_RUNS = {
    "fp32": (),
    "bf16": ("--bf16",),
    "syrk": ("--muon-use-syrk", "--muon-fp32-matmul-prec", "medium"),
    "zero3": FP32_NEWTON_SCHULZ,
    "megatron_core_muon_on_ddp": (*FP32_NEWTON_SCHULZ, "--no-use-megatron-fsdp", "--ckpt-format",
                                  "torch_dist"),
    # Several micro-batches per rank with experts (NVIDIA/Megatron-LM#6660,
    # fixes.upstream_fixes): at W=2 with EP=2 the experts' buffer reduces over one rank.
    "experts_accumulated": ACCUMULATED_EXPERTS,
    "experts_accumulated_on_ddp": (*ACCUMULATED_EXPERTS, *MEGATRON_DDP),
    # --ddp-average-in-collective (upstream_fixes, 2.): at W=4 with EP=2, two micro-batches per
    # rank, the experts' gradients average over expert groups of two, scaled by EDP / DP first.
    "experts_averaged": AVERAGED_EXPERTS,
    "experts_averaged_on_ddp": (*AVERAGED_EXPERTS, *MEGATRON_DDP),
}


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_multi_rank_path_keeps_collectives_on_the_gpu(world_size, tmp_path):
    failure = run_fake_ranks(fake_paths.every_path, world_size, "cuda", str(tmp_path))
    assert failure is None, failure


@pytest.mark.parametrize("shape", [(8, 1024, 1024), (16, 512, 2048), (4, 2048, 2048)])
def test_batched_bf16_newton_schulz_is_within_bf16s_own_error(shape):
    x = torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(0))

    def orthogonalized(precision, batched):
        with fp32_matmul_precision(precision):
            if batched:
                return newton_schulz(x, steps=5)
            return torch.stack([newton_schulz(m, steps=5) for m in x])

    per_matrix = orthogonalized("medium", batched=False)
    batching_gap = (orthogonalized("medium", batched=True) - per_matrix).abs().max().item()
    bf16_error = (per_matrix - orthogonalized("highest", batched=False)).abs().max().item()
    print(f"{shape}: |batched - per-matrix| {batching_gap:.2e}, |bf16 - fp32| {bf16_error:.2e}")
    assert batching_gap <= bf16_error, (batching_gap, bf16_error)


@pytest.mark.parametrize("shape", [(1024, 4096), (4096, 1024), (2048, 2048), (36, 100)])
def test_syrk_newton_schulz_is_within_bf16s_own_error_of_the_plain_kernel(shape):
    """megatron_muon.core.syrk's orthogonalization (the kernel where it takes the matrix; (36, 100)
    is not a multiple of 8 and takes the plain one) against TensorParallelMuon's own."""
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    from megatron_muon.core import syrk

    muon = TensorParallelMuon([torch.nn.Parameter(torch.zeros(1, device="cuda"))])
    with_syrk = syrk.scaled_orthogonalize_fn(muon.scaled_orthogonalize_fn, 5, "quintic",
                                             "spectral", 1.0)
    x = torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with fp32_matmul_precision("medium"):
        plain, syrk_result = muon.scaled_orthogonalize_fn(x, None), with_syrk(x, None)
    with fp32_matmul_precision("highest"):
        bf16_error = (plain - muon.scaled_orthogonalize_fn(x, None)).abs().max().item()
    gap = (syrk_result - plain).abs().max().item()
    print(f"{shape}: |syrk - plain| {gap:.2e}, |bf16 - fp32| {bf16_error:.2e}")
    assert gap <= bf16_error, (gap, bf16_error)


def test_the_allocation_tracker_gives_each_cuda_phase_its_peak():
    mib = 1 << 20
    with AllocationTracker(torch.device("cuda")) as tracker:
        with tracker.phase("a"):
            x, y = torch.empty(mib, device="cuda"), torch.empty(2 * mib, device="cuda")
            del x
        with tracker.phase("b"):
            z = torch.empty(mib // 2, device="cuda")
            del z
    assert tracker.peaks == {"a": 12 * mib, "b": 10 * mib}, tracker.peaks
    assert tracker.starts == {"a": 0, "b": 8 * mib}, tracker.starts
    del y


@pytest.mark.parametrize("shape", [(1024, 4096), (4096, 1024), (4, 1024, 1024)])
def test_newton_schulz_holds_at_most_what_the_plan_counts_on_cuda(shape):
    held, planned = newton_schulz_held(shape, torch.device("cuda"))
    print(f"{shape}: Newton-Schulz held {held} bytes, the plan counts {planned}")
    assert held <= planned, (held, planned)


def test_offloaded_state_leaves_the_gpu_between_steps_and_the_step_exact():
    """W=1 on NCCL (gpu_ranks.offloaded_state_rank)."""
    [found] = launcher.run_ranks(offloaded_state_rank, 1, timeout=300)
    without, offloaded = found["without"], found["offloaded"]
    print(found)
    assert found["same"]
    # The allocator rounds each block up to 512 bytes: one block per state tensor at most.
    rounding = 512 * 200
    assert without["between"] - offloaded["between"] >= without["state"] - rounding, found
    assert offloaded["peak"] <= without["peak"], found


@pytest.mark.parametrize("world_size, moment2_method", [(1, None), (1, "normuon"), (2, None),
                                                         (2, "normuon")])
def test_the_gather_inside_backward_gives_the_same_weights_on_nccl(world_size, moment2_method):
    """--muon-gather-inside-backward on CUDA streams (gpu_ranks.backward_gather_rank): every
    weight after three clipped steps is the run's without it, bit for bit, Muon's and NorMuon's
    (its second moment travelling with the rows); at W=1 the streams and buffers only (nothing
    moves), at W=2 the rows too."""
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs (NCCL refuses two ranks on one GPU)")
    found = launcher.run_ranks(backward_gather_rank, world_size, moment2_method, timeout=300)[0]
    print(found)
    assert found["same"] and found["ahead"] > 0, found


def test_a_teams_newton_schulz_on_cuda_is_megatron_cores_distributed_form():
    """Two ranks on the one GPU over gloo (gpu_ranks.team_rank)."""
    found = launcher.run_ranks(team_rank, 2, timeout=300)[0]
    print(found)
    for case, figures in found.items():
        shape = tuple(figures["shape"])
        # Exact where its members form A A as upstream does; the same sums associated otherwise
        # where they apply the Gram matrix twice.
        exact = not applies_gram_twice(min(shape), max(shape) // 2)
        assert figures["device"] == "cuda" and all(
            is_exact == exact for is_exact in figures["exact"].values()), (case, figures)
        bound = muon_drift([1.0], shape, reordering_error(max(shape))) + ATOL
        assert figures["fp32_gap"] <= bound, (case, figures)  # the Gram's fp32 sums reordered
        # At bf16 (its Gram summed in bf16, as upstream's distributed mode sums it) as far from
        # exact as bf16 Newton-Schulz on the whole matrix is, within a factor of two.
        assert figures["bf16_gap"] <= 2 * figures["bf16_error"], (case, figures)


def test_the_self_tests_estimate_times_newton_schulz_on_the_gpu():
    """The self-test's step estimate for a user's model (estimate) on CUDA: Newton-Schulz
    timed on the GPU on each of Llama-8B's shapes, and its step at W, 4 W and 16 W planned at
    those rates (gpu_ranks.estimate_rank)."""
    [found] = launcher.run_ranks(estimate_rank, 1, timeout=300)
    print(found)
    assert found["device"] == torch.cuda.get_device_name(), found
    assert len(found["newton_schulz"]) == len(found["shapes"]) >= 4, found
    assert all(tflops > 1 for _, tflops in found["newton_schulz"]), found  # a GPU's, not a CPU's
    assert [row["world"] for row in found["rows"]] == [8, 32, 128], found
    for row in found["rows"]:
        for mode in ("owner", "teams"):
            assert 0 < row[mode]["step_ms"] < 1e4 and row[mode]["busiest_over_ideal"] >= 1, row


def demo_losses(name: str, iterations: int, processes: int = 1) -> list[float]:
    """The losses the demo computed in DEMO_RUNS[name] (its exact values, not Megatron's print)."""
    return demo_log.losses(demo_log_of(name, iterations, processes), 1, iterations)


def demo_log_of(name: str, iterations: int, processes: int) -> str:
    """What the demo printed running DEMO_RUNS[name] on `processes` ranks."""
    return launcher.script_log(["examples/pretrain_gpt.py", "--train-iters", str(iterations),
                                "--eval-iters", "0", *DEMO_RUNS[name]], processes)


@pytest.mark.parametrize("run", ["fp32", "bf16", "syrk"])
def test_the_demo_trains_on_one_gpu(run):
    losses = demo_losses(run, iterations=30)
    assert losses[-1] < losses[0] - 1.0, losses


def _matches_megatron_core_muon_on_ddp(processes):
    """Two implementations of the same fp32 math: they differ in summation order only."""
    ours = demo_losses("zero3", COMPARED_ITERATIONS, processes)
    ddp = demo_losses("megatron_core_muon_on_ddp", COMPARED_ITERATIONS, processes)
    assert ours == pytest.approx(ddp, rel=RTOL, abs=0), (ours, ddp)


def test_zero3_matches_megatron_core_muon_on_ddp_on_one_gpu():
    _matches_megatron_core_muon_on_ddp(1)


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs 2 GPUs (NCCL refuses two ranks on one GPU)")
def test_zero3_matches_megatron_core_muon_on_ddp_on_two_gpus():
    _matches_megatron_core_muon_on_ddp(2)


def _equal_to_megatron_ddp_on_nccl(run, processes, iterations=4):
    """The demo's `run` and the same on Megatron DDP: each iteration's grad norm and loss equal
    (within RTOL), Megatron-FSDP patched by megatron_muon.fixes.upstream_fixes."""
    logs = [demo_log_of(name, iterations, processes) for name in (run, f"{run}_on_ddp")]
    assert "patched Megatron-FSDP" in logs[0], logs[0][-3000:]
    (norms, ddp_norms) = (demo_log.exact_values(log, "grad norm") for log in logs)
    (losses, ddp_losses) = (demo_log.losses(log, 1, iterations) for log in logs)
    assert sorted(norms) == list(range(1, iterations + 1)), logs[0][-3000:]
    for iteration in norms:
        assert norms[iteration] == pytest.approx(ddp_norms[iteration], rel=RTOL, abs=0), (
            norms, ddp_norms)
    assert losses == pytest.approx(ddp_losses, rel=RTOL, abs=0), (losses, ddp_losses)


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs 2 GPUs (NCCL refuses two ranks on one GPU)")
def test_accumulated_expert_gradients_match_megatron_ddp_on_nccl():
    """EP=2 at W=2, 2 micro-batches per rank, ZeRO-3: the experts' buffer reduces over one rank,
    which released Megatron-FSDP rescales at every micro-batch (fixes.upstream_fixes holds it
    to one explicit scale at the grad sync): grad norms and losses equal Megatron DDP's."""
    _equal_to_megatron_ddp_on_nccl("experts_accumulated", 2)


@pytest.mark.skipif(torch.cuda.device_count() < 4,
                    reason="needs 4 GPUs (NCCL refuses two ranks on one GPU)")
def test_averaged_expert_gradients_match_megatron_ddp_on_nccl():
    """--ddp-average-in-collective, EP=2 at W=4, 2 micro-batches per rank, ZeRO-3: released
    Megatron-FSDP averages the experts' gradients without their scale (EDP / DP), silently on
    NCCL (docs/flags.md; on gloo the flag sweep shows it): grad norms and losses equal Megatron
    DDP's with megatron_muon.fixes.upstream_fixes."""
    _equal_to_megatron_ddp_on_nccl("experts_averaged", 4)
