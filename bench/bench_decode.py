"""End-to-end decode benchmark: one model forward (`Transformer.decode_pass`) with 1, k and 2k query tokens.

    python -m pytest bench/bench_decode.py -q                  # batch 1/4/8/16 x cache 512..16384
    SBD_BENCH_QUICK=1 python -m pytest bench/bench_decode.py -q   # the grid's corners, 3 minutes here
    python -m sbd_kernels.roofline --measured <pytest --benchmark-json output>   # prediction vs measurement

The three widths are the three pass kinds of decoding (docs/algorithm.md §3): t = 1 an NTP step (1 causal row
appended to the cache), t = k a later pass of an SBD block (k block rows, nothing cached), t = 2k the first
pass of a block (k causal rows appended + k block rows). Random-weight models with the shapes of the `small`
preset (fp32, the bundled checkpoints' model) and of a 1B-class config (Llama-3.2-1B shapes, bf16), the
`sbd` ops in every layer, the cache filled to L tokens before every call; on `bench_device()`, the CPU or
the GPU (then the ops' Triton kernels, and the forward also replayed from a CUDA graph).

Each pass computes the logits the decoder reads, as `sbd_kernels.generate` does (`keep_last`,
`roofline.logit_rows`): the NTP row, the k block rows of both block passes (the first pass's k causal rows only
fill the cache).

Each case (config, dtype, batch, cache length, k) has three providers "sbd t=1", "sbd t=k", "sbd t=2k";
the baseline is "sbd t=1", so the report's speedup column reads time(1) / time(t), the inverse of the SBD
slowdown time(t) / time(1) that the roofline model predicts (paper Sec. 4). The shape and this machine's
ceilings (measured at the bench's thread count, 1 by default, see THREADS; on CUDA the GPU's datasheet, None
without a datasheet entry) are stored in extra_info["decode"] for `sbd roofline --measured`. bytes_moved and flops are the
roofline model's counts for the forward (`sbd_kernels.roofline.forward_work`). correct: the logits match a
forward through the pure-PyTorch attention oracle on the same inputs and cache.
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from bench.harness import bench_device, measure, parametrize_shapes, random_weights_, torch_threads
from sbd_kernels import roofline
from sbd_kernels.bench_report import datasheet_ceilings
from sbd_kernels.benchmark_grid import DECODE_BLOCK, DECODE_MODELS, TORCH_DTYPES, DecodeShape, decode_grid
from sbd_kernels.machine import machine_ceilings
from sbd_kernels.model import KVCache, ModelConfig, Transformer
from sbd_kernels.ops.attention.naive import block_attention_with_kvcache as naive_attention
from sbd_kernels.testing import tolerance

FAMILY = "decode"
DEVICE = bench_device()
# Every model is built for the longest cache of the full grid plus one first block pass (2k rows).
MAX_CACHE = max(shape.kv_len for shape in decode_grid())
# torch threads while timing. 1 by default: on this 2-core machine shared with other jobs, 2 OpenMP threads
# stalled at every GEMM barrier (small preset, 16-row fp32 matmuls of 128 x 384: 49 ms each with 2 threads,
# a full forward 1.4 ms with 1 thread). SBD_BENCH_DECODE_THREADS sets another count.
THREADS = int(os.environ.get("SBD_BENCH_DECODE_THREADS", "1"))
# Timed rounds (plus the harness's 3 warm-up rounds): 10 for the small model (its forwards took 20 ms-1.6 s
# here), 3 for the 1B model, which keeps its case under a minute; SBD_BENCH_ROUNDS overrides both.
ROUNDS = {"small": 10, "1b": 3}
# On CUDA: rounds of 10 forwards each (a forward takes milliseconds there, eagerly), so that the quick grid's
# 15 cases stay within the 45 s `sbd gpu-check` gives this file.
CUDA_ROUNDS = 10


def model_config(name: str) -> ModelConfig:
    """The ModelConfig of a DECODE_MODELS entry (a preset name or explicit dims), with room for MAX_CACHE
    cached tokens and a 2k-row pass."""
    preset_or_dims, _ = DECODE_MODELS[name]
    dims = ModelConfig.preset(preset_or_dims).__dict__ if isinstance(preset_or_dims, str) else preset_or_dims
    return ModelConfig(**{**dims, "max_seq_len": MAX_CACHE + 2 * DECODE_BLOCK})


@pytest.fixture(autouse=True)
def decode_threads():
    """THREADS torch threads for each test of this file."""
    with torch_threads(THREADS):
        yield


def cache_gib(shape: DecodeShape) -> float:
    cfg = model_config(shape.model)
    head_dim = cfg.dim // cfg.n_heads
    elements = 2 * cfg.n_layers * shape.batch * (shape.kv_len + 2 * shape.k) * cfg.n_kv_heads * head_dim
    return elements * TORCH_DTYPES[shape.dtype].itemsize / 2**30


_MODEL: dict[str, Transformer] = {}
_CACHE: dict[tuple, KVCache] = {}


def random_model(name: str) -> Transformer:
    """Seeded random weights in the model's dtype, built without an fp32 copy (uniform +-0.02: the same
    spread as the std 0.02 normal init, and 10x faster to fill for 1.5B parameters)."""
    if name not in _MODEL:
        _MODEL.clear()
        _CACHE.clear()
        with torch.device("meta"):
            model = Transformer(model_config(name))
        _MODEL[name] = random_weights_(model.to_empty(device=DEVICE).to(TORCH_DTYPES[DECODE_MODELS[name][1]]))
    return _MODEL[name]


def filled_cache(shape: DecodeShape, model: Transformer) -> KVCache:
    """A cache of batch x (kv_len + 2k) slots, random K/V, one cache alive at a time."""
    key = (shape.model, shape.batch, shape.kv_len)
    if key not in _CACHE:
        _CACHE.clear()
        cache = model.new_cache(shape.batch, shape.kv_len + 2 * shape.k)
        gen = torch.Generator(device=DEVICE).manual_seed(1)
        for t in (*cache.k, *cache.v):
            t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype, device=DEVICE))
        _CACHE[key] = cache
    return _CACHE[key]


def pass_inputs(cfg: ModelConfig, shape: DecodeShape) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(tokens [B, t], num_causal [B] int32, block_size) of the pass kind with `shape.tokens` rows."""
    batch, tokens, k = shape.batch, shape.tokens, shape.k
    ids = torch.randint(0, cfg.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(tokens))
    num_causal, block_size = {1: (1, 0), k: (0, k), 2 * k: (k, k)}[tokens]
    return ids.to(DEVICE), torch.full((batch,), num_causal, dtype=torch.int32, device=DEVICE), block_size


def ceilings() -> dict | None:
    """What the roofline comparison sets the timings against: this CPU's measured ceilings at the bench's
    thread count, or on CUDA the GPU's datasheet (None for a GPU without a datasheet entry)."""
    if DEVICE == "cuda":
        return datasheet_ceilings(torch.cuda.get_device_name())
    return {**machine_ceilings(), "threads": THREADS}


def matches_oracle(model: Transformer, cache: KVCache, kv_len: int, inputs, keep_last: int,
                   logits: torch.Tensor) -> bool:
    """Logits of the same pass through the attention oracle, within the tolerance row of the model's dtype
    widened 10x for the sum over layers (the check `sbd demo` applies to cached block logits)."""
    cache.seqlens.fill_(kv_len)
    expected = model.decode_pass(*inputs, cache, attention_op=naive_attention, keep_last=keep_last)
    atol, rtol = tolerance(next(model.parameters()).dtype)
    err = (logits - expected).abs().max().item()
    return err <= 10 * atol + rtol * expected.abs().max().item()


@parametrize_shapes(FAMILY)
@torch.inference_mode()
def test_decode_pass(benchmark, shape):
    limit = float(os.environ.get("SBD_BENCH_DECODE_CACHE_GB", "4"))
    if cache_gib(shape) > limit:
        pytest.skip(f"{shape.model}: KV cache of {cache_gib(shape):.1f} GiB over "
                    f"SBD_BENCH_DECODE_CACHE_GB={limit:g}")
    model = random_model(shape.model)
    cfg = model.config
    cache = filled_cache(shape, model)
    inputs = pass_inputs(cfg, shape)
    keep_last = roofline.logit_rows(shape.tokens, int(inputs[1][0]))

    def call():
        cache.seqlens.fill_(shape.kv_len)  # the pass appends its causal rows; every call starts from L tokens
        return model.decode_pass(*inputs, cache, keep_last=keep_last)

    correct = matches_oracle(model, cache, shape.kv_len, inputs, keep_last, call())
    flops, nbytes = roofline.forward_work(cfg, shape.batch, shape.tokens, shape.kv_len,
                                          roofline.PRECISIONS[shape.dtype], num_causal=int(inputs[1][0]))
    # The roofline of `sbd roofline --measured` must use the ceilings at the threads of the timings.
    benchmark.extra_info["decode"] = {"config": dataclasses.asdict(cfg), "dtype": shape.dtype,
                                      "batch": shape.batch, "kv_len": shape.kv_len, "k": shape.k,
                                      "tokens": shape.tokens, "ceilings": ceilings()}
    measure(benchmark, call, family=FAMILY, shape=shape, provider=shape.provider, baseline="sbd t=1",
            device=DEVICE, bytes_moved=int(nbytes), flops=int(flops), correct=correct, rounds=ROUNDS[shape.model],
            cuda_rounds=CUDA_ROUNDS)
