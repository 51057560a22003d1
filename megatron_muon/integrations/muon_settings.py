"""The `muon_*` settings, once: each one's name, default and flag (its help and parsing), for
every front end that carries them (megatron.training's --muon-* flags, added by
integrations.arguments; Bridge's MuonOptimizerConfig fields; the factory's `muon_*` arguments;
each front end reads them with MuonSettings.of), and the checks of a value a config may hold
without a flag's parser (Bridge's fields)."""

import argparse
import dataclasses

from ..core.settings import DIST_MODES, OWNER_CHOICES
from ..plan import MAX_EXCHANGE_BYTES


def positive(text: str) -> int:
    """A flag's positive integer."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} (must be positive)")
    return value


def at_least_0(text: str) -> int:
    """A flag's integer of 0 or more."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} (at least 0)")
    return value


def _setting(default, help: str, **parsed):
    """A setting: its default, and its --muon-<name> flag's help and how argparse parses it
    (integrations.arguments.add_muon_args adds each, in this order)."""
    return dataclasses.field(default=default, metadata={"help": help, "parsed": parsed})


@dataclasses.dataclass(frozen=True)
class MuonSettings:
    """Each field: ZeROTensorParallelMuon's argument of that name (FSDPMuonChainedOptimizer's
    for max_consecutive_skipped_steps); the flag is --muon-<name>, the config field and the
    factory's argument muon_<name> (the factory's docstring says what each does)."""
    dist_mode: str = _setting(
        "owner", choices=DIST_MODES,
        help='How Muon orthogonalizes FSDP-sharded matrices: "owner" gathers each matrix on one '
        'rank, which runs Newton-Schulz and scatters the result; "allgather" gathers every '
        'matrix on every rank.')
    owner_choice: str = _setting(
        "time", choices=OWNER_CHOICES,
        help='How "owner" mode picks each matrix\'s owner: "time" for the shortest estimated '
        'step (Newton-Schulz seconds and bytes at rates measured when the optimizer is built), '
        '"bytes" for the fewest bytes moved, from shapes alone. With fp32 Newton-Schulz '
        '(--muon-fp32-matmul-prec highest) results are bit-identical either way.')
    max_exchange_bytes: int | None = _setting(
        MAX_EXCHANGE_BYTES, type=positive,
        help='The most bytes "owner" mode\'s step holds at once on a rank beyond the weights, '
        'gradients and momentum: update rows, exchange buffers, assembled matrices, results and '
        'Newton-Schulz\'s working set of the two exchanges in flight. Default, per rank: what '
        'Muon\'s state saves it against Adam\'s (4 bytes per Muon element it holds) plus the '
        'most the step must exceed a rank\'s saving anyway (its largest matrices alone). '
        'Smaller: more, smaller exchanges and Newton-Schulz batches; a matrix that alone needs '
        'more than half goes alone in its batch and the start-up log names the largest.')
    max_team_size: int = _setting(
        1, type=positive,
        help='"owner" mode may split a matrix whose Newton-Schulz alone exceeds its share of the '
        'step over a team of up to this many ranks, which orthogonalize it together in '
        'megatron-core\'s "distributed" TP form (the Gram matrix summed over the team each '
        'iteration: equal to single-device Muon up to the order of those sums). Default 1: '
        'every matrix whole on one owner, bit-identical to single-device Muon.')
    use_syrk: bool = _setting(
        False, action="store_true",
        help='Run Newton-Schulz through emerging-optimizers\' Triton SYRK kernel (about half the '
        'FLOPs of its symmetric products): CUDA, Triton >= 3.4, --muon-fp32-matmul-prec medium; '
        'each matrix in its own call. Refused, naming why, where it cannot run.')
    gram_newton_schulz: bool = _setting(
        False, action="store_true",
        help='Run Gram Newton-Schulz (Dao-AILab\'s gram-newton-schulz: the same polynomial on the '
        'small Gram matrix, touching the long side only at the start, at a restart and at the '
        'end) on each matrix whole on its owner whose shape it costs fewer FLOPs for (more than '
        '1.5 times as long as wide: 0.70 of the FLOPs at 1:3.5, 0.56 at 1:7); standard '
        'Newton-Schulz on the rest (square matrices, TP-partitioned ones under --muon-tp-mode '
        'duplicated or distributed). At fp32 within a derived bound of standard Newton-Schulz '
        '(docs/design.md); at --muon-fp32-matmul-prec medium it iterates in fp16, as '
        'gram-newton-schulz does. The start-up log says how many matrices use it.')
    gram_restarts: tuple[int, ...] = _setting(
        (2,), type=int, nargs="+",
        help='With --muon-gram-newton-schulz: the iterations (0-based, each in [1, '
        '--muon-num-ns-steps)) at which Gram Newton-Schulz restarts from the long side, which '
        'keeps the Gram matrix well conditioned in low precision (gram-newton-schulz\'s '
        'gram_newton_schulz_reset_iterations; its default, 2).')
    max_consecutive_skipped_steps: int = _setting(
        10, type=at_least_0,
        help='Stop with an error after this many optimizer steps in a row skipped for NaN or Inf '
        'gradients (a diverged run); 0: never stop. Each skipped step is reported.')
    check_interval: int = _setting(
        0, type=at_least_0,
        help='Every this many optimizer steps, also compute each Muon matrix\'s update whole (as '
        '--muon-dist-mode allgather does) and stop with an error, naming the matrix, where the '
        'owner exchange\'s differs (beyond fp32 Newton-Schulz\'s 0, or a lower precision\'s own '
        'error); 0: never. Costs nothing between checks.')
    gather_inside_backward: bool = _setting(
        False, action="store_true",
        help='"owner" mode sends each matrix\'s momentum and reduced gradient rows to its owner '
        'during backward, as Megatron-FSDP finishes reducing them, instead of its update rows '
        'after backward; the owner forms the update itself after the clip, bit-identically. '
        'Only as many exchanges as the owners can hold within what Muon\'s state saves against '
        'Adam\'s; the start-up log says how many, or why none. Shown on CPU; not yet on a GPU.')

    @classmethod
    def of(cls, source) -> "MuonSettings":
        """The settings `source` holds as muon_<name> attributes (megatron.training's args, a
        Bridge config); one it lacks (a parser without our flags) at its default."""
        return cls(**{field.name: getattr(source, f"muon_{field.name}", field.default)
                      for field in dataclasses.fields(cls)})

    def factory_arguments(self) -> dict[str, object]:
        """As the factory's `muon_*` arguments."""
        return {f"muon_{name}": value for name, value in dataclasses.asdict(self).items()}

    def refusal(self, field_name) -> str | None:
        """What is wrong with a value no flag's parser checked (a config's), naming its field
        as `field_name(name)` gives it; None where every value is one the factory takes."""
        for setting in dataclasses.fields(self):  # the choices its flag takes
            choices, value = setting.metadata["parsed"].get("choices"), getattr(self, setting.name)
            if choices is not None and value not in choices:
                return f"{field_name(setting.name)} {value!r}: choose from {choices}"
        budget = self.max_exchange_bytes
        if budget is not None and (not isinstance(budget, int) or budget <= 0):
            return (f"{field_name('max_exchange_bytes')} {budget!r}: None (what Muon's state "
                    f"saves a rank) or a positive number of bytes (--muon-max-exchange-bytes)")
        return None
