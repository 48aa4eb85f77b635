r"""Models of the code-completion task: a small Llama-shaped Hugging Face model over bytes, trained with the SBD
objective through `sbd_kernels.hf` (the paper's protocol at this scale), and the speed/quality curve.

    python -m sbd_kernels.code_models corpus                       # file counts and sha256 of the corpus and splits
    python -m sbd_kernels.code_models train --objective ntp --max-minutes 100 --out code_ntp_base
    python -m sbd_kernels.code_models train --objective sbd --init-from code_ntp_base --steps N --data-seed 1 \
        --out code_sbd
    python -m sbd_kernels.code_models train --objective ntp --init-from code_ntp_base --steps N --data-seed 1 \
        --out code_ntp
    python -m sbd_kernels.code_models curve --sbd code_sbd --ntp code_ntp --json curve.json --plot curve.png

The second and third runs continue the first for the same number of steps on the same data (a window stream other than
the first run's, `--data-seed 1`): the SBD model, and the NTP-only baseline trained on for as long (the fair baseline).
Each run writes an HF model folder (`save_pretrained`: config.json with the `sbd_*` fields, model.safetensors),
`training.json` (command, time, machine, loss curves) and `train_state.pt` (weights, optimizer state and step, for
`--resume`).

The loss is `sbd_kernels.train.sbd_loss` / `ntp_loss` through the `SbdCausalLM` adapter: one objective for the
reference model and HF models. Windows of TRAIN_WINDOW ids (BOS + bytes from a line start, as the prompts start),
every position but the first a target (`window_targets`). Forward and backward run under bf16 autocast (weights and
optimizer fp32): on this CPU it halved the NTP step (6.3 -> 3.3 s for 16 x 384 bytes) and cut the SBD step by 40%
(16 -> 10 s).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
import zlib
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from sbd_kernels.code_completion import (
    BUDGET,
    TRAIN_WINDOW,
    VERSION,
    ByteTokenizer,
    Example,
    Scores,
    TrainWindows,
    corpus,
    duplicate_rate,
    line_examples,
    score,
)
from sbd_kernels.generate import DecodeConfig, DecodeOps, DecodeResult, generate
from sbd_kernels.model import read_training_state, sbd_train_inputs
from sbd_kernels.train import IGNORE, add_noise, ntp_loss, sbd_labels, sbd_loss

MODEL_SHAPE = {"hidden": 256, "layers": 6, "heads": 4, "kv_heads": 2, "ffn": 704}
EVAL_WINDOWS = 48           # held-out windows of the periodic evaluation (fixed: seed 0 of the held-out stream)


@dataclass
class CodeTrainConfig:
    """One training run of a code model (every field is a `--flag`)."""

    objective: str = "sbd"          # "sbd" (NTP + MATP) or "ntp"
    out: str = "code_model"
    init_from: str = ""             # continue from this model folder (fresh optimizer)
    steps: int = 1_000_000          # the cosine schedule runs over steps or max_minutes, whichever ends first
    max_minutes: float = 0.0        # > 0: stop after this much wall time
    batch_size: int = 12            # windows of TRAIN_WINDOW ids per step (6144 tokens)
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    block_min: int = 2              # k ~ U{block_min..block_max} per step (docs/algorithm.md §2.2)
    block_max: int = 16
    data_seed: int = 0              # seed of the window stream (continued runs use another one than their start)
    seed: int = 0                   # initialisation and noise
    bf16: bool = True               # forward and backward under CPU/GPU bf16 autocast
    eval_every: int = 250
    save_every: int = 250           # writes the model and the optimizer state (for --resume)
    snapshots: str = ""             # comma-separated steps at which a copy of the model is kept as <out>_step<N>
    resume: bool = False
    threads: int = 1
    device: str = "cpu"


def model_config(hidden: int = 256, layers: int = 6, heads: int = 4, kv_heads: int = 2, ffn: int = 704):
    """The Llama config of the code models (defaults: MODEL_SHAPE, 4.49M parameters, 18 MB in fp32): byte vocabulary,
    RoPE theta 10000 over TRAIN_WINDOW positions, tied embeddings, newline as EOS."""
    import transformers

    return transformers.LlamaConfig(vocab_size=ByteTokenizer.VOCAB_SIZE, hidden_size=hidden, intermediate_size=ffn,
                                    num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                    max_position_embeddings=TRAIN_WINDOW, rope_theta=10000.0, tie_word_embeddings=True,
                                    pad_token_id=ByteTokenizer.PAD, bos_token_id=ByteTokenizer.BOS,
                                    eos_token_id=ByteTokenizer.NEWLINE, attn_implementation="sdpa")


def load_code_model(path: str | Path, device: str = "cpu"):
    """(HF model in eval mode, its SbdCausalLM adapter) from a folder written by `train_code_model`."""
    import transformers

    from sbd_kernels import hf

    # Without transformers' "Loading weights" progress bar, which would land in the middle of the demo's tables.
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    model = model.to(device).eval()
    return model, hf.enable_sbd(model, mask_token_id=ByteTokenizer.MASK)


TINY_SHAPE = {"hidden": 32, "layers": 2, "heads": 2, "kv_heads": 1, "ffn": 64}
# Weights of the random models drawn with std 0.5 instead of HF's 0.02: at 0.02 every prediction is near-uniform
# (entropy 5.57 of at most 5.58 nats), so entropies and logits tie to within rounding, the EB order flips between
# a cached and a recomputed pass and the exact-KV check fails on noise; at 0.5 the entropies spread over 0.1-5 nats
# (one-prompt mean 2.8) and SBD reveals several positions per pass, as a trained model does.
TINY_INIT_STD = 0.5


def random_code_models(seed: int = 0) -> dict[str, object]:
    """Two untrained TINY_SHAPE models (seeded, TINY_INIT_STD) as SbdCausalLM adapters, {"sbd", "ntp_only"}:
    `sbd demo --quick` and the tests run the code task's whole pipeline on them in seconds."""
    import transformers

    from sbd_kernels import hf

    torch.manual_seed(seed)
    models = {}
    config = model_config(**TINY_SHAPE)
    config.initializer_range = TINY_INIT_STD
    for name in ("sbd", "ntp_only"):
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        models[name] = hf.enable_sbd(model, mask_token_id=ByteTokenizer.MASK, block_size=16)
    return models


def lr_at(step: int, time_fraction: float, cfg: CodeTrainConfig) -> float:
    """Linear warm-up, then cosine to lr * min_lr_ratio at cfg.steps or when time_fraction (the share of
    max_minutes used) reaches 1, whichever comes first."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, max(time_fraction, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


def block_size_at(step: int, cfg: CodeTrainConfig) -> int:
    """k ~ U{block_min..block_max} of a step, from the step number (the same after a resume)."""
    rng = torch.Generator().manual_seed(zlib.crc32(f"k/{cfg.seed}/{step}".encode()))
    return int(torch.randint(cfg.block_min, cfg.block_max + 1, (1,), generator=rng))


def window_targets(windows: torch.Tensor) -> torch.Tensor:
    """The target mask `[B, T]` bool of windows `[B, T]`: every position but the first. Position 0 holds BOS, the
    given start of every window and prompt, which no decode predicts; as a masked-prediction target it would only
    teach the model the constant at position 0 (the NTP term never counts position 0 anyway)."""
    targets = torch.ones_like(windows, dtype=torch.bool)
    targets[:, 0] = False
    return targets


@torch.no_grad()
def held_out_losses(sbd_model, windows: torch.Tensor, bf16: bool, block_size: int = 16) -> dict[str, float]:
    """NTP loss (nats per byte) and MATP loss / token accuracy at masked positions (eta ~ U(0,1) from seed 0,
    blocks of `block_size`) on fixed held-out windows `[N, TRAIN_WINDOW]`."""
    was_training = sbd_model.training
    sbd_model.eval()
    device = windows.device
    targets = window_targets(windows)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        ntp, _ = ntp_loss(sbd_model, windows, targets)
        noisy, _ = add_noise(windows, ByteTokenizer.MASK, torch.Generator(device=device).manual_seed(0))
        labels = sbd_labels(windows, targets, noisy, ByteTokenizer.MASK)[:, windows.shape[1]:]
        logits = sbd_model(*sbd_train_inputs(windows, noisy, block_size))[:, windows.shape[1]:]
    counted = labels != IGNORE
    matp = torch.nn.functional.cross_entropy(logits[counted], labels[counted])
    accuracy = (logits.argmax(-1) == labels)[counted].float().mean()
    sbd_model.train(was_training)
    return {"ntp_loss": round(float(ntp), 4), "matp_loss": round(float(matp), 4),
            "matp_accuracy": round(float(accuracy), 4)}


def _new_model(cfg: CodeTrainConfig):
    import transformers

    if cfg.init_from:
        return transformers.AutoModelForCausalLM.from_pretrained(cfg.init_from, attn_implementation="sdpa")
    torch.manual_seed(cfg.seed)
    return transformers.AutoModelForCausalLM.from_config(model_config(**MODEL_SHAPE))


def _optimizer(model: torch.nn.Module, cfg: CodeTrainConfig) -> torch.optim.AdamW:
    # No weight decay on norms (1-d parameters), as in sbd_kernels.train.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))


def _save(model, opt, cfg: CodeTrainConfig, record: dict, out: str, with_state: bool) -> None:
    """Model folder (save_pretrained, fp32 safetensors) + training.json; with_state: train_state.pt for --resume,
    written atomically after the folder and holding the weights too, so that a run stopped between the two files
    resumes from the weights, optimizer state and step of one save, never the folder's newer weights with an older
    optimizer state and step."""
    model.save_pretrained(out)
    Path(out, "training.json").write_text(json.dumps(record, indent=1) + "\n")
    if with_state:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": record["steps"],
                    "seconds": record["seconds"], "curve": record["curve"], "eval": record["eval"]},
                   Path(out, "train_state.pt.tmp"))
        Path(out, "train_state.pt.tmp").replace(Path(out, "train_state.pt"))


RESUME_KEYS = ("model", "optimizer", "step", "seconds", "curve", "eval")


def _resumed_model(out: str, state: dict):
    """The model of the training state `state` of the folder `out`: the architecture of its config.json, the weights
    of the state (the folder's own weights may be those of a later save whose state was never written)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.load_state_dict(state["model"])
    return model


def train_code_model(cfg: CodeTrainConfig) -> dict:
    """Runs one training run; writes the model folder and training.json; returns the training record."""
    from sbd_kernels import hf

    # config
    if cfg.objective not in ("sbd", "ntp"):
        raise ValueError(f"train_code_model: objective must be 'sbd' or 'ntp', got {cfg.objective!r}")
    torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.device)
    snapshots = {int(s) for s in cfg.snapshots.split(",") if s}

    # data
    windows = TrainWindows(TRAIN_WINDOW, cfg.data_seed)
    eval_windows = TrainWindows(TRAIN_WINDOW, 0, split="held_out").batch(EVAL_WINDOWS, 0).to(device)

    # model
    resume_from = Path(cfg.out, "train_state.pt")
    state = None
    if cfg.resume and resume_from.exists():
        state = read_training_state(str(resume_from), RESUME_KEYS, "a code model")
        model = _resumed_model(cfg.out, state)
    else:
        model = _new_model(cfg)
    sbd_model = hf.enable_sbd(model.to(device).train(), mask_token_id=ByteTokenizer.MASK, block_size=16)
    opt = _optimizer(model, cfg)
    start_step, seconds_before, curve, evals = 0, 0.0, [], []
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        start_step, seconds_before, curve, evals = state["step"], state["seconds"], state["curve"], state["eval"]
        print(f"resumed {cfg.out} at step {start_step}", file=sys.stderr, flush=True)
    noise = torch.Generator(device=device)
    record = {"config": asdict(cfg), "command": "python -m sbd_kernels.code_models " + " ".join(sys.argv[1:]),
              "parameters": sum(p.numel() for p in model.parameters()), "corpus": corpus().sha256,
              "corpus_package": f"transformers=={VERSION}", "torch": torch.__version__,
              "machine": machine(cfg.threads), "tokens_per_step": cfg.batch_size * TRAIN_WINDOW}

    # loop: eval / save, batch, loss, step, log
    t0 = time.time()
    step = start_step
    while step < cfg.steps:
        elapsed = seconds_before + time.time() - t0
        if cfg.max_minutes > 0 and elapsed >= 60 * cfg.max_minutes:
            break
        if step % cfg.eval_every == 0 and (step > start_step or not evals):
            evals.append({"step": step, "minutes": round(elapsed / 60, 2),
                          **held_out_losses(sbd_model, eval_windows, cfg.bf16)})
            print("eval " + json.dumps(evals[-1]), file=sys.stderr, flush=True)
        if step > start_step and (step % cfg.save_every == 0 or step in snapshots):
            record.update(steps=step, seconds=round(elapsed, 1), curve=curve, eval=evals)
            _save(model, opt, cfg, record, cfg.out, with_state=True)
            if step in snapshots:
                _save(model, opt, cfg, record, f"{cfg.out}_step{step}", with_state=False)

        tokens = windows.batch(cfg.batch_size, step).to(device)
        targets = window_targets(tokens)
        noise.manual_seed(zlib.crc32(f"noise/{cfg.seed}/{step}".encode()))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
            if cfg.objective == "sbd":
                loss, terms = sbd_loss(sbd_model, tokens, targets, block_size_at(step, cfg), ByteTokenizer.MASK,
                                       noise)
            else:
                loss, terms = ntp_loss(sbd_model, tokens, targets)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, elapsed / (60 * cfg.max_minutes) if cfg.max_minutes > 0 else 0.0, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        if step % 25 == 0:
            point = {"step": step, "minutes": round((seconds_before + time.time() - t0) / 60, 2),
                     "loss": round(float(loss.detach()), 4), **{name: round(float(v), 4) for name, v in terms.items()}}
            curve.append(point)
            print(json.dumps(point), file=sys.stderr, flush=True)

    seconds = seconds_before + time.time() - t0
    evals.append({"step": step, "minutes": round(seconds / 60, 2),
                  **held_out_losses(sbd_model, eval_windows, cfg.bf16)})
    print("final eval " + json.dumps(evals[-1]), file=sys.stderr, flush=True)
    record.update(steps=step, seconds=round(seconds, 1), curve=curve, eval=evals)
    _save(model.eval(), opt, cfg, record, cfg.out, with_state=True)
    return record


def machine(threads: int) -> str:
    """CPU model name, core count and torch threads, or the GPU name."""
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
    import os

    return f"{name}, {os.cpu_count()} cores, {threads} torch threads"


# ----------------------------------------------------------------------------------------------------
# The speed/quality curve
# ----------------------------------------------------------------------------------------------------
CURVE_GAMMAS = (0.0, 0.1, 0.35, 1.0, 3.0)
CURVE_BLOCK_SIZES = (4, 8, 16)
CURVE_RULES = ("eb", "threshold")


@dataclass(frozen=True)
class Setting:
    """One decode setting of the curve: NTP (block_size, gamma, rule None) or SBD."""

    method: str
    block_size: int | None = None
    gamma: float | None = None
    rule: str | None = None

    def config(self, max_new_tokens: int) -> DecodeConfig:
        if self.method == "ntp":
            return DecodeConfig(method="ntp", max_new_tokens=max_new_tokens)
        return DecodeConfig(method="sbd", block_size=self.block_size, gamma=self.gamma, rule=self.rule,
                            max_new_tokens=max_new_tokens)

    @property
    def label(self) -> str:
        if self.method == "ntp":
            return "NTP"
        return f"SBD {self.rule} k={self.block_size} gamma={self.gamma:g}"


def curve_settings(block_sizes: tuple[int, ...], gammas: tuple[float, ...], rules: tuple[str, ...]) -> list[Setting]:
    """NTP, then SBD for every (rule, k, gamma); the threshold rule at k = max(block_sizes) only and gamma > 0
    (at gamma 0 it reveals one position per pass, as NTP does)."""
    settings = [Setting("ntp")]
    for rule in rules:
        sizes = block_sizes if rule == "eb" else (max(block_sizes),)
        for k in sizes:
            settings += [Setting("sbd", k, g, rule) for g in gammas if rule == "eb" or g > 0]
    return settings


@dataclass
class CurvePoint:
    """One point of the curve: a model decoded with one setting on the held-out examples of `lines` lines.

    exact_match (0..1) and edit_similarity (0..100) over every example; nfe_per_token = forward passes per
    generated byte (EOS included); nfe_speedup = NTP's nfe_per_token / this one (same model); differ_from_ntp:
    examples whose scored text differs from the same model's NTP decode; tokens_per_s: batch-1 decode of the first
    timing_examples examples (prefill included); wall_speedup = tokens_per_s / that of NTP (same model).
    """

    model: str
    lines: int
    method: str
    block_size: int | None
    rule: str | None
    gamma: float | None
    exact_match: float
    edit_similarity: float
    nfe: int
    tokens: int
    nfe_per_token: float
    nfe_speedup: float = 1.0
    differ_from_ntp: int = 0
    tokens_per_s: float = 0.0
    wall_speedup: float = 1.0
    timing_examples: int = 0


def decode_examples(sbd_model, examples: list[Example], lines: int, setting: Setting, batch_size: int,
                    ops: DecodeOps | None = None) -> tuple[DecodeResult, Scores]:
    """Decodes the examples' prompts with `setting` (budget BUDGET[lines]; a one-line decode stops at the newline,
    a 4-line one runs to its budget, as the decode loop stops on a token, not on a count of them) and scores it.
    RuntimeError when a sequence stopped early on invalid logits (`DecodeResult.require_complete`)."""
    eos = ByteTokenizer.NEWLINE if lines == 1 else -1
    result = generate(sbd_model, [ex.prompt for ex in examples], setting.config(BUDGET[lines]), eos_id=eos,
                      pad_id=ByteTokenizer.PAD, batch_size=batch_size, ops=ops)
    result.require_complete(f"code completion, {lines}-line examples")
    return result, score(result.tokens, examples, lines)


def measure_curve(models: dict[str, object], examples: dict[int, list[Example]],
                  settings: dict[tuple[str, int], list[Setting]], batch_size: int, timing_examples: int,
                  log=print) -> list[CurvePoint]:
    """Every point of the curve: for each number of lines and model, each setting of settings[(model, lines)]
    (NTP first: the reference of the speedups)."""
    points = []
    for lines, exs in examples.items():
        for name, sbd_model in models.items():
            ntp = None
            for setting in settings[(name, lines)]:
                result, scores = decode_examples(sbd_model, exs, lines, setting, batch_size)
                timed = generate(sbd_model, [ex.prompt for ex in exs[:timing_examples]],
                                 setting.config(BUDGET[lines]), eos_id=ByteTokenizer.NEWLINE if lines == 1 else -1,
                                 pad_id=ByteTokenizer.PAD, batch_size=1) if timing_examples else None
                point = CurvePoint(name, lines, setting.method, setting.block_size, setting.rule, setting.gamma,
                                   scores.exact_match, scores.edit_similarity, result.total_nfe,
                                   result.total_generated, result.nfe_per_token,
                                   tokens_per_s=timed.tokens_per_s if timed else 0.0,
                                   timing_examples=min(timing_examples, len(exs)))
                if ntp is None:
                    ntp, ntp_scores = point, scores
                point.nfe_speedup = ntp.nfe_per_token / point.nfe_per_token
                point.differ_from_ntp = sum(a != b for a, b in zip(scores.predictions, ntp_scores.predictions))
                if timed:
                    point.wall_speedup = point.tokens_per_s / ntp.tokens_per_s
                points.append(point)
                log(f"{name:<14} lines={lines} {setting.label:<32} EM {100 * point.exact_match:5.1f}% "
                    f"ES {point.edit_similarity:5.1f} NFE/token {point.nfe_per_token:.3f} "
                    f"({point.nfe_speedup:.2f}x) differ {point.differ_from_ntp} wall {point.wall_speedup:.2f}x")
    return points


def summarize(points: list[dict], tolerance: float = 0.01) -> dict[str, dict]:
    """Per number of lines: exact match of the NTP-only baseline and of the SBD model's NTP decode; `matched`: the SBD
    point with the largest NFE speedup whose exact match is within `tolerance` (1 point) of the baseline's; `fastest`:
    the SBD point with the largest NFE speedup. Points as in `CurvePoint` (dicts)."""
    summary = {}
    for lines in sorted({p["lines"] for p in points}):
        mine = [p for p in points if p["lines"] == lines]
        baseline = next(p for p in mine if p["model"] == "ntp_only")
        sbd_ntp = next(p for p in mine if p["model"] == "sbd" and p["method"] == "ntp")
        sbd = [p for p in mine if p["model"] == "sbd" and p["method"] == "sbd"]
        matched = [p for p in sbd if p["exact_match"] >= baseline["exact_match"] - tolerance]

        def brief(p: dict | None) -> dict | None:
            keys = ("rule", "block_size", "gamma", "exact_match", "edit_similarity", "nfe_per_token", "nfe_speedup",
                    "wall_speedup")
            return None if p is None else {k: p[k] for k in keys}

        summary[str(lines)] = {
            "ntp_only": {k: baseline[k] for k in ("exact_match", "edit_similarity")},
            "sbd_model_ntp": {k: sbd_ntp[k] for k in ("exact_match", "edit_similarity")},
            "matched": brief(max(matched, key=lambda p: p["nfe_speedup"], default=None)),
            "fastest": brief(max(sbd, key=lambda p: p["nfe_speedup"], default=None)),
        }
    return summary


def plot_curve(points: list[dict], path: str | Path) -> None:
    """Exact match and edit similarity against NFE per token, one row of panels per number of lines: one line per
    (model, rule, k) through its gammas, the NTP decode of each model as a marker (the paper's Figure 1 in small)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    line_counts = sorted({p["lines"] for p in points})
    fig, axes = plt.subplots(len(line_counts), 2, figsize=(11, 4.2 * len(line_counts)), squeeze=False)
    for row, lines in zip(axes, line_counts):
        mine = [p for p in points if p["lines"] == lines]
        series: dict[str, list[dict]] = {}
        for p in mine:
            if p["method"] == "sbd":
                series.setdefault(f"{p['model']} SBD {p['rule']} k={p['block_size']}", []).append(p)
        for ax, metric, scale, name in ((row[0], "exact_match", 100, "exact match (%)"),
                                        (row[1], "edit_similarity", 1, "edit similarity")):
            for label, pts in series.items():
                pts = sorted(pts, key=lambda p: p["gamma"])
                ax.plot([p["nfe_per_token"] for p in pts], [scale * p[metric] for p in pts], "o-", ms=3, label=label)
                for p in pts:
                    ax.annotate(f"{p['gamma']:g}", (p["nfe_per_token"], scale * p[metric]), fontsize=6,
                                textcoords="offset points", xytext=(2, 3))
            for p in (p for p in mine if p["method"] == "ntp"):
                ax.plot([p["nfe_per_token"]], [scale * p[metric]], "s", ms=6, label=f"{p['model']} NTP")
            ax.set(xscale="log", xlabel="forward passes per generated byte (NFE / token)", ylabel=name,
                   title=f"{name}, {lines}-line completion")
            ax.grid(True, which="both", alpha=0.3)
        row[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_curve(args: argparse.Namespace) -> dict:
    """The `curve` command: decodes, prints each point, writes the JSON and the plot; returns the JSON object."""
    torch.set_num_threads(args.threads)
    gammas = tuple(float(g) for g in args.gammas.split(","))
    block_sizes = tuple(int(k) for k in args.block_sizes.split(","))
    rules = tuple(args.rules.split(","))
    models, settings, sources = {}, {}, {}
    full = curve_settings(block_sizes, gammas, rules)
    short = curve_settings((max(block_sizes),), gammas, ("eb",))
    for name, path, grid in (("sbd", args.sbd, full), ("ntp_only", args.ntp, [Setting("ntp")]),
                             *((Path(p).name, p, short) for p in args.compare)):
        if name in models:
            raise ValueError(f"curve: two models named {name!r}; give --compare folders other names")
        models[name] = load_code_model(path)[1]
        settings[name] = grid
        record = Path(path, "training.json")
        sources[name] = {"path": str(path), **({k: v for k, v in json.loads(record.read_text()).items()
                                                 if k in ("steps", "seconds", "parameters")} if record.exists() else {})}
    examples = {1: line_examples("held_out", args.examples, lines=1)}
    if args.examples_4:
        examples[4] = line_examples("held_out", args.examples_4, lines=4)
    # The 4-line variant costs its whole budget per example: there the SBD model gets the short grid too.
    grids = {(name, lines): grid if lines == 1 or name != "sbd" else short
             for name, grid in settings.items() for lines in examples}
    start = time.time()
    points = measure_curve(models, examples, grids, args.batch_size, args.timing_examples,
                           log=lambda msg: print(msg, flush=True))
    result = {"command": "python -m sbd_kernels.code_models " + " ".join(sys.argv[1:] if args.argv is None
                                                                         else args.argv),
              "machine": machine(args.threads), "torch": torch.__version__, "corpus": corpus().sha256,
              "examples": {str(lines): len(exs) for lines, exs in examples.items()},
              "duplicate_rate": {str(lines): round(duplicate_rate(exs), 4) for lines, exs in examples.items()},
              "models": sources, "minutes": round((time.time() - start) / 60, 1),
              "points": [asdict(p) for p in points]}
    result["summary"] = summarize(result["points"])
    print(json.dumps(result["summary"], indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot_curve(result["points"], args.plot)
    return result


def add_curve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--sbd", required=True, help="SBD model folder")
    parser.add_argument("--ntp", required=True, help="NTP-only baseline model folder")
    parser.add_argument("--compare", action="append", default=[],
                        help="another SBD model folder (e.g. an earlier snapshot): NTP and SBD EB at the largest k")
    parser.add_argument("--examples", type=int, default=1000, help="held-out one-line examples")
    parser.add_argument("--examples-4", type=int, default=200, help="held-out 4-line examples (0: none)")
    parser.add_argument("--gammas", default=",".join(f"{g:g}" for g in CURVE_GAMMAS))
    parser.add_argument("--block-sizes", default=",".join(str(k) for k in CURVE_BLOCK_SIZES))
    parser.add_argument("--rules", default=",".join(CURVE_RULES))
    parser.add_argument("--batch-size", type=int, default=32, help="prompts per batch of the scored decodes")
    parser.add_argument("--timing-examples", type=int, default=16,
                        help="examples of the batch-1 decode timed per point (0: no timing)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    return parser


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------
def add_train_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """One `--<field>` flag per CodeTrainConfig field, with its default."""
    for field in fields(CodeTrainConfig):
        flag = f"--{field.name.replace('_', '-')}"
        if isinstance(field.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default, dest=field.name)
        else:
            parser.add_argument(flag, type=type(field.default), default=field.default, dest=field.name,
                                help=f"default: {field.default!r}")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sbd_kernels.code_models",
                                     description="Code-completion models: corpus, training, speed/quality curve.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("corpus", help="print the corpus' file counts and sha256 (corpus, train, held-out)")
    add_train_arguments(sub.add_parser("train", help="train an NTP or SBD code model"))
    add_curve_arguments(sub.add_parser("curve", help="decode the held-out set over gamma, k and rule; JSON + plot"))
    args = parser.parse_args(argv)
    args.argv = argv
    data = corpus()
    print(json.dumps({"files": {"train": len(data.train), "held_out": len(data.held_out)}, "sha256": data.sha256}),
          file=sys.stderr, flush=True)
    if args.command == "train":
        cfg = CodeTrainConfig(**{f.name: getattr(args, f.name) for f in fields(CodeTrainConfig)})
        if cfg.objective not in ("sbd", "ntp"):
            parser.error(f"--objective must be sbd or ntp, got {cfg.objective!r}")
        train_code_model(cfg)
    elif args.command == "curve":
        run_curve(args)


if __name__ == "__main__":
    main()
