"""Every command line that the README, docs/ and tests_gpu/ show, parsed by megatron.training's
parser as the demo builds it (Megatron's flags, Muon's, the demo's defaults), without training: a
flag or value that Megatron refuses fails here, on CPU, and not at a user's first GPU run
(`--muon-fp32-matmul-prec highest` in tests_gpu/ would have stopped there at parsing).

- `make demo [NPROC=n] DEMO_ARGS="..."` and tests_gpu's DEMO_RUNS are meant to run: they are
  also validated (megatron.training's validate_args as install() makes it, then the demo's own
  refusals, then the model's TransformerConfig, which checks the fused kernels it asks for) at
  their world size;
- any other code span of flags (`--save DIR --save-interval N`, the flags after `pretrain_gpt.py`)
  parses; a flag named alone (`--lr`) exists.
Each command line is also parsed as pretrain() parses it again, with Megatron's own flags only.
Placeholders: a part in [brackets] (not a list of numbers) is tried with and without, {a,b} each
way, an upper-case word (DIR, N) is a value, and `...` stands for flags left out.
"""

import argparse
import contextlib
import io
import os
import re
import shlex
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from conftest import first_failure

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests_gpu"))
import test_gpu  # noqa: E402  (its tests skip without CUDA; its command lines are data)

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCED_BLOCK = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
INDENTED_LINE = re.compile(r"^(?: {4}|\t)(.*)$", re.MULTILINE)
INLINE_CODE = re.compile(r"`([^`]+)`")
MAKE_DEMO_PROCESSES = 2  # the Makefile's NPROC


class CommandLine(NamedTuple):
    kind: str  # "run" (parse and validate), "flags" (parse), "flag" (exists)
    processes: int
    flags: tuple[str, ...]


def code_spans(markdown: str) -> list[str]:
    """Each line of the fenced and indented code blocks (comments cut), and each inline code
    span (on one line)."""
    lines = [line.split(" #")[0] for block in FENCED_BLOCK.findall(markdown)
             for line in block.splitlines()[1:-1]]
    prose = FENCED_BLOCK.sub("", markdown)
    lines += INDENTED_LINE.findall(prose)
    return [" ".join(span.split()) for span in lines + INLINE_CODE.findall(prose)]


def _variants(text: str) -> list[str]:
    """`text` with each [optional] part left out and kept, and each {a,b} as a and as b."""
    # A list of numbers ('--moe-layer-freq [0,1,1,1]') is a value, not an optional part.
    choice = re.search(r"\[(?![\d,]+\])([^\]]*)\]|\{([^}]*)\}", text)
    if choice is None:
        return [text]
    options = ["", choice[1]] if choice[1] is not None else choice[2].split(",")
    return [variant for option in options
            for variant in _variants(text[:choice.start()] + option + text[choice.end():])]


def _tokens(text: str) -> tuple[str, ...]:
    return tuple("2" if re.fullmatch(r"[A-Z]+", token) else token
                 for token in shlex.split(text) if token != "...")


def command_lines(span: str) -> list[CommandLine]:
    """The command lines a code span shows: none, or one per variant of its placeholders."""
    if make := re.match(r"make demo\b(.*)", span):
        processes = re.search(r"\bNPROC=(\d+)", make[1])
        flags = re.search(r'\bDEMO_ARGS="([^"]*)"', make[1])
        kind, processes = "run", int(processes[1]) if processes else MAKE_DEMO_PROCESSES
        text = flags[1] if flags else ""
    elif script := re.search(r"pretrain_gpt\.py\s+(--.*)", span):
        kind, processes, text = "flags", MAKE_DEMO_PROCESSES, script[1]
    elif span.startswith("--"):
        kind, processes, text = "flags", MAKE_DEMO_PROCESSES, span
    else:
        return []
    found = []
    for variant in _variants(text):
        flags = _tokens(variant)
        if kind == "run" or flags:
            found.append(CommandLine("flag" if kind == "flags" and len(flags) == 1 else kind,
                                     processes, flags))
    return found


def documented_command_lines() -> dict[str, CommandLine]:
    """By where they are shown: each document's command lines, and tests_gpu's."""
    found = {}
    for document in DOCUMENTS:
        for span in code_spans(document.read_text()):
            for line in command_lines(span):
                found[f"{document.name}: {span} -> {' '.join(line.flags)}"] = line
    for name, flags in test_gpu.DEMO_RUNS.items():
        found[f"tests_gpu DEMO_RUNS[{name}]"] = CommandLine("run", 1, flags)
    return found


COMMAND_LINES = documented_command_lines()


def _check(rank, world_size, line: CommandLine):
    """Parse `line` as the demo would (and validate a runnable one); raise with what the parser
    or the validation said."""
    import megatron.training.arguments as megatron_arguments
    from megatron.training.argument_utils import core_transformer_config_from_args

    import megatron_muon.training

    megatron_muon.training.install()
    sys.path.insert(0, str(REPO / "examples"))
    import pretrain_gpt

    argv, environ = sys.argv, dict(os.environ)
    sys.argv = ["pretrain_gpt.py", *(line.flags if line.kind != "flag" else ())]
    os.environ.update(RANK="0", WORLD_SIZE=str(line.processes))
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
            if line.kind == "flag":
                parser = pretrain_gpt.add_demo_args(
                    megatron_arguments.add_megatron_arguments(
                        argparse.ArgumentParser(allow_abbrev=False)))
                # A flag that takes a value stops parse_known_args ("expected one argument").
                with contextlib.suppress(SystemExit):
                    _, unknown = parser.parse_known_args(line.flags)
                    assert not unknown, f"{line.flags[0]}: no such flag"
            else:
                args = megatron_arguments.parse_args(pretrain_gpt.add_demo_args)
                if line.kind == "run":
                    megatron_arguments.validate_args(args)
                    pretrain_gpt.refuse_what_megatron_core_cannot_do(args)
                    # The model's config, which checks what this machine lacks (a fused kernel).
                    core_transformer_config_from_args(args)
                # pretrain() parses the command line again, with Megatron's own flags only
                # (fault tolerance's setup): a value only the demo's parser accepts stops there.
                megatron_arguments.parse_args(ignore_unknown_args=True)
    except SystemExit as exit:
        # argparse prints its usage, then the error, and exits 2; the demo's refusals exit with it
        reason = exit.code if isinstance(exit.code, str) else said.getvalue().strip().splitlines()[-1]
        raise AssertionError(f"{' '.join(line.flags)}: {reason}") from None
    finally:
        sys.argv = argv
        os.environ.clear()
        os.environ.update(environ)


def failure_of(line: CommandLine) -> str | None:
    return first_failure(_check, 1, line, timeout=120)


@pytest.mark.parametrize("line", COMMAND_LINES.values(), ids=COMMAND_LINES.keys())
def test_each_command_line_shown_parses(line):
    failure = failure_of(line)
    assert failure is None, failure


def test_the_documents_show_runnable_command_lines_and_tests_gpu_its_runs():
    kinds = [line.kind for line in COMMAND_LINES.values()]
    assert kinds.count("run") > len(test_gpu.DEMO_RUNS) and "flags" in kinds and "flag" in kinds


@pytest.mark.parametrize("line, refusal", [
    (CommandLine("flags", 2, ("--muon-fp32-matmul-prec", "highestt")), "invalid choice: 'highestt'"),
    (CommandLine("flag", 2, ("--muon-use-nesterov",)), "--muon-use-nesterov: no such flag"),
    (CommandLine("run", 2, ("--tensor-model-parallel-size", "4")), "not divisible"),
    (CommandLine("run", 2, ("--optimizer", "adam", "--save", "2", "--save-interval", "1")),
     "cannot --save"),
    (CommandLine("run", 2, ("--optimizer", "adaptive_muon", "--adaptive-muon-beta2", "1.0")),
     "--adaptive-muon-beta2"),
])
def test_what_megatron_or_the_demo_refuses_fails_the_check(line, refusal):
    failure = failure_of(line)
    assert failure is not None and refusal in failure, failure


def test_command_lines_are_read_from_code_as_written():
    markdown = "\n".join([
        "Run `make demo NPROC=4 DEMO_ARGS=\"--tensor-model-parallel-size 2 [--muon-tp-mode x]\"`,",
        "then `torchrun ... pretrain_gpt.py --optimizer muon",
        "--use-megatron-fsdp ...`; `--muon-dist-mode {owner,allgather}` or `--lr`, not `x --lr`.",
        "```bash",
        "make demo   # the main job",
        "```",
        "    make demo DEMO_ARGS=\"--save DIR\"",
    ])
    lines = [line for span in code_spans(markdown) for line in command_lines(span)]
    assert sorted(lines) == sorted([
        CommandLine("run", 2, ()),
        CommandLine("run", 2, ("--save", "2")),
        CommandLine("run", 4, ("--tensor-model-parallel-size", "2")),
        CommandLine("run", 4, ("--tensor-model-parallel-size", "2", "--muon-tp-mode", "x")),
        CommandLine("flags", 2, ("--optimizer", "muon", "--use-megatron-fsdp")),
        CommandLine("flags", 2, ("--muon-dist-mode", "owner")),
        CommandLine("flags", 2, ("--muon-dist-mode", "allgather")),
        CommandLine("flag", 2, ("--lr",)),
    ])


def _help(rank, world_size):
    import megatron.training.arguments as megatron_arguments

    import megatron_muon.training

    megatron_muon.training.install()
    sys.path.insert(0, str(REPO / "examples"))
    import pretrain_gpt

    argv, sys.argv = sys.argv, ["pretrain_gpt.py", "--help"]
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said), pytest.raises(SystemExit) as exit:
            megatron_arguments.parse_args(pretrain_gpt.add_demo_args)
    finally:
        sys.argv = argv
    assert exit.value.code == 0, said.getvalue()[-2000:]
    for shown in ("--moe-paged-stash-buffer-size-factor-cuda", "10%)", "--muon-dist-mode"):
        assert shown in said.getvalue(), shown


def test_the_demo_prints_its_help():
    """`pretrain_gpt.py --help` (and any Megatron-LM script's, with install()) prints: argparse
    stopped on megatron-core 0.19.2's own help text for
    --moe-paged-stash-buffer-size-factor-cuda ('1.10 = 10%)': unsupported format character)."""
    failure = first_failure(_help, 1, timeout=120)
    assert failure is None, failure
