"""`python -m megatron_muon.selftest` (under torchrun): the cluster self-test, tools/selftest.py."""

import sys

from .tools.selftest import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
