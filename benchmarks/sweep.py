"""Every flag a Megatron user may add, run on Megatron-FSDP and on Megatron DDP side by side.

A row is a flag (or a few that go together) on a layout: a world size, tensor and expert
parallelism, a sharding strategy, micro-batches per rank. Each side is built and trained as
megatron.training builds and trains it, in process: the demo's command line
(examples/pretrain_gpt.py, a small GPT) parsed and validated by megatron.training as
`megatron_muon.training.install()` makes it, the model, its wrapper and the optimizer from
megatron.training's own `setup_model_and_optimizer` (its readers of every flag), and each
iteration through megatron.training's own `train_step` (megatron-core's schedule,
finalize_model_grads, the optimizer, the loss reduction). The sides differ by
`--use-megatron-fsdp` (with the strategy and the checkpoint format, which nothing here saves
with), and where a flag exists on one side only, by that flag. Adam on both sides tells
upstream's gradients from ours; Muon and adaptive Muon are ours on Megatron-FSDP against
megatron-core's on Megatron DDP.

Each row ends as one of OUTCOMES; `make sweep` runs every row (tests/e2e/test_flag_sweep.py, SWEEP=all)
and writes benchmarks/results/sweep.json; the main suite runs the rows marked `suite`.
"""

import contextlib
import dataclasses
import io
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
ITERATIONS = 3
# The small GPT both sides train (the demo's model_provider: megatron-core's local spec) on
# sequences of 16 tokens from a vocabulary of 64, micro-batches of 2 sequences; fp32 with fp32
# Newton-Schulz, dropout off, a constant learning rate.
MICRO_BATCH = 2
MODEL = ("--num-layers 2 --hidden-size 32 --ffn-hidden-size 48 --num-attention-heads 4 "
         "--seq-length 16 --max-position-embeddings 16 --vocab-size 64 "
         f"--micro-batch-size {MICRO_BATCH} --use-cpu-initialization --train-iters 10 "
         "--lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 0 --lr-decay-style constant "
         "--hidden-dropout 0 --attention-dropout 0 --clip-grad 1.0 --seed 1234 "
         "--muon-fp32-matmul-prec highest").split()
FSDP = "--use-megatron-fsdp --ckpt-format fsdp_dtensor".split()
DDP = "--no-use-megatron-fsdp --ckpt-format torch_dist".split()
STRATEGIES = {"ZeRO-1": "optim", "ZeRO-2": "optim_grads", "ZeRO-3": "optim_grads_params"}
MOE = "--num-experts 4 --moe-router-topk 2".split()

# What a row ends as.
OUTCOMES = {
    "equal": "Megatron-FSDP's losses and grad norms equal Megatron DDP's at every iteration",
    "refused": "refused before anything is built, naming the flag",
    "fixed": "equal, with megatron-muon's upstream layer's fix (fixes.upstream_fixes)",
    "limitation": "an upstream limitation, documented (docs/flags.md)",
}
# How far the sides' values may be apart, relative. fp32: both sides add the same gradients in
# another order (Megatron-FSDP's reduce-scatter buckets against Megatron DDP's all-reduce ones,
# and its sharded norm's partial sums), each sum of n terms changing by at most n·u (u = 2^-24)
# of its terms' magnitudes; over the few hundred terms of a bucket and three iterations, whose
# updates (lr 1e-3, Adam or Muon) pass each difference on, 1e-5 holds with room, as
# tests/tolerances.RTOL. bf16 (the forward, backward and their gradients in 16 bits): one
# rounding of a value there is 2^-8 of it, and the two sides round gradients at different points
# (their buckets, their communication dtypes).
TOLERANCE = {"fp32": 1e-5, "bf16": 2 ** -8}


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the run is laid out: the world size and Megatron's parallel flags."""

    world_size: int
    flags: tuple[str, ...]

    @property
    def data_parallel(self) -> int:
        tp = self._value("--tensor-model-parallel-size", 1)
        return self.world_size // tp

    def _value(self, flag: str, default: int) -> int:
        return int(self.flags[self.flags.index(flag) + 1]) if flag in self.flags else default

    def with_micro_batches(self, micro_batches: int) -> tuple[str, ...]:
        return (*self.flags, "--global-batch-size",
                str(micro_batches * MICRO_BATCH * self.data_parallel))


def _layout(world_size, flags=""):
    return Layout(world_size, tuple(flags.split()))


# The layouts a flag is tried on. EP in {1, DP/2, DP}, TP in {1, 2}, W in {2, 4}: dense at W=2
# and W=4; MoE with expert groups of two (EP = DP/2: each expert's gradient reduced over two
# ranks) and with EP = DP (NVIDIA's DP8/EP8: each expert on one rank, its gradient reduced over
# one); TP=2 on dense and MoE models (DP=2).
LAYOUTS = {
    "dense W=2": _layout(2),
    "dense W=4": _layout(4),
    "MoE W=4 EP=2": _layout(4, " ".join(MOE) + " --expert-model-parallel-size 2"),
    "MoE W=2 EP=2": _layout(2, " ".join(MOE) + " --expert-model-parallel-size 2"),
    "dense W=4 TP=2": _layout(4, "--tensor-model-parallel-size 2"),
    # megatron-core's MoE layer requires sequence parallelism with tensor parallelism.
    "MoE W=4 TP=2 EP=2": _layout(4, " ".join(MOE) + " --tensor-model-parallel-size 2 "
                                 "--expert-model-parallel-size 2 --sequence-parallel"),
}


@dataclasses.dataclass(frozen=True)
class Row:
    """A flag on a layout. `both`: flags on both sides; `fsdp`, `ddp`: flags one side only has
    (e.g. HSDP's, Megatron DDP's distributed optimizer); `expect`: the outcome (OUTCOMES);
    `why`: for fixed, the fix and its upstream reference; for limitation and refused, what the
    user is told; `precision`: which TOLERANCE applies."""

    flag: str
    layout: str
    optimizer: str = "adam"
    strategy: str = "ZeRO-3"
    micro_batches: int = 2
    both: tuple[str, ...] = ()
    fsdp: tuple[str, ...] = ()
    ddp: tuple[str, ...] = ()
    expect: str = "equal"
    why: str = ""
    precision: str = "fp32"
    suite: bool = False
    # What a limitation row shows (measured_outcome's words); the flag a refusal names.
    limitation_shows: str = ""
    refused_flag: str = ""

    def __post_init__(self):
        assert self.expect in OUTCOMES and self.layout in LAYOUTS, self
        assert (self.expect == "limitation") == bool(self.limitation_shows), self

    @property
    def shows(self) -> str:
        return {"equal": "equal", "fixed": "equal", "refused": "refused"}.get(
            self.expect, self.limitation_shows)

    @property
    def name(self) -> str:
        return (f"{self.flag or 'no flag'} | {self.layout} {self.strategy} "
                f"{self.micro_batches}mb | {self.optimizer}")

    @property
    def world_size(self) -> int:
        return LAYOUTS[self.layout].world_size

    @property
    def parallel_layout(self) -> tuple:
        """What the row's sides build megatron-core's groups for (running rows in this order
        builds them least often)."""
        return (self.world_size, self.layout, self.fsdp, self.ddp)

    def side_flags(self, fsdp: bool) -> list[str]:
        layout = LAYOUTS[self.layout]
        common = [*layout.with_micro_batches(self.micro_batches), "--optimizer", self.optimizer,
                  *self.both]
        if fsdp:
            return [*common, *FSDP, "--data-parallel-sharding-strategy",
                    STRATEGIES[self.strategy], *self.fsdp]
        return [*common, *DDP, *self.ddp]


@dataclasses.dataclass
class Side:
    """One side's run: each iteration's (loss, grad norm), or what refused it (in parsing and
    validation: before anything is built), or what failed once it was being built."""

    # (loss, grad norm), the norm None where the iteration was skipped (fp16's loss scaler).
    history: list[tuple[float, float | None]] = dataclasses.field(default_factory=list)
    refusal: str | None = None
    error: str | None = None


def _batch(iteration: int, micro_batch: int, seq: int, vocab: int, batch: int):
    """A micro-batch fixed by (iteration, data-parallel rank, micro-batch), the same on the
    tensor-parallel ranks of one data-parallel rank; some tokens masked out of the loss, a
    different number in each micro-batch (so a per-token loss differs from a mean of means)."""
    from megatron.core import parallel_state

    g = torch.Generator().manual_seed(
        10_000 * iteration + 100 * parallel_state.get_data_parallel_rank() + micro_batch)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    loss_mask = (torch.rand(batch, seq, generator=g) > 0.3).float()
    return {
        "tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
        "loss_mask": loss_mask,
        "attention_mask": torch.tril(torch.ones(seq, seq, dtype=torch.bool)).logical_not().view(
            1, 1, seq, seq),
        "position_ids": torch.arange(seq).unsqueeze(0).expand(batch, -1),
    }


def _parse(flags: list[str], world_size: int):
    """megatron.training's parse and validation of the demo's command line with `flags`."""
    import megatron.training.arguments as megatron_arguments
    import pretrain_gpt

    argv, environ = sys.argv, dict(os.environ)
    sys.argv = ["pretrain_gpt.py", *flags]
    os.environ.update(RANK=str(torch.distributed.get_rank()), WORLD_SIZE=str(world_size))
    if "--use-megatron-fsdp" not in flags:
        # Megatron DDP with TP or CP asks for it (validate_args), Megatron-FSDP refuses it.
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            args = megatron_arguments.parse_args(pretrain_gpt.add_demo_args)
            megatron_arguments.validate_args(args)
            pretrain_gpt.refuse_what_megatron_core_cannot_do(args)
        return args
    finally:
        sys.argv = argv
        os.environ.clear()
        os.environ.update(environ)


def _initialize(args):
    """What initialize_megatron does past the process group: megatron-core's groups for the
    layout (kept while the layout stays), the seeds, megatron.training's globals."""
    from megatron.core.rerun_state_machine import destroy_rerun_state_machine
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.training import global_vars

    from megatron_muon.tools.testing import init_parallel_state

    global_vars.unset_global_variables()
    destroy_rerun_state_machine()
    global_vars.set_global_variables(args, build_tokenizer=False)
    init_parallel_state(
        expert_parallel=args.expert_model_parallel_size,
        tensor_parallel=args.tensor_model_parallel_size,
        replicas=args.num_distributed_optimizer_instances,
        expert_tensor_parallel=args.expert_tensor_parallel_size,
        context_parallel=args.context_parallel_size)
    torch.manual_seed(args.seed)
    tp_random.model_parallel_cuda_manual_seed(args.seed)


def run_side(flags: list[str], world_size: int, iterations: int = ITERATIONS) -> Side:
    """Train the small GPT with `flags` as megatron.training would, `iterations` iterations."""
    import megatron_muon.training

    megatron_muon.training.install()
    try:
        args = _parse([*MODEL, *flags], world_size)
    except (SystemExit, AssertionError, ValueError) as refusal:
        return Side(refusal=str(refusal) or type(refusal).__name__)
    try:
        return _train(args, iterations)
    except Exception as error:  # noqa: BLE001 - what a user would see, recorded for the row
        return Side(error=f"{type(error).__name__}: {error}")


def _train(args, iterations: int) -> Side:
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config
    from megatron.training import training
    import pretrain_gpt

    _initialize(args)
    with contextlib.redirect_stdout(io.StringIO()):
        model, optimizer, scheduler = training.setup_model_and_optimizer(
            ModelType.encoder_or_decoder, pretrain_gpt.model_provider)
    config = get_model_config(model[0])
    # What megatron.training's train() sets before its loop (but its timers).
    config.grad_scale_func = optimizer.scale_loss
    config.timers = None
    if args.overlap_grad_reduce:
        config.no_sync_func = model[0].no_sync
        if args.align_grad_reduce:
            config.grad_sync_func = model[0].start_grad_sync
    if args.overlap_param_gather and args.align_param_gather:
        config.param_sync_func = model[0].start_param_sync
    config.finalize_model_grads_func = finalize_model_grads
    for chunk in model:
        chunk.train()
    side = Side()
    for iteration in range(iterations):
        data = iter([_batch(iteration, m, args.seq_length, args.vocab_size, args.micro_batch_size)
                     for m in range(get_num_microbatches())])
        loss, skipped, _, _, _, grad_norm, _, _ = training.train_step(
            pretrain_gpt.forward_step, data, model, optimizer, scheduler, config,
            get_forward_backward_func(), iteration=iteration)
        side.history.append((float(loss["lm loss"]), None if skipped else float(grad_norm)))
    return side


ADAM_AND_MUON = ("adam", "muon")
MLA = ("--multi-latent-attention --q-lora-rank 20 --kv-lora-rank 12 --qk-head-dim 8 "
       "--qk-pos-emb-head-dim 4 --v-head-dim 6 --normalization RMSNorm --qk-layernorm")
HSDP = "--num-distributed-optimizer-instances 2"
HFSDP = "--outer-dp-sharding-strategy optim"
AVERAGE_FIX = ("upstream_fixes 2 (not reported upstream): Megatron-FSDP drops the experts' "
               "gradient scale (expert-DP / DP) under average_in_collective, and fails to build "
               "a model without experts")


def _each(flag, layouts, optimizers=ADAM_AND_MUON, strategies=("ZeRO-3",), **row):
    """The flag's row on each layout, optimizer and strategy; `both`, `fsdp` and `ddp` as
    strings; `both` defaults to the flag itself."""
    sides = {side: tuple(row.pop(side, "").split()) for side in ("fsdp", "ddp")}
    both = tuple(row.pop("both", flag).split())
    return [Row(flag, layout, optimizer, strategy, both=both, **sides, **row)
            for layout in layouts for optimizer in optimizers for strategy in strategies]


def _suite(rows, *keep):
    """`rows` with those whose (layout, optimizer) is in `keep` marked for the main suite."""
    return [dataclasses.replace(row, suite=(row.layout, row.optimizer) in keep) for row in rows]


ROWS = [
    # Every layout and strategy without a flag: the baseline each flag's rows stand on.
    *_each("", LAYOUTS, strategies=STRATEGIES),
    *_each("", ["dense W=2", "MoE W=2 EP=2"], micro_batches=1),
    *_each("", ["dense W=2", "MoE W=4 EP=2"], ["adaptive_muon"]),
    # Gradients and their reduction.
    *_suite(_each("--ddp-average-in-collective", LAYOUTS, expect="fixed", why=AVERAGE_FIX),
            ("MoE W=4 EP=2", "adam"), ("MoE W=4 EP=2", "muon"), ("dense W=2", "adam")),
    *_each("--ddp-average-in-collective", ["MoE W=4 EP=2"], strategies=("ZeRO-1", "ZeRO-2"),
           expect="fixed", why=AVERAGE_FIX),
    *_suite(_each("--calculate-per-token-loss", ["dense W=2", "MoE W=4 EP=2", "MoE W=2 EP=2"]),
            ("MoE W=2 EP=2", "muon")),
    *_each("--overlap-grad-reduce", ["dense W=2"], strategies=("ZeRO-1",)),
    *_each("--overlap-grad-reduce", ["MoE W=2 EP=2"]),
    *_each("--overlap-grad-reduce", ["MoE W=4 EP=2"], strategies=("ZeRO-2",)),
    # Megatron DDP gathers parameters with --overlap-param-gather only from its distributed
    # optimizer's shards (Adam's), which megatron-core's Muon on DDP lays out only in bf16.
    *_suite(_each("--overlap-param-gather", ["dense W=2", "MoE W=4 EP=2"], ["adam"],
                  both="--overlap-grad-reduce --overlap-param-gather",
                  ddp="--use-distributed-optimizer"), ("dense W=2", "adam")),
    *_each("--overlap-param-gather", ["dense W=2", "MoE W=4 EP=2"], ["muon"],
           both="--overlap-grad-reduce", fsdp="--overlap-param-gather"),
    *_each("--ddp-bucket-size", ["dense W=2", "MoE W=4 EP=2"], both="--ddp-bucket-size 1000"),
    *_each("--no-check-for-nan-in-loss-and-grad", ["dense W=2"]),
    *_each("--use-distributed-optimizer", ["dense W=2", "MoE W=4 EP=2"], ["adam"], both="",
           ddp="--use-distributed-optimizer",
           why="on Megatron DDP's side (its distributed optimizer; Megatron-FSDP always shards)"),
    # Precision.
    *_suite(_each("--bf16", ["dense W=2", "MoE W=4 EP=2"], precision="bf16"),
            ("dense W=2", "muon")),
    *_each("--bf16 --grad-reduce-in-bf16", ["dense W=2"], precision="bf16"),
    *_each("--bf16 --accumulate-allreduce-grads-in-fp32", ["dense W=2"], precision="bf16"),
    *_each("--use-distributed-optimizer --bf16", ["dense W=2"], ["muon"], both="--bf16",
           ddp="--use-distributed-optimizer", precision="bf16",
           why="on Megatron DDP's side: megatron-core's layer-wise distributed Muon (bf16 only)"),
    *_suite(_each("--fp16", ["dense W=2"], expect="refused", refused_flag="--fp16"),
            ("dense W=2", "adam")),
    # The optimizer.
    *_each("--clip-grad 0", ["dense W=2"], ["muon"]),
    *_each("--clip-grad 0", ["dense W=2"], ["adam"], expect="limitation",
           limitation_shows="differs",
           why="megatron-core's DistributedOptimizer on Megatron-FSDP logs a grad norm of 0.0 "
               "when it does not clip (it computes the norm only to clip); its updates equal "
               "Megatron DDP's (the losses agree)"),
    *_each("--optimizer-cpu-offload", ["dense W=2", "MoE W=4 EP=2"], ["muon", "adaptive_muon"],
           both="", fsdp="--optimizer-cpu-offload",
           why="on Megatron-FSDP's side: the optimizer state in host memory between steps "
               "(megatron-core's own offload, HybridDeviceOptimizer, is Adam's and needs CUDA)"),
    *_each("--muon-gather-inside-backward", ["dense W=2", "dense W=4", "MoE W=4 EP=2"], ["muon"],
           both="", fsdp="--muon-gather-inside-backward",
           why="on Megatron-FSDP's side: each exchange's momentum and gradient rows sent to their "
               "owners as the grads are reduced (at the grad sync here), the owners forming the "
               "updates after the clip: ours bit for bit (docs/design.md)"),
    *_each("--muon-max-team-size 4", ["dense W=4"], ["muon"],
           both="--num-layers 1 --ffn-hidden-size 1024",
           fsdp="--muon-max-team-size 4 --muon-owner-choice bytes",
           why="on Megatron-FSDP's side: the MLP's fc1 and fc2 (1024 x 32, 32 x 1024) split over "
               "teams of ranks, orthogonalized in megatron-core's distributed form "
               "(docs/design.md, Teams); one layer with a 1024-wide MLP on both sides"),
    *_each("--muon-gram-newton-schulz", ["dense W=2", "MoE W=4 EP=2"], ["muon"],
           both="--ffn-hidden-size 128", fsdp="--muon-gram-newton-schulz",
           why="on Megatron-FSDP's side: Gram Newton-Schulz on the MLPs' 128 x 32 and 32 x 128 "
               "matrices (the square ones standard), against megatron-core's standard "
               "Newton-Schulz on Megatron DDP: the same polynomial, within fp32's rounding "
               "(docs/design.md); a 128-wide MLP on both sides"),
    *_each("--qk-clip", ["dense W=2"], ["muon"], expect="limitation",
           limitation_shows="no reference",
           why="Megatron DDP's --qk-clip needs TransformerEngine >= 2.9 (validate_args), absent "
               "on CPU: ours is held to single-device MuonClip in tests/chain/test_qk_clip.py"),
    # HSDP.
    # HSDP's flags exist on Megatron-FSDP's side only: Megatron DDP replicates over all ranks.
    *_suite(_each(f"{HSDP} --overlap-grad-reduce", ["dense W=4", "MoE W=4 EP=2"],
                  both="--overlap-grad-reduce", fsdp=HSDP),
            ("MoE W=4 EP=2", "adam"), ("dense W=4", "muon")),
    *_suite(_each(f"{HSDP} {HFSDP} --overlap-grad-reduce", ["dense W=4"], ["muon"],
                  both="--overlap-grad-reduce", fsdp=f"{HSDP} {HFSDP}"), ("dense W=4", "muon")),
    *_suite(_each(f"{HSDP} {HFSDP} --overlap-grad-reduce", ["dense W=4"], ["adam"],
                  both="--overlap-grad-reduce", fsdp=f"{HSDP} {HFSDP}", expect="refused",
                  refused_flag="--outer-dp-sharding-strategy"), ("dense W=4", "adam")),
    *_each(HSDP, ["dense W=4"], both="", fsdp=HSDP, expect="refused",
           refused_flag="--num-distributed-optimizer-instances",
           why="without --overlap-grad-reduce Megatron-FSDP never reduces across the replicas"),
    *_each(f"--ddp-average-in-collective {HSDP} --overlap-grad-reduce", ["MoE W=4 EP=2"],
           ["adam"], both="--ddp-average-in-collective --overlap-grad-reduce", fsdp=HSDP,
           expect="fixed", why=AVERAGE_FIX),
    # Tensor and expert parallelism.
    *_each("--sequence-parallel", ["dense W=4 TP=2"]),
    *_suite(_each("--expert-tensor-parallel-size 1", ["MoE W=4 TP=2 EP=2"]),
            ("MoE W=4 TP=2 EP=2", "muon")),
    # The model.
    *_each("--moe-shared-expert-intermediate-size 24", ["MoE W=4 EP=2"]),
    *_each("--moe-router-load-balancing-type aux_loss", ["MoE W=4 EP=2"],
           both="--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.01"),
    *_each("--moe-router-load-balancing-type seq_aux_loss", ["MoE W=4 EP=2"],
           both="--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 0.01"),
    *_each("--multi-latent-attention", ["dense W=2", "MoE W=4 EP=2"], both=MLA),
    *_each("--mtp-num-layers 1", ["dense W=2"], ["adam"],
           both="--mtp-num-layers 1 --position-embedding-type rope", expect="limitation",
           limitation_shows="error",
           why="megatron-core's local spec (CPU's) fails in multi-token prediction's loss on "
               "both sides (IndexError in process_mtp_loss); not run on CPU"),
    *_each("--context-parallel-size 2", ["dense W=2"], ["adam"], expect="limitation",
           limitation_shows="error",
           why="megatron-core's local attention (CPU's) has no context parallelism "
               "(TEDotProductAttention only); not run on CPU"),
    *_each("--init-model-with-meta-device", ["dense W=2"], ["adam"], both="",
           fsdp="--init-model-with-meta-device", expect="limitation", limitation_shows="error",
           why="Megatron-FSDP's meta-device initialization calls reset_parameters on every "
               "module, which megatron-core 0.19's VocabParallelEmbedding lacks: it stops at "
               "model wrap (ValueError naming embedding.word_embeddings), with any optimizer"),
]


def measured_outcome(fsdp: Side, ddp: Side, tolerance: float) -> tuple[str, float | None]:
    """What a row shows: refused (Megatron-FSDP's side, before anything is built, whatever
    Megatron DDP does), error (a side failed once it was being built), no reference (Megatron
    DDP refuses what Megatron-FSDP runs), equal or differs (by the returned relative
    difference)."""
    if fsdp.refusal:
        return "refused", None
    if fsdp.error or ddp.error:
        return "error", None
    if ddp.refusal:
        return "no reference", None
    pairs = [(ours, theirs) for ours_step, theirs_step in zip(fsdp.history, ddp.history)
             for ours, theirs in zip(ours_step, theirs_step)]
    if any((ours is None) != (theirs is None) for ours, theirs in pairs):
        return "differs", None  # one side skipped an iteration the other did not
    difference = max(abs(ours - theirs) / abs(theirs) for ours, theirs in pairs
                     if ours is not None)
    return ("equal" if difference <= tolerance else "differs"), difference


def run_row(row: Row) -> dict:
    """Both sides of a row, on this rank (every rank of the row's world size runs it)."""
    fsdp = run_side(row.side_flags(fsdp=True), row.world_size)
    ddp = run_side(row.side_flags(fsdp=False), row.world_size)
    outcome, difference = measured_outcome(fsdp, ddp, TOLERANCE[row.precision])
    return {"row": row.name, "flag": row.flag, "layout": row.layout, "strategy": row.strategy,
            "micro_batches": row.micro_batches, "optimizer": row.optimizer,
            "expect": row.expect, "why": row.why, "shows": outcome,
            "as_expected": outcome == row.shows,
            "relative_difference": difference, "tolerance": TOLERANCE[row.precision],
            "fsdp": dataclasses.asdict(fsdp), "ddp": dataclasses.asdict(ddp)}


TABLE_START = "<!-- sweep table: written by `make sweep` from benchmarks/results/sweep.json -->"
TABLE_END = "<!-- end of sweep table -->"


def markdown_table(results: list[dict]) -> str:
    """The docs' table: one line per flag and outcome, where it ran, its largest relative
    difference against Megatron DDP, and why (for fixed, refused and limitation rows)."""
    lines = ["| flag | outcome | where (layout, strategy, micro-batches per rank: optimizers) "
             "| largest relative difference | why |", "|---|---|---|---|---|"]
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for result in results:
        outcome = (result["expect"] if result["as_expected"]
                   else f"**{result['shows']}** (expected: {result['expect']})")
        # A refusal's own words where the row gives no reason.
        why = result["why"] or (result["fsdp"]["refusal"] if result["shows"] == "refused" else "")
        groups.setdefault((result["flag"] or "(none)", outcome, why), []).append(result)
    for (flag, outcome, why), members in groups.items():
        where: dict[str, list[str]] = {}
        for result in members:
            place = f"{result['layout']} {result['strategy']} {result['micro_batches']}mb"
            where.setdefault(place, []).append(result["optimizer"])
        differences = [result["relative_difference"] for result in members
                       if result["relative_difference"] is not None]
        largest = f"{max(differences):.1e}" if differences else "-"
        lines.append(f"| `{flag}` | {outcome} | "
                     + "; ".join(f"{place}: {', '.join(optimizers)}"
                                 for place, optimizers in where.items())
                     + f" | {largest} | {why} |")
    return "\n".join(lines)
