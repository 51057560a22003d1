"""What a front end keeps between its hooks in one run (integrations.megatron_lm and .bridge:
their factory builds the chain, their training log reports its step), as explicit state."""

import dataclasses

from ..step import rates_file
from ..step.chained import FSDPMuonChainedOptimizer


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
