"""Which versions megatron-muon supports (supported_versions.py), which are installed, and the
errors that name both when an installed version lacks a name the package borrows, or one
dependency cannot import another (compat/upstream.py)."""

import importlib
import importlib.metadata
import platform

from .supported_versions import OPTIONAL, SUPPORTED

# Each error's last line: what to install.
_INSTALL_SUPPORTED = ("Install the versions this release supports ("
                      + ", ".join(f"{d}{v}" for d, v in SUPPORTED.items()) + ").")
_RANGES = {**SUPPORTED, **{name: versions for extra in OPTIONAL.values()
                           for name, versions in extra.items()}}

# Which distribution provides a module, for the error's version and supported range: the first
# whose prefix the module's name starts with.
_DISTRIBUTIONS = {"megatron.bridge": "megatron-bridge", "megatron": "megatron-core",
                  "torch": "torch", "emerging_optimizers": "emerging-optimizers",
                  "megatron_fsdp": "megatron-fsdp", "argparse": "python", "builtins": "python"}
# Where a distribution's __version__ lives when it has no package metadata (a source checkout):
# megatron-core's in megatron.core (the namespace package megatron has none).
_VERSION_MODULES = {"megatron-core": "megatron.core"}


def distribution_of(dotted: str) -> str:
    """The distribution that provides the module or name `dotted`."""
    return next(d for prefix, d in _DISTRIBUTIONS.items()
                if f"{dotted}.".startswith(f"{prefix}."))


def installed_version(distribution: str) -> str:
    """A distribution's installed version, also for megatron-core from a source checkout."""
    if distribution == "python":
        return platform.python_version()
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:  # e.g. megatron-core from a source checkout
        module = _VERSION_MODULES.get(distribution) or next(
            m for m, d in _DISTRIBUTIONS.items() if d == distribution)
        return str(getattr(importlib.import_module(module), "__version__", "of unknown version"))


def own_version() -> str:
    """megatron-muon's version, or "(from source)" where it runs from a checkout on the path
    (its metadata is then absent)."""
    try:
        return importlib.metadata.version("megatron-muon")
    except importlib.metadata.PackageNotFoundError:
        return "(from source)"


def unsupported(missing: dict[str, str]) -> ImportError:
    """The error for borrowed names the installed versions lack ({dotted name: why megatron-muon
    needs it}): each package, its installed version, the names and the supported ranges."""
    lacking: dict[str, list[str]] = {}
    for name, why in missing.items():
        lacking.setdefault(distribution_of(name), []).append(f"  {name}: {why}")
    return ImportError(
        f"megatron-muon {own_version()} does not support the installed "
        + ", ".join(f"{d} {installed_version(d)}" for d in lacking)
        + ": names it uses are gone.\n"
        + "".join(f"{d} {installed_version(d)} ("
                  + (f"supported: {d}{_RANGES[d]}" if d in _RANGES else "not required")
                  + ") has no\n" + "\n".join(names) + "\n" for d, names in lacking.items())
        + _INSTALL_SUPPORTED)


def cannot_import(importer: str, imported: str, symptom: str) -> ImportError:
    """The error for one installed distribution that cannot import another (`symptom`: how that
    shows), before it is blamed for the names it then lacks."""
    return ImportError(
        f"megatron-muon {own_version()}: the installed {importer} {installed_version(importer)} "
        f"cannot import the installed {imported} {installed_version(imported)} ({symptom}).\n"
        + _INSTALL_SUPPORTED)
