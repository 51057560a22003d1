"""Device discipline: every tensor megatron_muon creates says on which device. A factory without
`device=` makes a CPU tensor, which NCCL refuses in a collective and which would move Newton-Schulz
off the GPU (`*_like` and `new_*` follow a tensor already on the right device)."""

import ast
from pathlib import Path

import megatron_muon

FACTORIES = {"tensor", "empty", "zeros", "ones", "full", "arange", "randn", "rand", "randint",
             "eye", "linspace"}
PACKAGE = Path(megatron_muon.__file__).parent


def _factories_without_device(source: str) -> list[int]:
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in FACTORIES and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch"
            and not any(keyword.arg == "device" for keyword in node.keywords)]


def test_every_tensor_factory_names_its_device():
    found = {str(path.relative_to(PACKAGE)): lines for path in sorted(PACKAGE.rglob("*.py"))
             if (lines := _factories_without_device(path.read_text()))}
    assert not found, f"tensor factories without device= (file: lines): {found}"


def test_the_scan_finds_a_factory_without_device():
    assert _factories_without_device("x = torch.zeros(3)\ny = torch.zeros(3, device=d)\n") == [1]
