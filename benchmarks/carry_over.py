"""What carries over a checkpoint (issue 69): every change a user makes between a save and a
load, run as the demo does it. A row's saving run trains the demo's small GPT to iteration 6,
saving at 3 (its log is the uninterrupted run); the loading run, with the row's change, loads
iteration 3 (`--load DIR --ckpt-step 3` and its own flags, as users resume) and trains to 6.
The row ends as one of OUTCOMES: iterations 4-6 (4 alone where only the weights carry over) of
the loading run against the saving run's, losses and grad norms, fp32 Newton-Schulz; or the
loading run stops before training, saying what to do.

`make carry-over` runs every row (tests/e2e/test_carry_over.py, CARRY_OVER=all) and writes
benchmarks/results/carry_over.json and the table in docs/reliability.md; the main suite runs
the rows marked `suite` (the other rows' cases the e2e tests run apart, named in `tested_by`)."""

import dataclasses

# The demo's GPT made small, dropout off, fp32 Newton-Schulz; a global batch of 8 at every
# world size (2 micro-batches of 2 a rank at 2 data-parallel ranks, 1 at 4), so that every
# layout trains on the same sequences.
MODEL = ("--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "256",
         "--seq-length", "64", "--max-position-embeddings", "64", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--muon-fp32-matmul-prec", "highest",
         "--micro-batch-size", "2", "--global-batch-size", "8")
ITERATIONS, SAVED_AT = 6, 3
# The same training up to the order in which gradients add (tests/tolerances.RTOL).
TOLERANCE = 1e-5

ZERO = {"ZeRO-1": "optim", "ZeRO-2": "optim_grads", "ZeRO-3": "optim_grads_params"}
DDP = ("--no-use-megatron-fsdp", "--ckpt-format", "torch_dist")
EXPERTS = ("--num-experts", "4", "--moe-router-topk", "2")
HSDP = ("--num-distributed-optimizer-instances", "2", "--overlap-grad-reduce")
OFFLOAD = ("--optimizer-cpu-offload",)
NORMUON = ("--optimizer", "adaptive_muon", "--adaptive-muon-moment2-method", "normuon")
ADAMUON = ("--optimizer", "adaptive_muon")  # megatron-core's default second moment, AdaMuon's

OUTCOMES = {
    "equal": "iterations 4-6 equal the uninterrupted run's (losses and grad norms, 1e-5 relative)",
    "weights": "with --no-load-optim the weights, iteration and schedule: iteration 4 equal",
    "refused": "stops before training, saying what to do",
}


def strategy(name: str) -> tuple[str, ...]:
    return ("--data-parallel-sharding-strategy", ZERO[name])


def ep(size: int) -> tuple[str, ...]:
    return (*EXPERTS, "--expert-model-parallel-size", str(size))


def tp(size: int) -> tuple[str, ...]:
    return ("--tensor-model-parallel-size", str(size))


# TP 2 orthogonalizing each matrix whole, as TP 1 does (megatron-core's blockwise mode would
# orthogonalize each TP rank's block apart: other training, not what a checkpoint carries).
TP2_WHOLE = (*tp(2), "--muon-tp-mode", "duplicated")


@dataclasses.dataclass(frozen=True)
class Row:
    """A change between save and load: the saving run's flags and world size, the loading run's,
    what it ends as (OUTCOMES) and, for a refusal, a regular expression of what it says."""

    name: str
    saved: tuple[str, ...] = ()
    loaded: tuple[str, ...] = ()
    saved_world: int = 2
    loaded_world: int = 2
    expect: str = "equal"
    says: str = ""
    suite: bool = False
    tested_by: str = ""  # the e2e test that runs this case in the main suite, where one does

    @property
    def last(self) -> int:
        """The last iteration compared: with the optimizer state left behind the training
        differs from the next update on."""
        return SAVED_AT + 1 if self.expect == "weights" else ITERATIONS

    @property
    def saved_on_ddp(self) -> bool:
        return "--no-use-megatron-fsdp" in self.saved


ROWS = [
    Row("W 2 -> 4", loaded_world=4,
        tested_by="test_a_checkpoint_from_two_processes_resumes_on_four_at_the_same_global_batch"),
    Row("W 4 -> 2", saved_world=4),
    Row("ZeRO-3 -> ZeRO-1", loaded=strategy("ZeRO-1")),
    Row("ZeRO-1 -> ZeRO-3", saved=strategy("ZeRO-1")),
    Row("ZeRO-2 -> no_shard", saved=strategy("ZeRO-2"),
        loaded=("--data-parallel-sharding-strategy", "no_shard")),
    Row("TP 1 -> 2", loaded=TP2_WHOLE, loaded_world=4),
    Row("TP 2 -> 1", saved=TP2_WHOLE, saved_world=4, loaded_world=4),
    Row("EP 2 -> 4", saved=ep(2), loaded=ep(4), loaded_world=4),
    Row("EP 4 -> 2", saved=ep(4), loaded=ep(2), saved_world=4),
    Row("FSDP -> HSDP (2 replicas)", loaded=HSDP, saved_world=4, loaded_world=4),
    Row("HSDP -> FSDP", saved=HSDP, saved_world=4, loaded_world=4),
    Row("state offloaded -> not", saved=OFFLOAD,
        tested_by="test_demo_resumes_from_its_checkpoint_bit_identically_its_state_offloaded_or_not"),
    Row("state not offloaded -> offloaded", loaded=OFFLOAD),
    Row("Muon -> NorMuon, --no-load-optim", loaded=(*NORMUON, "--no-load-optim"),
        expect="weights"),
    Row("Muon -> NorMuon", loaded=NORMUON, expect="refused", says=r"--no-load-optim"),
    Row("Muon -> Adam, --no-load-optim", loaded=("--optimizer", "adam", "--no-load-optim"),
        expect="weights"),
    Row("Megatron DDP (megatron-core's Muon) -> Megatron-FSDP", saved=DDP,
        tested_by="test_a_megatron_ddp_muon_run_continues_on_megatron_fsdp"),
    Row("Megatron DDP (megatron-core's Muon) -> Megatron-FSDP, W=4 with experts",
        saved=(*DDP, *ep(2)), loaded=ep(2), saved_world=4, loaded_world=4),
    Row("Megatron DDP (megatron-core's AdaMuon) -> Megatron-FSDP", saved=(*DDP, *ADAMUON),
        loaded=ADAMUON, suite=True),
    Row("Megatron DDP (Adam) -> Megatron-FSDP Muon", saved=(*DDP, "--optimizer", "adam"),
        expect="refused", says=r"--no-load-optim",
        tested_by="test_an_adam_ddp_checkpoint_loads_into_muon_with_no_load_optim_only"),
    Row("Megatron DDP (Adam) -> Megatron-FSDP Muon, --no-load-optim",
        saved=(*DDP, "--optimizer", "adam"), loaded=("--no-load-optim",), expect="weights",
        tested_by="test_an_adam_ddp_checkpoint_loads_into_muon_with_no_load_optim_only"),
    Row("Megatron DDP, TP 2 -> Megatron-FSDP, TP 2", saved=(*DDP, *tp(2)), loaded=tp(2),
        saved_world=4, loaded_world=4),
    Row("Megatron DDP, TP 2, SwiGLU -> Megatron-FSDP, TP 2", saved=(*DDP, *tp(2), "--swiglu"),
        loaded=(*tp(2), "--swiglu"), saved_world=4, loaded_world=4),
    Row("Megatron-FSDP -> Megatron DDP (megatron-core's Muon)", loaded=DDP,
        tested_by="test_megatron_ddp_continues_a_megatron_fsdp_muon_checkpoint"),
    Row("Megatron-FSDP, TP 2 -> Megatron DDP, TP 2", saved=tp(2), loaded=(*DDP, *tp(2)),
        saved_world=4, loaded_world=4, expect="refused",
        says=r"--tensor-model-parallel-size 1 only"),
]


TABLE_START = ("<!-- carry-over table: written by `make carry-over` from "
               "benchmarks/results/carry_over.json -->")
TABLE_END = "<!-- end of carry-over table -->"


def outcome(row: Row, difference: float | None, refusal: str | None) -> str:
    """What a row's runs showed: refused where the load stopped, else equal (or weights) where
    the compared iterations are within TOLERANCE, else differs."""
    if refusal is not None:
        return "refused"
    if difference is not None and difference <= TOLERANCE:
        return row.expect if row.expect == "weights" else "equal"
    return "differs"


def launch_environment(flags) -> dict[str, str]:
    """What a run's launch sets beside its flags, as Megatron's launch scripts do:
    megatron.training's validate_args asserts CUDA_DEVICE_MAX_CONNECTIONS=1 for Megatron DDP with
    tensor or context parallelism (before Blackwell), and for Megatron-FSDP asserts it unset or
    above 1. A run moving between the two changes it with its flags."""
    return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if "--no-use-megatron-fsdp" in flags else {}


def _launched(world: int, flags) -> str:
    """A run's table cell: its world size, environment and flags, as a user launches it."""
    environment = " ".join(f"`{name}={value}`" for name, value in launch_environment(flags).items())
    return f"{world}: " + " ".join(part for part in (environment, f"`{' '.join(flags) or '-'}`")
                                   if part)


def markdown_table(results: list[dict]) -> str:
    """The docs' table: one line per row, its layouts, what it ended as, the largest relative
    difference of the compared iterations, what a refusal said, and the main suite's test."""
    lines = ["| change between save and load | saved: W, environment, flags "
             "| loaded: W, environment, flags | outcome "
             "| largest relative difference | said, or the suite's test |",
             "|---|---|---|---|---|---|"]
    for result in results:
        shown = (result["expect"] if result["as_expected"]
                 else f"**{result['shows']}** (expected: {result['expect']})")
        difference = result["relative_difference"]
        said = (result["refusal"] or "").replace("|", "\\|")
        where = "`test_carry_over`" if result["suite"] else (
            f"`{result['tested_by']}`" if result["tested_by"] else "")
        lines.append(" | ".join([
            f"| {result['row']}", _launched(result["saved_world"], result["saved"]),
            _launched(result["loaded_world"], result["loaded"]), shown,
            "-" if difference is None else f"{difference:.1e}",
            "; ".join(part for part in (said, where) if part)]) + " |")
    return "\n".join(lines)
