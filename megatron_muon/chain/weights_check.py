"""The check interval's second half, after a step's param sync: the weights themselves. Replicas
of a main weight (no_shard, HSDP) hold the same bits, and the weights the model computes with
(Megatron-FSDP's model weight buffers) are the main weights cast to their dtype. Ranks compare
one fingerprint per tensor, never the tensors."""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from ..core.checks import MuonCheckError
from ..distribution.agreement import agree_on_every_rank
from ..distribution.dtensor_rows import data_parallel_dims
from .model_chunks import named_main_weights

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_FINGERPRINT_CHUNK = 1 << 24  # elements: 128 MiB of int64 scratch at most


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """An int64 of `t`'s bits in which a change of any one element shows: the sum of each
    element's bits times an odd weight of its position, wrapping around (changing an element's
    bits by b changes the sum by b times an odd number, never by 0 modulo 2**64). Summed in
    chunks, so a whole weight buffer needs a bounded int64 scratch, not three times its size."""
    bits = t.detach().contiguous().view(-1)
    bits = bits.view(_BITS[bits.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=bits.device)
    for start in range(0, bits.numel(), _FINGERPRINT_CHUNK):
        chunk = bits[start:start + _FINGERPRINT_CHUNK].long()
        weights = torch.arange(start, start + chunk.numel(), dtype=torch.int64,
                               device=bits.device) * 2 + 1
        total += (chunk * weights).sum()
    return total + bits.numel()


def _differing(entries: list) -> set:
    """The keys of (key, fingerprint, process group) entries whose fingerprint is not the same on
    every rank of its group. Two reductions per group, in the order the groups first appear:
    every rank of a model chunk lists the same entries, so all issue the same collectives."""
    by_group: dict = {}
    for key, print_, group in entries:
        by_group.setdefault(group, []).append((key, print_))
    differ = set()
    for group, items in by_group.items():
        highest = torch.stack([print_ for _, print_ in items])
        lowest = highest.clone()
        dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=group)
        differ.update(key for (key, _), unequal in zip(items, (highest != lowest).tolist())
                      if unequal)
    return differ


def replicas_that_differ(named_main_weights: list) -> tuple[list[str], int]:
    """(names of main weights whose replicas differ, how many (weight, replica group) pairs were
    compared). Replicas: the data-parallel mesh dims a main weight is Replicate on (no_shard's,
    HSDP's outer dim under outer no_shard). Collective over those groups."""
    entries = []
    for name, p in named_main_weights:
        if isinstance(p, DTensor):
            for dim in data_parallel_dims(p):
                if isinstance(p.placements[dim], Replicate) and p.device_mesh.size(dim) > 1:
                    entries.append((name, fingerprint(p.to_local()), p.device_mesh.get_group(dim)))
    return sorted(_differing(entries)), len(entries)


def compute_weights_that_differ(megatron_fsdp) -> list[str]:
    """Names of params whose compute weights differ from their main weights once the param sync
    is done. On each rank, the rows it installed: its part of each model weight item against its
    main weights cast to the model's dtype, paired as Megatron-FSDP's install pairs them
    (ParamAndGradBuffer.copy_main_weights_to_model_weights). Where the model weights are
    unsharded (no_shard, ZeRO-1/2), also the whole buffer the forward reads, the same on every
    rank of its group: every rank then computes with every rank's installed rows. Collective over
    those buffers' groups."""
    buffers = megatron_fsdp.param_and_grad_buffer
    names, differ, gathered = buffers.param_to_name, set(), []
    for index, group in enumerate(buffers.parameter_groups):
        main, model = group.main_weight_buffer, group.model_weight_buffer
        if main is None or model is None:  # nothing to step, or it computes with the main weights
            continue
        shard = model.is_data_distributed or main.is_data_distributed
        for param in group.params:
            item = main.param_idx[param]
            compute = model.get_item(item, only_shard=shard)
            if not torch.equal(compute, main.get_item(item, only_shard=shard).to(compute.dtype)):
                differ.add(names[param])
        if not model.is_data_distributed:
            gathered.append((index, fingerprint(model.data), model.data_parallel_group))
    for index in _differing(gathered):
        differ.update(names[param] for param in buffers.parameter_groups[index].params)
    return sorted(differ)


def check_after_param_sync(model_chunks: list, fsdp_models: list, muon_optimizers: list,
                           iteration: int) -> None:
    """The check interval's second half, after the param sync (FSDPMuonChainedOptimizer.step):
    replicas and compute weights checked, every rank's verdict agreed, and every rank raises or
    none; rank 0 prints the check's one line."""
    failures, replica_groups = [], 0
    for chunk, fsdp in zip(model_chunks, fsdp_models):
        differ, compared = replicas_that_differ(named_main_weights(chunk))
        replica_groups += compared
        failures += [f"{name}: its replicas differ" for name in differ]
        failures += [f"{name}: the compute weights differ from the main weights"
                     for name in compute_weights_that_differ(fsdp)]
    device = next(model_chunks[0].parameters()).device
    _, replica_groups, failures = agree_on_every_rank(0.0, replica_groups, failures, device)
    if failures:
        raise MuonCheckError(
            f"muon check at iteration {iteration}: after the param sync the weights are not what "
            f"this step made (the step was applied; the run stops):\n  " + "\n  ".join(failures))
    checks = [muon.last_check for muon in muon_optimizers
              if muon.last_check and muon.last_check.iteration == muon.iteration]
    update = (f"max |owner - reference| = {max(c.worst for c in checks):.3e} over "
              f"{sum(c.matrices for c in checks)} matrices" if checks
              else "no owner exchange to compare (dist_mode allgather)")
    replicas = "replicas equal" if replica_groups else "no replicas"
    if dist.get_rank() == 0:
        print(f"muon check at iteration {iteration}: {update}; {replicas}; compute weights equal",
              flush=True)
