"""Megatron-Bridge's tests run in their own venv (make test-bridge): gloo on CPU, as tests/ does,
with tests/' helpers importable."""

import os
import sys
from pathlib import Path

os.environ["CUDA_VISIBLE_DEVICES"] = ""
BRIDGE = Path(__file__).resolve().parent
sys.path.insert(0, str(BRIDGE.parent / "tests"))
sys.path.insert(0, str(BRIDGE))


def pytest_configure(config):
    config.addinivalue_line("markers", "bridge: trains through Megatron-Bridge (tests_bridge/, "
                                       "make test-bridge, in .venv-bridge)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if BRIDGE in item.path.parents:
            item.add_marker("bridge")
