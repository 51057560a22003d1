"""The versions of Python and of each dependency this release supports, each range tested at both
ends (constraints/lowest.txt, constraints/newest.txt). setup.py reads this file before anything
is installed, and megatron_muon.compat.upstream names these ranges when an installed version lacks a
name it borrows: plain data, no imports."""

SUPPORTED = {
    "python": ">=3.12",
    # The lower bound names the pre-release so NVIDIA's container builds (2.8.0a0+<hash> in NGC
    # 25.08, up to 2.14.0a0 in 26.09, 2.15.0a0 expected after it) satisfy it and pip leaves the
    # container's torch alone.
    "torch": ">=2.8.0a0,<2.16",
    # Megatron-FSDP comes with it: megatron-core uses its own copy
    # (megatron.core.distributed.fsdp.src.megatron_fsdp), and so do we.
    "megatron-core": ">=0.19.0,<0.20",
    "emerging-optimizers": ">=0.3.0,<0.4",
}
# Optional ranges, each an extra of its own (pip install 'megatron-muon[fsdp]'), tested at both
# ends like the others. fsdp: the standalone Megatron-FSDP package, for models sharded outside
# Megatron (megatron_muon.standalone); NeMo Automodel 0.7 pins 0.5.0, megatron-core 0.19.2's own
# copy is 0.6.1's code.
# gram: Dao-AILab's gram-newton-schulz (--muon-gram-newton-schulz), whose torch path the tests hold
# ours to; installed without its dependencies there (its kernels' quack and CUTLASS DSL are GPU
# packages), with them by the extra.
OPTIONAL = {"fsdp": {"megatron-fsdp": ">=0.5.0,<0.7"},
            "gram": {"gram-newton-schulz": ">=0.1.6,<0.2"}}
