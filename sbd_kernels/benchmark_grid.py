"""The benchmark grid: every shape the benchmarks time, as typed records, in one place.

One record per benchmarked call of an op (or one forward of the decode benchmark). `bench/bench_<family>.py`
parametrises over `<family>_grid(quick)`, the report and the plots read each record back from the timing's
`extra_info["shape"]` (`shape_from_dict`), and `sbd_kernels.aot` asks each Triton launcher which compiled
configurations it picks at these shapes. A case label ("B=1 K=16 V=128256 bf16") is generated from its
record (`label`) and never parsed back.

SBD_BENCH_QUICK=1 selects the quick subset of each family (`quick=True`): the full grid of the four
families took 28 minutes on a 2-core machine, the quick one a few.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class _Labelled:
    """A record's label, generated from (field, text) parts: the report's case, the plots' legends."""

    def label_parts(self) -> list[tuple[str, str]]:
        raise NotImplementedError

    @property
    def label(self) -> str:
        return " ".join(text for _, text in self.label_parts())

    def label_without(self, *names: str) -> str:
        """The label less the parts of `names` (a plot's x axis)."""
        return " ".join(text for name, text in self.label_parts() if name not in names)


@dataclass(frozen=True)
class SamplingShape(_Labelled):
    """`sbd.entropy_sample` on logits [batch, positions, vocab] of `dtype`, scalar `temperature`
    (temperature_val, no per-row tensor), no compute_mask."""

    batch: int
    positions: int
    vocab: int
    dtype: str
    temperature: float = 1.0  # the case that needs the random numbers
    top_k: int = 0            # sampling filters (scalar fallbacks top_k_val / top_p_val); 0 / 1.0 = off
    top_p: float = 1.0

    def label_parts(self) -> list[tuple[str, str]]:
        parts = [("batch", f"B={self.batch}"), ("positions", f"K={self.positions}"), ("vocab", f"V={self.vocab}"),
                 ("dtype", self.dtype)]
        if self.top_k:
            parts.append(("top_k", f"top-k={self.top_k}"))
        if self.top_p < 1.0:
            parts.append(("top_p", f"top-p={self.top_p:g}"))
        return parts

    @property
    def test_id(self) -> str:
        filters = (f"-k{self.top_k}" if self.top_k else "") + (f"-p{self.top_p:g}" if self.top_p < 1.0 else "")
        return f"{self.batch}-{self.positions}-{self.vocab}-{self.dtype}{filters}"


@dataclass(frozen=True)
class ScatterShape(_Labelled):
    """`sbd.mask_scatter_` on [batch, block] positions with `rule`, gamma given per row as a [batch]
    tensor of `gamma`, no valid mask."""

    batch: int
    block: int
    rule: str = "eb"
    # The paper's "high" setting for chat (docs/algorithm.md §3.7): entropies uniform in [0, 0.2): 4-5
    # positions of a 16-block are accepted, a realistic mid-block pass.
    gamma: float = 0.35

    def label_parts(self) -> list[tuple[str, str]]:
        return [("batch", f"B={self.batch}"), ("block", f"K={self.block}"), ("rule", self.rule)]

    @property
    def test_id(self) -> str:
        return f"{self.batch}-{self.block}"


@dataclass(frozen=True)
class AttentionShape(_Labelled):
    """`sbd.block_attention_with_kvcache`: one SBD pass of `causal` rows appended to a contiguous cache
    holding `length` tokens, and a `block` of bidirectional rows, in `dtype`."""

    batch: int
    length: int
    dtype: str
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    causal: int = 16
    block: int = 16

    @property
    def seq(self) -> int:
        """S = C + K query rows per sequence."""
        return self.causal + self.block

    def label_parts(self) -> list[tuple[str, str]]:
        return [("batch", f"B={self.batch}"), ("q_heads", f"Hq={self.q_heads}"), ("kv_heads", f"Hkv={self.kv_heads}"),
                ("head_dim", f"D={self.head_dim}"), ("causal", f"C={self.causal}"), ("block", f"K={self.block}"),
                ("length", f"L={self.length}"), ("dtype", self.dtype)]

    @property
    def test_id(self) -> str:
        return f"{self.batch}-{self.length}-{self.dtype}"


# Llama-3.2-1B shapes (1.5B parameters with untied embeddings; 16 layers, GQA 32/8, head_dim 64).
LLAMA_1B_DIMS = {"vocab_size": 128256, "dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8,
                 "ffn_dim": 8192, "rope_theta": 500000.0, "mask_token_id": 128255}
# Decode models: (ModelConfig preset name or explicit dims, dtype). `small` is the bundled checkpoints'
# model, in fp32; the 1B model runs in bf16: half the bytes of fp32, and on a CPU with AVX512-BF16 bf16
# GEMMs of 16-512 rows ran 4-10x faster than fp32 (27.7 vs 4.0 GFLOP/s at 16 x 2048 x 8192).
DECODE_MODELS: dict[str, tuple[str | dict, str]] = {"small": ("small", "fp32"), "1b": (LLAMA_1B_DIMS, "bf16")}
DECODE_BLOCK = 16  # the paper's k
# (batches, cache lengths) of the decode grid; the cases whose cache exceeds SBD_BENCH_DECODE_CACHE_GB are
# skipped at run time (bench/bench_decode.py).
_DECODE_AXES = ((1, 4, 8, 16), (512, 1024, 2048, 4096, 8192, 16384))
_DECODE_QUICK_AXES = {"small": ((1, 16), (512, 16384)), "1b": ((1,), (512,))}


@dataclass(frozen=True)
class DecodeShape(_Labelled):
    """One forward (`Transformer.decode_pass`) of `model` (a DECODE_MODELS key) with `tokens` query rows per
    sequence over a cache of `kv_len` tokens: 1 (an NTP step), k (a later pass of an SBD block) or 2k (the
    first pass of a block). The three widths of one (model, batch, kv_len) are the providers of one case."""

    model: str
    batch: int
    kv_len: int
    tokens: int
    k: int = DECODE_BLOCK

    @property
    def dtype(self) -> str:
        return DECODE_MODELS[self.model][1]

    def label_parts(self) -> list[tuple[str, str]]:
        """The case of the three widths: `tokens` is the provider, not part of the label."""
        return [("model", self.model), ("dtype", self.dtype), ("batch", f"B={self.batch}"),
                ("kv_len", f"L={self.kv_len}"), ("k", f"k={self.k}")]

    @property
    def provider(self) -> str:
        return f"sbd t={self.tokens}"

    @property
    def test_id(self) -> str:
        return f"{self.model}-{self.batch}-{self.kv_len}-{self.tokens}"


# Hugging Face Llama configs of the HF decode benchmark (transformers names), both run in bf16: a small model
# (the regime where per-pass overhead decides) and Llama-3.2-1B's shapes.
HF_MODELS: dict[str, dict] = {
    "small": {"vocab_size": 32000, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2},
    "1b": {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
           "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0},
}
# The small model as a Mistral with a sliding window in every layer, shorter than the decodes (64 + 64 tokens and
# a block): its decode passes past W run the windowed layers' PyTorch path (`sbd_kernels.hf.torch_attention`).
HF_MODELS["small-swa"] = {**HF_MODELS["small"], "model_type": "mistral", "sliding_window": 32}
# The small model as a Gemma 2: soft-capped attention scores (50) in every layer, so every decode pass runs its
# attention in PyTorch over the whole cache, and a window of 32 in every other layer; HF runs it eager (it refuses
# sdpa, which has no cap).
HF_MODELS["small-gemma2"] = {**HF_MODELS["small"], "model_type": "gemma2", "head_dim": 64, "query_pre_attn_scalar": 64,
                             "sliding_window": 32, "attn_implementation": "eager"}


@dataclass(frozen=True)
class HfDecodeShape(_Labelled):
    """A whole decode of `new_tokens` tokens after `prompt` prompt tokens by a random-weight HF model (`model`, an
    HF_MODELS key: a Llama unless it names another model_type; bf16) for `batch` sequences. Providers: HF greedy `generate`, our NTP decode
    through the ops, our SBD decode (block `k`) through the ops."""

    model: str
    batch: int
    prompt: int = 64
    new_tokens: int = 64
    k: int = 16

    def label_parts(self) -> list[tuple[str, str]]:
        return [("model", f"hf-{self.model}"), ("batch", f"B={self.batch}"), ("prompt", f"P={self.prompt}"),
                ("new_tokens", f"N={self.new_tokens}"), ("k", f"k={self.k}")]

    @property
    def test_id(self) -> str:
        return f"{self.model}-{self.batch}"


Shape = SamplingShape | ScatterShape | AttentionShape | DecodeShape | HfDecodeShape
SHAPE_TYPES: dict[str, type] = {"sampling": SamplingShape, "scatter": ScatterShape,
                                "attention": AttentionShape, "decode": DecodeShape, "hf": HfDecodeShape}


def sampling_grid(quick: bool = False) -> list[SamplingShape]:
    """Llama-2 / Llama-3 / Qwen vocabularies, one position and a k = 16 block, batch 1 and 8, fp32 and bf16;
    then the filters of a serving stack's defaults, top-k 50 and top-p 0.9, at a k = 16 block of the Llama-3 and
    Qwen vocabularies. quick: batch 1 and the first two vocabularies, filters at 128256 only."""
    vocabs, batches = ((32000, 128256), (1,)) if quick else ((32000, 128256, 151936), (1, 8))
    plain = [SamplingShape(batch, positions, vocab, dtype)
             for batch in batches for positions in (1, 16) for vocab in vocabs for dtype in ("fp32", "bf16")]
    filter_vocabs = (128256,) if quick else (128256, 151936)
    filtered = [SamplingShape(batch, 16, vocab, dtype, **filters)
                for batch in batches for vocab in filter_vocabs for dtype in ("fp32", "bf16")
                for filters in ({"top_k": 50}, {"top_p": 0.9})]
    return plain + filtered


def scatter_grid(quick: bool = False) -> list[ScatterShape]:
    """Batch 1, 16, 128 and blocks of 16 and 32 (the same grid when quick: every case takes microseconds)."""
    return [ScatterShape(batch, block) for batch in (1, 16, 128) for block in (16, 32)]


def attention_grid(quick: bool = False) -> list[AttentionShape]:
    """One SBD pass of a Llama-3-8B-like layer (Hq = 32, Hkv = 8, D = 128, C = K = 16) over caches of 512,
    4096 and 16384 tokens, batch 1 and 4, fp32 / bf16 / fp16; quick: batch 1, fp32 and bf16."""
    dtypes, batches = (("fp32", "bf16"), (1,)) if quick else (("fp32", "bf16", "fp16"), (1, 4))
    return [AttentionShape(batch, length, dtype)
            for batch in batches for length in (512, 4096, 16384) for dtype in dtypes]


def decode_grid(quick: bool = False) -> list[DecodeShape]:
    """Every model x batch 1/4/8/16 x cache 512-16384 x width 1, k, 2k, grouped by model and cache so that
    each model and cache is built once; quick: the small model at the corners of the range, the 1B model at
    batch 1 x 512 only (its 1-token forward took 0.25 s on one core, its 2k-token one 0.6 s)."""
    shapes = []
    for model in DECODE_MODELS:
        batches, lengths = _DECODE_QUICK_AXES[model] if quick else _DECODE_AXES
        shapes += [DecodeShape(model, batch, kv_len, tokens) for batch in batches for kv_len in lengths
                   for tokens in (1, DECODE_BLOCK, 2 * DECODE_BLOCK)]
    return shapes


def hf_grid(quick: bool = False) -> list[HfDecodeShape]:
    """Batch 1, 4, 16 of the small model and of the 1B-shaped one (32 new tokens for the 1B model: one of its
    forwards took 0.25-0.6 s at batch 1 on one core here), batch 1 and 16 of the small sliding-window and Gemma 2
    ones; quick:
    the small model at batch 1 and 16."""
    if quick:
        return [HfDecodeShape("small", batch) for batch in (1, 16)]
    return ([HfDecodeShape("small", batch) for batch in (1, 4, 16)]
            + [HfDecodeShape(model, batch) for model in ("small-swa", "small-gemma2") for batch in (1, 16)]
            + [HfDecodeShape("1b", batch, prompt=64, new_tokens=32) for batch in (1, 4, 16)])


GRIDS = {"sampling": sampling_grid, "scatter": scatter_grid, "attention": attention_grid, "decode": decode_grid,
         "hf": hf_grid}


def shape_to_dict(shape: Shape) -> dict:
    """The record's fields, for a benchmark's JSON (`extra_info["shape"]`)."""
    return asdict(shape)


def shape_from_dict(family: str, data: dict) -> Shape:
    """The record of `family` that `shape_to_dict` wrote; fields it does not declare are an error."""
    cls = SHAPE_TYPES[family]
    unknown = set(data) - {f.name for f in fields(cls)}
    if unknown:
        raise ValueError(f"benchmark_grid: {family} shape has unknown fields {sorted(unknown)}")
    return cls(**data)
