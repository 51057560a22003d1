"""Muon on a Hugging Face model sharded by Megatron-FSDP outside Megatron, on CPU or GPUs:

    torchrun --standalone --nproc-per-node 2 examples/train_hf_fully_shard.py [--model llama]
        [--strategy optim_grads_params] [--steps 60]

A tiny Llama or Qwen3 built from its config (no download) learns a fixed Markov chain
(synthetic_data.py): `megatron_fsdp.fully_shard_model` shards it (the standalone megatron-fsdp
package where installed, else megatron-core's copy), `megatron_muon.standalone.muon_optimizer`
puts Muon on its hidden matrices and AdamW on the rest (it prints which at start). gloo and fp32
Newton-Schulz on CPU, NCCL and Megatron's bf16 Newton-Schulz on GPUs. That each step is exactly
single-device Muon + AdamW is tests/integrations/test_standalone.py's to show.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from megatron_muon.cpu.torch_compat import apply_cpu_compat
from megatron_muon.standalone import muon_optimizer
from megatron_muon.tools.testing import hugging_face_model
from synthetic_data import MarkovChainDataset  # beside this script

try:
    import megatron_fsdp
except ImportError:
    from megatron.core.distributed.fsdp.src import megatron_fsdp

MODELS = {"llama": "Llama", "qwen3": "Qwen3"}
VOCAB, SEQUENCE, MICRO_BATCH = 128, 64, 4


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="llama")
    parser.add_argument("--strategy", default="optim_grads_params",
                        choices=["no_shard", "optim", "optim_grads", "optim_grads_params"])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        apply_cpu_compat()  # Megatron-FSDP on CPU: no CUDA streams, gloo's collectives
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    torch.manual_seed(0)
    model, layer = hugging_face_model(
        MODELS[args.model], vocab_size=VOCAB, hidden_size=64, intermediate_size=192,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=SEQUENCE)
    mesh = init_device_mesh(device.type, (world, 1), mesh_dim_names=("dp", "tp"))
    model = megatron_fsdp.fully_shard_model(
        model, device_mesh=mesh, dp_shard_dim="dp", tp_dim="tp", zero_dp_strategy=args.strategy,
        fsdp_unit_modules=[layer], device=device,
        mixed_precision_policy=megatron_fsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32))
    optimizer = muon_optimizer(model, lr=0.02, adamw_lr=3e-3,
                               fp32_matmul_prec="medium" if cuda else "highest")

    data = MarkovChainDataset(args.steps * MICRO_BATCH * world, SEQUENCE, VOCAB)
    losses = []
    for step in range(args.steps):
        samples = [data[(step * world + rank) * MICRO_BATCH + i] for i in range(MICRO_BATCH)]
        tokens = torch.stack([s["tokens"] for s in samples]).to(device)
        labels = torch.stack([s["labels"] for s in samples]).to(device)
        logits = model(input_ids=tokens).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d} loss {losses[-1]:.4f}", flush=True)
    if rank == 0:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
