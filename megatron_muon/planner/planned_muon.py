"""What the planner reads of the optimizer it plans, core.zero_muon.ZeROTensorParallelMuon (and
its adaptive subclass), named by what it reads: the planner sits below core, which builds it, so
it types the optimizer as a Protocol and never imports its class (tests/test_layers.py). A test
holds ZeROTensorParallelMuon to it and to interleaving's MuonPart
(tests/distribution/test_interleaving.py)."""

from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..distribution.dtensor_rows import ParamAttributes
from ..plan import GramSchedule, Matrix


class PlannedColumns(Protocol):
    """An adaptive variant's second moment (core.second_moment.SecondMoment), as it plans."""

    def planned(self, matrix: Matrix) -> Matrix:
        """`matrix` with the columns of state it sends beside the rows and holds per row."""
        ...


@runtime_checkable
class PlannedMuon(Protocol):
    """The settings, groups and Newton-Schulz of the optimizer GroupPlanner plans: its own
    (`dist_mode`, `owner_choice`, `max_team_size`, `use_syrk`, `gram`, `second_moment`,
    `dp_group`),
    TensorParallelMuon's (`tp_mode`, `pg_collection`, `qkv_split_shapes`, `fp32_matmul_prec`,
    `newton_schulz_settings`) and torch.optim.Optimizer's `param_groups`."""

    param_groups: list[dict]
    dp_group: dist.ProcessGroup | None
    dist_mode: str
    owner_choice: str
    max_team_size: int
    use_syrk: bool
    gram: GramSchedule | None
    second_moment: PlannedColumns | None
    tp_mode: str
    pg_collection: object  # megatron-core's ProcessGroupCollection, or None
    qkv_split_shapes: tuple[int, int, int] | None
    fp32_matmul_prec: str
    newton_schulz_settings: dict

    def device(self) -> torch.device: ...

    def name_of(self, p: torch.Tensor) -> str: ...

    def tp_group_of(self, attrs: ParamAttributes) -> dist.ProcessGroup | None: ...

    def splits_qkv(self, attrs: ParamAttributes) -> bool: ...

    def orthogonalize_full(self, p: DTensor, full: torch.Tensor) -> torch.Tensor: ...
