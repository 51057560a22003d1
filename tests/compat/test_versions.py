"""The dependency ranges admit what GPU users train with, and what CI tests. NVIDIA's containers
ship their own torch builds, versioned 2.X.0a0+<hash> (a pre-release of 2.X.0 by pip's rules),
which TransformerEngine and apex in them are compiled against: a range they fell outside of would
make pip replace the container's torch, or fail to resolve."""

from importlib.metadata import requires
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

CONSTRAINTS = Path(__file__).resolve().parents[2] / "constraints"
# NGC PyTorch containers and their torch (25.12's from NVIDIA's release notes, the others from
# public repositories; issue 29).
NGC_TORCH = {"25.08": "2.8.0a0", "25.09": "2.9.0a0", "25.10": "2.9.0a0", "25.11": "2.10.0a0",
             "25.12": "2.10.0a0", "26.01": "2.10.0a0", "26.02": "2.11.0a0", "26.03": "2.11.0a0",
             "26.04": "2.12.0a0", "26.05": "2.12.0a0", "26.06": "2.13.0a0", "26.07": "2.13.0a0",
             "26.08": "2.14.0a0", "26.09": "2.14.0a0",
             # The containers after 26.09 are expected to move to torch 2.15 (issue 52).
             "after 26.09": "2.15.0a0"}


def requirement(name: str) -> Requirement:
    """The installed megatron-muon's requirement on `name` (setup.py's, as pip read it): a
    dependency's, or an optional range's (its extra's, e.g. megatron-fsdp)."""
    return next(r for r in map(Requirement, requires("megatron-muon")) if r.name == name)


def pinned(end: str) -> dict[str, Version]:
    """constraints/<end>.txt: the versions CI tests at that end of the ranges."""
    lines = (line.split("#")[0].strip() for line in (CONSTRAINTS / f"{end}.txt").read_text().splitlines())
    return {name: Version(version) for name, _, version in
            (line.partition("==") for line in lines if line)}


@pytest.mark.parametrize("container", NGC_TORCH)
def test_every_ngc_containers_torch_satisfies_the_requirement(container):
    torch = requirement("torch")
    for build in (NGC_TORCH[container], f"{NGC_TORCH[container]}+3c1d3e5e.nv{container[-5:]}"):
        # pip's check of an installed distribution allows pre-releases; a fresh resolution does
        # too, since the range names one.
        assert torch.specifier.contains(Version(build), prereleases=True), (container, build, torch)
        assert torch.specifier.contains(Version(build)), (container, build, torch)


@pytest.mark.parametrize("end", ["lowest", "newest"])
def test_ci_tests_each_end_of_every_range(end):
    pins = pinned(end)
    for name in ("torch", "megatron-core", "emerging-optimizers", "megatron-fsdp"):
        assert requirement(name).specifier.contains(pins[name]), (end, name, pins[name])
    for name, version in pins.items():
        released = Version(version.base_version)
        if end == "lowest":  # nothing older is admitted but the same release's pre-releases
            below = Version(f"{released.major}.{released.minor}.{released.micro - 1}") if \
                released.micro else Version(f"{released.major}.{released.minor - 1}.99")
            assert not requirement(name).specifier.contains(below, prereleases=True), (name, below)
        else:  # the next minor release, untested, is not admitted, nor its pre-releases
            above = Version(f"{released.major}.{released.minor + 1}.0a0")
            assert not requirement(name).specifier.contains(above, prereleases=True), (name, above)
