"""checkpoint: what a checkpoint holds beyond what Megatron saves, and loads across formats. Each
file's size and CRC-32, recorded at a save and verified before a load (checksums); how each
format keys a tensor, what both share, and the refusal of optimizer state a load cannot read
(keys); a Megatron DDP checkpoint read into a Muon run on Megatron-FSDP (from_megatron_ddp) and
ours into a Megatron DDP run (to_megatron_ddp); which of the two a load is (direction). Imports
the layers below it."""
