"""Command-line flags for Muon on Megatron-FSDP, as a Megatron `extra_args_provider`.

megatron.training already defines `--optimizer muon` and the `--muon-*` hyper-parameters
(momentum, nesterov, scale mode, Newton-Schulz steps and coefficients, tp mode...); this adds only
what Megatron lacks.
"""

import argparse
import dataclasses
import re

from ..compat import upstream
from ..core.zero_adaptive_muon import MOMENT2_METHODS, check_adaptive_settings
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


def add_muon_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    offer_fp32_newton_schulz(parser)
    group = parser.add_argument_group(title='muon on megatron-fsdp')
    defined = {option for action in upstream.parser_actions(parser)
               for option in action.option_strings}
    for setting in dataclasses.fields(MuonSettings):
        flag = '--muon-' + setting.name.replace('_', '-')
        if flag not in defined:  # megatron-core main defines --muon-use-syrk
            group.add_argument(flag, default=setting.default, help=setting.metadata['help'],
                               **setting.metadata['parsed'])
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
    return parser


# The --optimizer values megatron_muon steps on Megatron-FSDP (megatron.training refuses them
# there).
FSDP_OPTIMIZERS = ('muon', 'adaptive_muon')


def asks_for_ours(optimizer: str, megatron_fsdp: bool) -> bool:
    """Whether an optimizer name, on Megatron-FSDP or not, asks for what megatron_muon provides:
    muon (or adaptive_muon) on Megatron-FSDP. Each front end reads the two from its own
    settings: flags_ask_for_ours here, Bridge's muon_on_megatron_fsdp(cfg)."""
    return optimizer in FSDP_OPTIMIZERS and megatron_fsdp


def flags_ask_for_ours(args: argparse.Namespace) -> bool:
    """asks_for_ours of megatron.training's --optimizer and --use-megatron-fsdp."""
    return asks_for_ours(args.optimizer, args.use_megatron_fsdp)


def takes_dist_muon(optimizer: str, megatron_fsdp: bool) -> bool:
    """dist_muon (megatron-core's layer-wise distributed Muon, for Megatron DDP; Bridge's Kimi K2
    recipe names it) on Megatron-FSDP, which megatron.training and Bridge refuse there: ours
    steps it as muon, and the front end says so once, in taking_dist_muon's words."""
    return optimizer == 'dist_muon' and megatron_fsdp


def taking_dist_muon(asked: str) -> str:
    """The line a front end prints where it takes dist_muon (`asked`: in its own settings)."""
    return f"{asked}: megatron-muon's distributed Muon (ZeROTensorParallelMuon) steps it"


def validate_muon_args(args: argparse.Namespace) -> None:
    """Refuse, with a clear message naming the flags, what Muon on Megatron-FSDP does not
    support, and what Megatron-FSDP does not with any optimizer (integrations.rules)."""
    if args.use_megatron_fsdp and not flags_ask_for_ours(args):
        rules.refuse(lambda section, field: getattr(args, field), _flag, training_loop=True,
                     what='--use-megatron-fsdp', muon=False)
    if not flags_ask_for_ours(args):
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
