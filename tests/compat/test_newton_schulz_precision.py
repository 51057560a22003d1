"""Which precision Newton-Schulz runs at, on either kind of CPU: the probe for emulated bf16
matmuls (torch_compat.torch_compat.bf16_matmul_is_emulated) is patched both ways, so the suite shows the
choice whatever CPU it runs on.

- the demo (and the benchmarks, through torch_compat.fast_newton_schulz_precision) run fp32 ('highest')
  where bf16 matmuls are emulated and Megatron's bf16 ('medium') elsewhere; the command line
  wins; the demo says so in one line at start only when it chose fp32;
- a user's own script keeps what it asks for; install() warns once, on rank 0, with the cost
  measured on the spot, when it asks for bf16 where bf16 is emulated.
"""

import contextlib
import io
import os
import sys
import warnings
from pathlib import Path

from conftest import run_distributed

REPO = Path(__file__).resolve().parents[2]
WARNING = "--muon-fp32-matmul-prec medium runs Newton-Schulz in bf16, which this CPU has no native"
# A script's own flags: a small GPT, Muon on Megatron-FSDP, no precision asked for.
SCRIPT = ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
          "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
          "--optimizer", "muon", "--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor")


def _parsed(provider, argv, rank=0):
    """megatron.training's parse and validate_args (as install() makes it) of `argv`, with what
    they printed and warned."""
    import megatron.training.arguments as megatron_arguments

    sys.argv, printed = ["script.py", *argv], io.StringIO()
    os.environ.update(RANK=str(rank), WORLD_SIZE="2")
    with warnings.catch_warnings(record=True) as warned, contextlib.redirect_stdout(printed):
        warnings.simplefilter("always")
        args = megatron_arguments.parse_args(provider)
        megatron_arguments.validate_args(args)
    return args, printed.getvalue(), [str(w.message) for w in warned if WARNING in str(w.message)]


def _the_demo_chooses(rank, world_size, emulated):
    import megatron_muon.training
    from megatron_muon.cpu import torch_compat

    megatron_muon.training.install()
    torch_compat.bf16_matmul_is_emulated = lambda: emulated
    sys.path.insert(0, str(REPO / "examples"))
    import pretrain_gpt

    def demo(*argv):
        args, _, warned = _parsed(pretrain_gpt.add_demo_args, argv)
        said = io.StringIO()
        with contextlib.redirect_stdout(said):
            pretrain_gpt.say_newton_schulz_runs_in_fp32(args, argv)
        return args.muon_fp32_matmul_prec, said.getvalue(), warned

    precision, said, warned = demo()
    if emulated:
        assert precision == "highest" and torch_compat.fast_newton_schulz_precision() == "highest"
        assert said.count("\n") == 1 and said.startswith(
            "pretrain_gpt.py: Newton-Schulz in fp32 (--muon-fp32-matmul-prec highest): this CPU "
            "has no native bf16 matmul"), said
        assert "--muon-fp32-matmul-prec medium asks for it anyway" in said
    else:
        assert precision == "medium" and torch_compat.fast_newton_schulz_precision() == "medium"
        assert said == ""
    assert not warned
    assert demo("--optimizer", "adam")[1] == ""  # no Newton-Schulz, nothing to say
    for asked in ("medium", "high", "highest"):  # the command line wins, and the demo is quiet
        precision, said, _ = demo("--muon-fp32-matmul-prec", asked)
        assert (precision, said) == (asked, "")


def test_the_demo_runs_fp32_newton_schulz_where_bf16_matmuls_are_emulated():
    run_distributed(_the_demo_chooses, 1, True, fresh=True)


def test_the_demo_keeps_megatrons_bf16_newton_schulz_where_bf16_matmuls_are_native():
    run_distributed(_the_demo_chooses, 1, False, fresh=True)


def _a_scripts_request(rank, world_size):
    import megatron_muon.training
    from megatron_muon.cpu import torch_compat
    from megatron_muon.integrations.arguments import add_muon_args

    megatron_muon.training.install()
    torch_compat.bf16_matmul_is_emulated = lambda: False
    assert not _parsed(add_muon_args, SCRIPT)[2]  # native bf16: medium says nothing
    torch_compat.bf16_matmul_is_emulated = lambda: True
    for quiet in (["--muon-fp32-matmul-prec", "highest"], ["--optimizer", "adam"]):
        assert not _parsed(add_muon_args, [*SCRIPT, *quiet])[2]
    assert not _parsed(add_muon_args, SCRIPT, rank=1)[2]  # rank 0 speaks for the job
    args, _, warned = _parsed(add_muon_args, SCRIPT)
    assert args.muon_fp32_matmul_prec == "medium"  # Megatron's default, kept
    assert len(warned) == 1, warned
    assert "ms here in bf16 against" in warned[0] and "--muon-fp32-matmul-prec highest runs it in fp32" in warned[0]
    args, _, warned = _parsed(add_muon_args, [*SCRIPT, "--muon-fp32-matmul-prec", "medium"])
    assert args.muon_fp32_matmul_prec == "medium" and not warned  # once per process


def test_install_warns_once_when_a_script_asks_for_emulated_bf16_newton_schulz():
    run_distributed(_a_scripts_request, 1, fresh=True)
