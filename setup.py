from setuptools import find_packages, setup

setup(
    name="megatron-muon",
    version="0.1.0",
    description="Muon optimizer for Megatron-FSDP (ZeRO-1/2/3, tensor and expert parallel)",
    packages=find_packages(include=["megatron_muon", "megatron_muon.*"]),
    python_requires=">=3.12",
    install_requires=[
        "torch==2.13.0",
        "megatron-core==0.19.2",
        "megatron-fsdp==0.6.1",
        # Later releases renamed modules that megatron-core 0.19.2 imports.
        "emerging-optimizers==0.3.0",
        "numpy",
    ],
    extras_require={
        "test": ["pytest", "matplotlib"],
        # apex has no registry release: GPU users build it from source (see README).
        "gpu": ["transformer-engine[pytorch]"],
    },
)
