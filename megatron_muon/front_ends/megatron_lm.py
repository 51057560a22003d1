"""The switch that lets megatron.training train with `--optimizer muon --use-megatron-fsdp`.

Call `install()` once, before Megatron parses its arguments (it is idempotent). It

* takes `--optimizer dist_muon` with `--use-megatron-fsdp` as muon, ours, saying so once (Megatron
  refuses it; on Megatron DDP dist_muon stays megatron-core's layer-wise Muon);
* makes `validate_args` accept muon with Megatron-FSDP, which Megatron refuses twice (its
  validate_args asserts "Megatron-FSDP does not support the muon optimizer yet" and "Emerging
  optimizer does not support Megatron-FSDP for now"): validated as Adam on Megatron-FSDP would
  be, after `validate_muon_args` has refused what Muon on Megatron-FSDP lacks; every other
  combination as before. `--optimizer-cpu-offload` needs no `--use-precision-aware-optimizer`
  there (asked for Megatron's HybridDeviceOptimizer; Muon's offload is core/state_offload.py);
* routes megatron.training's optimizer factory to `integrations.factory.get_megatron_optimizer`
  with `--muon-dist-mode` (training.py imports the name, so megatron.core.optimizer's attribute is
  not the one it calls);
* without CUDA, makes megatron.training run on CPU with gloo (cpu/; inert with CUDA);
* fixes released Megatron-FSDP's gradients where upstream fixed them after the release, for every
  optimizer (fixes.upstream_fixes: a buffer reduced over one rank, e.g. the experts' at
  expert parallel = data parallel, rescaled at every micro-batch);
* lets a megatron-core whose dataset helper is built start without a Makefile (the wheel ships
  `helpers_cpp` built and none, and initialize_megatron's `compile_helpers()` would exit); a
  source checkout still builds, and a failed build still stops the run (fixes.upstream_fixes);
* names --no-load-optim where a Muon run's --load finds no optimizer state (DCP names one key);
* loads a Megatron DDP checkpoint (`torch_dist`) into a Muon run on Megatron-FSDP with --load DIR
  (checkpoint.from_megatron_ddp): the weights, megatron-core Muon's state, the schedule; and ours
  into a Megatron DDP run (checkpoint.to_megatron_ddp; checkpoint.direction decides);
* gives Muon on Megatron-FSDP MuonClip (--qk-clip) and --log-max-attention-logit, on
  megatron-core's local attention too: the optimizer's step reduces the max logits over the
  data-parallel ranks in one all-reduce and clips the sharded main weights (chain.qk_clip);
  the log prints each iteration's max logit (Megatron's own goes to TensorBoard and W&B only);
* reports the step (level 1) and its parts (level 2) to megatron.training's timers beside
  Megatron's (observe.phases), its scalars to TensorBoard and W&B (reporting.step_report),
  and with --tensorboard-dir writes there the rates it measured (reporting.rates_file);
* makes a Muon-on-FSDP run record each checkpoint file's size and CRC-32 after a save
  (checkpoint.checksums) and verify them before a load, on every rank together: a damaged file
  stops the run, named, before any state changes;
* accepts `--muon-fp32-matmul-prec highest` (fp32 Newton-Schulz, which Megatron's choices lack
  on CUDA) in every parse megatron.training makes, and warns once, on rank 0, when a Muon run
  asks for bf16 Newton-Schulz on a CPU that emulates bf16 matmuls (docs/newton-schulz-precision.md).
"""

import inspect
import re
import warnings
from pathlib import Path

import megatron.training.arguments
import megatron.training.checkpointing
import megatron.training.training
import torch
from megatron.training.checkpointing import (CheckpointType, get_checkpoint_name,
                                             get_checkpoint_tracker_filename,
                                             get_load_checkpoint_path_by_args, read_metadata)
from megatron.training.utils import print_rank_0, print_rank_last
from torch.distributed.checkpoint.api import CheckpointException

from ..chain import qk_clip
from ..checkpoint import checksums, direction, keys
from ..compat import upstream
from ..cpu import torch_compat
from ..cpu.training_compat import apply_megatron_training_compat
from ..fixes import upstream_fixes
from ..integrations import factory
from ..integrations.arguments import (FSDP_OPTIMIZERS, flags_ask_for_ours, mend_help_texts,
                                      offer_fp32_newton_schulz, takes_dist_muon, taking_dist_muon,
                                      validate_muon_args)
from ..integrations.muon_settings import MuonSettings
from ..integrations.run_state import RunState, training_log_then

_megatron_add_arguments = megatron.training.arguments.add_megatron_arguments
_megatron_validate_args = megatron.training.arguments.validate_args
_megatron_load_base_checkpoint = upstream.current(
    'megatron.training.checkpointing._load_base_checkpoint')
_megatron_save_checkpoint = megatron.training.training.save_checkpoint
_megatron_load_checkpoint = megatron.training.training.load_checkpoint
_megatron_clip_qk = megatron.training.training.clip_qk
_megatron_training_log = megatron.training.training.training_log
_RUN = RunState()
_LOAD_BASE_CHECKPOINT_PARAMETERS = inspect.signature(_megatron_load_base_checkpoint)
# Megatron's optimizers that run Newton-Schulz at --muon-fp32-matmul-prec.
MUON_OPTIMIZERS = ('muon', 'dist_muon', 'adaptive_muon')
MISSING_OPTIMIZER_STATE = re.compile(
    r'Missing key in checkpoint state_dict: (optimizer\.[^\s]*?)\.?$', re.MULTILINE)


def _add_megatron_arguments(parser):
    parser = _megatron_add_arguments(parser)
    offer_fp32_newton_schulz(parser)
    mend_help_texts(parser)
    return parser


_warned_of_emulated_bf16 = False


def _warn_if_newton_schulz_is_emulated(args) -> None:
    """Once, on rank 0: Muon asked for bf16 Newton-Schulz (--muon-fp32-matmul-prec medium, the
    default) on a CPU that emulates bf16 matmuls; the run keeps it."""
    global _warned_of_emulated_bf16
    if (_warned_of_emulated_bf16 or args.rank != 0 or args.optimizer not in MUON_OPTIMIZERS
            or args.muon_fp32_matmul_prec != 'medium'
            or not torch_compat.bf16_matmul_is_emulated()):
        return
    _warned_of_emulated_bf16 = True
    bf16 = torch_compat.matmul_seconds(torch.bfloat16)
    fp32 = torch_compat.matmul_seconds(torch.float32)
    warnings.warn(
        f'--muon-fp32-matmul-prec medium runs Newton-Schulz in bf16, which this CPU has no native '
        f'matmul for: a 512x512 matmul took {bf16 * 1e3:.0f} ms here in bf16 against '
        f'{fp32 * 1e3:.1f} ms in fp32 ({bf16 / fp32:.0f}x). --muon-fp32-matmul-prec highest runs '
        f'it in fp32.', stacklevel=2)


def _take_dist_muon_on_megatron_fsdp(args) -> None:
    """--optimizer dist_muon with Megatron-FSDP, which megatron.training refuses: ours steps it
    (arguments.takes_dist_muon), as bridge.install(cfg) does. Said on rank 0."""
    if not takes_dist_muon(args.optimizer, args.use_megatron_fsdp):
        return
    args.optimizer = 'muon'
    if args.rank == 0:
        asked = '--optimizer dist_muon with --use-megatron-fsdp'
        print(f'megatron-muon: {taking_dist_muon(asked)}', flush=True)


def _validate_args(args, defaults={}):
    _take_dist_muon_on_megatron_fsdp(args)
    _warn_if_newton_schulz_is_emulated(args)
    validate_muon_args(args)
    if not flags_ask_for_ours(args):
        return _megatron_validate_args(args, defaults)
    print_args = upstream.current('megatron.training.arguments._print_args')

    # Megatron measures max attention logits only in TransformerEngine's attention (it asserts
    # TE >= 2.9 for both flags); megatron_muon measures them in the local one too
    # (megatron_muon.chain.qk_clip), and validate_muon_args has checked --qk-clip's settings.
    # Megatron asks --optimizer-cpu-offload for --use-precision-aware-optimizer, whose code path
    # its HybridDeviceOptimizer reuses; Muon's offload is its own (core/state_offload.py).
    as_given = {'optimizer': args.optimizer, 'qk_clip': args.qk_clip,
                'log_max_attention_logit': args.log_max_attention_logit,
                'optimizer_cpu_offload': args.optimizer_cpu_offload}

    def print_args_as_given(title, args_to_print):
        # validate_args prints the arguments once every check has run: show them as given.
        vars(args_to_print).update(as_given)
        print_args(title, args_to_print)

    args.optimizer, args.optimizer_cpu_offload = 'adam', False
    if args.transformer_impl == 'local':
        args.qk_clip = args.log_max_attention_logit = False
    try:
        with upstream.temporarily('megatron.training.arguments._print_args', print_args_as_given):
            return _megatron_validate_args(args, defaults)
    finally:
        vars(args).update(as_given)


def _get_megatron_optimizer(*args, **kwargs):
    flags = megatron.training.get_args()
    optimizer = factory.get_megatron_optimizer(
        *args, **MuonSettings.of(flags).factory_arguments(), **kwargs)
    _RUN.built(optimizer, flags.tensorboard_dir)
    return optimizer


def _load_base_checkpoint(*args, **kwargs):
    bound = _LOAD_BASE_CHECKPOINT_PARAMETERS.bind(*args, **kwargs)
    loaded = _load_across_formats(**bound.arguments)
    if loaded is not None:
        return loaded
    try:
        return _megatron_load_base_checkpoint(*args, **kwargs)
    except CheckpointException as error:  # a BaseException
        missing = MISSING_OPTIMIZER_STATE.search(str(error))
        if missing is None or megatron.training.get_args().optimizer not in FSDP_OPTIMIZERS:
            raise
        raise RuntimeError(keys.load_the_model_only(
            f'the checkpoint has no optimizer state for this run (first missing: {missing[1]}): '
            f'it was saved by another optimizer, or with --no-save-optim')) from error


def _checkpoint_to_load(load_dir, args):
    """(directory, iteration, release) of the checkpoint --load names (as upstream's
    _load_base_checkpoint picks it, --ckpt-step first), or None."""
    tracker = Path(get_checkpoint_tracker_filename(load_dir)) if load_dir else None
    if tracker is None or not tracker.is_file():
        return None
    iteration, release = read_metadata(str(tracker))
    iteration = getattr(args, 'ckpt_step', None) or iteration
    return (Path(get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)),
            iteration, release)


def _load_across_formats(load_dir, args, rank0=False, sharded_state_dict=None, **_):
    """_load_base_checkpoint's result where --load crosses formats (checkpoint.direction: a Muon
    run on Megatron-FSDP whose --load holds a Megatron DDP checkpoint, or a Megatron DDP run
    whose --load holds ours; upstream: a bare KeyError, or AttributeError), else None: on rank0
    what the direction reads before the load (the args, the iteration), so that load_checkpoint
    then generates the state dict of the run's own format; with it, that state dict loaded."""
    found = _checkpoint_to_load(load_dir, args)
    if found is None:
        return None
    checkpoint, iteration, release = found
    crossing = direction.crossing(checkpoint, muon_on_megatron_fsdp=flags_ask_for_ours(args),
                                  megatron_fsdp=args.use_megatron_fsdp,
                                  ckpt_format=args.ckpt_format)
    if crossing is None:
        return None
    if rank0:
        state = direction.read_before_the_load(crossing, checkpoint)
    else:
        megatron.training.checkpointing.set_loaded_iteration(iteration)
        print_rank_0(f' loading {crossing.says(checkpoint)} at iteration {iteration}')
        state = direction.load(crossing, checkpoint, sharded_state_dict, args.num_experts)
    return state, str(checkpoint), release, CheckpointType[crossing.value]


def _clip_qk(model, log_max_only=False):
    """megatron.training's QK-clip after the optimizer's step
    (chain.qk_clip.clip_qk_after_the_step), ours for Muon on Megatron-FSDP."""
    return qk_clip.clip_qk_after_the_step(model, log_max_only, _megatron_clip_qk,
                                          flags_ask_for_ours(megatron.training.get_args()))


def _report_beside_megatron(logged: dict) -> None:
    """After Megatron's log line: the iteration's max attention logit (measured in its forward,
    before any clip) on a line of its own (Megatron sends it only to TensorBoard and W&B); our
    step's timers as training_log logs and writes its own (it names none of ours); the step's
    scalars (reporting.step_report) to TensorBoard and W&B where they are on."""
    flags, iteration = megatron.training.get_args(), logged['iteration']
    first, logging = logged.get('is_first_iteration'), iteration % flags.log_interval == 0
    if flags.log_max_attention_logit and (logging or first):
        print_rank_last(f' iteration {iteration:8d} | max attention logit: '
                        f'{logged["max_attention_logit"]:.4f} |')
    if (logging or first) and flags_ask_for_ours(flags):
        _RUN.log_step(megatron.training.get_timers(), flags.timing_log_level,
                      flags.log_timers_to_tensorboard,
                      (megatron.training.get_tensorboard_writer(),
                       megatron.training.get_wandb_writer()),
                      iteration, flags.log_interval, reset=not first)


_training_log = training_log_then(_megatron_training_log, _report_beside_megatron)


def _checksummed(flags) -> bool:
    return flags_ask_for_ours(flags) and flags.ckpt_format == 'fsdp_dtensor'


def _save_checkpoint(iteration, *args, **kwargs):
    """Megatron's save, then each rank's files' checksums, of persistent, synchronous saves (an
    async one is still writing); a save killed before its tracker file leaves the last one."""
    result = _megatron_save_checkpoint(iteration, *args, **kwargs)
    flags = megatron.training.get_args()
    if (_checksummed(flags) and not flags.async_save
            and not kwargs.get('non_persistent_ckpt', False)):
        checkpoint = get_checkpoint_name(flags.save, iteration, kwargs.get('release', False),
                                         return_base_dir=True)
        checksums.record_on_every_rank(Path(checkpoint))
    return result


def _load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg='load', *args, **kwargs):
    flags = megatron.training.get_args()
    if _checksummed(flags) and getattr(flags, load_arg, None):
        checksums.verify_on_every_rank(Path(get_load_checkpoint_path_by_args(flags, load_arg)))
    return _megatron_load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg, *args,
                                     **kwargs)


def install() -> None:
    """Point megatron.training's argument validation and optimizer factory at Muon-on-FSDP, and
    let it start on this machine (CPU layer without CUDA, the wheel's prebuilt dataset helper).
    Each patch is listed in megatron_muon.compat.upstream; `uninstall()` undoes them all."""
    apply_megatron_training_compat()
    upstream_fixes.apply()
    upstream_fixes.skip_dataset_helper_build_at('megatron.core.datasets.utils.compile_helpers')
    for target, replacement in (
            ('megatron.training.arguments.add_megatron_arguments', _add_megatron_arguments),
            ('megatron.training.arguments.validate_args', _validate_args),
            ('megatron.training.checkpointing._load_base_checkpoint', _load_base_checkpoint),
            ('megatron.training.training.save_checkpoint', _save_checkpoint),
            ('megatron.training.training.load_checkpoint', _load_checkpoint),
            ('megatron.training.training.clip_qk', _clip_qk),
            ('megatron.training.training.training_log', _training_log),
            ('megatron.training.training.get_megatron_optimizer', _get_megatron_optimizer)):
        upstream.patch(target, replacement)


def uninstall() -> None:
    """Put back what install() (and the CPU layer) replaced in megatron.training, megatron-core,
    Megatron-FSDP and torch."""
    upstream.undo_patches()
