from setuptools import find_packages, setup

setup(
    name="megatron-muon",
    version="0.1.0",
    description="Muon optimizer for Megatron-FSDP (ZeRO-1/2/3, tensor and expert parallel)",
    packages=find_packages(include=["megatron_muon", "megatron_muon.*"]),
    python_requires=">=3.12",
    # Ranges, each end tested (constraints/lowest.txt, constraints/newest.txt). torch's lower
    # bound names the pre-release so NVIDIA's container builds (2.8.0a0+<hash> in NGC 25.08, up
    # to 2.14.0a0 in 26.09) satisfy it and pip leaves the container's torch alone.
    install_requires=[
        "torch>=2.8.0a0,<2.15",
        # Megatron-FSDP comes with it: megatron-core uses its own copy
        # (megatron.core.distributed.fsdp.src.megatron_fsdp), and so do we. That copy needs
        # einops, which megatron-core does not declare (the megatron-fsdp package does).
        "megatron-core>=0.19.0,<0.20",
        "einops",
        "emerging-optimizers>=0.3.0,<0.4",
        "numpy",
    ],
    extras_require={
        "test": ["pytest", "matplotlib", "packaging"],
        # apex has no registry release: GPU users build it from source (see README).
        "gpu": ["transformer-engine[pytorch]"],
    },
)
