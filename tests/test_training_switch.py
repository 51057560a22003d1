"""megatron_muon.training.install() through megatron.training's own argument validation, and the
CPU layer's inertness on a CUDA machine. Each check runs in a fresh interpreter: both patch
modules for the life of the process."""

import sys

import pytest

BASE_ARGV = ["pretrain", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
             "--train-iters", "2", "--lr", "0.01", "--transformer-impl", "local",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
             "--no-gradient-accumulation-fusion", "--use-megatron-fsdp",
             "--data-parallel-sharding-strategy", "optim_grads_params", "--ckpt-format", "fsdp_dtensor"]


def _validate(*flags):
    """Parse and validate as megatron.training does (parse_and_validate_args, minus its global)."""
    import megatron.training.arguments as megatron_arguments

    from megatron_muon.arguments import add_muon_args

    sys.argv = BASE_ARGV + list(flags)
    args = megatron_arguments.parse_args(extra_args_provider=add_muon_args)
    megatron_arguments.validate_args(args)
    return args


def _refused(match, *flags):
    with pytest.raises((AssertionError, ValueError), match=match):
        _validate(*flags)


def _switch(rank, world_size):
    from megatron_muon.cpu import apply_megatron_training_compat

    apply_megatron_training_compat()
    _refused("Megatron-FSDP does not support the muon optimizer", "--optimizer", "muon")
    import megatron.training.training

    import megatron_muon.training
    megatron_muon.training.install()
    megatron_muon.training.install()  # idempotent
    assert megatron.training.training.get_megatron_optimizer is megatron_muon.training._get_megatron_optimizer
    args = _validate("--optimizer", "muon")
    assert args.optimizer == "muon" and args.use_megatron_fsdp and args.muon_dist_mode == "owner"
    assert _validate("--optimizer", "adam").optimizer == "adam"
    _refused("does not support: --fp16", "--optimizer", "muon", "--fp16")
    _refused("without --overlap-grad-reduce", "--optimizer", "muon",
             "--num-distributed-optimizer-instances", "2")
    with pytest.raises(SystemExit):  # argparse: invalid choice
        _validate("--optimizer", "muon", "--muon-dist-mode", "everywhere")
    # What we do not support is still refused by Megatron, as before.
    _refused("Megatron-FSDP does not support the soap optimizer", "--optimizer", "soap")


def test_install_lets_megatron_validate_muon_on_megatron_fsdp_only(distributed):
    distributed(_switch, 1, fresh=True)  # install() patches megatron.training for good


def _inert_with_cuda():
    import torch

    stream, device_count = torch.cuda.Stream, torch.cuda.device_count
    torch.cuda.is_available = lambda: True
    from megatron_muon import cpu

    assert cpu.apply_cpu_compat() is False and cpu.apply_megatron_training_compat() is False
    assert torch.cuda.Stream is stream and torch.cuda.device_count is device_count
    assert torch.overrides._get_current_function_mode() is None


def test_cpu_layer_changes_nothing_when_cuda_is_available():
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_inert_with_cuda)
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0
