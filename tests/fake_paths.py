"""The multi-rank code paths, run by every rank under fake_ranks (no float data moves): what they
must not do is hand a collective a tensor off the ranks' device, or fail; the numbers are not
checked here (the gloo suite does that)."""

import dataclasses

from fsdp_models import load_checkpoint, save_checkpoint
from megatron_muon import get_megatron_optimizer
from megatron_muon.chain.model_chunks import named_main_weights
from megatron_muon.tools.testing import (TINY, fsdp_gpt, init_parallel_state, lm_loss,
                                         optimizer_config)

# (name, sharding strategy, Muon dist mode, experts, HSDP replicas, the world sizes it runs at,
# the optimizer state in host memory: its pinned host tensors must reach no collective, and a
# checkpoint saves and loads them; --muon-max-team-size: at W=4 a one-layer GPT's fc1 and fc2,
# 32x the model's width, go to teams). W=4 runs what W=2 cannot show, beside ZeRO-3's owner
# step and the offloaded experts (more ranks to an exchange, ranks holding nothing); the other
# paths add only their W=2 calls again (12 of the test's 24 s on 2 cores).
CASES = [
    ("zero3-owner", "optim_grads_params", "owner", None, 1, (2, 4), False, 1),
    ("zero3-allgather", "optim_grads_params", "allgather", None, 1, (2,), False, 1),
    ("zero1-owner", "optim", "owner", None, 1, (2,), False, 1),
    ("no_shard-owner", "no_shard", "owner", None, 1, (2,), False, 1),
    ("experts", "optim_grads_params", "owner", 4, 1, (2,), False, 1),
    ("hsdp", "optim_grads_params", "owner", None, 2, (4,), False, 1),
    ("experts-offloaded", "optim_grads_params", "owner", 4, 1, (2, 4), True, 1),
    ("zero3-teams", "optim_grads_params", "owner", None, 1, (4,), False, 4),
]


def _build(strategy, dist_mode, experts, replicas, offload, max_team):
    init_parallel_state(expert_parallel=2 if experts else 1, replicas=replicas)
    # MuonClip on, with a threshold the logits pass: its all-reduce runs in every step, and its
    # clip wherever the fake group's stand-in weights give a logit above 0.
    shape = TINY if max_team == 1 else dataclasses.replace(TINY, layers=1, ffn=32 * TINY.hidden)
    model = fsdp_gpt(shape, strategy=strategy, num_experts=experts, qk_clip=True,
                     qk_clip_threshold=1e-6)
    config = optimizer_config(optimizer_cpu_offload=offload, optimizer_offload_fraction=1.0)
    # Teams sized by FLOPs (owners by bytes), not by rates the fake group's collectives give.
    return model, get_megatron_optimizer(config, [model], muon_dist_mode=dist_mode,
                                         muon_max_team_size=max_team,
                                         muon_owner_choice="bytes" if max_team > 1 else "time")


def _step(model, optimizer, rank, step):
    """A step that is taken: the fake group leaves some buffers as they were, which can make the
    gradients non-finite, or so large that their norm overflows (either skips the step: the
    chain decides from the norm); after the grad sync they are made finite and bounded."""
    optimizer.zero_grad()
    lm_loss(model, step, rank).backward()
    model.finish_grad_sync()
    for _, p in named_main_weights(model):
        if p.grad is not None:
            p.grad.to_local().nan_to_num_(0.0, 0.0, 0.0).clamp_(-1.0, 1.0)
    return optimizer.step()[0]


def every_path(rank, world_size, guard, checkpoint_dir):
    """Construction, a step, and a checkpoint saved and loaded, for every case that fits."""
    for name, strategy, dist_mode, experts, replicas, worlds, offload, max_team in CASES:
        if world_size not in worlds:
            continue
        model, optimizer = _build(strategy, dist_mode, experts, replicas, offload, max_team)
        split = [matrix.team for part in optimizer.chained_optimizers
                 for plan in getattr(part.optimizer, "plans", ()) for matrix in plan.matrices]
        assert (max_team > 1) == any(split), (name, split)
        device = next(model.parameters()).device
        assert device.type == guard.device_type, (name, device)
        before = dict(guard.calls)
        assert _step(model, optimizer, rank, 0), f"{name}: the step was skipped"
        if dist_mode == "owner" and not experts:
            # The step did reach the exchange: rows travelled to their owners and back.
            exchanges = guard.calls.get("all_to_all_single", 0) - before.get("all_to_all_single", 0)
            assert exchanges > 0, name
        path = f"{checkpoint_dir}/{name}"
        save_checkpoint(model, optimizer, path)
        model, optimizer = _build(strategy, dist_mode, experts, replicas, offload, max_team)
        load_checkpoint(model, optimizer, path)
        assert _step(model, optimizer, rank, 1), f"{name}: the step after loading was skipped"
