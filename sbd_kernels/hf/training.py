"""SBD fine-tuning of Hugging Face models: the training mask in each attention implementation's form, a data
collator that builds the SBD objective's inputs and labels, and a loss for `Trainer(compute_loss_func=...)`.

The objective is the one of `sbd_kernels.train` (docs: `sbd_kernels.train.sbd_loss`), built from the same
functions (`add_noise`, `sbd_labels`, `sbd_train_inputs`, `sbd_mask_allows`): per batch one block size
k ~ U{block_min..block_max}; per sequence a mask rate eta ~ U(0, 1); input `[clean ; noisy]` with repeated
position ids; labels aligned with the logits (NTP labels shifted on the clean half, masked tokens unshifted on
the noisy half); one mean over every counted target of both halves.

Training blocks are aligned at position 0 of each sequence (0, k, 2k, ...), while decoding aligns blocks at the
end of the prompt. Both are the SBD recipe: what the model learns is to fill a block given everything before it,
and position ids carry where the block is.

Batch layout from `SbdDataCollator` (n = longest sequence of the batch, right-padded):
    input_ids     [B, 2n] int64      [clean ; noisy]
    position_ids  [B, 2n] int64      [0..n-1 ; 0..n-1]
    attention_mask                   [B, 1, 2n, 2n] bool (sdpa), additive (eager) or a BlockMask (flex_attention)
    labels, shift_labels [B, 2n] int64   aligned with the logits, -100 where not counted
HF's causal-LM loss uses `shift_labels` as given, so `model(**batch).loss` is the SBD loss too; with
`compute_loss_func=sbd_loss_func` the Trainer uses this module's loss.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from sbd_kernels.hf.attention import BASE_IMPLEMENTATIONS, base_implementation
from sbd_kernels.hf.model import mask_for_implementation
from sbd_kernels.model import sbd_mask_allows
from sbd_kernels.train import IGNORE, add_noise, sbd_labels


def padded_sbd_mask(lengths: Tensor, n: int, block_size: int) -> Tensor:
    """`[B, 2n, 2n]` bool: the SBD training mask (`sbd_mask_allows`) restricted to keys of real tokens
    (position mod n < lengths[b]); padded rows keep at least position 0 of their half, so no row is empty."""
    idx = torch.arange(2 * n, device=lengths.device)
    allowed = sbd_mask_allows(idx[:, None], idx[None, :], n, block_size)               # [2n, 2n]
    key_real = (idx % n)[None, :] < lengths[:, None]                                      # [B, 2n]
    return allowed[None] & key_real[:, None, :]


def sbd_training_mask(lengths: Tensor, n: int, block_size: int, implementation: str,
                      dtype: torch.dtype = torch.float32) -> Any:
    """The SBD training mask of a right-padded batch (`lengths [B]` real tokens of each sequence, n its padded
    length) in the form `implementation` reads: bool `[B, 1, 2n, 2n]` ("sdpa"), additive in `dtype` ("eager"), or a
    FlexAttention BlockMask ("flex_attention", built from the same predicate, on the device of `lengths`)."""
    if implementation == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        k = torch.tensor(block_size, device=lengths.device)

        def mask_mod(b, h, q, kv):
            return sbd_mask_allows(q, kv, n, k) & (kv % n < lengths[b])

        return create_block_mask(mask_mod, B=lengths.shape[0], H=None, Q_LEN=2 * n, KV_LEN=2 * n,
                                 device=lengths.device)
    return mask_for_implementation(padded_sbd_mask(lengths, n, block_size), implementation, dtype)


def _block_size_at(seed: int, batch_index: int, block_min: int, block_max: int) -> int:
    """k ~ U{block_min..block_max} for batch `batch_index`: the same on every data-parallel rank (ranks call the
    collator once per step in lockstep), independent of the data."""
    rng = torch.Generator().manual_seed(zlib.crc32(f"sbd-k/{seed}/{batch_index}".encode()))
    return int(torch.randint(block_min, block_max + 1, (1,), generator=rng))


@dataclass
class SbdDataCollator:
    """Turns tokenized examples into SBD training batches for an HF model prepared by `enable_sbd`.

    Each example is a dict with `input_ids` (list or 1-D tensor) and optionally `labels` of the same length in HF's
    causal-LM convention (-100 where a token is not a target, e.g. the prompt of chat / instruction data) or
    `loss_mask` (1 = target). Without either, every token but the first is a target. The noise is applied to every
    token, prompts included; only targets are counted in the loss.

    model_config: `model.config` after `enable_sbd` (mask id, base attention implementation, dtype for eager).
    block_min, block_max: the range of the per-batch block size (SBD recipe: 2..16).
    seed: seeds the block size (from the batch count: equal on every rank) and the noise (with `rank`).
    pad_to_multiple_of: pads n up to a multiple (e.g. 8 for tensor cores; 128 for FlexAttention blocks).
    """

    model_config: Any
    block_min: int = 2
    block_max: int = 16
    seed: int = 0
    rank: int = 0
    pad_to_multiple_of: int = 1
    dtype: torch.dtype = torch.float32
    _batches: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.block_min <= self.block_max:
            raise ValueError(f"SbdDataCollator: need 1 <= block_min <= block_max, got {self.block_min}, "
                             f"{self.block_max}")
        self.mask_token_id = getattr(self.model_config, "sbd_mask_token_id", None)
        if self.mask_token_id is None:
            raise ValueError("SbdDataCollator: the config has no sbd_mask_token_id; run enable_sbd(model, ...) first")
        self.implementation = base_implementation(self.model_config)
        if self.implementation not in BASE_IMPLEMENTATIONS:
            raise ValueError(f"SbdDataCollator: unsupported attention implementation {self.implementation!r}")
        self.pad_token_id = getattr(self.model_config, "pad_token_id", None) or 0
        self._noise = torch.Generator().manual_seed(zlib.crc32(f"sbd-noise/{self.seed}/{self.rank}".encode()))

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        tokens, targets, lengths = self._pad(examples)
        k = _block_size_at(self.seed, self._batches, self.block_min, self.block_max)
        self._batches += 1
        noisy, _ = add_noise(tokens, self.mask_token_id, self._noise)
        labels = sbd_labels(tokens, targets, noisy, self.mask_token_id)                   # [B, 2n]
        n = tokens.shape[1]
        return {
            "input_ids": torch.cat([tokens, noisy], dim=1),
            "position_ids": torch.arange(n).repeat(2).expand(tokens.shape[0], 2 * n),
            "attention_mask": sbd_training_mask(lengths, n, k, self.implementation, self.dtype),
            "labels": labels,
            "shift_labels": labels,
        }

    def _pad(self, examples: list[dict[str, Any]]) -> tuple[Tensor, Tensor, Tensor]:
        """(tokens [B, n] int64 right-padded, targets [B, n] bool, lengths [B] int64)."""
        if not examples:
            raise ValueError("SbdDataCollator: empty batch")
        rows = [torch.as_tensor(ex["input_ids"], dtype=torch.int64) for ex in examples]
        if any(r.dim() != 1 or r.numel() == 0 for r in rows):
            raise ValueError("SbdDataCollator: every example needs a non-empty 1-D input_ids")
        longest = max(r.numel() for r in rows)
        n = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        tokens = torch.full((len(rows), n), self.pad_token_id, dtype=torch.int64)
        targets = torch.zeros(len(rows), n, dtype=torch.bool)
        for i, (row, ex) in enumerate(zip(rows, examples)):
            tokens[i, : row.numel()] = row
            targets[i, : row.numel()] = self._targets(ex, row.numel())
        lengths = torch.tensor([r.numel() for r in rows], dtype=torch.int64)
        return tokens, targets, lengths

    @staticmethod
    def _targets(example: dict[str, Any], length: int) -> Tensor:
        """[length] bool: which tokens are targets (see the class docstring)."""
        if "labels" in example:
            labels = torch.as_tensor(example["labels"], dtype=torch.int64)
            mask = labels != IGNORE
        elif "loss_mask" in example:
            mask = torch.as_tensor(example["loss_mask"]).bool()
        else:
            mask = torch.ones(length, dtype=torch.bool)
            mask[0] = False
        if mask.shape != (length,):
            raise ValueError(f"SbdDataCollator: labels / loss_mask must have the length of input_ids ({length}), "
                             f"got {tuple(mask.shape)}")
        return mask


def sbd_loss_func(outputs: Any, labels: Tensor, num_items_in_batch: Tensor | int | None = None) -> Tensor:
    """SBD loss from HF model outputs and the collator's aligned labels: the sum of cross-entropies over counted
    targets divided by `num_items_in_batch` (the Trainer's count over all gradient-accumulation micro-batches and
    ranks) or, without it, by this batch's count. Usable as `Trainer(compute_loss_func=sbd_loss_func)`."""
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
    total = F.cross_entropy(logits.float().flatten(0, 1), labels.to(logits.device).flatten(), ignore_index=IGNORE,
                            reduction="sum")
    count = num_items_in_batch if num_items_in_batch is not None else (labels != IGNORE).sum().clamp(min=1)
    if torch.is_tensor(count):
        count = count.to(total.device)
    return total / count
