"""End-to-end decode benchmark: one model forward (`Transformer.decode_pass`) with 1, k and 2k query tokens.

    python -m pytest bench/bench_decode.py -q                  # batch 1/4/8/16 x cache 512..16384
    SBD_BENCH_QUICK=1 python -m pytest bench/bench_decode.py -q   # the grid's corners, 3 minutes here
    python -m sbd_kernels.roofline --measured <pytest --benchmark-json output>   # prediction vs measurement

The three widths are the three pass kinds of decoding (docs/algorithm.md §3): t = 1 an NTP step (1 causal row
appended to the cache), t = k a later pass of an SBD block (k block rows, nothing cached), t = 2k the first
pass of a block (k causal rows appended + k block rows). Random-weight models with the shapes of the `small`
preset (fp32, the bundled checkpoints' model) and of a 1B-class config (Llama-3.2-1B shapes, bf16), the
`sbd` ops in every layer, the cache filled to L tokens before every call.

Each case (config, dtype, batch, cache length, k) has three providers "sbd t=1", "sbd t=k", "sbd t=2k";
the baseline is "sbd t=1", so the report's speedup column reads time(1) / time(t), the inverse of the SBD
slowdown time(t) / time(1) that the roofline model predicts (paper Sec. 4). The shape and this machine's
ceilings (measured at the bench's thread count, 1 by default, see THREADS) are stored in extra_info["decode"]
for `sbd roofline --measured`. bytes_moved and flops are the
roofline model's counts for the forward (`sbd_kernels.roofline.forward_work`). correct: the logits match a
forward through the pure-PyTorch attention oracle on the same inputs and cache.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import pytest
import torch

from bench.common import (
    DTYPES_BY_NAME,
    measure_copy_bandwidth_gbs,
    measure_matmul_peak_gflops,
    quick_grid,
    record,
    run_timed,
)
from sbd_kernels import roofline
from sbd_kernels.model import KVCache, ModelConfig, Transformer
from sbd_kernels.ops.attention.naive import block_attention_with_kvcache as naive_attention
from sbd_kernels.testing import tolerance

FAMILY = "decode"
BLOCK = 16  # the paper's k

# Llama-3.2-1B shapes (1.5B parameters with untied embeddings; 16 layers, GQA 32/8, head_dim 64).
ONE_B = {"vocab_size": 128256, "dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "ffn_dim": 8192,
             "max_seq_len": 16384 + 2 * BLOCK, "rope_theta": 500000.0, "mask_token_id": 128255}
SMALL = {**ModelConfig.preset("small").__dict__, "max_seq_len": 16384 + 2 * BLOCK}
# (name, config, dtype). The 1B config runs in bf16: half the bytes of fp32, and on this CPU bf16 GEMMs with
# 16-512 rows ran 4-10x faster than fp32 (measured: 27.7 vs 4.0 GFLOP/s at 16 x 2048 x 8192).
CONFIGS = {"small": (SMALL, "fp32"), "1b": (ONE_B, "bf16")}

# Every batch x cache length whose KV cache fits SBD_BENCH_DECODE_CACHE_GB (default 4 GiB: the 1B cache at
# batch 16 x 16384 is 8.6 GB). SBD_BENCH_QUICK=1: the small model at the corners of the range, the 1B model
# at batch 1 x 512 only (its 1-token forward took 0.25 s here, its 2k-token one 0.6 s, on 1 thread).
FULL_GRID = ([1, 4, 8, 16], [512, 1024, 2048, 4096, 8192, 16384])
QUICK_GRID = {"small": ([1, 16], [512, 16384]), "1b": ([1], [512])}
# torch threads while timing. 1 by default: on this 2-core machine shared with other jobs, 2 OpenMP threads
# stalled at every GEMM barrier (small preset, 16-row fp32 matmuls of 128 x 384: 49 ms each with 2 threads,
# a full forward 1.4 ms with 1 thread). SBD_BENCH_DECODE_THREADS sets another count.
THREADS = int(os.environ.get("SBD_BENCH_DECODE_THREADS", "1"))
# Timed rounds (plus run_timed's 3 warm-up rounds): 10 for the small model (its forwards took 20 ms-1.6 s
# here), 3 for the 1B model, which keeps its case under a minute; SBD_BENCH_ROUNDS overrides both.
ROUNDS = {"small": 10, "1b": 3}


@pytest.fixture(autouse=True)
def decode_threads():
    """The bench's thread count for each test, torch's previous one restored for the other bench files."""
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(before)


@functools.cache
def ceilings(threads: int) -> dict:
    """Copy bandwidth and matmul peaks measured at the bench's thread count (the roofline of `sbd roofline
    --measured` must use the same threads as the timings; `bench.common.machine_ceilings` uses torch's
    default count)."""
    return {"copy_gbs": measure_copy_bandwidth_gbs(), "threads": threads,
            "matmul_gflops": {n: measure_matmul_peak_gflops(DTYPES_BY_NAME[n]) for n in ("fp32", "bf16")}}


def grid() -> list[tuple[str, int, int, int]]:
    """(config name, batch, cache length, tokens), grouped by config and cache so each model and cache is
    built once."""
    cases = []
    for name in CONFIGS:
        batches, lengths = QUICK_GRID[name] if quick_grid() else FULL_GRID
        for batch in batches:
            for kv_len in lengths:
                for tokens in (1, BLOCK, 2 * BLOCK):
                    cases.append((name, batch, kv_len, tokens))
    return cases


def cache_gib(name: str, batch: int, kv_len: int) -> float:
    cfg, dtype = CONFIGS[name]
    head_dim = cfg["dim"] // cfg["n_heads"]
    elements = 2 * cfg["n_layers"] * batch * (kv_len + 2 * BLOCK) * cfg["n_kv_heads"] * head_dim
    return elements * DTYPES_BY_NAME[dtype].itemsize / 2**30


_MODEL: dict[str, Transformer] = {}
_CACHE: dict[tuple, KVCache] = {}


def random_model(name: str) -> Transformer:
    """Seeded random weights in the config's dtype, built without an fp32 copy (uniform +-0.02: the same
    spread as the std 0.02 normal init, and 10x faster to fill for 1.5B parameters)."""
    if name not in _MODEL:
        _MODEL.clear()
        _CACHE.clear()
        cfg, dtype = CONFIGS[name]
        with torch.device("meta"):
            model = Transformer(ModelConfig(**cfg))
        model = model.to_empty(device="cpu").to(DTYPES_BY_NAME[dtype]).eval()
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for pname, param in model.named_parameters():
                if pname.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.copy_(torch.rand(param.shape, generator=gen, dtype=param.dtype) * 0.04 - 0.02)
        _MODEL[name] = model
    return _MODEL[name]


def filled_cache(name: str, model: Transformer, batch: int, kv_len: int) -> KVCache:
    """A cache of batch x (kv_len + 2k) slots, random K/V, one cache alive at a time."""
    key = (name, batch, kv_len)
    if key not in _CACHE:
        _CACHE.clear()
        cache = KVCache.for_model(model, batch, kv_len + 2 * BLOCK)
        gen = torch.Generator().manual_seed(1)
        for t in (*cache.k, *cache.v):
            t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype))
        _CACHE[key] = cache
    return _CACHE[key]


def pass_inputs(cfg: ModelConfig, batch: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(tokens [B, t], num_causal [B] int32, block_size) of the pass kind with `tokens` rows."""
    ids = torch.randint(0, cfg.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(tokens))
    num_causal, block_size = {1: (1, 0), BLOCK: (0, BLOCK), 2 * BLOCK: (BLOCK, BLOCK)}[tokens]
    return ids, torch.full((batch,), num_causal, dtype=torch.int32), block_size


def matches_oracle(model: Transformer, cache: KVCache, kv_len: int, inputs, logits: torch.Tensor) -> bool:
    """Logits of the same pass through the attention oracle, within the tolerance row of the model's dtype
    widened 10x for the sum over layers (the check `sbd demo` applies to cached block logits)."""
    cache.seqlens.fill_(kv_len)
    expected = model.decode_pass(*inputs, cache, attention_op=naive_attention)
    atol, rtol = tolerance(next(model.parameters()).dtype)
    err = (logits - expected).abs().max().item()
    return err <= 10 * atol + rtol * expected.abs().max().item()


@pytest.mark.parametrize("name,batch,kv_len,tokens", grid())
@torch.inference_mode()
def test_decode_pass(benchmark, name, batch, kv_len, tokens):
    limit = float(os.environ.get("SBD_BENCH_DECODE_CACHE_GB", "4"))
    if cache_gib(name, batch, kv_len) > limit:
        pytest.skip(f"{name}: KV cache of {cache_gib(name, batch, kv_len):.1f} GiB over "
                    f"SBD_BENCH_DECODE_CACHE_GB={limit:g}")
    model = random_model(name)
    cfg, dtype = model.config, CONFIGS[name][1]
    cache = filled_cache(name, model, batch, kv_len)
    inputs = pass_inputs(cfg, batch, tokens)

    def call():
        cache.seqlens.fill_(kv_len)  # the pass appends its causal rows; every call starts from L tokens
        return model.decode_pass(*inputs, cache)

    correct = matches_oracle(model, cache, kv_len, inputs, call())
    flops, nbytes = roofline.forward_work(cfg, batch, tokens, kv_len, roofline.PRECISIONS[dtype],
                                          num_causal=int(inputs[1][0]))
    record(benchmark, family=FAMILY, case=f"{name} {dtype} B={batch} L={kv_len} k={BLOCK}",
           provider=f"sbd t={tokens}", baseline="sbd t=1", bytes_moved=int(nbytes), flops=int(flops),
           correct=correct)
    benchmark.extra_info["decode"] = {"config": dataclasses.asdict(cfg), "dtype": dtype, "batch": batch,
                                      "kv_len": kv_len, "k": BLOCK, "tokens": tokens,
                                      "ceilings": ceilings(THREADS)}
    run_timed(benchmark, call, rounds=None if "SBD_BENCH_ROUNDS" in os.environ else ROUNDS[name])
