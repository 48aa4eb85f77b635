"""Models of the code-completion task: a small Llama-shaped Hugging Face model over bytes, trained with the SBD
objective through `sbd_kernels.hf` (the paper's protocol at this scale).

    python -m sbd_kernels.code_models --objective ntp --minutes 60 --out checkpoints/code_ntp
    python -m sbd_kernels.code_models --objective sbd --init-from checkpoints/code_ntp --minutes 30 --out .../code_sbd
    python -m sbd_kernels.code_models --objective ntp --init-from checkpoints/code_ntp --minutes 30 --out .../code_ntp_more

The second and third runs continue the first for the same budget: the SBD model, and the NTP-only baseline trained
on for as long (the fair baseline). Each run writes an HF model folder (`save_pretrained`: config.json with the
`sbd_*` fields, model.safetensors) and `training.json` (command, time, hardware, loss curve).

The loss is `sbd_kernels.train.sbd_loss` / `ntp_loss` through the `SbdCausalLM` adapter: one objective for the
reference model and HF models. Windows of WINDOW bytes from the training split, targets everywhere but the first.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from sbd_kernels.code_completion import TOKENIZER, VERSION, ByteTokenizer, TrainWindows, corpus
from sbd_kernels.train import ntp_loss, sbd_loss

WINDOW = 384


@dataclass
class CodeTrainConfig:
    """One training run of a code model (every field is a `--flag`)."""

    objective: str = "sbd"          # "sbd" or "ntp"
    out: str = "code_model"
    init_from: str = ""             # continue from this model folder (fresh optimizer)
    minutes: float = 30.0           # wall-clock budget; the cosine schedule runs over it
    batch_size: int = 16
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    block_min: int = 2
    block_max: int = 16
    seed: int = 0
    threads: int = 2
    device: str = "cpu"


def model_config(hidden: int = 256, layers: int = 6, heads: int = 8, kv_heads: int = 4, ffn: int = 704):
    """The Llama config of the code models: 4.5M parameters (18 MB in fp32), byte vocabulary, RoPE theta 10000."""
    import transformers

    return transformers.LlamaConfig(vocab_size=ByteTokenizer.VOCAB_SIZE, hidden_size=hidden, intermediate_size=ffn,
                                    num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                    max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=True,
                                    pad_token_id=ByteTokenizer.PAD, bos_token_id=ByteTokenizer.BOS,
                                    eos_token_id=ByteTokenizer.NEWLINE, attn_implementation="sdpa")


def load_code_model(path: str | Path, device: str = "cpu"):
    """(HF model in eval mode, its SbdCausalLM adapter) from a folder written by `train_code_model`."""
    import transformers

    from sbd_kernels import hf

    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").to(device).eval()
    return model, hf.enable_sbd(model)


def _lr_at(step: int, fraction: float, cfg: CodeTrainConfig) -> float:
    """Linear warm-up, then cosine to lr * min_lr_ratio over the time budget (`fraction` of it used)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * min(1.0, fraction)))


def train_code_model(cfg: CodeTrainConfig) -> dict:
    """Runs one training run; writes the model folder and training.json; returns the training record."""
    import transformers

    from sbd_kernels import hf

    torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.device)
    if cfg.init_from:
        model = transformers.AutoModelForCausalLM.from_pretrained(cfg.init_from, attn_implementation="sdpa")
    else:
        torch.manual_seed(cfg.seed)
        model = transformers.AutoModelForCausalLM.from_config(model_config())
    sbd_model = hf.enable_sbd(model.to(device).train(), mask_token_id=ByteTokenizer.MASK, block_size=16)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    windows = TrainWindows(WINDOW, cfg.seed + (1 if cfg.init_from else 0))
    noise = torch.Generator(device=device).manual_seed(cfg.seed)
    curve, start, step = [], time.time(), 0
    while (elapsed := time.time() - start) < 60 * cfg.minutes:
        tokens = windows.next_batch(cfg.batch_size).to(device)
        targets = torch.ones_like(tokens, dtype=torch.bool)
        if cfg.objective == "sbd":
            rng = torch.Generator().manual_seed(zlib.crc32(f"k/{cfg.seed}/{step}".encode()))
            k = int(torch.randint(cfg.block_min, cfg.block_max + 1, (1,), generator=rng))
            loss, terms = sbd_loss(sbd_model, tokens, targets, k, ByteTokenizer.MASK, noise)
        else:
            loss, terms = ntp_loss(sbd_model, tokens, targets)
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, elapsed / (60 * cfg.minutes), cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 25 == 0:
            point = {"step": step, "minutes": round(elapsed / 60, 2), "loss": round(float(loss), 4),
                     **{name: round(float(v), 4) for name, v in terms.items()}}
            curve.append(point)
            print(json.dumps(point), file=sys.stderr, flush=True)
    model.eval().save_pretrained(cfg.out)
    record = {"config": asdict(cfg), "command": " ".join(sys.argv), "steps": step,
              "minutes": round((time.time() - start) / 60, 1), "bytes_seen": step * cfg.batch_size * WINDOW,
              "parameters": sum(p.numel() for p in model.parameters()), "corpus": corpus().sha256,
              "package": f"transformers=={VERSION}", "torch": torch.__version__, "machine": _machine(), "curve": curve}
    Path(cfg.out, "training.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def _machine() -> str:
    """CPU model name and core count, or the GPU name."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    name = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {torch.get_num_threads()} threads"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train a code-completion model (NTP or SBD) on the pinned corpus.")
    for name, default in asdict(CodeTrainConfig()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default, dest=name)
    cfg = CodeTrainConfig(**vars(parser.parse_args(argv)))
    if cfg.objective not in ("sbd", "ntp"):
        parser.error(f"--objective must be sbd or ntp, got {cfg.objective!r}")
    print(json.dumps({"corpus": corpus().sha256, "tokenizer_vocab": TOKENIZER.VOCAB_SIZE}), file=sys.stderr)
    train_code_model(cfg)


if __name__ == "__main__":
    main()
