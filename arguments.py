"""The command-line flags of megatron-muon for Megatron pretrain scripts, at the repository's top
level as the design lists them: `--optimizer muon --use-megatron-fsdp` with megatron-core's
`--muon-*` flags, plus `--muon-dist-mode`.

    from arguments import add_muon_args          # in a checkout of this repository
    from megatron_muon.arguments import add_muon_args   # anywhere the package is installed

Both are the same functions: their code lives in megatron_muon/arguments.py so that the
installed package carries it (a top-level `arguments` module in site-packages would shadow
other projects' own).
"""

from megatron_muon.arguments import add_muon_args, validate_muon_args

__all__ = ["add_muon_args", "validate_muon_args"]
