"""The model protocol of SBD: what a model must offer for the one SBD loss and the one decode loop.

`sbd_kernels.train.sbd_loss`, `sbd_kernels.generate.generate`, `oracle_decode` and `block_logit_error` take
any `SbdModel`. Two implementations ship: the reference `sbd_kernels.model.Transformer` and
`sbd_kernels.hf.SbdCausalLM`, the adapter of a Hugging Face causal LM. Both are `torch.nn.Module`s, so
`parameters()` gives the device and dtype, and DistributedDataParallel can wrap them for training.

A decode cache is any object with a `seqlens` tensor (`[B]` int32, tokens cached per row) that the model's
`decode_pass` reads and advances; `new_cache` makes one.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import Tensor


@runtime_checkable
class DecodeCache(Protocol):
    """Per-row KV cache of a decode: `seqlens [B]` int32 is the number of tokens cached in each row.

    A cache may also state its slots per row as an int `max_len` (`KVCache` and `SbdCache` do): `generate` then
    checks once that `new_cache(batch, max_len)` gave it the slots it asked for and skips the ops' per-call
    value checks; a cache without it keeps them."""

    seqlens: Tensor


@runtime_checkable
class SbdModel(Protocol):
    """A causal LM trained (or being trained) with the SBD objective (docs: `sbd_kernels.train`).

    mask_token_id: the vocabulary id of the mask token m.

    forward(tokens, positions, attn_mask) -> logits:
        tokens `[B, T]` int64, positions `[B, T]` int64 (RoPE position of every row; the SBD training input
        repeats positions), attn_mask a bool `[B or 1, T, T]` tensor (True = query may attend key) or a
        FlexAttention BlockMask, or None for causal. Returns logits `[B, T, V]` float32. No cache.

    new_cache(batch, max_len) -> DecodeCache:
        an empty cache for `batch` rows of up to `max_len` cached tokens, on the model's device and dtype.

    decode_pass(tokens, num_causal, block_size, cache, attention_op=None, keep_last=0) -> logits:
        one cached pass with the row layout of `sbd.block_attention_with_kvcache`: tokens `[B, C + K]` int64,
        rows `[0, c_b)` causal (position L_b + i, appended to the cache), rows `[c_b, C)` padding, rows
        `[C, C + K)` the block (positions L_b + c_b + j, never cached); num_causal `[B]` int32;
        attention_op: the attention kernel (default the fused op); keep_last > 0 computes the logits of the
        last `keep_last` rows only. Returns logits `[B, C + K or keep_last, V]` (float32, or the model's
        dtype: the sampler reads fp32 / fp16 / bf16) and advances `cache.seqlens` by num_causal on the device
        (no host sync).
    """

    mask_token_id: int

    def __call__(self, tokens: Tensor, positions: Tensor | None = None, attn_mask: Any = None) -> Tensor: ...

    def new_cache(self, batch: int, max_len: int) -> DecodeCache: ...

    def decode_pass(self, tokens: Tensor, num_causal: Tensor, block_size: int, cache: Any,
                    attention_op: Any = None, keep_last: int = 0) -> Tensor: ...
