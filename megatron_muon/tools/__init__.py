"""tools: beside the product. The cluster self-test (selftest: `python -m megatron_muon.selftest`),
a train step's memory per rank (memory), and the small models tests and benchmarks build
(testing)."""
