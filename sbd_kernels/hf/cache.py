"""`SbdCache`: the KV cache of SBD decoding of a Hugging Face model, as a transformers `Cache`.

Per layer, contiguous `k`, `v` `[B, S_max, Hkv, D]` (the layout of `sbd.block_attention_with_kvcache`, not HF's
`[B, H, S, D]`; Hkv and D may differ between layers, as in Gemma 4, and a layer that attends to another layer's
keys and values, the KV-shared layers of Gemma 4 and Gemma 3n, holds that layer's buffers), and one `seqlens [B]`
int32 shared by all layers: the cached length of each row, which differs between rows of a batch. The op appends
the causal rows of a pass inside attention; `SbdCausalLM.decode_pass` then advances `seqlens` on the device. HF's
own write path (`update`) therefore only checks that the call comes from an SBD decode pass: this cache cannot
serve as a plain HF cache, and says so instead of returning keys that attend to nothing cached.

Why not HF's caches: `DynamicCache` grows by concatenation (a new tensor every pass; the op writes in place into
preallocated slots), and `StaticCache` holds one length for the whole batch in `[B, H, S, D]`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin


class SbdCacheError(RuntimeError):
    """A transformers code path used an `SbdCache` the way only plain HF caches can be used."""


def _refuse(what: str) -> SbdCacheError:
    return SbdCacheError(
        f"{what}. SbdCache is written by sbd.block_attention_with_kvcache inside SBD decode passes "
        "(SbdCausalLM.decode_pass, sbd_kernels.hf.generate), which also build the position ids (causal row i at "
        "L_b + i, block row j at L_b + c_b + j); it cannot be passed to a plain HF forward or HF generate as "
        "its cache (past_key_values, or cache from transformers 5.24)")


class SbdCacheLayer(CacheLayerMixin):
    """One layer's `keys` / `values` `[B, S_max, Hkv, D]`, allocated up front (never lazily)."""

    is_compileable = True
    is_sliding = False

    def __init__(self, keys: Tensor, values: Tensor):
        super().__init__()
        self.keys, self.values = keys, values
        self.is_initialized = True

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """Never needed: the buffers exist from construction."""

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        raise _refuse("SbdCache layers are not written by update()")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        raise _refuse("SbdCache rows have different lengths: HF cannot build one mask for them")

    def get_seq_length(self) -> int:
        raise _refuse("SbdCache rows have different lengths (SbdCache.seqlens)")

    def get_max_length(self) -> int:
        return self.keys.shape[1]


class SbdCache(Cache):
    """KV cache of an SBD decode: `layers[i].keys/values [B, S_max, Hkv, D]`, `seqlens [B]` int32.

    Build one with `SbdCausalLM.new_cache(batch, max_len)` (shapes from the model config, the model's dtype and
    device) or directly. Writing is the op's (inside `SbdCausalLM.decode_pass`); reading the cached prefix of row b
    is `layers[i].keys[b, :seqlens[b]]`.
    """

    def __init__(self, num_layers: int, batch: int, max_len: int, num_kv_heads: int | Sequence[int],
                 head_dim: int | Sequence[int], dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, shared_with: Sequence[int | None] | None = None):
        """num_kv_heads, head_dim: one for every layer, or one per layer. shared_with: per layer, None or the
        earlier layer whose keys and values it attends to (its buffers are that layer's: a decode pass writes the
        same rows to the same slots through both, once in each)."""
        kv_heads = [num_kv_heads] * num_layers if isinstance(num_kv_heads, int) else list(num_kv_heads)
        head_dims = [head_dim] * num_layers if isinstance(head_dim, int) else list(head_dim)
        sources = [None] * num_layers if shared_with is None else list(shared_with)
        if not len(kv_heads) == len(head_dims) == len(sources) == num_layers:
            raise ValueError(f"SbdCache: num_kv_heads, head_dim and shared_with need one entry per layer "
                             f"({num_layers}), got {len(kv_heads)}, {len(head_dims)} and {len(sources)}")
        layers: list[SbdCacheLayer] = []
        for i, (heads, dim, source) in enumerate(zip(kv_heads, head_dims, sources)):
            if source is None:
                shape = (batch, max_len, heads, dim)
                layers.append(SbdCacheLayer(torch.zeros(shape, dtype=dtype, device=device),
                                            torch.zeros(shape, dtype=dtype, device=device)))
                continue
            if not 0 <= source < i or sources[source] is not None:
                raise ValueError(f"SbdCache: layer {i} shares the cache of layer {source}, which must be an earlier "
                                 "layer with a cache of its own")
            layers.append(SbdCacheLayer(layers[source].keys, layers[source].values))
        super().__init__(layers=layers)
        self.seqlens = torch.zeros(batch, dtype=torch.int32, device=device)
        self._in_pass = False

    @property
    def max_len(self) -> int:
        return self.layers[0].keys.shape[1] if self.layers else 0

    def layer_buffers(self, layer_idx: int) -> tuple[Tensor, Tensor]:
        """(k_cache, v_cache) `[B, S_max, Hkv, D]` of one layer."""
        layer = self.layers[layer_idx]
        return layer.keys, layer.values

    @contextlib.contextmanager
    def decode_pass(self) -> Iterator[None]:
        """Marks the duration of one SBD decode pass (HF's `update` calls are legal only inside one)."""
        self._in_pass = True
        try:
            yield
        finally:
            self._in_pass = False

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[Tensor, Tensor]:
        """HF's per-layer write: inside an SBD pass it returns the new rows unchanged (the attention op appends the
        causal ones itself); elsewhere it refuses, since HF attention would then see no cached keys at all."""
        if not self._in_pass:
            raise _refuse("update() outside an SBD decode pass")
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise _refuse("SbdCache rows have different lengths (SbdCache.seqlens), so HF cannot derive position_ids "
                      "from it")

    def advance(self, num_causal: Tensor) -> None:
        """seqlens += num_causal ([B] int32), on the device, no host sync."""
        self.seqlens.add_(num_causal.to(self.seqlens.dtype))

    def reset(self) -> None:
        self.seqlens.zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise _refuse("SbdCache does not support beam search")

    def crop(self, max_length: int) -> None:
        raise _refuse("SbdCache does not support cropping (assisted decoding)")
