"""SBD fine-tuning of Hugging Face models: the training mask in each attention implementation's form, a data
collator that builds the SBD objective's inputs and labels, and a loss for `Trainer(compute_loss_func=...)`.

The objective is the one of `sbd_kernels.train` (docs: `sbd_kernels.train.sbd_loss`), built from the same
functions (`add_noise`, `sbd_labels`, `sbd_train_inputs`, `SbdMaskMod`, `sbd_objective`): per batch one block size
k ~ U{block_min..block_max}; per sequence a mask rate eta ~ U(0, 1); input `[clean ; noisy]` with repeated
position ids; labels aligned with the logits (NTP labels shifted on the clean half, masked tokens unshifted on
the noisy half); one mean over every counted target of both halves.

Training blocks are aligned at position 0 of each sequence (0, k, 2k, ...), while decoding aligns blocks at the
end of the prompt. Both are the SBD recipe: what the model learns is to fill a block given everything before it,
and position ids carry where the block is.

Batch layout from `SbdDataCollator` (n = the longest real sequence of the batch, padded on the right):
    input_ids     [B, 2n] int64      [clean ; noisy]
    position_ids  [B, 2n] int64      [0..n-1 ; 0..n-1]
    attention_mask                   [B, 1, 2n, 2n] bool (sdpa), additive (eager; in the config's dtype) or an
                                     SbdBlockMask (flex_attention); for a model with sliding-window layers the
                                     windowed form, alone or in {"full_attention": .., "sliding_attention": ..}
    labels, shift_labels [B, 2n] int64   aligned with the logits, -100 where not counted
HF's causal-LM loss uses `shift_labels` as given, so `model(**batch).loss` is the SBD loss too; with
`compute_loss_func=sbd_loss_func` the Trainer uses this module's loss.
"""
from __future__ import annotations

import copy
import hashlib
import os
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from sbd_kernels.hf.attention import mask_implementation
from sbd_kernels.hf.model import mask_for_implementation
from sbd_kernels.hf.window import mask_by_layer_type
from sbd_kernels.model import SbdMaskMod, sbd_train_inputs
from sbd_kernels.train import IGNORE, add_noise, sbd_labels, sbd_objective


class SbdBlockMask(BlockMask):
    """A FlexAttention BlockMask whose `to(device)` moves the tensors its `SbdMaskMod` reads (k, the sequence
    lengths) along with its block tensors: HF Trainer / accelerate move a batch with `.to(device)`, and
    `BlockMask.to` alone would leave the mask_mod indexing CPU tensors inside a CUDA kernel."""

    mask_mod: SbdMaskMod

    @classmethod
    def of(cls, block_mask: BlockMask) -> SbdBlockMask:
        """The same mask as an SbdBlockMask (its attributes copied: BlockMask's constructor arguments change
        between torch versions, its attributes are what `flex_attention` reads)."""
        if not isinstance(block_mask.mask_mod, SbdMaskMod):
            raise TypeError(f"SbdBlockMask: the mask_mod must be an SbdMaskMod, got {block_mask.mask_mod!r}")
        movable = cls.__new__(cls)
        movable.__dict__.update(vars(block_mask))
        return movable

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SbdBlockMask:
        moved = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, Tensor):
                setattr(moved, name, value.to(device, non_blocking=non_blocking))
        moved.mask_mod = self.mask_mod.to(device, non_blocking=non_blocking)
        return moved


def sbd_training_mask(lengths: Tensor, n: int, block_size: int, implementation: str,
                      dtype: torch.dtype = torch.float32, window: int | None = None) -> Any:
    """The SBD training mask of a right-padded batch (`lengths [B]` real tokens of each sequence, n its padded
    length) in the form `implementation` reads: bool `[B, 1, 2n, 2n]` ("sdpa"), additive in `dtype` ("eager"), or
    an `SbdBlockMask` ("flex_attention"), on the device of `lengths`. One predicate, `SbdMaskMod`, gives all three:
    `sbd_mask_allows` restricted to keys of real tokens, and with a window W (a sliding-window layer's mask) to keys
    fewer than W positions behind the query. ValueError naming the argument unless 1 <= lengths <= n,
    block_size >= 1 and window is None or >= 1."""
    _check_mask_arguments(lengths, n, block_size)
    if window is not None and window < 1:
        raise ValueError(f"sbd_training_mask: window must be None or >= 1, got {window}")
    # SbdMaskMod holds n and k as 0-d tensors on the device of lengths: the compiled FlexAttention kernel reads them
    # anew at each batch, so batches of another padded length or block size get their own mask.
    mask_mod = SbdMaskMod(n, block_size, lengths, window=window)
    if implementation == "flex_attention":
        return SbdBlockMask.of(create_block_mask(mask_mod, B=lengths.shape[0], H=None, Q_LEN=2 * n, KV_LEN=2 * n,
                                                 device=lengths.device))
    return mask_for_implementation(mask_mod.dense(), implementation, dtype)


def _check_mask_arguments(lengths: Tensor, n: int, block_size: int) -> None:
    """ValueError naming the argument of `sbd_training_mask` out of range: lengths not `[B]` or outside [1, n] (a
    length of 0 leaves rows with no key to attend, NaN under sdpa; one above n reads keys that are not there),
    n or block_size below 1.

    The range of lengths is a check on tensor values: free for lengths on the CPU (the collator's), one host sync
    for lengths on a GPU, once per mask built, small next to the training step the mask serves; kept there too,
    because a wrong length gives a wrong loss or NaN without an error."""
    if n < 1:
        raise ValueError(f"sbd_training_mask: n must be >= 1, got {n}")
    if block_size < 1:
        raise ValueError(f"sbd_training_mask: block_size must be >= 1, got {block_size}")
    if lengths.dim() != 1:
        raise ValueError(f"sbd_training_mask: lengths must be [B], got shape {tuple(lengths.shape)}")
    if bool(((lengths < 1) | (lengths > n)).any()):
        raise ValueError(f"sbd_training_mask: lengths must be in [1, n] = [1, {n}], got {lengths.tolist()}")


def _block_size_at(seed: int, batch_index: int, block_min: int, block_max: int) -> int:
    """k ~ U{block_min..block_max} for batch `batch_index` of the data loader: the same on every data-parallel rank
    (ranks draw their batches in lockstep), independent of the data."""
    rng = torch.Generator().manual_seed(zlib.crc32(f"sbd-k/{seed}/{batch_index}".encode()))
    return int(torch.randint(block_min, block_max + 1, (1,), generator=rng))


def _noise_generator(seed: int, rank: int, worker_seed: int | None, batch_index: int) -> torch.Generator:
    """The generator of one batch's noise, seeded from every coordinate that tells batches apart: the collator's
    seed, the rank, the DataLoader worker's seed (None in the main process) and the batch's index in that process.
    A 64-bit hash, so that seeds of distinct batches do not collide over a long training."""
    key = f"sbd-noise/{seed}/{rank}/{worker_seed}/{batch_index}".encode()
    return torch.Generator().manual_seed(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little"))


def _worker() -> tuple[int, int, int | None]:
    """(worker id, number of workers, worker seed) of the DataLoader worker this runs in; (0, 1, None) in the main
    process. torch seeds each worker with the loader's base seed, drawn anew for every epoch's workers, plus its
    id."""
    info = torch.utils.data.get_worker_info()
    return (0, 1, None) if info is None else (info.id, info.num_workers, info.seed)


def _default_rank() -> int:
    """This process's data-parallel rank: torch.distributed's when a process group is initialized, else the RANK
    variable torchrun / accelerate set (DataLoader workers started with "spawn" see no process group), else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _config_dtype(config: Any) -> torch.dtype:
    """The dtype `config` records (`from_pretrained(..., dtype=...)`), fp32 when it records none."""
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _real_span(example: dict[str, Any], length: int) -> slice:
    """Where an example's real tokens are: all `length` of input_ids, or the 1s of its `attention_mask` (the
    padding, 0s at either end, is left out). ValueError naming attention_mask when it has another length than
    input_ids, no 1, or 0s between 1s (one sequence per example: packed examples are not supported)."""
    if example.get("attention_mask") is None:
        return slice(0, length)
    mask = torch.as_tensor(example["attention_mask"])
    if mask.shape != (length,):
        raise ValueError(f"SbdDataCollator: attention_mask must have the shape of input_ids ({length},), got "
                         f"{tuple(mask.shape)}")
    real = mask.nonzero().flatten().tolist()
    if not real:
        raise ValueError("SbdDataCollator: attention_mask is all 0 (an example without a real token)")
    if len(real) != real[-1] + 1 - real[0]:
        holes = sorted(set(range(real[0], real[-1] + 1)) - set(real))
        raise ValueError(f"SbdDataCollator: attention_mask has 0s between real tokens (at {holes}); only padding at "
                         "either end is supported, one sequence per example")
    return slice(real[0], real[-1] + 1)


@dataclass
class SbdDataCollator:
    """Turns tokenized examples into SBD training batches for an HF model prepared by `enable_sbd`.

    Each example is a dict with `input_ids` (list or 1-D tensor), optionally `attention_mask` (padding to strip:
    0s at either end) and the targets, all of the same length: `labels` in HF's causal-LM convention (-100 where a
    token is not a target, e.g. the prompt of chat / instruction data, the token id where it is) or `loss_mask`
    (1 = target). Without either, every real token but the first is a target. The noise is applied to every real
    token, prompts included; only targets are counted in the loss. Under HF Trainer, give `labels`: its default
    `remove_unused_columns=True` keeps `labels` and `attention_mask` but drops a `loss_mask` column before the
    collator sees it, which then trains on the prompts (the collator cannot tell those examples from unlabelled ones).
    A real token equal to the SBD mask token id is refused (ValueError naming the example and the position): the
    objective takes every mask token of the noisy half for one the noise put there. For a model with sliding-window
    layers, the windowed layers get the training mask with the window applied (`mask_by_layer_type`): a batch's
    attention_mask is then a dict keyed by layer type, or the windowed mask alone where every layer is windowed.

    model_config: `model.config` after `enable_sbd` (mask id, base attention implementation, recorded dtype): the
    model's own config object, from which each batch reads the attention implementation the model runs; one other
    than "sbd" or the recorded base is refused (call `enable_sbd` again after switching or reloading the model).
    block_min, block_max: the range of the per-batch block size (SBD recipe: 2..16).
    seed: seeds the block size and the noise. Each batch's block size follows from the seed and the batch's index
    in the data loader (equal on every rank), its noise from the seed, `rank`, the DataLoader worker's seed (a
    fresh one per worker and epoch, drawn from torch's RNG: seed it, or the Trainer does) and the batch's index in
    that worker: no two ranks, workers or batches draw the same noise. Called outside DataLoader workers, the
    batches follow from the seed and the rank alone.
    rank: the data-parallel rank (default: `torch.distributed`'s when a process group is initialized, else the RANK
    environment variable, else 0).
    pad_to_multiple_of: pads n up to a multiple, an int >= 1 (e.g. 8 for tensor cores; 128 for FlexAttention
    blocks).
    dtype: of the additive mask of eager attention (default: the dtype `model_config` records, fp32 when none;
    HF's eager masks are in the model's dtype too, and one in another dtype is exact, promoted on addition).
    """

    model_config: Any
    block_min: int = 2
    block_max: int = 16
    seed: int = 0
    rank: int | None = None
    pad_to_multiple_of: int = 1
    dtype: torch.dtype | None = None
    _batches: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        # Checked here, not where n is rounded up: 0 divided by zero there, and a negative multiple gave a tensor
        # size error or (-1) no error. bool is an int to Python, but True is no multiple anyone means.
        multiple = self.pad_to_multiple_of
        if not isinstance(multiple, int) or isinstance(multiple, bool) or multiple < 1:
            raise ValueError(f"SbdDataCollator: pad_to_multiple_of must be an int >= 1, got {multiple!r}")
        if not 1 <= self.block_min <= self.block_max:
            raise ValueError(f"SbdDataCollator: need 1 <= block_min <= block_max, got {self.block_min}, "
                             f"{self.block_max}")
        self.mask_token_id = getattr(self.model_config, "sbd_mask_token_id", None)
        if self.mask_token_id is None:
            raise ValueError("SbdDataCollator: the config has no sbd_mask_token_id; run enable_sbd(model, ...) first")
        # Refused here already when the model runs another attention than the recorded one or adds the router
        # loss, and again per batch.
        _checked_mask_implementation(self.model_config)
        self.pad_token_id = getattr(self.model_config, "pad_token_id", None) or 0
        if self.dtype is None:
            self.dtype = _config_dtype(self.model_config)

    @property
    def implementation(self) -> str:
        """The attention implementation the training mask is built for, read from the config at every batch: the
        model may have been switched (`set_attn_implementation`) since the collator was made, and a mask of the
        wrong form is misread without an error (`sbd_kernels.hf.attention.mask_implementation` refuses). Also
        refuses a mixture-of-experts config set to add its router loss (`_checked_mask_implementation`)."""
        return _checked_mask_implementation(self.model_config)

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        tokens, targets, lengths = self._pad(examples)
        worker, workers, worker_seed = _worker()
        rank = _default_rank() if self.rank is None else self.rank
        # Workers take the loader's batches in turns: batch i of worker w is batch i * workers + w of the loader.
        k = _block_size_at(self.seed, self._batches * workers + worker, self.block_min, self.block_max)
        noisy, _ = add_noise(tokens, self.mask_token_id, _noise_generator(self.seed, rank, worker_seed, self._batches))
        self._batches += 1
        labels = sbd_labels(tokens, targets, noisy, self.mask_token_id)                   # [B, 2n]
        implementation = self.implementation
        mask = mask_by_layer_type(self.model_config, lambda window: sbd_training_mask(
            lengths, tokens.shape[1], k, implementation, self.dtype, window))
        input_ids, position_ids, attention_mask = sbd_train_inputs(tokens, noisy, k, mask)
        batch = {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": attention_mask,
                 "labels": labels, "shift_labels": labels}
        # Every tensor contiguous: position_ids is one row expanded over the batch (stride 0), which a DataLoader
        # with pin_memory=True (Trainer's default on a GPU) refuses ("more than one element of the written-to
        # tensor refers to a single memory location"); also the masks of a dict by layer type.
        return _contiguous(batch)

    def _pad(self, examples: list[dict[str, Any]]) -> tuple[Tensor, Tensor, Tensor]:
        """(tokens [B, n] int64 right-padded, targets [B, n] bool, lengths [B] int64) of the examples' real tokens."""
        if not examples:
            raise ValueError("SbdDataCollator: empty batch")
        rows, row_targets = zip(*(self._example(i, ex) for i, ex in enumerate(examples)))
        lengths = torch.tensor([r.numel() for r in rows], dtype=torch.int64)
        longest = int(lengths.max())
        n = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        tokens = torch.full((len(rows), n), self.pad_token_id, dtype=torch.int64)
        targets = torch.zeros(len(rows), n, dtype=torch.bool)
        for i, (row, target) in enumerate(zip(rows, row_targets)):
            tokens[i, : row.numel()] = row
            targets[i, : row.numel()] = target
        return tokens, targets, lengths

    def _example(self, index: int, example: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """(tokens [m] int64, targets [m] bool) of the m real tokens of example `index` (see the class docstring)."""
        tokens = torch.as_tensor(example["input_ids"], dtype=torch.int64)
        if tokens.dim() != 1 or tokens.numel() == 0:
            raise ValueError(f"SbdDataCollator: every example needs a non-empty 1-D input_ids, got shape "
                             f"{tuple(tokens.shape)}")
        real = _real_span(example, tokens.numel())
        self._refuse_mask_token(index, tokens, real)
        if example.get("labels") is not None:
            name, targets = "labels", torch.as_tensor(example["labels"], dtype=torch.int64) != IGNORE
        elif example.get("loss_mask") is not None:
            name, targets = "loss_mask", torch.as_tensor(example["loss_mask"]).bool()
        else:
            name, targets = None, torch.zeros(tokens.numel(), dtype=torch.bool)
            targets[real.start + 1:real.stop] = True
        if targets.shape != tokens.shape:
            raise ValueError(f"SbdDataCollator: {name} must have the length of input_ids ({tokens.numel()}), got "
                             f"shape {tuple(targets.shape)}")
        self._refuse_targets_past_the_head(index, tokens, targets, real)
        return tokens[real], targets[real]

    def _refuse_targets_past_the_head(self, index: int, tokens: Tensor, targets: Tensor, real: slice) -> None:
        """ValueError naming example `index` and the positions where a target token has no logit: a model whose LM
        head is pruned to its first `output_vocab_size` ids (Apertus 1.5: the text ids) cannot be trained to emit
        the others (its loss would index past the logits: a bare IndexError on the CPU, a device assert on a
        GPU). Such ids may stay in the context, outside the targets."""
        width = getattr(self.model_config, "output_vocab_size", None)
        if width is None:
            return
        found = ((tokens[real] >= width) & targets[real]).nonzero().flatten() + real.start
        if found.numel():
            raise ValueError(f"SbdDataCollator: example {index} has target ids past the LM head's "
                             f"output_vocab_size {width} at positions {found.tolist()} (ids "
                             f"{tokens[found].tolist()}); the model has no logits for them: leave them out of the "
                             "targets (labels -100 or loss_mask 0 there)")

    def _refuse_mask_token(self, index: int, tokens: Tensor, real: slice) -> None:
        """ValueError naming example `index` and the positions of its input_ids where a real token is the SBD mask
        token: the labels would take it for a token the noise masked (MATP targets where nothing was masked) and
        NTP would train the model to emit it. Padding outside `real` is not text and may hold any id."""
        found = (tokens[real] == self.mask_token_id).nonzero().flatten() + real.start
        if found.numel():
            raise ValueError(f"SbdDataCollator: example {index} has the SBD mask token id {self.mask_token_id} in "
                             f"input_ids at positions {found.tolist()}; the mask token must not occur in the text "
                             "(choose another mask_token_id with enable_sbd, or remove it from the data)")


def _contiguous(value: Any) -> Any:
    """`value` with every tensor in it, also inside dicts, made contiguous; other values as they are."""
    if isinstance(value, dict):
        return {name: _contiguous(item) for name, item in value.items()}
    return value.contiguous() if isinstance(value, Tensor) else value


def _checked_mask_implementation(config: Any) -> str:
    """The attention implementation an SBD batch's training mask is built for (`mask_implementation`, which refuses
    a model switched to another base). Raises ValueError for an MoE config with `output_router_logits` on: HF's
    load-balancing loss reads the batch's `attention_mask` as a 2-D padding mask, and an SBD batch's is the 4-D
    training mask (a tensor or a BlockMask), so the model's forward fails on a shape mismatch deep in that loss
    (Mixtral, Qwen3-MoE)."""
    if getattr(config, "output_router_logits", False):
        raise ValueError(
            "SbdDataCollator: model.config.output_router_logits is True, and HF's router load-balancing loss reads "
            "attention_mask as a [B, T] padding mask, while an SBD batch's is the [B, 1, 2n, 2n] training mask; "
            "set model.config.output_router_logits = False (the SBD objective is trained without the router loss)")
    return mask_implementation(config, "SbdDataCollator")


def sbd_loss_func(outputs: Any, labels: Tensor, num_items_in_batch: Tensor | int | None = None) -> Tensor:
    """SBD loss from HF model outputs and the collator's aligned labels `[B, 2n]`: `sbd_kernels.train.sbd_objective`,
    the sum of cross-entropies over counted targets divided by `num_items_in_batch` (the Trainer's count over all
    gradient-accumulation micro-batches and ranks) or, without it, by this batch's count. Usable as
    `Trainer(compute_loss_func=sbd_loss_func)`."""
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(logits.device)
    return sbd_objective(logits, labels.to(logits.device), num_items_in_batch)[0]
