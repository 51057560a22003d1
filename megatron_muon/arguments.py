"""`megatron_muon.arguments.add_muon_args` / `validate_muon_args`: the flags for Megatron pretrain
scripts (integrations/arguments.py), at the path the repository's top-level arguments.py and
users import."""

from .integrations.arguments import add_muon_args, validate_muon_args

__all__ = ["add_muon_args", "validate_muon_args"]
