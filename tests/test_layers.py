"""The package's layers (docs/design.md) and the one direction their imports point: each layer
imports only itself and the layers below it, the package's top-level modules (its public paths)
import anything and nothing imports them; every module and class stays small enough to read in
one sitting, and every layer's folder holds one concern's code (megatron_muon/README.md)."""

import ast
import io
import re
import tokenize
from pathlib import Path

import megatron_muon

PACKAGE = Path(megatron_muon.__file__).parent
# Lowest first: a layer may import the layers before it. plan/ and compat/ import nothing else.
LAYERS = ("plan", "compat", "fixes", "cpu", "observe", "distribution", "planner", "core",
          "reporting", "chain", "checkpoint", "estimate", "integrations", "front_ends", "tools")
BELOW = {"plan": {"plan"}, "compat": {"compat"}}
for _lower, _layer in zip(LAYERS[1:], LAYERS[2:]):
    BELOW[_layer] = BELOW[_lower] | {_layer, "plan"}
# front_ends/: each front end's modules; no front end imports another's (they share integrations/).
FRONT_ENDS = {"megatron_lm": {"megatron_lm"}, "bridge": {"bridge"},
              "standalone": {"standalone", "automodel", "placement"}}
TOP = "megatron_muon"  # the package's own modules: __init__ and the public entry points
MAX_MODULE_LINES, MAX_CLASS_LINES = 400, 250  # every line
# Code lines only: a docstring, a comment or a blank line never counts (megatron_muon/README.md).
MAX_LAYER_CODE_LINES = 1200


def _layer(module: str) -> str:
    """megatron_muon.<layer>.<...> -> layer; a top-level module (or the package) -> TOP."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else TOP


def _imported(module: str, is_package: bool, source: str) -> list[str]:
    """Every megatron_muon module (or name in one) that `source`, the code of `module`, imports,
    also inside functions."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.split(".")[0] == TOP]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[:len(module.split(".")) - node.level + is_package]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == TOP:
                found += [f"{target}.{alias.name}" for alias in node.names]
    return found


def against_the_direction(module: str, is_package: bool, source: str) -> list[str]:
    """The imports of `module` that point up or sideways: into a layer above its own, or into
    the package's top-level modules from inside a layer."""
    layer = _layer(module)
    if layer == TOP:
        return []
    return [target for target in _imported(module, is_package, source)
            if _layer(target) not in BELOW[layer]]


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        yield ".".join(parts[:-1] if is_package else parts), is_package, path


def test_every_layer_imports_only_itself_and_the_layers_below():
    layers = {_layer(module) for module, _, _ in _modules()}
    assert layers == {*LAYERS, TOP}
    wrong = {module: targets for module, is_package, path in _modules()
             if (targets := against_the_direction(module, is_package, path.read_text()))}
    assert wrong == {}


def _front_end(module: str) -> str | None:
    """The front end a module of front_ends/ (or a name in one) belongs to."""
    parts = module.split(".")
    if len(parts) < 3 or parts[1] != "front_ends":
        return None
    return next(front for front, modules in FRONT_ENDS.items() if parts[2] in modules)


def into_another_front_end(module: str, is_package: bool, source: str) -> list[str]:
    """The imports of a front end's `module` that reach another front end's modules."""
    own = _front_end(module)
    return [target for target in _imported(module, is_package, source)
            if own is not None and _front_end(target) not in (None, own)]


def test_no_front_end_imports_another():
    front_ends = {_front_end(module) for module, _, _ in _modules()} - {None}
    assert front_ends == set(FRONT_ENDS)
    wrong = {module: targets for module, is_package, path in _modules()
             if (targets := into_another_front_end(module, is_package, path.read_text()))}
    assert wrong == {}
    assert into_another_front_end("megatron_muon.front_ends.bridge", False,
                                  "from .megatron_lm import install\n"
                                  "from ..integrations import factory\n") == [
        "megatron_muon.front_ends.megatron_lm.install"]
    assert into_another_front_end("megatron_muon.front_ends.automodel", False,
                                  "from .standalone import muon_optimizer") == []


def test_the_check_finds_an_import_against_the_direction():
    """Each way an import may point the wrong way, and ones that do not."""
    assert against_the_direction("megatron_muon.core.zero_muon", False,
                                 "from ..chain.chained import FSDPMuonChainedOptimizer\n"
                                 "from ..plan import Matrix\nfrom . import syrk\n") == [
        "megatron_muon.chain.chained.FSDPMuonChainedOptimizer"]
    assert against_the_direction("megatron_muon.distribution.exchange", False,
                                 "from ..core.muon_math import momentum_update_") == [
        "megatron_muon.core.muon_math.momentum_update_"]
    assert against_the_direction("megatron_muon.plan", True, "from ..compat import upstream") == [
        "megatron_muon.compat.upstream"]
    assert against_the_direction("megatron_muon.cpu.torch_compat", False,
                                 "def f():\n    import megatron_muon.core.exchange\n") == [
        "megatron_muon.core.exchange"]
    assert against_the_direction("megatron_muon.tools.selftest", False,
                                 "from .. import get_megatron_optimizer") == [
        "megatron_muon.get_megatron_optimizer"]
    assert against_the_direction("megatron_muon.training", False,
                                 "from .front_ends.megatron_lm import install") == []


def _lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def code_lines(source: str) -> int:
    """The lines of `source` that hold code: not blank, not only a comment, not part of a
    docstring (a module's, a class's or a function's first statement, a string)."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    code = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                              tokenize.DEDENT, tokenize.ENDMARKER):
            code.update(range(token.start[0], token.end[0] + 1))
    return len(code - docstrings)


def test_code_lines_count_no_docstring_comment_or_blank_line():
    source = ('"""A module\n\nits docstring."""\n\n# a comment\nimport os  # beside code\n\n\n'
              'class A:\n    """Its docstring."""\n\n    def f(self):\n'
              '        """One more."""\n        return (1 +\n                2)\n\n\n'
              'TEXT = """a string, not a docstring\n"""\n')
    # import os; class A:; def f(self):; return (1 + / 2); TEXT = """... / """
    assert code_lines(source) == 7


def test_modules_classes_and_layers_stay_small():
    modules = {module: (path.read_text(), _layer(module)) for module, _, path in _modules()}
    long_modules = {module: n for module, (source, _) in modules.items()
                    if (n := len(source.splitlines())) > MAX_MODULE_LINES}
    long_classes = {f"{module}.{node.name}": _lines(node)
                    for module, (source, _) in modules.items()
                    for node in ast.walk(ast.parse(source))
                    if isinstance(node, ast.ClassDef) and _lines(node) > MAX_CLASS_LINES}
    per_layer: dict[str, int] = {}
    for source, layer in modules.values():
        per_layer[layer] = per_layer.get(layer, 0) + code_lines(source)
    assert long_modules == {} and long_classes == {}
    assert max(per_layer.values()) <= MAX_LAYER_CODE_LINES, per_layer


def _layout_table() -> set[str]:
    """The files docs/design.md's "Layout" table lists in the package's folders, as
    "folder/file.py" (under the folder's bold heading row)."""
    table = (PACKAGE.parent / "docs" / "design.md").read_text().split("## Layout", 1)[1].strip()
    listed, folder = set(), None
    for row in table.split("\n\n", 1)[0].splitlines():
        if heading := re.match(r"\| \*\*(\w+)/\*\* \|", row):
            folder = heading[1]
        elif folder and row.startswith("| `"):
            cell = row.split(" | ")[0]
            listed |= {f"{folder}/{name}" for name in re.findall(r"`([\w.]+\.py)`", cell)}
    return listed


def test_the_design_layout_table_lists_every_module():
    modules = {str(path.relative_to(PACKAGE)) for _, is_package, path in _modules()
               if not is_package and path.parent != PACKAGE}
    assert _layout_table() == modules
