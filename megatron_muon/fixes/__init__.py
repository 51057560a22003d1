"""fixes: released upstream repaired where the installed code has the defect, for every
optimizer (upstream_fixes): Megatron-FSDP's gradients (a buffer reduced over one rank, the
average in the collective, HSDP's outer all-reduce, missing experts' dense group),
megatron-core's adaptive Muon's scale, the dataset helper's build. Each is probed in the
installed code, applied through compat.upstream (listed, undoable) and nowhere else. Imports
compat."""
