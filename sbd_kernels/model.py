"""Reference Llama-style decoder (RMSNorm, RoPE, SwiGLU, GQA) with the three forward modes SBD needs.

One set of weights serves:
- `Transformer.forward`: no cache, causal by default or any boolean mask. Used by NTP training, the SBD
  training forward over `[clean ; noisy]` (docs/algorithm.md §2.3-2.4) and the full-recompute
  oracle decode (docs/algorithm.md §3.10).
- `Transformer.sbd_train_forward`: `[clean ; noisy]`, equal position ids, the mask of docs/algorithm.md §2.4.
- `Transformer.decode_pass`: one cached pass with the row layout of `sbd::block_attention_with_kvcache`
  (causal rows appended to the cache, block rows never cached).

Checkpoints (`save_checkpoint` / `load_checkpoint`) hold the config as a plain dict beside the fp32
weights, so loading needs nothing but this file. `load_checkpoint` checks a file (format, structure,
config, every weight's name and shape) before it builds anything, and raises `CheckpointError` naming
the file and what is wrong.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import pickle
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Reserved id of the mask token m in the character vocabulary of `sbd_kernels.tasks` (pad 0, eos 1,
# mask 2, separator 3): the mask is an ordinary vocabulary entry (docs/algorithm.md §2.7).
CHAR_MASK_TOKEN_ID = 2


@dataclass
class ModelConfig:
    """Shapes of the decoder. `preset(name)` gives the named configurations.

    head_dim = dim / n_heads must be even (RoPE rotates pairs of features). max_seq_len: the sequence length the
    configuration is sized for (the character presets: the longest task sequence plus a block; the 8B shapes:
    the published context lengths); a record, not a limit: RoPE angles are computed for any position
    (`rope_cos_sin`, no table), so neither the forward nor a decode checks it, and positions past the length a
    model was trained on run without error, with predictions of unknown quality.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    mask_token_id: int = CHAR_MASK_TOKEN_ID

    def __post_init__(self) -> None:
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig: dim ({self.dim}) must divide by n_heads ({self.n_heads}) and n_heads by "
                f"n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig: head_dim {self.head_dim} must be even (dim {self.dim} / n_heads "
                             f"{self.n_heads}; RoPE rotates pairs of features)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"ModelConfig: mask_token_id {self.mask_token_id} outside the vocabulary")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        """`tiny` (tests), `small` (the bundled demo checkpoints), `llama3.1-8b`, `qwen3-8b` (benchmark
        shapes with random weights; Qwen3's q/k norms are not modelled, only its shapes)."""
        if name not in PRESETS:
            raise ValueError(f"ModelConfig.preset: unknown name {name!r}; choose from {sorted(PRESETS)}")
        return cls(**PRESETS[name])


PRESETS: dict[str, dict[str, Any]] = {
    # 48 ids cover the 41-character task vocabulary with room to spare; max_seq_len covers the longest
    # task sequence (97) plus a full overhanging block of 16 at the end of decoding.
    "tiny": {
        "vocab_size": 48, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64,
        "max_seq_len": 160,
    },
    # 0.8M parameters: the size that learned reversed addition (docs/performance.md §7.1) for NTP and SBD on
    # this CPU within the training budget (d 256 cost 3-6x more per step).
    "small": {
        "vocab_size": 48, "dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 384,
        "max_seq_len": 160,
    },
    "llama3.1-8b": {
        "vocab_size": 128256, "dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "ffn_dim": 14336,
        "max_seq_len": 131072, "rope_theta": 500000.0, "norm_eps": 1e-5, "mask_token_id": 128255,
    },
    "qwen3-8b": {
        "vocab_size": 151936, "dim": 4096, "n_layers": 36, "n_heads": 32, "n_kv_heads": 8, "ffn_dim": 12288,
        "max_seq_len": 40960, "rope_theta": 1000000.0, "norm_eps": 1e-6, "mask_token_id": 151935,
    },
}


class KVCache(nn.Module):
    """Per-layer contiguous K/V `[B, S_max, Hkv, D]` and `seqlens [B]` int32 (tokens cached per row).

    The attention op writes the causal rows' K/V into slots `[seqlens[b], seqlens[b] + c_b)`; the model
    then calls `advance(num_causal)` once per pass, after the last layer. Build one shaped for a model with
    `Transformer.new_cache(batch, max_len)`.
    """

    def __init__(self, n_layers: int, batch: int, max_len: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__()
        shape = (batch, max_len, n_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.seqlens = torch.zeros(batch, dtype=torch.int32, device=device)
        self._max_len = max_len

    @property
    def max_len(self) -> int:
        """Cache slots per row (S_max)."""
        return self.k[0].shape[1] if self.k else self._max_len

    def reset(self) -> None:
        self.seqlens.zero_()

    def advance(self, num_causal: Tensor) -> None:
        # num_causal: [B] int32, rows appended by this pass; an in-place device op, no host sync.
        self.seqlens.add_(num_causal.to(self.seqlens.dtype))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin `[B, T, 1, D]` fp32 for integer positions `[B, T]` (rotate-half layout)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32)
                               / head_dim)
    angles = positions.float()[..., None] * inv_freq  # [B, T, D/2]
    angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x `[B, T, H, D]` rotated by its position: x * cos + rotate_half(x) * sin, computed in fp32."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


@functools.cache
def _compiled_flex_attention() -> Callable[..., Tensor]:
    # FlexAttention is only fast compiled (eager materialises the full score matrix); compiled once.
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


AttentionOp = Callable[..., tuple[Tensor, Tensor]]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q `[B, T, Hq, D]`, k, v `[B, T, Hkv, D]`, RoPE applied to q and k."""
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn_mask: Any = None) -> Tensor:
        """No cache. attn_mask: None (causal), bool `[B or 1, T, T]` (True = may attend), or a
        FlexAttention `BlockMask` (training on a GPU)."""
        b, t, _ = x.shape
        q, k, v = (y.transpose(1, 2) for y in self.qkv(x, cos, sin))  # [B, H, T, D]
        if attn_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        elif isinstance(attn_mask, Tensor):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask[:, None], enable_gqa=True)
        else:
            out = _compiled_flex_attention()(q, k, v, block_mask=attn_mask, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))

    def forward_cached(self, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                       cache_seqlens: Tensor, num_causal: Tensor, block_size: int,
                       attention_op: AttentionOp) -> Tensor:
        """One decode pass of this layer; attention_op appends the causal rows' K/V to the cache."""
        b, t, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)
        out, _ = attention_op(q, k, v, k_cache, v_cache, cache_seqlens, num_causal, block_size)
        return self.wo(out.reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn_mask: Any = None) -> Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, attn_mask)
        return x + self.feed_forward(self.ffn_norm(x))

    def forward_cached(self, x: Tensor, cos: Tensor, sin: Tensor, *cache_args: Any) -> Tensor:
        x = x + self.attention.forward_cached(self.attention_norm(x), cos, sin, *cache_args)
        return x + self.feed_forward(self.ffn_norm(x))


def sbd_mask_allows(q: Tensor, kv: Tensor, n: int, block_size: int | Tensor) -> Tensor:
    """Training-mask predicate (docs/algorithm.md §2.4) over `[clean ; noisy]` (2n positions): may q attend kv?

    clean q < n:  clean keys kv <= q; no noisy key.
    noisy q >= n: clean keys of strictly earlier blocks ((q-n)//k > kv//k) and every noisy key of its
                  own block ((q-n)//k == (kv-n)//k), blocks aligned at 0, k, 2k, ... .

    q, kv: integer tensors of any broadcastable shapes; block_size: an int or a 0-d integer tensor. Elementwise
    tensor ops only, so the same function builds the dense mask (`sbd_attention_mask`) and serves as a
    FlexAttention `mask_mod` (through `SbdMaskMod`).
    """
    q_noisy, kv_noisy = q >= n, kv >= n
    q_pos, kv_pos = q - n * q_noisy, kv - n * kv_noisy
    q_block, kv_block = q_pos // block_size, kv_pos // block_size
    clean = ~q_noisy & ~kv_noisy & (kv_pos <= q_pos)
    earlier_block = q_noisy & ~kv_noisy & (q_block > kv_block)
    same_block = q_noisy & kv_noisy & (q_block == kv_block)
    return clean | earlier_block | same_block


@dataclass(frozen=True)
class SbdMaskMod:
    """The training mask of a batch as a FlexAttention `mask_mod(b, h, q, kv)` that holds the tensors it reads.

    n: tokens per half of `[clean ; noisy]` (an int). block_size: the block size k, an int or a 0-d integer
    tensor. lengths: `[B]` real tokens of each right-padded sequence, or None (no padding). Allowed:
    `sbd_mask_allows(q, kv, n, k)` and, with lengths, kv a real token of sequence b (kv mod n < lengths[b]);
    padded query rows keep position 0 of their half, so no row is empty. window: W, an int or a 0-d integer tensor,
    or None: a real query row at position p = q mod n attends only to keys at positions kv mod n > p - W (a
    sliding-window layer's mask; every real row keeps its own position, padded rows are left unbounded).

    The mask_mod reads n and k as 0-d tensors (`n_tensor`, `block_size`, made on the device of `lengths` when
    given as ints), none as a Python int: a compiled FlexAttention kernel reads tensors anew at each call but may
    keep an int from the call it was traced in. `torch.compile(flex_attention)` (HF's flex_attention path)
    recompiles with dynamic shapes at the first batch of another padded length, and with n an int it then
    masked that batch and every later one with the first batch's n (a wrong loss, no error). One compiled
    kernel so serves every k and every n. The int n stays for the dense mask's shape (no host sync).

    Holding the tensors as fields (not in a closure) lets `to(device)` move them with the mask; the same object,
    called on index grids, builds the dense mask (`dense`).
    """

    n: int
    block_size: int | Tensor
    lengths: Tensor | None = None
    n_tensor: Tensor | None = dataclasses.field(default=None, repr=False)
    window: int | Tensor | None = None

    def __post_init__(self) -> None:
        device = self.lengths.device if self.lengths is not None else (
            self.block_size.device if isinstance(self.block_size, Tensor) else None)
        if isinstance(self.block_size, Tensor):
            if self.block_size.dim() != 0:
                raise ValueError(f"SbdMaskMod: block_size must be an int or a 0-d tensor, got shape "
                                 f"{tuple(self.block_size.shape)}")
        else:
            object.__setattr__(self, "block_size", torch.tensor(self.block_size, dtype=torch.int64, device=device))
        if self.n_tensor is None:
            object.__setattr__(self, "n_tensor", torch.tensor(self.n, dtype=torch.int64, device=device))
        if self.window is not None and not isinstance(self.window, Tensor):
            object.__setattr__(self, "window", torch.tensor(self.window, dtype=torch.int64, device=device))

    def __call__(self, b: Tensor, h: Any, q: Tensor, kv: Tensor) -> Tensor:
        allowed = sbd_mask_allows(q, kv, self.n_tensor, self.block_size)
        if self.window is not None:
            q_pos = q % self.n_tensor
            near = q_pos - kv % self.n_tensor < self.window
            allowed = allowed & (near if self.lengths is None else near | (q_pos >= self.lengths[b]))
        if self.lengths is None:
            return allowed
        return allowed & (kv % self.n_tensor < self.lengths[b])

    def tensors(self) -> list[Tensor]:
        return [t for t in (self.n_tensor, self.block_size, self.lengths, self.window) if t is not None]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SbdMaskMod:
        move = functools.partial(Tensor.to, device=device, non_blocking=non_blocking)
        return dataclasses.replace(self, n_tensor=move(self.n_tensor), block_size=move(self.block_size),
                                   lengths=None if self.lengths is None else move(self.lengths),
                                   window=None if self.window is None else move(self.window))

    def dense(self) -> Tensor:
        """`[B or 1, 2n, 2n]` bool (True = q may attend kv), evaluated cell by cell on the device of the mask."""
        idx = torch.arange(2 * self.n, device=self.n_tensor.device)
        batch = 1 if self.lengths is None else self.lengths.shape[0]
        b = torch.arange(batch, device=idx.device)[:, None, None]
        return self(b, None, idx[None, :, None], idx[None, None, :]).expand(batch, -1, -1)


def sbd_attention_mask(n: int, block_size: int, device: torch.device | str | None = None) -> Tensor:
    """docs/algorithm.md §2.4 training mask `[2n, 2n]` bool over `[clean ; noisy]` (True = q may attend kv):
    `sbd_mask_allows` evaluated on every (query, key) pair."""
    if n < 1 or block_size < 1:
        raise ValueError(f"sbd_attention_mask: n ({n}) and block_size ({block_size}) must be >= 1")
    idx = torch.arange(2 * n, device=device)
    return sbd_mask_allows(idx[:, None], idx[None, :], n, block_size)


def sbd_train_inputs(clean: Tensor, noisy: Tensor, block_size: int, attn_mask: Any = None
                     ) -> tuple[Tensor, Tensor, Any]:
    """(tokens `[B, 2n]` = [clean ; noisy], positions `[B, 2n]` = [0..n-1 ; 0..n-1], mask) for
    `Transformer.forward`; a separate function so a DistributedDataParallel wrapper can be called."""
    b, n = clean.shape
    positions = torch.arange(n, device=clean.device).repeat(2).expand(b, 2 * n)
    if attn_mask is None:
        attn_mask = sbd_attention_mask(n, block_size, clean.device)[None]
    return torch.cat([clean, noisy], dim=1), positions, attn_mask


def check_decode_pass(caller: str, tokens: Tensor, num_causal: Tensor, block_size: int, seqlens: Tensor,
                      keep_last: int) -> None:
    """ValueError naming the argument when one `decode_pass` argument disagrees with tokens `[B, C + K]`: block_size
    and keep_last in [0, C + K], num_causal and the cache's seqlens of shape `[B]`. Shapes only (no host sync):
    a keep_last of -1 kept all rows but the first, and a num_causal or cache of another batch failed deep inside
    with an error naming another tensor."""
    if tokens.dim() != 2:
        raise ValueError(f"{caller}: tokens must be [B, C + K], got shape {list(tokens.shape)}")
    batch, rows = tokens.shape
    for name, value in (("block_size", block_size), ("keep_last", keep_last)):
        if not 0 <= value <= rows:
            raise ValueError(f"{caller}: {name} must be in [0, C + K] = [0, {rows}] (tokens {list(tokens.shape)}), "
                             f"got {value}")
    for name, t in (("num_causal", num_causal), ("cache.seqlens", seqlens)):
        if tuple(t.shape) != (batch,):
            raise ValueError(f"{caller}: {name} must have shape [B] = [{batch}] (tokens {list(tokens.shape)}), got "
                             f"{list(t.shape)}")


def decode_positions(seqlens: Tensor, num_causal: Tensor, num_slots: int, block_size: int) -> Tensor:
    """Positions `[B, C+K]` int64 of one decode pass: causal/padding row i at L_b + i, block row j at
    L_b + c_b + j (padding rows' outputs are discarded by the op)."""
    start = seqlens.long()[:, None]
    causal = start + torch.arange(num_slots, device=seqlens.device)
    block = start + num_causal.long()[:, None] + torch.arange(block_size, device=seqlens.device)
    return torch.cat([causal, block], dim=1)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # std 0.02 (GPT-2 / Llama); keeps the initial logits near uniform for any vocabulary.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def _cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)

    def _logits(self, x: Tensor) -> Tensor:
        return self.output(self.norm(x)).float()

    def forward(self, tokens: Tensor, positions: Tensor | None = None, attn_mask: Any = None) -> Tensor:
        """tokens `[B, T]` int64 -> logits `[B, T, V]` fp32, no cache.

        positions `[B, T]` int64 (None = arange(T)); attn_mask bool `[B or 1, T, T]`, True = may attend
        (None = causal), or a FlexAttention BlockMask.
        """
        b, t = tokens.shape
        if positions is None:
            positions = torch.arange(t, device=tokens.device).expand(b, t)
        cos, sin = self._cos_sin(positions)
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, attn_mask)
        return self._logits(x)

    def sbd_train_forward(self, clean: Tensor, noisy: Tensor, block_size: int,
                          attn_mask: Any = None) -> Tensor:
        """Training forward (docs/algorithm.md §2.3-2.4): clean, noisy `[B, n]` -> logits `[B, 2n, V]` fp32.

        Input `[clean ; noisy]`, noisy token i at the same position id as clean token i. attn_mask
        defaults to `sbd_attention_mask(n, block_size)`; a caller may pass the same mask as a
        FlexAttention BlockMask.
        """
        return self.forward(*sbd_train_inputs(clean, noisy, block_size, attn_mask))

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty KV cache for `batch` rows of up to `max_len` cached tokens, in the model's dtype and on its
        device (the `SbdModel` protocol; the one constructor of a cache shaped for a model)."""
        cfg, weight = self.config, self.tok_embeddings.weight
        return KVCache(cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.head_dim, weight.dtype, weight.device)

    def decode_pass(self, tokens: Tensor, num_causal: Tensor, block_size: int, cache: KVCache,
                    attention_op: AttentionOp | None = None, keep_last: int = 0) -> Tensor:
        """One cached pass: tokens `[B, C+K]` int64, num_causal `[B]` int32 -> logits `[B, C+K, V]` fp32
        (`[B, keep_last, V]`: the last keep_last rows only, when keep_last > 0).

        Rows `[0, c_b)` are causal tokens at positions L_b + i (L_b = cache.seqlens[b]), rows `[c_b, C)`
        padding, rows `[C, C+K)` the block at L_b + c_b + j. Every layer calls attention_op (default
        `torch.ops.sbd.block_attention_with_kvcache`), which appends the causal rows' K/V; afterwards
        cache.seqlens += num_causal on the device.
        """
        check_decode_pass("Transformer.decode_pass", tokens, num_causal, block_size, cache.seqlens, keep_last)
        if attention_op is None:
            attention_op = torch.ops.sbd.block_attention_with_kvcache
        num_slots = tokens.shape[1] - block_size
        positions = decode_positions(cache.seqlens, num_causal, num_slots, block_size)
        cos, sin = self._cos_sin(positions)
        x = self.tok_embeddings(tokens)
        for layer, k_cache, v_cache in zip(self.layers, cache.k, cache.v):
            x = layer.forward_cached(x, cos, sin, k_cache, v_cache, cache.seqlens, num_causal, block_size,
                                     attention_op)
        cache.advance(num_causal)
        return self._logits(x[:, -keep_last:] if keep_last else x)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def save_checkpoint(model: Transformer, path: str | os.PathLike, **meta: Any) -> None:
    """Writes `{"config": dict, "state_dict": fp32 weights, "meta": meta}` with torch.save, atomically
    (a stopped run never leaves a truncated file). meta: plain Python values (numbers, strings, lists)."""
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    payload = {"config": dataclasses.asdict(model.config), "state_dict": state, "meta": meta}
    tmp = f"{os.fspath(path)}.tmp"
    torch.save(payload, tmp)
    os.replace(tmp, path)


class CheckpointError(ValueError):
    """A file `load_checkpoint` cannot use; the message names the file and what is wrong with it."""


# The largest config a checkpoint may declare, checked before anything is built. 4-64x beyond the
# largest open models (Llama 3.1 405B: dim 16384, 126 layers, ffn 53248; Gemma 3: 262144 ids; 10M-token
# contexts) so that every real config passes; the weights must then match the config tensor by tensor,
# so a small file can no longer make the loader allocate and initialise a model of any size.
CHECKPOINT_LIMITS = {"vocab_size": 2**22, "dim": 2**17, "n_layers": 2**12, "n_heads": 2**12,
                     "n_kv_heads": 2**12, "ffn_dim": 2**19, "max_seq_len": 2**26}
CHECKPOINT_MAX_PARAMETERS = 2**40     # 4 TiB of fp32 weights


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu"
                    ) -> tuple[Transformer, dict[str, Any]]:
    """(model in eval mode on map_location, meta) from a file written by `save_checkpoint`; needs no
    training code.

    The file is read with `torch.load(weights_only=True)` (no code in it can run), after every member of its
    archive has matched its CRC-32 (a bit flipped on disk in a weight is an error, not a wrong weight), and
    checked before any module is built: a dict {config, state_dict, meta}; every config key known, sizes
    positive integers within CHECKPOINT_LIMITS, at most CHECKPOINT_MAX_PARAMETERS parameters; exactly the
    weights of that config, each a floating-point tensor of its shape. The model is then built on the meta
    device and filled from the file, never initialised at full size.

    Raises CheckpointError (a ValueError) naming the file and the problem: missing path, a directory, an empty,
    truncated or damaged file (a member failing its CRC-32 named), not a torch.save archive, refused by
    weights_only, the wrong structure, an unknown / missing / bad config key, missing / unexpected / misshapen
    weights.
    """
    name = os.fspath(path)
    payload = read_torch_file(name)
    config, state, meta = _checkpoint_parts(name, payload)
    cfg = _checkpoint_config(name, config)
    _check_checkpoint_weights(name, cfg, state)
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device=map_location)
    model.load_state_dict(state)
    return model.eval(), meta


def read_torch_file(path: str) -> Any:
    """torch.load(path, weights_only=True) on the CPU (a checkpoint, a training state), with each way a file
    can be unusable as a CheckpointError (torch itself says OSError('Invalid argument') for a truncated file, a bare EOFError
    for an empty one, and nothing at all for damaged bytes inside the archive: its zip reader skips the CRC-32
    checks, so a flipped bit in a weight loaded as a wrong weight).

    One open file: the archive's structure and every member's CRC-32 (`_check_archive`) are checked through it,
    then torch.load reads it from the start. The CRC pass reads every byte once more; the alternative, the
    whole file in memory for both, would double the peak memory of loading a large checkpoint."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file")
    if os.path.isdir(path):
        raise CheckpointError(f"{path}: is a directory, not a checkpoint file")
    try:
        with open(path, "rb") as file:
            _check_archive(path, file)
            file.seek(0)
            return _load_weights_only(path, file)
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read it ({err.strerror or err})") from err


def _load_weights_only(path: str, file: BinaryIO) -> Any:
    """torch.load(file, weights_only=True) on the CPU, its failures as CheckpointErrors naming `path`."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{path}: refused by torch.load(weights_only=True), it holds more than tensors "
                              f"and plain values ({_unpickling_reason(err)})") from err
    except Exception as err:  # a damaged archive fails in many ways: RuntimeError, OSError, EOFError, ...
        detail = str(err).strip().splitlines()[0] if str(err).strip() else "no detail"
        raise CheckpointError(f"{path}: damaged ({type(err).__name__}: {detail})") from err


def _check_archive(path: str, file: BinaryIO) -> None:
    """CheckpointError unless `file` (open at its start) is a complete torch.save zip archive whose every
    member matches the CRC-32 stored for it when it was written."""
    head = file.read(4)
    size = file.seek(0, os.SEEK_END)
    if size == 0:
        raise CheckpointError(f"{path}: empty file (0 bytes), not an sbd_kernels checkpoint")
    if head != b"PK\x03\x04":        # torch.save writes a zip archive
        raise CheckpointError(f"{path}: not an sbd_kernels checkpoint (not a torch.save archive)")
    if not zipfile.is_zipfile(file):   # the central directory, at the very end of the file, is missing
        raise CheckpointError(f"{path}: truncated ({size} bytes, the end of the archive is missing: an "
                              "interrupted write or copy?)")
    try:
        with zipfile.ZipFile(file) as archive:
            names = archive.namelist()
            top = names[0].split("/")[0] if names else ""
            if f"{top}/data.pkl" not in names:
                raise CheckpointError(f"{path}: not an sbd_kernels checkpoint (a zip archive, but not one written "
                                      "by torch.save)")
            corrupt = archive.testzip()
    except (CheckpointError, OSError):
        raise
    except Exception as err:  # BadZipFile, zlib.error for a compressed member, RuntimeError for an encrypted one
        raise CheckpointError(f"{path}: damaged zip archive ({type(err).__name__}: {err})") from err
    if corrupt is not None:
        raise CheckpointError(f"{path}: damaged: the CRC-32 check failed for {corrupt} (its bytes changed after "
                              "torch.save wrote them: a disk or copy error?)")


def read_training_state(path: str, keys: tuple[str, ...], kind: str) -> dict[str, Any]:
    """`read_torch_file(path)`, checked to be a dict holding every one of `keys` (a training state written
    beside a run for --resume); CheckpointError naming the file, `kind` and the missing keys otherwise."""
    state = read_torch_file(path)
    missing = [key for key in keys if key not in state] if isinstance(state, dict) else list(keys)
    if missing:
        raise CheckpointError(f"{path}: not a training state of {kind} (missing {', '.join(missing)})")
    return state


def _unpickling_reason(err: Exception) -> str:
    """The one informative line of torch's multi-paragraph weights_only error."""
    for line in str(err).splitlines():
        line = line.strip()
        if line.startswith("WeightsUnpickler error:") and line != "WeightsUnpickler error:":
            line = line.removeprefix("WeightsUnpickler error:").strip()
        if line and not line.startswith(("Weights only load failed", "(1)", "(2)", "Check the documentation",
                                         "Please file an issue", "WeightsUnpickler error:")):
            return line.split(". Please use")[0]
    return "an object it may not unpickle"


def _checkpoint_parts(path: str, payload: Any) -> tuple[dict, dict, dict]:
    """(config, state_dict, meta) of a payload that has the structure `save_checkpoint` writes."""
    keys = ("config", "state_dict", "meta")
    if not isinstance(payload, dict) or set(payload) != set(keys):
        got = f"a dict with keys {list(payload)}" if isinstance(payload, dict) else f"a {type(payload).__name__}"
        raise CheckpointError(f"{path}: not an sbd_kernels checkpoint (it holds {got}, expected a dict with keys "
                              "config, state_dict, meta)")
    for key in keys:
        if not isinstance(payload[key], dict):
            raise CheckpointError(f"{path}: {key!r} is a {type(payload[key]).__name__}, expected a dict")
    return payload["config"], payload["state_dict"], payload["meta"]


def _checkpoint_config(path: str, config: dict) -> ModelConfig:
    """The ModelConfig of a checkpoint's config dict: known keys, sizes in CHECKPOINT_LIMITS, finite
    positive floats, and what `ModelConfig` checks (divisible heads, an even head dimension, the mask id)."""
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    for key in config:
        if key not in fields:
            raise CheckpointError(f"{path}: unknown config key {key!r} (known: {', '.join(fields)})")
    for key, field in fields.items():
        if key not in config and field.default is dataclasses.MISSING:
            raise CheckpointError(f"{path}: missing config key {key!r}")
    for key, value in config.items():
        if key in CHECKPOINT_LIMITS:
            if type(value) is not int or not 1 <= value <= CHECKPOINT_LIMITS[key]:
                raise CheckpointError(f"{path}: config {key!r} must be an integer in [1, {CHECKPOINT_LIMITS[key]}], "
                                      f"got {value!r}")
        elif fields[key].type in ("float", float):
            if type(value) not in (int, float) or not (math.isfinite(value) and value > 0):
                raise CheckpointError(f"{path}: config {key!r} must be a finite number > 0, got {value!r}")
        elif type(value) is not int:
            raise CheckpointError(f"{path}: config {key!r} must be an integer, got {value!r}")
    try:
        return ModelConfig(**config)
    except ValueError as err:
        raise CheckpointError(f"{path}: bad config: {err}") from err


def _expected_weights(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every weight of Transformer(cfg), in state_dict order, from a one-layer model on
    the meta device: no memory, and time independent of n_layers."""
    with torch.device("meta"):
        one_layer = Transformer(dataclasses.replace(cfg, n_layers=1)).state_dict()
    per_layer = {name.removeprefix("layers.0."): tuple(t.shape) for name, t in one_layer.items()
                 if name.startswith("layers.0.")}
    first_in_layer = next(iter(per_layer))
    shapes: dict[str, tuple[int, ...]] = {}
    for name, tensor in one_layer.items():
        if name == f"layers.0.{first_in_layer}":
            shapes.update({f"layers.{i}.{n}": shape for i in range(cfg.n_layers) for n, shape in per_layer.items()})
        elif not name.startswith("layers."):
            shapes[name] = tuple(tensor.shape)
    return shapes


def _check_checkpoint_weights(path: str, cfg: ModelConfig, state: dict) -> None:
    """The state dict holds exactly the weights of cfg, each a dense floating-point tensor of its shape."""
    expected = _expected_weights(cfg)
    parameters = sum(math.prod(shape) for shape in expected.values())
    if parameters > CHECKPOINT_MAX_PARAMETERS:
        raise CheckpointError(f"{path}: the config describes {parameters:.3g} parameters, more than the "
                              f"{CHECKPOINT_MAX_PARAMETERS:.3g} a checkpoint may hold")
    missing = [name for name in expected if name not in state]
    if missing:
        raise CheckpointError(f"{path}: missing weights: {_some(missing)}")
    unexpected = [str(name) for name in state if name not in expected]
    if unexpected:
        raise CheckpointError(f"{path}: unexpected weights: {_some(unexpected)}")
    for name, shape in expected.items():
        weight = state[name]
        if not isinstance(weight, Tensor) or weight.layout != torch.strided:
            kind = f"a {weight.layout} tensor" if isinstance(weight, Tensor) else f"a {type(weight).__name__}"
            raise CheckpointError(f"{path}: weight {name!r} is {kind}, expected a dense tensor")
        if not weight.is_floating_point():
            raise CheckpointError(f"{path}: weight {name!r} has dtype {weight.dtype}, expected a floating-point "
                                  "dtype")
        if tuple(weight.shape) != shape:
            raise CheckpointError(f"{path}: weight {name!r} has shape {list(weight.shape)}, the config gives "
                                  f"{list(shape)}")


def _some(names: list[str], shown: int = 4) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
