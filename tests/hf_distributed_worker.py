"""Worker of tests/test_hf.py's 2-process runs (gloo, CPU): `torchrun --nproc_per_node 2 hf_distributed_worker.py MODE OUT`.

MODE "trainer-ddp": HF Trainer (DistributedDataParallel) with the SBD collator and loss.
MODE "fsdp2": a plain loop over an FSDP2-sharded model (`fully_shard` per decoder layer), same collator and loss.
(accelerate's FSDP path through Trainer does not run on CPU / gloo, hence the plain loop for FSDP2.)
Rank 0 prints one JSON line: world size, wrapper type, per-step losses.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import transformers

from sbd_kernels import hf
from sbd_kernels.train import exit_rank_without_finalization


def tiny_sbd_llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      attn_implementation="sdpa", pad_token_id=0)
    model = transformers.LlamaForCausalLM(config)
    hf.enable_sbd(model, mask_token_id=95)
    return model


def examples(rank: int, count: int) -> list[dict]:
    return [{"input_ids": list(range(3 + (i + rank) % 5, 20 + i % 7))} for i in range(count)]


def trainer_ddp(out: str, rank: int) -> tuple[object, str, list[float]]:
    model = tiny_sbd_llama()
    args = transformers.TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=3,
                                          learning_rate=1e-3, use_cpu=True, report_to=[], save_strategy="no",
                                          logging_steps=1, remove_unused_columns=False, ddp_backend="gloo")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=examples(0, 32),
                                   data_collator=hf.SbdDataCollator(model.config, rank=rank),
                                   compute_loss_func=hf.sbd_loss_func)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    return trainer, type(trainer.model_wrapped).__name__, losses


def fsdp2_loop(rank: int) -> tuple[object, str, list[float]]:
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    model = tiny_sbd_llama()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    collator = hf.SbdDataCollator(model.config, rank=rank)
    losses = []
    for step in range(3):
        batch = collator(examples(rank + step, 2))
        labels = batch.pop("labels")
        loss = hf.sbd_loss_func(model(**batch), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return model, type(model).__name__, losses


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    # The trainer (its DDP wrapper) or the sharded model lives until the rank exits: freeing a gloo wrapper
    # right after backward can deadlock the rank (sbd_kernels.train.average_gradients).
    _owner, wrapper, losses = trainer_ddp(out, rank) if mode == "trainer-ddp" else fsdp2_loop(rank)
    if rank == 0:
        print(json.dumps({"world": dist.get_world_size(), "wrapper": wrapper, "losses": losses}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    exit_rank_without_finalization()


if __name__ == "__main__":
    main()
