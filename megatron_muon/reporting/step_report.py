"""What a Muon chain's step reports (FSDPMuonChainedOptimizer's, read by duck typing). The
scalars megatron.training's and Bridge's logs get (TensorBoard, W&B; log_beside_megatron, every
--log-interval): what one step exchanges on this rank, as its plans count it at
construction (exchanges, collectives, bytes received; tests hold a step's observed traffic to
these counts), how evenly Newton-Schulz falls on the ranks this rank's exchange groups span (the
busiest rank's FLOPs over their mean), the steps skipped so far and the check interval's last
result. Outside megatron.training (the standalone and Automodel paths) observe.phases.PhaseTimes
takes the place of Megatron's timers, and `report` gives both at once."""

from collections import Counter

from ..observe import phases

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


def log_beside_megatron(chain, timers, level: int, timers_to_writers: bool, writers,
                        iteration: int, interval: int, reset: bool) -> None:
    """What a logging iteration of megatron.training's or Bridge's training_log leaves out (it
    names none of ours): our step's phases' `timers` (phases.timer_names(`level`)) logged as it
    logs its own and, `timers_to_writers` (--log-timers-to-tensorboard), written to `writers`
    (TensorBoard's, W&B's; None where off); `chain`'s scalars written to them."""
    names, (board, wandb) = phases.timer_names(level), writers
    for writer in (board, wandb) if names and timers_to_writers else ():
        timers.write(names, writer, iteration, normalizer=interval, reset=False)
    if names:
        timers.log(names, normalizer=interval, reset=reset)
    scalars = step_scalars(chain) if board or wandb else {}
    for name, value in scalars.items() if board else ():
        board.add_scalar(name, value, iteration)
    if wandb and scalars:
        wandb.log(scalars, iteration)


def report(chain) -> dict[str, float]:
    """step_scalars of `chain` and, where it times its steps itself (`report_interval`), the
    last step's phases in seconds, named as Megatron writes its timers ("muon-step-time", ...)."""
    times = chain.phase_times.seconds if chain.phase_times is not None else {}
    return {**step_scalars(chain), **{f"{name}-time": s for name, s in times.items()}}
