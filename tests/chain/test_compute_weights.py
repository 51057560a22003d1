"""What the next forward reads: after every step of the chain (a skipped one too) each module
computes with the optimizer's main weights, for every sharding strategy, as megatron-core's own
optimizer leaves the model. Under ZeRO-1/2 the compute weights are unsharded and a rank installs
only its own rows: without the param sync the other rows stay stale and training goes wrong
silently. (After a checkpoint load: test_checkpoint.)"""

import pytest
import torch
from megatron.core import parallel_state

from fsdp_models import STRATEGIES, ForwardReads
from megatron_muon import get_megatron_optimizer
from megatron_muon.chain.model_chunks import find_megatron_fsdp
from megatron_muon.tools.testing import fsdp_gpt, init_parallel_state, lm_loss, optimizer_config

STEPS, SKIPPED_STEP = 3, 1
# (strategy, HSDP outer strategy or None, expert parallel, tensor parallel, --overlap-grad-reduce
# and --overlap-param-gather, finalize_model_grads syncs the grads before the step)
PLAIN = [(strategy, None, 1, 1, False, False) for strategy in STRATEGIES]
OVERLAPPED = [(strategy, None, 1, 1, True, True) for strategy in STRATEGIES]
CASES = {
    2: PLAIN + OVERLAPPED,
    # At W=4 the layouts W=2 lacks (HSDP, EP, TP), beside ZeRO-3 (ZeRO-1 runs under EP and TP
    # here; the ZeRO-2 and no_shard cases add nothing W=2's do not show, for 8 s of the suite).
    4: [case for case in PLAIN if case[0] == "optim_grads_params"]
       + [("optim_grads_params", "no_shard", 1, 1, True, True),
                ("optim_grads_params", "optim", 1, 1, True, True),
                ("optim", None, 2, 1, False, True), ("optim_grads", None, 2, 1, True, False),
                ("optim", None, 1, 2, False, False), ("optim_grads_params", None, 1, 2, True, True)],
}
# Without a main weight buffer (--megatron-fsdp-main-params-dtype auto on the fp32 GPT): the
# optimizer steps the compute weights' buffer itself and the install copies nothing.
WITHOUT_MAIN_BUFFER = {2: [("optim", None, 1, 1, False, False),
                           ("optim_grads_params", None, 1, 1, True, True)], 4: []}


def _forward_reads_main_weights(rank, world_size, case, main_params_dtype=torch.float32):
    strategy, outer, expert_parallel, tensor_parallel, overlap, finalize = case
    init_parallel_state(expert_parallel=expert_parallel, tensor_parallel=tensor_parallel,
                        replicas=2 if outer else 1)
    model = fsdp_gpt(strategy=strategy, outer_strategy=outer or "no_shard", overlap=overlap,
                     num_experts=4 if expert_parallel > 1 else None,
                     main_params_dtype=main_params_dtype)
    reads = ForwardReads(find_megatron_fsdp(model))
    optimizer = get_megatron_optimizer(optimizer_config(), [model])
    for step in range(STEPS + 1):
        optimizer.zero_grad()
        with model.no_sync():  # as Megatron's schedules mark the last micro-batch
            pass
        # Tensor-parallel ranks read the same batch: the batch follows the data-parallel rank.
        loss = lm_loss(model, step, parallel_state.get_data_parallel_rank())
        reads.assert_main_weights(f"{case} main_params_dtype={main_params_dtype} W={world_size} "
                                  f"forward after {step} steps")
        if step == STEPS:
            return
        if step == SKIPPED_STEP and rank == world_size - 1:
            loss = loss * float("nan")  # every gradient non-finite: the step is skipped
        loss.backward()
        if finalize:
            model.finish_grad_sync()
        assert optimizer.step()[0] == (step != SKIPPED_STEP)


def _every_case(rank, world_size):
    for case in CASES[world_size]:
        _forward_reads_main_weights(rank, world_size, case)
    for case in WITHOUT_MAIN_BUFFER[world_size]:
        _forward_reads_main_weights(rank, world_size, case, main_params_dtype=None)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_the_next_forward_reads_the_main_weights(distributed, world_size):
    distributed(_every_case, world_size)
