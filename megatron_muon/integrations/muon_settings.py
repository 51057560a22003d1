"""The `muon_*` settings, once: each one's name and default, for every front end that carries
them (megatron.training's --muon-* flags: integrations.arguments; Bridge's MuonOptimizerConfig
fields; the factory's `muon_*` arguments; each front end reads them with MuonSettings.of), and
the checks of a value a config may hold without a flag's parser (Bridge's fields)."""

import dataclasses

from ..core.settings import DIST_MODES, OWNER_CHOICES
from ..plan import MAX_EXCHANGE_BYTES


@dataclasses.dataclass(frozen=True)
class MuonSettings:
    """Each field: ZeROTensorParallelMuon's argument of that name (FSDPMuonChainedOptimizer's
    for max_consecutive_skipped_steps); the flag is --muon-<name>, the config field and the
    factory's argument muon_<name> (the factory's docstring says what each does)."""
    dist_mode: str = "owner"
    owner_choice: str = "time"
    check_interval: int = 0
    max_exchange_bytes: int | None = MAX_EXCHANGE_BYTES
    max_team_size: int = 1
    use_syrk: bool = False
    max_consecutive_skipped_steps: int = 10

    @classmethod
    def of(cls, source) -> "MuonSettings":
        """The settings `source` holds as muon_<name> attributes (megatron.training's args, a
        Bridge config); one it lacks (a parser without our flags) at its default."""
        return cls(**{field.name: getattr(source, f"muon_{field.name}", field.default)
                      for field in dataclasses.fields(cls)})

    def factory_arguments(self) -> dict[str, object]:
        """As the factory's `muon_*` arguments."""
        return {f"muon_{name}": value for name, value in dataclasses.asdict(self).items()}

    def refusal(self, field_name) -> str | None:
        """What is wrong with a value no flag's parser checked (a config's), naming its field
        as `field_name(name)` gives it; None where every value is one the factory takes."""
        for name, choices in (("dist_mode", DIST_MODES), ("owner_choice", OWNER_CHOICES)):
            if getattr(self, name) not in choices:
                return f"{field_name(name)} {getattr(self, name)!r}: choose from {choices}"
        budget = self.max_exchange_bytes
        if budget is not None and (not isinstance(budget, int) or budget <= 0):
            return (f"{field_name('max_exchange_bytes')} {budget!r}: None (what Muon's state "
                    f"saves a rank) or a positive number of bytes (--muon-max-exchange-bytes)")
        return None
