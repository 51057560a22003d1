"""What megatron-muon borrows from upstream: a name gone from an installed version fails the import
with one error that says what to install; the patches install() and the CPU layer apply come off
again, leaving megatron.training, Megatron-FSDP and torch as they were; and no module but
megatron_muon.compat.upstream reaches a private upstream name."""

import ast
import subprocess
import sys
import textwrap
from importlib.metadata import version
from pathlib import Path

import pytest

from megatron_muon.compat import upstream, versions
from megatron_muon.compat.supported_versions import SUPPORTED

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_muon"


def _python(code: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter (the patches and deletions stay out of this one)."""
    return subprocess.run([sys.executable, "-W", "ignore", "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_name_or_patch_target_gone_from_upstream_is_named_at_import():
    """Borrowed names and patch targets, all named in one error (one interpreter for both)."""
    run = _python("""
        import megatron.core.optimizer.emerging_optimizers as core_muon
        import megatron.training.training
        import torch.distributed.device_mesh as device_mesh
        del megatron.training.training.clip_qk
        del core_muon._eopt_init_state_fn
        del device_mesh.DeviceMesh._flatten
        # A moved name (main's location, then 0.19's): named where neither is left.
        del core_muon._is_nonlinear_or_embedding
        vars(core_muon).pop("_is_muon_excluded", None)
        import megatron_muon
    """)
    assert run.returncode != 0
    error = run.stderr[run.stderr.index("ImportError: "):]
    for distribution, name in (
            ("megatron-core", "megatron.core.optimizer.emerging_optimizers._eopt_init_state_fn"),
            ("torch", "torch.distributed.device_mesh.DeviceMesh._flatten")):
        assert (f"{distribution} {version(distribution)} (supported: "
                f"{distribution}{SUPPORTED[distribution]}) has no\n  {name}: ") in error, error
    for location in ("_is_muon_excluded", "_is_nonlinear_or_embedding"):
        assert f"megatron.core.optimizer.emerging_optimizers.{location}: megatron-core's rule" \
            in error, error
    assert "emerging-optimizers" not in error.splitlines()[0], error  # only what lacks a name
    assert "Install the versions this release supports" in error
    assert "\n  megatron.training.training.clip_qk: patched: " in error, error


@pytest.mark.slow
def test_megatron_core_that_cannot_import_emerging_optimizers_is_named_at_import():
    """emerging-optimizers 0.5 moved SOAP, which megatron-core imports beside Muon: megatron-core
    then defines its Muon family on object. The error says so, not that Muon's names are gone."""
    run = _python("""
        import sys
        sys.modules["emerging_optimizers.soap"] = None  # as 0.5's move leaves it: ImportError
        import megatron_muon
    """)
    assert run.returncode != 0
    error = run.stderr[run.stderr.index("ImportError: "):]
    assert (f"the installed megatron-core {version('megatron-core')} cannot import the installed "
            f"emerging-optimizers {version('emerging-optimizers')} ") in error, error
    assert "names it uses are gone" not in error and "emerging-optimizers>=" in error, error


@pytest.mark.slow
def test_uninstall_leaves_megatron_training_megatron_fsdp_and_torch_as_they_were():
    run = _python("""
        import importlib
        import importlib.util

        import torch

        import megatron_muon.training
        from megatron_muon import upstream

        def resolve(owner):  # a module, or a class in one (torch.Tensor)
            try:
                return importlib.import_module(owner)
            except ModuleNotFoundError:
                module, _, name = owner.rpartition(".")
                return getattr(importlib.import_module(module), name)

        owners = {target.rpartition(".")[0] for target in upstream.PATCHES} - {"torch.overrides"}
        owners = {owner: resolve(owner) for owner in owners if importlib.util.find_spec(owner.split(".")[0])
                  and not owner.startswith("megatron.bridge.")}  # install() leaves Bridge alone

        def snapshot():
            return {owner: dict(vars(found)) for owner, found in owners.items()}

        def changed(before, after):
            return sorted(f"{owner}.{name}" for owner in before
                          for name in before[owner].keys() | after[owner].keys()
                          if before[owner].get(name, None) is not after[owner].get(name, None))

        before = snapshot()
        megatron_muon.training.install()
        patched = changed(before, snapshot())
        assert set(patched) <= set(upstream.PATCHES), set(patched) - set(upstream.PATCHES)
        assert "megatron.training.arguments.validate_args" in patched, patched
        if not torch.cuda.is_available():
            assert "torch.cuda.Stream" in patched and "torch.Tensor.cuda" in patched, patched
            assert torch.overrides._get_current_function_mode() is not None
            torch.zeros(1, device="cuda")  # the CPU layer makes it on CPU
        megatron_muon.training.uninstall()
        assert changed(before, snapshot()) == [], changed(before, snapshot())
        assert torch.overrides._get_current_function_mode() is None
        megatron_muon.training.install()  # and again, as a fresh process would
        assert changed(before, snapshot()) == patched
        print("patched", len(patched))
    """)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "patched " in run.stdout


def test_an_unlisted_target_is_refused():
    with pytest.raises(KeyError, match="not listed in megatron_muon.compat.upstream.PATCHES"):
        upstream.patch("torch.cuda.is_available", lambda: True)
    with pytest.raises(KeyError):
        with upstream.temporarily("megatron.training.training.pretrain", None):
            pass
    assert not upstream.is_patched("torch.cuda.is_available")


# Documented public API despite the underscore.
PUBLIC_NAMES = {"os._exit"}


def _private_upstream_names(source: str) -> list[str]:
    """Private names of other packages a module imports, reads or tests for."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            found += [f"{node.module}.{alias.name}" for alias in node.names
                      if alias.name.startswith("_") and not node.module.startswith("megatron_muon")]
        elif (isinstance(node, ast.Attribute) and node.attr.startswith("_")
              and not node.attr.startswith("__")
              and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
              and ast.unparse(node) not in PUBLIC_NAMES):
            found.append(ast.unparse(node))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
              and str(node.args[1].value).startswith("_")
              and not str(node.args[1].value).startswith("__")):  # a dunder: public, as above
            found.append(ast.unparse(node))
    return found


def test_only_the_upstream_module_reaches_private_upstream_names():
    assert _private_upstream_names(
        "from torch.distributed import _coalescing_manager\n"
        "x = torch.autograd._engine_run_backward\n"
        "getattr(mesh, '_shard_order', None)\n"
        "self._plan; from ._own import _helper; os._exit(2)\n") == [
        "torch.distributed._coalescing_manager", "torch.autograd._engine_run_backward",
        "getattr(mesh, '_shard_order', None)"]
    reached = {str(path.relative_to(PACKAGE)): names for path in PACKAGE.rglob("*.py")
               if path != PACKAGE / "compat" / "upstream.py"
               for names in [_private_upstream_names(path.read_text())] if names}
    assert reached == {}


def test_versions_are_named_from_a_source_checkout_too(monkeypatch):
    """Where megatron-muon (or megatron-core) runs from a checkout on the path, without package
    metadata, its version is still named: the self-test's first line stopped on
    PackageNotFoundError on a GPU machine that had megatron-muon on PYTHONPATH."""
    import importlib.metadata

    import megatron.core

    def no_metadata(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", no_metadata)
    assert versions.own_version() == "(from source)"
    assert versions.installed_version("megatron-core") == megatron.core.__version__


@pytest.mark.slow
def test_an_upstream_import_that_fails_is_not_called_a_missing_name():
    """megatron-core main reads the GPU's properties when its optimizer package is imported: with
    a broken driver that raises RuntimeError, which must reach the user as it is, not as "names
    it uses are gone"."""
    run = _python("""
        import megatron.core.optimizer.emerging_optimizers as core_muon

        def broken(name):
            raise RuntimeError("Found no NVIDIA driver on your system")

        core_muon.__getattr__ = broken  # any name the module lacks: as an import would fail
        del core_muon._eopt_init_state_fn
        import megatron_muon
    """)
    assert run.returncode != 0
    assert "RuntimeError: Found no NVIDIA driver on your system" in run.stderr, run.stderr
    assert "names it uses are gone" not in run.stderr, run.stderr
