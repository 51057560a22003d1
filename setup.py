import runpy
from pathlib import Path

from setuptools import find_packages, setup

RANGES = Path(__file__).parent / "megatron_muon" / "compat" / "supported_versions.py"
VERSIONS = runpy.run_path(str(RANGES))
SUPPORTED, OPTIONAL = VERSIONS["SUPPORTED"], VERSIONS["OPTIONAL"]

setup(
    name="megatron-muon",
    version="0.1.0",
    description="Muon optimizer for Megatron-FSDP (ZeRO-1/2/3, tensor and expert parallel)",
    packages=find_packages(include=["megatron_muon", "megatron_muon.*"]),
    python_requires=SUPPORTED["python"],
    install_requires=[
        *(f"{name}{versions}" for name, versions in SUPPORTED.items() if name != "python"),
        # megatron-core's copy of Megatron-FSDP needs it; megatron-core does not declare it (the
        # megatron-fsdp package does).
        "einops",
        "numpy",
        # megatron-core's torch_dist checkpoint writer (dist_checkpointing's filesystem_async)
        # imports it; megatron-core does not declare it, and without it Megatron DDP's --save fails.
        "psutil",
        # megatron.training's --tensorboard-dir writer (torch.utils.tensorboard) needs it; neither
        # torch nor megatron-core declares it, and without it the run logs to TensorBoard nothing.
        "tensorboard",
    ],
    extras_require={
        # transformers: the tests build tiny Hugging Face models from their configs (no download).
        "test": ["pytest", "matplotlib", "packaging", "transformers"],
        # apex has no registry release: GPU users build it from source (see README).
        "gpu": ["transformer-engine[pytorch]"],
        # megatron_muon.bridge: Muon on Megatron-FSDP through Megatron-Bridge's recipes.
        "bridge": ["megatron-bridge>=0.6.2,<0.7"],
        **{extra: [f"{name}{versions}" for name, versions in ranges.items()]
           for extra, ranges in OPTIONAL.items()},
    },
)
