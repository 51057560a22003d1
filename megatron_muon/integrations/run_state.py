"""What a front end keeps between its hooks in one run (integrations.megatron_lm and .bridge:
their factory builds the chain, their training log reports its step), as explicit state."""

import dataclasses

from ..step import rates_file
from ..step.chained import FSDPMuonChainedOptimizer


@dataclasses.dataclass
class RunState:
    chain: FSDPMuonChainedOptimizer | None = None  # the run's Muon chain, once built
    # Where the run writes its event files, where the front end learns it before the build
    # (Bridge: cfg.logger's, at install).
    tensorboard_dir: str | None = None

    def built(self, optimizer, tensorboard_dir: str | None) -> None:
        """The front end's factory built `optimizer`. A Muon chain is kept (its step's scalars
        go to the logs), and the rates it measured are written beside the event files."""
        if isinstance(optimizer, FSDPMuonChainedOptimizer):
            self.chain = optimizer
            if tensorboard_dir:
                rates_file.write_rates(optimizer, tensorboard_dir)
