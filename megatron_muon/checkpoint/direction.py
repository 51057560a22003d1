"""Which way a load crosses between Megatron DDP's format and ours, decided in one place for both
front ends that load (front_ends.megatron_lm's --load, front_ends.bridge's checkpoint load):
a Muon run on Megatron-FSDP (fsdp_dtensor) whose load finds a Megatron DDP checkpoint
(torch_dist) reads it with from_megatron_ddp; a Megatron DDP run (torch_dist) whose load finds
ours reads it with to_megatron_ddp; any other load is the front end's own."""

import enum
from pathlib import Path

from . import from_megatron_ddp, keys, to_megatron_ddp


class Direction(enum.Enum):
    """Its value: the name of the CheckpointType (megatron.training's enum, and Bridge's) the
    loaded state is handed back as."""
    FROM_MEGATRON_DDP = "FSDP_DTENSOR"
    TO_MEGATRON_DDP = "GLOBAL"

    def says(self, checkpoint: Path) -> str:
        """What the load is, for the log."""
        if self is Direction.FROM_MEGATRON_DDP:
            return f"the Megatron DDP (torch_dist) checkpoint {checkpoint} into Megatron-FSDP"
        return f"the Megatron-FSDP (fsdp_dtensor) checkpoint {checkpoint} into Megatron DDP"


def crossing(checkpoint: Path, *, muon_on_megatron_fsdp: bool, megatron_fsdp: bool,
             ckpt_format: str) -> Direction | None:
    """The direction in which a run loads `checkpoint` (the run: Muon on Megatron-FSDP or not,
    Megatron-FSDP or not, its --ckpt-format), or None where it is the run's own format."""
    if muon_on_megatron_fsdp and ckpt_format == "fsdp_dtensor" and keys.is_torch_dist(checkpoint):
        return Direction.FROM_MEGATRON_DDP
    if not megatron_fsdp and ckpt_format == "torch_dist" and keys.is_ours(checkpoint):
        return Direction.TO_MEGATRON_DDP
    return None


def read_before_the_load(direction: Direction, checkpoint: Path) -> dict:
    """What the front end reads on rank 0 before the load (megatron.training's rank0=True:
    the args, the iteration), so that it generates the state dict of the run's own format."""
    if direction is Direction.FROM_MEGATRON_DDP:
        common = from_megatron_ddp.common_state(checkpoint)
        return {key: common.get(key) for key in keys.READ_BEFORE_THE_LOAD}
    return to_megatron_ddp.common_state(checkpoint)


def load(direction: Direction, checkpoint: Path, sharded_state_dict: dict,
         num_experts: int | None) -> dict:
    """The run's state dict (as its front end generated it) loaded from `checkpoint`."""
    if direction is Direction.FROM_MEGATRON_DDP:
        return from_megatron_ddp.load(checkpoint, sharded_state_dict)
    return to_megatron_ddp.load(checkpoint, sharded_state_dict, num_experts)
