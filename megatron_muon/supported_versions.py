"""The versions of Python and of each dependency this release supports, each range tested at both
ends (constraints/lowest.txt, constraints/newest.txt). setup.py reads this file before anything
is installed, and megatron_muon.upstream names these ranges when an installed version lacks a
name it borrows: plain data, no imports."""

SUPPORTED = {
    "python": ">=3.12",
    # The lower bound names the pre-release so NVIDIA's container builds (2.8.0a0+<hash> in NGC
    # 25.08, up to 2.14.0a0 in 26.09) satisfy it and pip leaves the container's torch alone.
    "torch": ">=2.8.0a0,<2.15",
    # Megatron-FSDP comes with it: megatron-core uses its own copy
    # (megatron.core.distributed.fsdp.src.megatron_fsdp), and so do we.
    "megatron-core": ">=0.19.0,<0.20",
    "emerging-optimizers": ">=0.3.0,<0.4",
}
