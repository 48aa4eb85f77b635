"""SBD training (docs/algorithm.md §2) and plain NTP training of the reference model on the synthetic tasks.

SBD objective, per step:
- k ~ U{2..16}, one per step (drawn from the step number, so every data-parallel rank agrees);
- per sequence eta ~ U(0, 1); every token of the noisy copy is replaced by the mask id with prob. eta;
- input [clean ; noisy] (length 2n), noisy token i at the same position id as clean token i, attention
  mask (docs/algorithm.md §2.4, `sbd_attention_mask`): dense bool mask + SDPA on CPU, FlexAttention BlockMask
  on a GPU;
- loss = one mean over every counted target of both halves: NTP (clean half, shifted labels) and MATP
  (noisy half, masked positions, unshifted labels). Targets are counted on answer + EOS positions only
  (the prompts are random digits/letters nobody can predict); the noise is applied everywhere.
With `--objective ntp` the loss is the NTP term alone over the clean sequence (the baseline).

Run: `sbd train --objective ntp --steps 1500 --out ntp.pt`, then
`sbd train --objective sbd --init-from ntp.pt --lr 5e-4 --out sbd.pt` (or `python -m sbd_kernels.train ...`).
Data parallel: `torchrun --nproc-per-node 2 -m sbd_kernels.train ...` (gloo on CPU, nccl on CUDA);
each rank draws its own batch, and the loss is one mean over the targets of every rank's batch
(`global_mean_loss`: one all_reduce of the CE sums and target counts per step), and the gradients are
averaged after backward (`average_gradients`: no DDP wrapper, whose collectives inside backward could
deadlock a gloo rank); with --max-minutes, rank 0's clock decides for every rank when to stop and how far
the cosine has run.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from sbd_kernels import argtypes
from sbd_kernels.argtypes import UsageError, add_option
from sbd_kernels.generate import integer, real
from sbd_kernels.model import (
    PRESETS,
    CheckpointError,
    ModelConfig,
    SbdMaskMod,
    Transformer,
    load_checkpoint,
    read_training_state,
    save_checkpoint,
    sbd_attention_mask,
    sbd_train_inputs,
)
from sbd_kernels.tasks import (
    TASKS,
    TOKENIZER,
    TrainStream,
    collate,
    exact_match,
    get_task,
    make_examples,
    sequence_length,
)

__all__ = [
    "TrainConfig",
    "add_arguments",
    "add_noise",
    "average_gradients",
    "broadcast_parameters",
    "evaluate",
    "exit_rank_without_finalization",
    "global_mean_loss",
    "lr_at",
    "main",
    "ntp_labels",
    "ntp_loss",
    "ntp_loss_terms",
    "sbd_attention_mask",
    "sbd_labels",
    "sbd_loss",
    "sbd_loss_terms",
    "sbd_objective",
    "sbd_term_sums",
    "train",
    "warmup_share",
]

IGNORE = -100  # cross-entropy ignore_index for positions that are not counted


@dataclass
class TrainConfig:
    """Every training option; each field is also a command-line flag (`batch_size`: `--batch-size`), of the type
    it is annotated with (`_typed_field`: TypeError naming the field otherwise), and takes the values its flag
    takes (`FLAG_TYPES`): ValueError naming the field otherwise."""

    preset: str = "small"               # with init_from: replaced by the preset of that checkpoint's model
    tasks: str = "add,rot13"            # comma-separated task names (sbd_kernels.tasks.TASKS)
    objective: str = "sbd"              # "sbd" (NTP + MATP) or "ntp" (baseline)
    steps: int = 2000
    max_minutes: float = 0.0            # > 0: also stop after this much wall time; the cosine then runs
                                        # over whichever budget (steps or minutes) is used up first
    batch_size: int = 32                # sequences per rank per step
    lr: float = 1e-3
    min_lr_ratio: float = 0.1           # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    block_min: int = 2                  # k ~ U{block_min..block_max} (docs/algorithm.md §2.2)
    block_max: int = 16
    eval_every: int = 250
    eval_examples: int = 64             # held-out examples per task at each evaluation
    checkpoint_every: int = 100
    log_every: int = 10
    out: str = "model.pt"
    init_from: str = ""                 # start from these weights (e.g. SBD after NTP), fresh optimizer; a
                                        # resume takes its weights from <out>.state and does not read the file
    resume: bool = False                # continue from <out>.state (weights, optimizer, step, time used); the
                                        # fields outside RESUME_MAY_CHANGE must be the run's own
    seed: int = 0
    threads: int = 1
    device: str = "cpu"
    attention: str = "auto"             # "sdpa", "flex", or "auto": FlexAttention on CUDA, SDPA elsewhere

    def __post_init__(self) -> None:
        # Types first, field by field as annotated: the value checks below parse str(value) as the flag's text,
        # so "5" passed as steps and stayed a string, a NumPy integer stayed one in the checkpoint's train_config
        # (which torch.load(weights_only=True) then refuses), and resume="no" resumed.
        for field in dataclasses.fields(self):
            setattr(self, field.name, _typed_field(field.name, field.type, getattr(self, field.name)))
        for name, flag in FLAG_TYPES.items():
            value = getattr(self, name)
            if "choices" in flag and value not in flag["choices"]:
                raise ValueError(f"TrainConfig: {name} must be one of {', '.join(flag['choices'])}, got {value!r}")
            if "type" in flag and flag["type"] not in _FILE_TYPES:
                try:
                    flag["type"](str(value))
                except argparse.ArgumentTypeError as err:
                    raise ValueError(f"TrainConfig: {name} {err}") from None
        if self.block_min > self.block_max:
            raise ValueError(f"TrainConfig: block_min ({self.block_min}) must be <= block_max ({self.block_max})")

    def task_list(self) -> list[str]:
        return [t for t in self.tasks.split(",") if t]


_PATH_FIELDS = ("out", "init_from")  # of TrainConfig: also take an os.PathLike, kept as its str


def _typed_field(name: str, annotation: str, value: object) -> object:
    """`value` of the TrainConfig field `name`, annotated `annotation` ("int", "float", "bool" or "str"), as that
    type: an int from Python, NumPy or one-element tensor integers, not bools (`generate.integer`); a float from
    Python or NumPy reals, not bools (`generate.real`); a bool only from True or False; a str (or, for a file,
    an os.PathLike). TypeError naming the field otherwise."""
    if annotation == "int":
        return integer("TrainConfig", name, value)
    if annotation == "float":
        return real("TrainConfig", name, value)
    if annotation == "bool":
        if isinstance(value, bool):
            return value
        raise TypeError(f"TrainConfig: {name} must be True or False, got {value!r} ({type(value).__name__})")
    if name in _PATH_FIELDS and isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str):
        return value
    kind = "a str or an os.PathLike" if name in _PATH_FIELDS else "a str"
    raise TypeError(f"TrainConfig: {name} must be {kind}, got {value!r} ({type(value).__name__})")


# ---------------------------------------------------------------- SBD objective (docs/algorithm.md §2)

def block_size_for_step(step: int, cfg: TrainConfig) -> int:
    """k ~ U{block_min..block_max}, one per step, the same on every rank (seeded by the step)."""
    rng = torch.Generator().manual_seed(zlib.crc32(f"k/{cfg.seed}/{step}".encode()))
    return int(torch.randint(cfg.block_min, cfg.block_max + 1, (1,), generator=rng))


def add_noise(tokens: Tensor, mask_token_id: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Noisy copy (docs/algorithm.md §2.1): eta `[B]` ~ U(0,1) per sequence, each token -> mask id w.p. eta.
    Returns (noisy `[B, n]` int64, eta `[B]` fp32). generator lives on the device of tokens."""
    b, n = tokens.shape
    eta = torch.rand(b, generator=generator, device=tokens.device)
    masked = torch.rand(b, n, generator=generator, device=tokens.device) < eta[:, None]
    return torch.where(masked, torch.full_like(tokens, mask_token_id), tokens), eta


def ntp_labels(tokens: Tensor, target_mask: Tensor) -> Tensor:
    """labels `[B, n]`: position i predicts tokens[i+1] where target_mask[i+1]; IGNORE elsewhere."""
    labels = torch.full_like(tokens, IGNORE)
    labels[:, :-1] = torch.where(target_mask[:, 1:], tokens[:, 1:], IGNORE)
    return labels


def sbd_labels(tokens: Tensor, target_mask: Tensor, noisy: Tensor, mask_token_id: int) -> Tensor:
    """labels `[B, 2n]` for [clean ; noisy]: NTP labels on the clean half; on the noisy half the
    original token at the same position where it was masked and is a target; IGNORE elsewhere."""
    matp = torch.where((noisy == mask_token_id) & target_mask, tokens, IGNORE)
    return torch.cat([ntp_labels(tokens, target_mask), matp], dim=1)


def _summed_cross_entropy(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """(sum of CE over counted positions, count) for logits `[B, T, V]` (any float dtype, CE in fp32), labels
    `[B, T]`."""
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    return loss, (labels != IGNORE).sum()


def sbd_term_sums(logits: Tensor, labels: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
    """The two terms of the SBD loss (docs/algorithm.md §2.5) of the logits `[B, 2n, V]` of `[clean ; noisy]` and
    their `sbd_labels` `[B, 2n]`: {"ntp": (CE sum, target count), "matp": (CE sum, target count)} over the clean
    and the noisy half (sums fp32 scalars, counts int64 scalars)."""
    n = labels.shape[1] // 2
    return {"ntp": _summed_cross_entropy(logits[:, :n], labels[:, :n]),
            "matp": _summed_cross_entropy(logits[:, n:], labels[:, n:])}


def sbd_objective(logits: Tensor, labels: Tensor, num_items: Tensor | int | None = None
                  ) -> tuple[Tensor, dict[str, Tensor]]:
    """SBD loss (docs/algorithm.md §2.5) of the logits `[B, 2n, V]` of `[clean ; noisy]` and their `sbd_labels`
    `[B, 2n]`: the sum of CE over the NTP targets (clean half) and MATP targets (noisy half), divided by their
    count, or by `num_items` (a count taken over more than this batch: gradient-accumulation steps, ranks).
    Returns (loss, detached per-term means)."""
    (ntp_sum, ntp_count), (matp_sum, matp_count) = sbd_term_sums(logits, labels).values()
    count = (ntp_count + matp_count).clamp(min=1) if num_items is None else num_items
    stats = {"ntp": ntp_sum.detach() / ntp_count.clamp(min=1),
             "matp": matp_sum.detach() / matp_count.clamp(min=1)}
    return (ntp_sum + matp_sum) / count, stats


def _sbd_forward(model: nn.Module, tokens: Tensor, target_mask: Tensor, block_size: int, mask_token_id: int,
                 generator: torch.Generator, attn_mask: Any = None) -> tuple[Tensor, Tensor]:
    """(logits `[B, 2n, V]`, `sbd_labels` `[B, 2n]`) of one noisy copy of tokens `[B, n]`."""
    noisy, _ = add_noise(tokens, mask_token_id, generator)
    labels = sbd_labels(tokens, target_mask, noisy, mask_token_id)
    return model(*sbd_train_inputs(tokens, noisy, block_size, attn_mask)), labels


def sbd_loss(model: nn.Module, tokens: Tensor, target_mask: Tensor, block_size: int, mask_token_id: int,
             generator: torch.Generator, attn_mask: Any = None) -> tuple[Tensor, dict[str, Tensor]]:
    """SBD loss (docs/algorithm.md §2.5): one mean of CE over NTP targets (clean half) and MATP targets (noisy
    half). model: a Transformer or a module with its forward (`hf.SbdCausalLM`). Returns (loss, detached
    per-term means)."""
    return sbd_objective(*_sbd_forward(model, tokens, target_mask, block_size, mask_token_id, generator, attn_mask))


def sbd_loss_terms(model: nn.Module, tokens: Tensor, target_mask: Tensor, block_size: int, mask_token_id: int,
                   generator: torch.Generator, attn_mask: Any = None) -> dict[str, tuple[Tensor, Tensor]]:
    """The terms (`sbd_term_sums`) of the SBD loss of one batch, unreduced: `global_mean_loss` divides them by
    the target count of every rank's batch."""
    return sbd_term_sums(*_sbd_forward(model, tokens, target_mask, block_size, mask_token_id, generator, attn_mask))


def ntp_loss_terms(model: nn.Module, tokens: Tensor, target_mask: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
    """{"ntp": (CE sum, count)} of the causal forward of tokens `[B, n]` over answer + EOS targets."""
    return {"ntp": _summed_cross_entropy(model(tokens), ntp_labels(tokens, target_mask))}


def ntp_loss(model: nn.Module, tokens: Tensor, target_mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """NTP-only loss: mean CE of the causal forward over answer + EOS targets."""
    total, count = ntp_loss_terms(model, tokens, target_mask)["ntp"]
    loss = total / count.clamp(min=1)
    return loss, {"ntp": loss.detach()}


def global_mean_loss(terms: dict[str, tuple[Tensor, Tensor]], world: int, device: torch.device
                     ) -> tuple[Tensor, dict[str, Tensor]]:
    """One mean over the targets of every data-parallel rank (docs/algorithm.md §2.5) from this rank's `terms`
    {name: (CE sum, target count)} (`sbd_loss_terms`, `ntp_loss_terms`). Returns (loss, stats):

    loss = world * sum(this rank's CE sums) / N, N = the target count summed over the ranks, so that the gradient
    averaged over the world ranks (`average_gradients`, or DDP's) is that of sum(every rank's CE sums) / N;
    stats (detached): "loss" = sum(every rank's CE sums) / N, and each term's CE sum / count over the ranks
    (NaN for a term without a target on any rank).

    One all_reduce per call of a `[2 * len(terms)]` fp64 tensor (sums, then counts: fp64 counts are exact to
    2**53) on `device` (`collective_device`); none when world == 1."""
    sums = torch.stack([total for total, _ in terms.values()])                    # [T] fp32, with grad
    counts = torch.stack([count for _, count in terms.values()])                  # [T] int64
    totals = torch.cat([sums.detach().double(), counts.double()])                 # [2T]
    if world > 1:
        reduced = totals.to(device)            # a host copy only where the backend takes CPU tensors (gloo)
        dist.all_reduce(reduced)
        totals = reduced.to(sums.device)
    global_sums, global_counts = totals.split(len(terms))
    count = global_counts.sum().clamp(min=1)
    stats = {"loss": global_sums.sum() / count,
             **{name: global_sums[i] / global_counts[i] for i, name in enumerate(terms)}}
    return sums.sum() * (world / count).to(sums.dtype), stats


def _by_dtype(tensors: list[Tensor]) -> list[list[Tensor]]:
    """`tensors` in groups of one dtype each (one flat collective per group), in first-seen order."""
    groups: dict[torch.dtype, list[Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor)
    return list(groups.values())


def _collective_in_place(tensors: list[Tensor], device: torch.device,
                         collective: Callable[[Tensor], object]) -> None:
    """Runs `collective` (a function of one tensor, in place) once on `tensors` of one dtype flattened into one
    buffer on `device` (`collective_device`), then writes the result back into each tensor."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors]).to(device)
    collective(flat)
    with torch.no_grad():
        for tensor, part in zip(tensors, flat.split([t.numel() for t in tensors])):
            tensor.copy_(part.view_as(tensor))


def broadcast_parameters(model: nn.Module, device: torch.device) -> None:
    """Every rank takes rank 0's parameters and buffers: one broadcast per dtype, on `device`
    (`collective_device`). Ranks built alike already agree; this makes sure of it before the first step."""
    for group in _by_dtype([*model.parameters(), *model.buffers()]):
        _collective_in_place(group, device, lambda flat: dist.broadcast(flat, src=0))


def average_gradients(model: nn.Module, world: int, device: torch.device) -> None:
    """grad := the mean of the ranks' gradients, for every parameter that requires one, after backward: one
    all_reduce (sum) per dtype of the gradients flattened, on `device` (`collective_device`), then / world.
    A parameter without a gradient on this rank takes zeros, so that every rank reduces the same tensors.

    Called from the training loop's thread once backward has returned, not from autograd hooks during backward
    (as DistributedDataParallel's are): a gloo collective launched inside backward keeps a Python object of the
    backward's thread-local state in its work item, and the gloo worker thread that drops the item takes the
    GIL to free it. When DDP's wrapper, the last owner of the process group, was freed (train's return) before
    that thread had, the group's destructor joined the thread while holding the GIL: a deadlock (a loop of 3
    gloo training steps and return, 3 copies beside each other on 2 cores, hung in 4 of 6 runs within 100
    iterations; with the collectives launched from this thread, none of 6 runs of 400 iterations hung). Costs
    the overlap of the reduction with backward that DDP gives: one all_reduce of every gradient after it."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)

    def mean_over_ranks(flat: Tensor) -> None:
        dist.all_reduce(flat)
        flat.div_(world)

    for group in _by_dtype([p.grad for p in params]):
        _collective_in_place(group, device, mean_over_ranks)


def flex_block_mask(n: int, block_size: int, device: torch.device) -> Any:
    """The mask of docs/algorithm.md §2.4 as a FlexAttention BlockMask over 2n positions (GPU training)."""
    from torch.nn.attention.flex_attention import create_block_mask

    # k as a tensor, not a Python int: the compiled kernel then serves every k of U{2..16} instead of
    # recompiling once per value.
    mask_mod = SbdMaskMod(n, torch.tensor(block_size, device=device))
    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=2 * n, KV_LEN=2 * n, device=device)


# ---------------------------------------------------------------- schedule

def lr_at(step: int, cfg: TrainConfig, time_fraction: float = 0.0, warmup_fraction: float = 0.0) -> float:
    """Linear warm-up over warmup_steps, then cosine from lr down to lr * min_lr_ratio at cfg.steps, or when
    time_fraction, the share of max_minutes used, reaches 1, if that comes first.

    The cosine's progress is the larger of (step - warmup_steps) / (steps - warmup_steps) and
    (time_fraction - warmup_fraction) / (1 - warmup_fraction), the share of the time left after the warm-up
    that has been used, where warmup_fraction is the share used when the warm-up ended (`warmup_share`). Both
    are 0 at the first step after the warm-up, so the rate goes on from lr there; a cosine placed by
    time_fraction alone started at cos(pi * warmup_fraction), 19% below lr after a warm-up of 30% of the time."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    step_progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    time_progress = (time_fraction - warmup_fraction) / (1.0 - warmup_fraction) if warmup_fraction < 1.0 else 1.0
    progress = min(1.0, max(step_progress, time_progress))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


# ---------------------------------------------------------------- evaluation

@torch.no_grad()
def greedy_ntp_answers(model: Transformer, prompts: Tensor, answer_tokens: int) -> Tensor:
    """Greedy NTP continuation without a cache: prompts `[B, P]` -> `[B, answer_tokens]` int64."""
    seq = prompts
    for _ in range(answer_tokens):
        nxt = model(seq)[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    return seq[:, prompts.shape[1]:]


@torch.no_grad()
def evaluate(model: Transformer, tasks: list[str], count: int, seed: int = 0, block_size: int = 16
             ) -> dict[str, float | int]:
    """Held-out metrics per task: NTP loss, greedy NTP exact match (no cache), and MATP loss / token
    accuracy at masked answer positions (eta ~ U(0,1) from a fixed seed, k = block_size) with their count,
    `<task>/matp_targets`. Without a masked answer position both MATP numbers are NaN (a mean over nothing)."""
    model.eval()
    device = next(model.parameters()).device
    mask_id = model.config.mask_token_id
    out: dict[str, float | int] = {}
    for name in tasks:
        task, examples = get_task(name), make_examples(name, "held_out", count, seed)
        length = task.prompt_tokens + task.answer_tokens
        tokens, target_mask = (t.to(device) for t in collate(examples, length))
        out[f"{name}/ntp_loss"] = float(ntp_loss(model, tokens, target_mask)[0])
        gen = torch.Generator(device=device).manual_seed(seed)
        noisy, _ = add_noise(tokens, mask_id, gen)
        labels = sbd_labels(tokens, target_mask, noisy, mask_id)[:, tokens.shape[1]:]
        logits = model.sbd_train_forward(tokens, noisy, block_size)[:, tokens.shape[1]:]
        matp_sum, matp_count = _summed_cross_entropy(logits, labels)
        counted = labels != IGNORE
        # A few held-out examples at small eta can mask no answer position: both MATP numbers are then NaN
        # (a loss of 0 would read as a perfect score), and matp_targets says why.
        matp_hits = (logits.argmax(-1) == labels)[counted]
        out[f"{name}/matp_loss"] = float(matp_sum / matp_count) if matp_count else math.nan
        out[f"{name}/matp_acc"] = float(matp_hits.float().mean()) if matp_count else math.nan
        out[f"{name}/matp_targets"] = int(matp_count)
        answers = greedy_ntp_answers(model, tokens[:, : task.prompt_tokens], task.answer_tokens)
        hits = [exact_match(pred, TOKENIZER.encode_answer(ex.answer)) for pred, ex in zip(answers, examples)]
        out[f"{name}/ntp_exact_match"] = sum(hits) / len(hits)
    model.train()
    return out


# ---------------------------------------------------------------- distributed set-up

def launched_world_size() -> int:
    """The number of processes torchrun started (WORLD_SIZE), 1 without torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def training_device(requested: str, world: int, local_rank: int) -> torch.device:
    """The device this process trains on: `requested` (cfg.device), but under torchrun (world > 1) a CUDA request
    becomes cuda:<local_rank> whatever index it named, one GPU per rank. A CUDA request without an index is
    cuda:0 (`torch.cuda.set_device` needs one)."""
    device = torch.device(requested)
    if device.type != "cuda":
        return device
    return torch.device("cuda", local_rank if world > 1 else device.index or 0)


def init_distributed(device: torch.device) -> tuple[int, int]:
    """(rank, world size); joins the torchrun process group when WORLD_SIZE > 1."""
    world = launched_world_size()
    if world == 1:
        return 0, 1
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), world


def collective_device(backend: str, device: torch.device) -> torch.device:
    """Where the tensors of a collective on a process group of `backend` (torch.distributed's name: "gloo",
    "nccl") must live: the CPU when the backend takes CPU tensors (gloo), else the training device `device`
    (nccl takes CUDA tensors only and refuses CPU ones)."""
    if "cpu" in dist.Backend.backend_capability.get(backend, ()):
        return torch.device("cpu")
    return device


class Progress:
    """One-line progress: a bar with step, loss terms, lr and tokens/s; redrawn in place on a terminal,
    one line per `every` steps otherwise (log files)."""

    def __init__(self, total: int, start: int, every: int, enabled: bool):
        self.total, self.every, self.enabled = total, every, enabled
        self.tty = sys.stderr.isatty()
        self.t0, self.step0 = time.time(), start

    def update(self, step: int, tokens_per_step: int, values: dict[str, float | Tensor]) -> None:
        """values: numbers or 0-d tensors, read (a host sync for a GPU tensor) only when a line is printed."""
        done = step + 1
        if not self.enabled or (not self.tty and done % self.every and done != self.total):
            return
        elapsed = time.time() - self.t0
        rate = (done - self.step0) / max(elapsed, 1e-9)
        filled = int(30 * done / self.total)
        terms = " ".join(f"{k} {float(v):.4g}" for k, v in values.items())
        eta_s = (self.total - done) / max(rate, 1e-9)
        line = (f"[{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total} {terms} "
                f"tok/s {rate * tokens_per_step:,.0f} elapsed {elapsed / 60:.1f}m eta {eta_s / 60:.1f}m")
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- training loop

def _format_eval(result: dict[str, float]) -> str:
    return " ".join(f"{k} {v}" if isinstance(v, int) else f"{k} {v:.4f}" for k, v in result.items())


def _log(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, file=sys.stderr, flush=True)


def _build_model(cfg: TrainConfig, device: torch.device, resumed: dict[str, Any] | None
                 ) -> tuple[Transformer, TrainConfig]:
    """(model in training mode on device, cfg): the preset's model with fresh weights, or the checkpoint
    cfg.init_from, whose shape decides the preset that cfg (and so the checkpoint's train_config) records.
    `resumed`: the TrainConfig (as a dict) of the run whose training state will be loaded, or None. A resumed
    run started from cfg.init_from does not read that file (the state holds its weights; the file may be gone):
    it takes the preset its run recorded, the init file's."""
    if cfg.init_from and resumed is None:
        model, _ = load_checkpoint(cfg.init_from)
        return model.to(device).train(), dataclasses.replace(cfg, preset=_preset_of(model.config, cfg.init_from))
    if cfg.init_from:
        cfg = dataclasses.replace(cfg, preset=resumed.get("preset", cfg.preset))
    torch.manual_seed(cfg.seed)
    return Transformer(ModelConfig.preset(cfg.preset)).to(device).train(), cfg


def _preset_of(config: ModelConfig, path: str) -> str:
    """The name of the preset whose config is `config` (that of the checkpoint `path`); ValueError naming the
    file when it is none of them (a train_config must name the preset it trained)."""
    for name in PRESETS:
        if ModelConfig.preset(name) == config:
            return name
    raise ValueError(f"--init-from {path}: its model config is none of the presets ({', '.join(PRESETS)}): "
                     f"{dataclasses.asdict(config)}")


def _optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    # No weight decay on norms (1-d parameters), as in nanoGPT / Llama.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def _save(model: Transformer, opt: torch.optim.Optimizer, cfg: TrainConfig, step: int, seconds: float,
          history: list[dict[str, Any]], warmup_seconds: float | None) -> None:
    meta = {"train_config": dataclasses.asdict(cfg), "steps_done": step, "train_seconds": round(seconds, 1),
            "eval": history, "torch": str(torch.__version__)}
    save_checkpoint(model, cfg.out, **meta)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                "seconds": seconds, "eval": history, "config": dataclasses.asdict(cfg),
                "warmup_seconds": warmup_seconds}, f"{cfg.out}.state.tmp")
    os.replace(f"{cfg.out}.state.tmp", f"{cfg.out}.state")


def time_share(t0: float, seconds_before: float, max_minutes: float, world: int, device: torch.device) -> float:
    """The share of max_minutes the run has used: seconds_before (trained before a resume) plus the time since
    t0, on rank 0's clock for every rank (a broadcast on `device`, see `collective_device`), so that all ranks
    stop at the same step (share >= 1) and set the same learning rate from it (`lr_at`)."""
    share = torch.tensor([(seconds_before + time.time() - t0) / (60 * max_minutes)], dtype=torch.float64,
                         device=device)
    if world > 1:
        dist.broadcast(share, src=0)
    return float(share)


def warmup_share(warmup_seconds: float | None, max_minutes: float) -> float:
    """The share of max_minutes that the warm-up used (`lr_at`'s warmup_fraction), from the seconds trained when
    it ended, kept in seconds because a resume may change max_minutes. 0 without a time budget, before the
    warm-up has ended, and for a training state that does not record it (one written before it was recorded:
    its run placed the cosine from 0, and goes on so)."""
    if max_minutes <= 0 or warmup_seconds is None:
        return 0.0
    return warmup_seconds / (60 * max_minutes)


# A training state also holds "warmup_seconds" (`warmup_share`), absent from the states written before it was.
RESUME_KEYS = ("model", "optimizer", "step", "seconds", "eval", "config")

# The TrainConfig fields a resumed run may change: its budgets (steps, max_minutes; the cosine then runs over the
# new budget), evaluation, logging and files, and where and how the same computation runs (threads, device,
# attention). Every other field decides what is trained (model, data, objective, optimiser and schedule): a
# resume that changed one would continue another run than the one the checkpoint's train_config describes.
RESUME_MAY_CHANGE = frozenset({"steps", "max_minutes", "eval_every", "eval_examples", "checkpoint_every",
                               "log_every", "out", "resume", "threads", "device", "attention"})


def check_resume_config(path: str, saved: dict[str, Any], step: int, cfg: TrainConfig) -> None:
    """ValueError when cfg cannot continue the run whose training state `path` holds `saved` (its TrainConfig as a
    dict) at `step`: a field outside RESUME_MAY_CHANGE with another value than the run's, or fewer steps than
    the run has done. The message names the field, the run's value and the new one."""
    for name, value in dataclasses.asdict(cfg).items():
        if name not in RESUME_MAY_CHANGE and saved.get(name) != value:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{path}: {flag} {value!r} contradicts the run being resumed, which was started with "
                             f"{flag} {saved.get(name)!r}; resume with its value, or start again with --overwrite")
    if step > cfg.steps:
        raise ValueError(f"{path}: --steps {cfg.steps} is below the {step} steps the run being resumed has done; "
                         f"pass --steps {step} or more")


def resume_path(cfg: TrainConfig) -> str | None:
    """The training state a run of cfg continues from: <out>.state when cfg.resume and it exists, else None (a
    fresh start)."""
    path = f"{cfg.out}.state"
    return path if cfg.resume and os.path.exists(path) else None


def _resume_state(path: str, state: dict[str, Any], model: Transformer, opt: torch.optim.Optimizer,
                  cfg: TrainConfig) -> tuple[int, float, list, float | None]:
    """Loads the training `state` read from `path` (`read_training_state`; written beside a checkpoint by
    `train`) into model and opt; returns (step, seconds trained, eval history, seconds trained when the warm-up
    ended or None). Raises CheckpointError naming the file when it holds the weights or optimizer of another
    model; ValueError when cfg contradicts the run (`check_resume_config`)."""
    check_resume_config(path, state["config"], state["step"], cfg)
    try:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as err:
        raise CheckpointError(f"{path}: the training state of another model ({_first_line(err)}); resume "
                              "with the run's own config, or start again with --overwrite") from err
    return state["step"], state["seconds"], state["eval"], state.get("warmup_seconds")


def _why_complete(cfg: TrainConfig, step: int, used: float) -> str:
    """The message of a resumed run that has no step left at `step`: which budget is spent (`used`: the share
    of max_minutes used, on rank 0's clock), and which flag to raise."""
    if step >= cfg.steps:
        return (f"the run is complete ({step} of --steps {cfg.steps} done); nothing to train: raise --steps to "
                "continue")
    return (f"the run is complete ({used * cfg.max_minutes:.1f} of --max-minutes {cfg.max_minutes} used); nothing "
            "to train: raise --max-minutes to continue")


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def train(cfg: TrainConfig) -> Transformer:
    """Runs the whole training described by cfg; returns the trained model (rank 0 writes cfg.out)."""
    # config
    if cfg.objective not in ("sbd", "ntp"):
        raise ValueError(f"train: objective must be 'sbd' or 'ntp', got {cfg.objective!r}")
    if cfg.attention not in ("auto", "sdpa", "flex"):
        raise ValueError(f"train: attention must be 'auto', 'sdpa' or 'flex', got {cfg.attention!r}")
    if not 1 <= cfg.block_min <= cfg.block_max:
        raise ValueError(f"train: need 1 <= block_min <= block_max, got {cfg.block_min}, {cfg.block_max}")
    torch.set_num_threads(cfg.threads)
    device = training_device(cfg.device, launched_world_size(), int(os.environ.get("LOCAL_RANK", "0")))
    rank, world = init_distributed(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    sync_device = collective_device(dist.get_backend(), device) if world > 1 else torch.device("cpu")

    # data
    tasks = cfg.task_list()
    n = sequence_length(tasks)

    # model (CheckpointError naming the file when a training state is damaged or is none: RESUME_KEYS)
    state_path = resume_path(cfg)
    state = read_training_state(state_path, RESUME_KEYS, "sbd train") if state_path else None
    model, cfg = _build_model(cfg, device, state["config"] if state else None)
    mask_id = model.config.mask_token_id
    opt = _optimizer(model, cfg)
    start, seconds_before, history, warmup_seconds = 0, 0.0, [], None
    if state is not None:
        start, seconds_before, history, warmup_seconds = _resume_state(state_path, state, model, opt, cfg)
        del state  # its copy of the weights and of the optimizer's moments, loaded into model and opt
        _log(rank, f"resumed from {state_path} at step {start}")
    if world > 1:
        broadcast_parameters(model, sync_device)
    _log(rank, f"model {cfg.preset if not cfg.init_from else cfg.init_from}: {model.num_parameters():,} "
               f"parameters; objective {cfg.objective}; tasks {tasks}; n = {n}; world {world}")

    # loop: (eval + checkpoint), batch, loss, step, log
    tokens_per_step = cfg.batch_size * n * world * (2 if cfg.objective == "sbd" else 1)
    progress = Progress(cfg.steps, start, cfg.log_every, rank == 0)
    flex_masks: dict[int, Any] = {}
    use_flex = cfg.attention == "flex" or (cfg.attention == "auto" and device.type == "cuda")
    t0 = time.time()
    step, used = start, 0.0
    for step in range(start, cfg.steps):
        if cfg.max_minutes > 0:
            used = time_share(t0, seconds_before, cfg.max_minutes, world, sync_device)
            if used >= 1.0:
                break
        if step == cfg.warmup_steps and warmup_seconds is None:
            # Under a time budget, rank 0's clock (`used`), so that every rank places the cosine alike.
            warmup_seconds = (used * 60 * cfg.max_minutes if cfg.max_minutes > 0
                              else seconds_before + time.time() - t0)
        if rank == 0 and step > start and step % cfg.eval_every == 0:
            history.append({"step": step, **evaluate(model, tasks, cfg.eval_examples, cfg.seed)})
            _log(rank, "eval " + _format_eval(history[-1]))
        if rank == 0 and step > start and step % cfg.checkpoint_every == 0:
            _save(model, opt, cfg, step, seconds_before + time.time() - t0, history, warmup_seconds)

        data_seed = zlib.crc32(f"data/{cfg.seed}/{rank}/{step}".encode())
        examples = TrainStream(tasks, data_seed).next_batch(cfg.batch_size)
        tokens, target_mask = (t.to(device) for t in collate(examples, n))
        if cfg.objective == "sbd":
            k = block_size_for_step(step, cfg)
            gen = torch.Generator(device=device).manual_seed(data_seed)
            attn_mask = None
            if use_flex:
                if k not in flex_masks:
                    flex_masks[k] = flex_block_mask(n, k, device)
                attn_mask = flex_masks[k]
            terms = sbd_loss_terms(model, tokens, target_mask, k, mask_id, gen, attn_mask)
        else:
            terms = ntp_loss_terms(model, tokens, target_mask)
        loss, stats = global_mean_loss(terms, world, sync_device)

        lr = lr_at(step, cfg, used, warmup_share(warmup_seconds, cfg.max_minutes))
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if world > 1:
            average_gradients(model, world, sync_device)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        progress.update(step, tokens_per_step, {**stats, "lr": lr})
    else:
        step = cfg.steps
    if step == start > 0:
        # A resume with no step left: the checkpoint and its state stay as they are (no second final evaluation).
        _log(rank, f"{cfg.out}.state: {_why_complete(cfg, start, used)}")
    elif rank == 0:
        history.append({"step": step, **evaluate(model, tasks, cfg.eval_examples, cfg.seed)})
        _log(rank, "\nfinal eval " + _format_eval(history[-1]))
        _save(model, opt, cfg, step, seconds_before + time.time() - t0, history, warmup_seconds)
    if world > 1:
        dist.destroy_process_group()
    return model


# ---------------------------------------------------------------- command line

def _init_file(text: str) -> str:
    """--init-from's type: a file name, or "" for none. Whether the file must exist depends on --resume, so
    `check_init_from` checks it after the parse."""
    return text


# What each flag (and TrainConfig field) accepts: add_argument keywords. The types also check TrainConfig
# values, but for the files (_FILE_TYPES), which are checked when they are read or written.
FLAG_TYPES: dict[str, dict[str, Any]] = {
    "preset": {"choices": tuple(PRESETS)},
    "tasks": {"type": argtypes.choice_list(TASKS)},
    "objective": {"choices": ("sbd", "ntp")},
    "steps": {"type": argtypes.positive_int},
    "max_minutes": {"type": argtypes.non_negative_float},
    "batch_size": {"type": argtypes.positive_int},
    "lr": {"type": argtypes.non_negative_float},
    "min_lr_ratio": {"type": argtypes.fraction},
    "warmup_steps": {"type": argtypes.non_negative_int},
    "weight_decay": {"type": argtypes.non_negative_float},
    "grad_clip": {"type": argtypes.positive_float},
    "block_min": {"type": argtypes.positive_int},
    "block_max": {"type": argtypes.positive_int},
    "eval_every": {"type": argtypes.positive_int},
    "eval_examples": {"type": argtypes.positive_int},
    "checkpoint_every": {"type": argtypes.positive_int},
    "log_every": {"type": argtypes.positive_int},
    "out": {"type": argtypes.output_file},
    "init_from": {"type": _init_file},
    "resume": {"action": argparse.BooleanOptionalAction,
               "help": "continue from <out>.state (weights, optimizer, step, time used) if it exists; only "
                       "the budgets, evaluation, logging, file and device flags may differ from the run's"},
    "seed": {"type": argtypes.seed},
    "threads": {"type": argtypes.positive_int},
    "device": {"type": argtypes.device},
    "attention": {"choices": ("auto", "sdpa", "flex")},
}
_FILE_TYPES = (argtypes.output_file, _init_file)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """One flag per TrainConfig field, typed by FLAG_TYPES, with its default (`batch_size`: `--batch-size`,
    and the field's own spelling as a hidden alias); and --overwrite."""
    for field in dataclasses.fields(TrainConfig):
        kwargs = {"help": f"default: {field.default!r}", **FLAG_TYPES[field.name]}
        add_option(parser, "--" + field.name.replace("_", "-"), default=field.default, **kwargs)
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --out file (without it, only --resume of its own run may)")
    return parser


def main(args: argparse.Namespace) -> None:
    """`sbd train`: the flags checked together (UsageError), then the training."""
    if args.block_min > args.block_max:
        raise UsageError(f"--block-min ({args.block_min}) must be <= --block-max ({args.block_max})")
    if args.attention == "flex" and torch.device(args.device).type != "cuda":
        raise UsageError(f"--attention flex runs on --device cuda only, not --device {args.device}: use "
                         "--attention sdpa (or auto)")
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    check_out(cfg, args.overwrite)
    check_init_from(cfg)
    argtypes.require_device(cfg.device)
    train(cfg)
    if launched_world_size() > 1:
        exit_rank_without_finalization()


def exit_rank_without_finalization() -> NoReturn:
    """Ends a torchrun rank whose training finished (checkpoint written, process group destroyed) with
    os._exit(0), its output flushed, skipping the interpreter's finalization.

    torch 2.13 aborts a gloo rank there now and then (SIGABRT, "terminate called without an active
    exception"; torchrun then reports the run failed after it wrote its checkpoint). The backward pass keeps a
    Python object in thread-local state (`_engine_run_backward` stashes a contextvars.Context), each
    allreduce DDP starts from the backward captures that state in gloo's AsyncWork, and a gloo worker thread
    drops the last AsyncWork after DDP's wait has returned. When the main thread is already in Py_FinalizeEx,
    that decref's GIL acquire ends the worker thread (PyThread_exit_thread), whose unwinding through the
    AsyncWork destructor calls std::terminate. destroy_process_group does not stop those threads: the
    process group outlives it once DDP has wrapped a module. A barrier before it still let ranks abort.
    A 20-line DDP script (2 gloo ranks, 3 steps, on 2 cores, mostly beside another such run) aborted in 5 of
    324 runs, every core dump with this stack (rank 0 or 1); ending with this exit, in none of 390. The same
    work item deadlocks a rank that frees DDP's wrapper before finalization (`average_gradients`): keep the
    wrapper alive until this exit. `train` launches no collective inside backward; its ranks end so all the same.

    Raises RuntimeError while a default process group is still initialized: destroy it first, so that the
    other ranks are not left waiting on this one."""
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("exit_rank_without_finalization: the process group is still initialized; call "
                           "torch.distributed.destroy_process_group() first")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def check_out(cfg: TrainConfig, overwrite: bool) -> None:
    """UsageError when cfg.out names an existing file and neither overwrite nor cfg.resume with the
    <out>.state of its run is given: a typo must not replace a bundled checkpoint or a day of training."""
    if overwrite or not os.path.exists(cfg.out):
        return
    if resume_path(cfg):
        return
    hint = f"--resume found no {cfg.out}.state to continue from; " if cfg.resume else ""
    raise UsageError(f"--out {cfg.out} exists: {hint}pass --overwrite to replace it")


def check_init_from(cfg: TrainConfig) -> None:
    """UsageError, worded as argparse's, when cfg.init_from names no readable file and the run reads it: a
    fresh start. A resume takes its weights from <out>.state (`resume_path`) and does not need the file."""
    if not cfg.init_from or resume_path(cfg):
        return
    try:
        argtypes.existing_file(cfg.init_from)
    except argparse.ArgumentTypeError as err:
        raise UsageError(f"argument --init-from: {err}") from None


if __name__ == "__main__":
    from sbd_kernels import cli

    cli.main(["train", *sys.argv[1:]])
