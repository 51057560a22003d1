"""The benchmarks, run as scripts (`python benchmarks/<name>.py`, or make bench / bench-demo /
scale); a package so that the tests import them as `benchmarks.<name>`."""
