"""What a front end keeps between its hooks in one run (front_ends.megatron_lm and .bridge:
their factory builds the chain, their training log reports its step), as explicit state; and
the training log both loops get, theirs then ours (training_log_then)."""

import dataclasses
import functools
import inspect
from collections.abc import Callable

from ..chain.chained import FSDPMuonChainedOptimizer
from ..reporting import rates_file, step_report


@dataclasses.dataclass
class RunState:
    chain: FSDPMuonChainedOptimizer | None = None  # the run's Muon chain, once built
    # Bridge: install()'s cfg.logger (a LoggerConfig), whose tensorboard_dir is read when the
    # chain is built, not when install() ran.
    bridge_logger: object | None = None

    def built(self, optimizer, tensorboard_dir: str | None) -> None:
        """The front end's factory built `optimizer`. A Muon chain is kept (its step's scalars
        go to the logs), and the rates it measured are written beside the event files."""
        if isinstance(optimizer, FSDPMuonChainedOptimizer):
            self.chain = optimizer
            if tensorboard_dir:
                rates_file.write_rates(optimizer, tensorboard_dir)

    def log_step(self, timers, level: int, timers_to_writers: bool, writers, iteration: int,
                 interval: int, reset: bool) -> None:
        """The chain's step beside the loop's own log (step_report.log_beside_megatron), once
        it is built."""
        if self.chain is not None:
            step_report.log_beside_megatron(self.chain, timers, level, timers_to_writers, writers,
                                            iteration, interval, reset)


def training_log_then(training_log: Callable, report: Callable[[dict], None]) -> Callable:
    """`training_log` (megatron.training's or Bridge's), then `report` of its arguments by name;
    with its signature (functools.wraps), for wrappers that bind arguments."""
    parameters = inspect.signature(training_log)

    @functools.wraps(training_log)
    def logged(*args, **kwargs):
        report_memory_flag = training_log(*args, **kwargs)
        report(parameters.bind(*args, **kwargs).arguments)
        return report_memory_flag

    return logged
