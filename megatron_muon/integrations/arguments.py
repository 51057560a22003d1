"""Command-line flags for Muon on Megatron-FSDP, as a Megatron `extra_args_provider`.

megatron.training already defines `--optimizer muon` and the `--muon-*` hyper-parameters
(momentum, nesterov, scale mode, Newton-Schulz steps and coefficients, tp mode...); this adds only
what Megatron lacks.
"""

import argparse
import re

from ..compat import upstream
from ..core.zero_adaptive_muon import MOMENT2_METHODS, check_adaptive_settings
from ..core.settings import DIST_MODES, OWNER_CHOICES
from . import rules
from .muon_settings import MuonSettings

# What each --muon-fp32-matmul-prec does to Newton-Schulz (emerging_optimizers' newton_schulz
# under torch.set_float32_matmul_precision; docs/newton-schulz-precision.md).
FP32_MATMUL_PRECISIONS = {
    'highest': 'fp32 matmuls (what the bit-exactness contract is stated at)',
    'high': 'TF32 on CUDA; fp32 on CPUs without AMX-FP16',
    'medium': 'bf16 matmuls (Megatron\'s default; emulated, about 100x slower, on a CPU '
              'without native bf16)',
    'low': 'not a torch precision: torch ignores it with a warning, so the process\'s global '
           'precision applies',
}


def offer_fp32_newton_schulz(parser: argparse.ArgumentParser) -> None:
    """Add emerging_optimizers' 'highest' to the choices of Megatron's --muon-fp32-matmul-prec,
    whose low/medium/high include no fp32 on CUDA. install() has every parser megatron.training
    builds do it: pretrain() parses the command line again with Megatron's own (fault tolerance's
    setup), which would refuse the value."""
    for action in upstream.parser_actions(parser):
        if '--muon-fp32-matmul-prec' in action.option_strings:
            action.choices = list(FP32_MATMUL_PRECISIONS)
            action.help = 'Precision of Newton-Schulz\'s matmuls: ' + '; '.join(
                f'{name}: {meaning}' for name, meaning in FP32_MATMUL_PRECISIONS.items())


# A '%' that argparse's help formatting (`help % params`) does not read as a specifier: '%(name)s'
# and '%%' are; a bare one (megatron-core 0.19.2's TransformerConfig docstrings, shown as help
# for --moe-paged-stash-buffer-size-factor-cuda: "1.10 = 10%)") stops --help with ValueError.
_PERCENT = re.compile(r'%[%(]?')


def mend_help_texts(parser: argparse.ArgumentParser) -> None:
    """Escape each bare '%' in the parser's help texts, so that --help prints."""
    for action in upstream.parser_actions(parser):
        if action.help and action.help is not argparse.SUPPRESS:
            action.help = _PERCENT.sub(lambda found: found[0] if len(found[0]) == 2 else '%%',
                                       action.help)


def _at_least_0(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f'{value} (at least 0)')
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f'{value} (must be positive)')
    return value


def add_muon_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    offer_fp32_newton_schulz(parser)
    group = parser.add_argument_group(title='muon on megatron-fsdp')
    group.add_argument('--muon-dist-mode', choices=DIST_MODES, default=MuonSettings.dist_mode,
                       help='How Muon orthogonalizes FSDP-sharded matrices: "owner" gathers each '
                       'matrix on one rank, which runs Newton-Schulz and scatters the result; '
                       '"allgather" gathers every matrix on every rank.')
    group.add_argument('--muon-owner-choice', choices=OWNER_CHOICES,
                       default=MuonSettings.owner_choice,
                       help='How "owner" mode picks each matrix\'s owner: "time" for the shortest '
                       'estimated step (Newton-Schulz seconds and bytes at rates measured when the '
                       'optimizer is built), "bytes" for the fewest bytes moved, from shapes '
                       'alone. With fp32 Newton-Schulz (--muon-fp32-matmul-prec highest) results '
                       'are bit-identical either way.')
    group.add_argument('--muon-max-exchange-bytes', type=_positive,
                       default=MuonSettings.max_exchange_bytes,
                       help='The most bytes "owner" mode\'s step holds at once on a rank beyond '
                       'the weights, gradients and momentum: update rows, exchange buffers, '
                       'assembled matrices, results and Newton-Schulz\'s working set of the two '
                       'exchanges in flight. Default, per rank: what Muon\'s state saves it '
                       'against Adam\'s (4 bytes per Muon element it holds) plus the most the '
                       'step must exceed a rank\'s saving anyway (its largest matrices alone). '
                       'Smaller: more, smaller exchanges and Newton-Schulz batches; a matrix '
                       'that alone needs more than half goes alone in its batch and the start-up '
                       'log names the largest.')
    group.add_argument('--muon-max-team-size', type=_positive,
                       default=MuonSettings.max_team_size,
                       help='"owner" mode may split a matrix whose Newton-Schulz '
                       'alone exceeds its share of the step over a team of up to this many ranks, '
                       'which orthogonalize it together in megatron-core\'s "distributed" TP '
                       'form (the Gram matrix summed over the team each iteration: equal to '
                       'single-device Muon up to the order of those sums). Default 1: every '
                       'matrix whole on one owner, bit-identical to single-device Muon.')
    if not any('--muon-use-syrk' in action.option_strings
               for action in upstream.parser_actions(parser)):  # megatron-core main defines it
        group.add_argument('--muon-use-syrk', action='store_true',
                           help='Run Newton-Schulz through emerging-optimizers\' Triton SYRK '
                           'kernel (about half the FLOPs of its symmetric products): CUDA, '
                           'Triton >= 3.4, --muon-fp32-matmul-prec medium; each matrix in its own '
                           'call. Refused, naming why, where it cannot run.')
    # megatron-core's OptimizerConfig fields for --optimizer adaptive_muon, which
    # megatron.training has no flags for (it builds OptimizerConfig from the args by field name).
    group.add_argument('--adaptive-muon-moment2-method', choices=MOMENT2_METHODS,
                       default='adamuon',
                       help='--optimizer adaptive_muon\'s second moment after Newton-Schulz: '
                       '"adamuon" elementwise (AdaMuon), "normuon" per row, or per column of a '
                       'matrix wider than tall, rescaled to the orthogonalized update\'s '
                       'Frobenius norm (NorMuon), "namo" a scalar from the gradient\'s norm.')
    group.add_argument('--adaptive-muon-beta2', type=float, default=0.95,
                       help='--optimizer adaptive_muon: the second moment\'s decay rate.')
    group.add_argument('--adaptive-muon-eps', type=float, default=1e-8,
                       help='--optimizer adaptive_muon: the second moment\'s epsilon.')
    group.add_argument('--muon-max-consecutive-skipped-steps', type=_at_least_0,
                       default=MuonSettings.max_consecutive_skipped_steps,
                       help='Stop with an error after this many optimizer steps in a row skipped '
                       'for NaN or Inf gradients (a diverged run); 0: never stop. Each skipped '
                       'step is reported.')
    group.add_argument('--muon-check-interval', type=_at_least_0,
                       default=MuonSettings.check_interval,
                       help='Every this many optimizer steps, also compute each Muon matrix\'s '
                       'update whole (as --muon-dist-mode allgather does) and stop with an error, '
                       'naming the matrix, where the owner exchange\'s differs (beyond fp32 '
                       'Newton-Schulz\'s 0, or a lower precision\'s own error); 0: never. Costs '
                       'nothing between checks.')
    return parser


# The --optimizer values megatron_muon steps on Megatron-FSDP (megatron.training refuses them there).
FSDP_OPTIMIZERS = ('muon', 'adaptive_muon')


def muon_on_megatron_fsdp(args: argparse.Namespace) -> bool:
    """Whether the flags ask for what megatron_muon provides: --optimizer muon (or
    adaptive_muon) on Megatron-FSDP."""
    return args.optimizer in FSDP_OPTIMIZERS and args.use_megatron_fsdp


def validate_muon_args(args: argparse.Namespace) -> None:
    """Refuse, with a clear message naming the flags, what Muon on Megatron-FSDP does not
    support, and what Megatron-FSDP does not with any optimizer (integrations.rules)."""
    if args.use_megatron_fsdp and not muon_on_megatron_fsdp(args):
        rules.refuse(lambda section, field: getattr(args, field), _flag, training_loop=True,
                     what='--use-megatron-fsdp', muon=False)
    if not muon_on_megatron_fsdp(args):
        return
    what = f'--optimizer {args.optimizer} with --use-megatron-fsdp'
    if not hasattr(args, 'muon_dist_mode'):
        raise ValueError(f'{what} needs Muon\'s flags: parse the arguments with '
                         f'extra_args_provider=megatron_muon.arguments.add_muon_args')
    rules.refuse(lambda section, field: getattr(args, field), _flag, training_loop=True, what=what)
    if args.optimizer == 'adaptive_muon':
        check_adaptive_settings(args.adaptive_muon_moment2_method, args.adaptive_muon_beta2,
                                args.adaptive_muon_eps, args.muon_use_syrk)


def _flag(section: str, field: str) -> str:
    return '--' + field.replace('_', '-')
