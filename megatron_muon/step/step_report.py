"""The scalars a chain's step reports where megatron.training writes its own (TensorBoard, W&B;
integrations.megatron_lm logs them every --log-interval): what one step exchanges on this rank,
as its plans count it at construction (exchanges, collectives, bytes received; tests hold a
step's observed traffic to these counts), how evenly Newton-Schulz falls on the ranks this
rank's exchange groups span (the busiest rank's FLOPs over their mean), the steps skipped so far
and the check interval's last result."""

from collections import Counter

SCALARS = ("muon/exchanges", "muon/collectives", "muon/bytes-received",
           "muon/newton-schulz-busiest-over-mean", "muon/skipped-steps",
           "muon/check-max-difference")


def step_scalars(chain) -> dict[str, float]:
    """{name: value} of SCALARS for FSDPMuonChainedOptimizer `chain` on this rank (the check's
    once a check has run)."""
    muons = chain.muon_optimizers
    plans = [(plan, muon.newton_schulz_settings["num_ns_steps"]) for muon in muons
             for plan in muon.plans]
    load: Counter = Counter()
    for plan, _ in plans:
        load.update(plan.newton_schulz_flops())
    mean = sum(load.values()) / max(len(load), 1)
    scalars = {
        "muon/exchanges": sum(len(plan.routes) for plan, _ in plans),
        "muon/collectives": sum(plan.collectives(steps) for plan, steps in plans),
        "muon/bytes-received": sum(plan.bytes_received() for plan, _ in plans),
        "muon/newton-schulz-busiest-over-mean": max(load.values()) / mean if mean else 1.0,
        "muon/skipped-steps": chain.skipped_steps}
    checks = [muon.last_check for muon in muons if muon.last_check is not None]
    if checks:
        scalars["muon/check-max-difference"] = max(checks, key=lambda c: c.iteration).worst
    return scalars
