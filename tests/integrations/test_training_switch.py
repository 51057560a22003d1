"""megatron_muon.training.install() through megatron.training's own argument validation, its
choice to build megatron-core's dataset helper or not, and the CPU layer's inertness on a CUDA
machine. Each check runs in a fresh interpreter: both patch
modules for the life of the process."""

import contextlib
import importlib.machinery
import io
import sys
from unittest import mock

import pytest

BASE_ARGV = ["pretrain", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
             "--train-iters", "2", "--lr", "0.01", "--transformer-impl", "local",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
             "--no-gradient-accumulation-fusion", "--use-megatron-fsdp",
             "--data-parallel-sharding-strategy", "optim_grads_params", "--ckpt-format", "fsdp_dtensor"]

BUILT_HELPER = f"helpers_cpp{importlib.machinery.EXTENSION_SUFFIXES[0]}"


def _validate(*flags):
    """Parse and validate as megatron.training does (parse_and_validate_args, minus its global)."""
    import megatron.training.arguments as megatron_arguments

    from megatron_muon.integrations.arguments import add_muon_args

    sys.argv = BASE_ARGV + list(flags)
    args = megatron_arguments.parse_args(extra_args_provider=add_muon_args)
    megatron_arguments.validate_args(args)
    return args


def _refused(match, *flags):
    with pytest.raises((AssertionError, ValueError), match=match):
        _validate(*flags)


def _switch(rank, world_size, checkout):
    _refused("Megatron-FSDP does not support the muon optimizer", "--optimizer", "muon")
    _refused("Megatron-FSDP does not support the dist_muon optimizer", "--optimizer", "dist_muon")
    import megatron.core.datasets.utils as datasets
    import megatron.training.global_vars
    import megatron.training.training

    from megatron_muon.fixes import upstream_fixes
    from megatron_muon.front_ends import megatron_lm
    # In a Megatron-LM checkout (a Makefile beside the helper) the build runs, and a failing build
    # still stops the run.
    wheel_file, build = datasets.__file__, datasets.compile_helpers
    datasets.__file__ = f"{checkout}/utils.py"
    megatron_lm.install()
    assert datasets.compile_helpers is build
    with pytest.raises(SystemExit):
        datasets.compile_helpers()  # make in the checkout: its Makefile fails
    datasets.__file__ = wheel_file
    megatron_lm.install()
    megatron_lm.install()  # idempotent
    # This venv has megatron-core's wheel: its helper is built, its Makefile absent.
    assert datasets.compile_helpers is upstream_fixes.skip_dataset_helper_build
    assert megatron.training.training.get_megatron_optimizer is megatron_lm._get_megatron_optimizer
    args = _validate("--optimizer", "muon")
    assert args.optimizer == "muon" and args.use_megatron_fsdp and args.muon_dist_mode == "owner"
    # Megatron-LM's own name for Muon at scale: on Megatron-FSDP ours, said once.
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        args = _validate("--optimizer", "dist_muon")
    assert args.optimizer == "muon" and not args.use_layer_wise_distributed_optimizer
    assert said.getvalue().count("--optimizer dist_muon with --use-megatron-fsdp: megatron-muon") == 1
    # Our flags reach the factory megatron.training calls.
    megatron.training.global_vars.set_args(_validate(
        "--optimizer", "muon", "--muon-dist-mode", "allgather", "--muon-owner-choice", "bytes",
        "--muon-max-consecutive-skipped-steps", "3", "--muon-check-interval", "5",
        "--muon-max-exchange-bytes", "65536", "--muon-use-syrk", "--muon-max-team-size", "8",
        "--muon-gather-inside-backward", "--muon-gram-newton-schulz", "--muon-gram-restarts", "1",
        "3"))
    with mock.patch.object(megatron_lm.factory, "get_megatron_optimizer") as factory:
        megatron.training.training.get_megatron_optimizer("config", ["chunk"])
    factory.assert_called_once_with("config", ["chunk"], muon_dist_mode="allgather",
                                    muon_owner_choice="bytes",
                                    muon_max_consecutive_skipped_steps=3, muon_check_interval=5,
                                    muon_max_exchange_bytes=65536, muon_use_syrk=True,
                                    muon_max_team_size=8, muon_gather_inside_backward=True,
                                    muon_gram_newton_schulz=True, muon_gram_restarts=[1, 3])
    assert _validate("--optimizer", "adam").optimizer == "adam"
    _refused("does not support: --fp16", "--optimizer", "muon", "--fp16")
    _refused("without --overlap-grad-reduce", "--optimizer", "muon",
             "--num-distributed-optimizer-instances", "2")
    # Megatron would accept these for Adam on Megatron-FSDP; Muon's chain would ignore them.
    for flag in ("--use-precision-aware-optimizer", "--use-torch-fsdp2"):
        _refused(f"does not support: {flag}", "--optimizer", "muon", flag)
    # Muon's state offload, alone: Megatron asks it for --use-precision-aware-optimizer.
    offload = _validate("--optimizer", "muon", "--optimizer-cpu-offload")
    assert offload.optimizer_cpu_offload and offload.optimizer_offload_fraction == 1.0
    _refused("does not support: --optimizer-offload-fraction 1.5", "--optimizer", "muon",
             "--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.5")
    _refused("--use-precision-aware-optimizer", "--optimizer", "adam", "--optimizer-cpu-offload")
    # Megatron alone asks TransformerEngine for these; megatron_muon measures local attention too.
    assert _validate("--optimizer", "muon", "--log-max-attention-logit").log_max_attention_logit
    clip = _validate("--optimizer", "muon", "--qk-clip", "--qk-clip-threshold", "5")
    assert clip.qk_clip and clip.qk_clip_threshold == 5 and clip.transformer_impl == "local"
    mla = ("--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "32",
           "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16")
    assert _validate("--optimizer", "muon", "--qk-clip", *mla).multi_latent_attention
    # Megatron-FSDP's model wrap dies on pipeline stages, whatever the optimizer: said up front.
    for optimizer in ("muon", "adam"):
        _refused(r"--pipeline-model-parallel-size 2 \(megatron-core 0.19's Megatron-FSDP",
                 "--optimizer", optimizer, "--pipeline-model-parallel-size", "2")
    for flags, refusal in [
            (["--qk-clip-alpha", "1"], r"--qk-clip-alpha 1.0 \(must lie in \(0, 1\)\)"),
            (["--qk-clip-alpha", "0"], r"--qk-clip-alpha 0.0 \(must lie in \(0, 1\)\)"),
            (["--qk-clip-threshold", "0"], r"--qk-clip-threshold 0.0 \(must be positive\)"),
            (["--attention-output-gate"], "--qk-clip with --attention-output-gate")]:
        _refused(refusal, "--optimizer", "muon", "--qk-clip", *flags)
    # Without TransformerEngine its attention cannot report logits: Megatron's own check stands.
    _refused("TE >= 2.9.0", "--optimizer", "muon", "--qk-clip", "--transformer-impl",
             "transformer_engine")
    for flags in (["--muon-dist-mode", "everywhere"],  # argparse: invalid choice
                  ["--muon-max-consecutive-skipped-steps", "-1"],  # argparse: -1 (at least 0)
                  ["--muon-max-exchange-bytes", "0"],  # argparse: 0 (must be positive)
                  ["--muon-max-team-size", "0"]):
        with pytest.raises(SystemExit):
            _validate("--optimizer", "muon", *flags)
    # What we do not support is still refused by Megatron, as before.
    _refused("Megatron-FSDP does not support the soap optimizer", "--optimizer", "soap")


def test_install_lets_megatron_validate_muon_on_megatron_fsdp_only(distributed, tmp_path):
    (tmp_path / "Makefile").write_text("all:\n\tfalse\n")
    (tmp_path / BUILT_HELPER).touch()
    distributed(_switch, 1, str(tmp_path), fresh=True)  # install() patches megatron.training for good


@pytest.mark.parametrize("files, prebuilt", [
    ([BUILT_HELPER], True),  # the wheel
    ([BUILT_HELPER, "Makefile"], False),  # a checkout, built
    (["Makefile", "helpers.cpp"], False),  # a checkout, not built yet
    (["helpers.cpp"], False),  # nothing to build with, nothing built: the build fails, as before
])
def test_dataset_helper_is_prebuilt_only_in_the_wheels_layout(tmp_path, files, prebuilt):
    from megatron_muon.fixes.upstream_fixes import dataset_helper_is_prebuilt

    for name in files:
        (tmp_path / name).touch()
    assert dataset_helper_is_prebuilt(tmp_path) is prebuilt


def _inert_with_cuda():
    import torch

    stream, device_count = torch.cuda.Stream, torch.cuda.device_count
    torch.cuda.is_available = lambda: True
    # A Hopper's answers: megatron-core 0.20 asks them when megatron.core.optimizer is imported
    # (megatron.core.ssm.ops.gdp.common, where triton is installed).
    torch.cuda.get_device_name = lambda device=None: "NVIDIA H100 80GB HBM3"
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    from megatron_muon.cpu import torch_compat, training_compat

    assert torch_compat.apply_cpu_compat() is False
    assert training_compat.apply_megatron_training_compat() is False
    from megatron_muon.front_ends import megatron_lm

    megatron_lm.install()
    assert torch.cuda.Stream is stream and torch.cuda.device_count is device_count
    assert torch.overrides._get_current_function_mode() is None


@pytest.mark.slow
def test_cpu_layer_changes_nothing_when_cuda_is_available():
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_inert_with_cuda)
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0


def test_the_top_level_arguments_module_is_the_packages():
    import importlib.util
    from pathlib import Path

    import megatron_muon.integrations.arguments

    spec = importlib.util.spec_from_file_location(
        "top_level_arguments", Path(__file__).resolve().parents[2] / "arguments.py")
    top_level = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(top_level)
    assert top_level.add_muon_args is megatron_muon.integrations.arguments.add_muon_args
    assert top_level.validate_muon_args is megatron_muon.integrations.arguments.validate_muon_args
