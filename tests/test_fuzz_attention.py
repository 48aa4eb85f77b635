"""Property test of `sbd.block_attention_with_kvcache`: random tiny calls whose every tensor argument is a
view into a larger poisoned buffer, on every backend against the oracle.

Each case (drawn from its seed) picks B 1..4, C 0..4, K 0..4 (S >= 1), Hkv 1..2 with GQA ratio 1 / 2 / 4,
D 8 / 16 / 24, a dtype, a contiguous or paged cache (page size 1..5), ragged L_b and c_b, a softmax_scale,
and a layout for every argument:
- q, k, v: strided or offset views (testing.Embedded), or slices of one fused qkv projection output;
  their padding rows [c_b, C) are NaN (never read);
- cache_seqlens, num_causal, block_table: contiguous, offset, strided (stride 2) or expanded (stride 0)
  views (testing.Embedded); unused block_table entries hold invalid page ids (never read);
- k_cache, v_cache: each a view with permuted, padded strides (contiguous last dim) into its own NaN
  buffer, or the two halves of one combined allocation (FlashInfer's `kv[num_pages, 2, page_size, H, D]`,
  or `kv[B, S_max, 2, H, D]`).
Every backend (C++ CPU op, Triton launcher under the interpreter, or compiled on CUDA copies of the
buffers with SBD_TEST_DEVICE=cuda, the oracle itself) runs on fresh copies of the same buffers; the reference is the oracle on plain contiguous copies. Checks: out and lse within
the tolerance table; the caches bit for bit equal to the reference's; no element of a cache buffer outside
the written slots [L_b, L_b + c_b) changed (poison included); the buffers of read-only arguments unchanged.
Hkv = 2 is drawn only for B <= 2: the interpreter runs B * Hkv * (1 + cache splits + combine tiles) programs
of ~15 ms each, and the default 300 cases should stay near 30 s of CPU time.

A second property, `test_fuzz_cache_aliasing`: two caches placed with random strides in one buffer are
rejected exactly when a brute-force enumeration of their addresses finds a collision.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch
from attention_cases import assert_bitwise_equal
from test_attention_triton import triton_op

from sbd_kernels.ops.attention import naive
from sbd_kernels.testing import FLOAT_DTYPES, Embedded, assert_close, on_device, triton_test_device

INDEX_LAYOUTS = ("contiguous", "offset", "strided", "expanded")
QKV_LAYOUTS = ("strided", "offset", "fused")
CACHE_LAYOUTS = ("own", "combined")
BACKENDS = {"cpu": torch.ops.sbd.block_attention_with_kvcache, "triton": on_device(triton_op, triton_test_device()),
            "naive": naive.block_attention_with_kvcache}
# Invalid page ids for the block_table entries past the pages a sequence uses.
BAD_PAGE_IDS = (-1, 2**31 - 1)


@dataclass
class Spec:
    """Sizes, values and layouts of one random call."""

    B: int
    C: int
    K: int
    Hq: int
    Hkv: int
    D: int
    dtype: torch.dtype
    paged: bool
    page_size: int  # contiguous cache: S_max
    pages_per_seq: int  # contiguous cache: 1
    num_pages: int  # contiguous cache: B
    lengths: list[int]
    causal: list[int]
    scale: float | None
    layouts: dict[str, str]


def draw(seed: int) -> Spec:
    """A random tiny call. Expanded index tensors get equal rows; an expanded (shared) page table gets
    num_causal = 0, since sequences sharing pages must not write them."""
    rng = random.Random(seed)
    B, C = rng.randint(1, 4), rng.randint(0, 4)
    K = rng.randint(0 if C else 1, 4)
    Hkv = rng.choice((1, 2)) if B <= 2 else 1
    paged = rng.random() < 0.5
    layouts = {name: rng.choice(INDEX_LAYOUTS) for name in ("cache_seqlens", "num_causal", "block_table")}
    layouts |= {name: rng.choice(QKV_LAYOUTS) for name in ("q", "k", "v")}
    layouts["cache"] = rng.choice(CACHE_LAYOUTS)
    lengths = [rng.randint(0, 12) for _ in range(B)]
    causal = [rng.randint(0, C) for _ in range(B)]
    if layouts["cache_seqlens"] == "expanded":
        lengths = lengths[:1] * B
    if layouts["num_causal"] == "expanded":
        causal = causal[:1] * B
    if paged and layouts["block_table"] == "expanded":
        causal = [0] * B
    used = max(1, max(l + c for l, c in zip(lengths, causal)))
    if paged:
        page_size = rng.randint(1, 5)
        pages_per_seq = -(-used // page_size) + rng.randint(0, 1)
        num_pages = B * pages_per_seq + rng.randint(0, 2)
    else:
        page_size, pages_per_seq, num_pages = used + rng.randint(0, 3), 1, B
    scale = None if rng.random() < 0.5 else rng.uniform(0.05, 2.0)
    return Spec(B, C, K, Hkv * rng.choice((1, 2, 4)), Hkv, rng.choice((8, 16, 24)), rng.choice(FLOAT_DTYPES),
                paged, page_size, pages_per_seq, num_pages, lengths, causal, scale, layouts)


@dataclass
class View:
    """One argument: `buffer` (a key of Call.buffers) seen with this size, stride and storage offset."""

    buffer: str
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @staticmethod
    def of(buffer: str, t: torch.Tensor) -> View:
        return View(buffer, tuple(t.shape), t.stride(), t.storage_offset())

    def on(self, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        return buffers[self.buffer].as_strided(self.size, self.stride, self.offset)


@dataclass
class Call:
    """The buffers of one call (1-D or not, each its own allocation), the views passed as arguments, and
    the reference: the same values as plain contiguous tensors."""

    spec: Spec
    buffers: dict[str, torch.Tensor]
    views: dict[str, View]
    reference: dict[str, torch.Tensor]

    def args(self, buffers: dict[str, torch.Tensor]) -> tuple:
        """The op's arguments as views of `buffers`."""
        t = {name: view.on(buffers) for name, view in self.views.items()}
        return (t["q"], t["k"], t["v"], t["k_cache"], t["v_cache"], t["cache_seqlens"], t["num_causal"],
                self.spec.K, t.get("block_table"), self.spec.scale)

    def reference_args(self) -> tuple:
        r = {name: t.clone() for name, t in self.reference.items()}
        return (r["q"], r["k"], r["v"], r["k_cache"], r["v_cache"], r["cache_seqlens"], r["num_causal"],
                self.spec.K, r.get("block_table"), self.spec.scale)


def _embed(call: Call, name: str, value: torch.Tensor, layout: str) -> None:
    embedded = Embedded(value, layout)
    call.buffers[name] = embedded.buffer
    call.views[name] = View.of(name, embedded.view)


def _block_table(spec: Spec) -> torch.Tensor:
    """[B, pages_per_seq] distinct page ids (one shared row when expanded); entries past the pages a
    sequence uses hold invalid ids."""
    table = torch.randperm(spec.num_pages)[: spec.B * spec.pages_per_seq].view(spec.B, spec.pages_per_seq)
    if spec.layouts["block_table"] == "expanded":
        table[:] = table[0].clone()
    for b, (length, causal) in enumerate(zip(spec.lengths, spec.causal)):
        used = -(-(length + causal) // spec.page_size)
        if spec.layouts["block_table"] == "expanded":
            used = -(-max(l + c for l, c in zip(spec.lengths, spec.causal)) // spec.page_size)
        for page in range(used, spec.pages_per_seq):
            table[b, page] = BAD_PAGE_IDS[page % 2]
    return table.to(torch.int32)


def _filled_cache(spec: Spec, table: torch.Tensor | None) -> torch.Tensor:
    """[num_pages, page_size, Hkv, D]: random values in slots [0, L_b) of every sequence, NaN elsewhere."""
    cache = torch.full((spec.num_pages, spec.page_size, spec.Hkv, spec.D), float("nan"), dtype=spec.dtype)
    for b, length in enumerate(spec.lengths):
        slots = torch.arange(length)
        page = table[b].long()[slots // spec.page_size] if spec.paged else torch.full_like(slots, b)
        cache[page, slots % spec.page_size] = torch.randn(length, spec.Hkv, spec.D).to(spec.dtype)
    return cache


def _own_cache_view(rng: random.Random, shape: tuple[int, ...],
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(NaN buffer, view of `shape`) with the three outer dims in a random order, each stride padded by
    0..3 elements, a storage offset of 0..3 and the last dim contiguous."""
    order = rng.sample(range(3), 3)  # outermost first
    strides, extent = [0, 0, 0, 1], shape[3] + rng.randint(0, 3)
    for dim in reversed(order):
        strides[dim] = extent
        extent = extent * shape[dim] + rng.randint(0, 3)
    offset = rng.randint(0, 3)
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    buffer = torch.full((offset + span + 3,), float("nan"), dtype=dtype)
    return buffer, buffer.as_strided(shape, strides, offset)


def _place_caches(call: Call, rng: random.Random, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    spec = call.spec
    if spec.layouts["cache"] == "combined":
        if spec.paged:  # FlashInfer: kv[num_pages, 2, page_size, Hkv, D]
            kv = torch.full((spec.num_pages, 2, *k_cache.shape[1:]), float("nan"), dtype=spec.dtype)
            k_view, v_view = kv[:, 0], kv[:, 1]
        else:  # kv[B, S_max, 2, Hkv, D]
            kv = torch.full((*k_cache.shape[:2], 2, *k_cache.shape[2:]), float("nan"), dtype=spec.dtype)
            k_view, v_view = kv[:, :, 0], kv[:, :, 1]
        call.buffers["kv"] = kv
        names = ("kv", "kv")
    else:
        (k_buffer, k_view), (v_buffer, v_view) = (_own_cache_view(rng, tuple(k_cache.shape), spec.dtype)
                                                  for _ in "kv")
        call.buffers["k_buffer"], call.buffers["v_buffer"] = k_buffer, v_buffer
        names = ("k_buffer", "v_buffer")
    k_view.copy_(k_cache)
    v_view.copy_(v_cache)
    call.views["k_cache"], call.views["v_cache"] = View.of(names[0], k_view), View.of(names[1], v_view)


def _place_qkv(call: Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q, k, v by their layouts; those with layout "fused" are slices of one [B, S, heads, D] buffer."""
    spec = call.spec
    fused = [(name, t) for name, t in (("q", q), ("k", k), ("v", v)) if spec.layouts[name] == "fused"]
    if fused:
        heads = sum(t.shape[2] for _, t in fused)
        qkv = torch.full((spec.B, spec.C + spec.K, heads, spec.D), float("nan"), dtype=spec.dtype)
        start = 0
        for name, t in fused:
            view = qkv[:, :, start:start + t.shape[2]]
            view.copy_(t)
            call.views[name] = View.of("qkv", view)
            start += t.shape[2]
        call.buffers["qkv"] = qkv
    for name, t in (("q", q), ("k", k), ("v", v)):
        if spec.layouts[name] != "fused":
            _embed(call, name, t, spec.layouts[name])


def build(seed: int) -> Call:
    """The call of `seed`: buffers, argument views and the reference values."""
    spec = draw(seed)
    torch.manual_seed(seed)
    rng = random.Random(seed + 1)
    call = Call(spec, {}, {}, {})
    S = spec.C + spec.K
    q = torch.randn(spec.B, S, spec.Hq, spec.D).to(spec.dtype)
    k = torch.randn(spec.B, S, spec.Hkv, spec.D).to(spec.dtype)
    v = torch.randn(spec.B, S, spec.Hkv, spec.D).to(spec.dtype)
    for b, causal in enumerate(spec.causal):
        for t in (q, k, v):
            t[b, causal:spec.C] = float("nan")  # padding rows: never read
    table = _block_table(spec) if spec.paged else None
    k_cache, v_cache = _filled_cache(spec, table), _filled_cache(spec, table)
    lengths = torch.tensor(spec.lengths, dtype=torch.int32)
    causal = torch.tensor(spec.causal, dtype=torch.int32)
    call.reference = {"q": q, "k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": lengths,
                      "num_causal": causal}
    _place_qkv(call, q, k, v)
    _place_caches(call, rng, k_cache, v_cache)
    _embed(call, "cache_seqlens", lengths, spec.layouts["cache_seqlens"])
    _embed(call, "num_causal", causal, spec.layouts["num_causal"])
    if table is not None:
        call.reference["block_table"] = table
        _embed(call, "block_table", table, spec.layouts["block_table"])
    return call


def written_masks(call: Call) -> dict[str, torch.Tensor]:
    """Per cache buffer, True at the elements of cache slots [L_b, L_b + c_b) of every sequence."""
    spec = call.spec
    masks = {}
    for name in ("k_cache", "v_cache"):
        view = call.views[name]
        masks.setdefault(view.buffer, torch.zeros(call.buffers[view.buffer].shape, dtype=torch.bool))
        mask_view = view.on(masks)
        for b, (length, causal) in enumerate(zip(spec.lengths, spec.causal)):
            for slot in range(length, length + causal):
                page = int(call.reference["block_table"][b, slot // spec.page_size]) if spec.paged else b
                mask_view[page, slot % spec.page_size] = True
    return masks


def check_backend(call: Call, backend: str, expected: tuple) -> None:
    """Run `backend` on fresh copies of the call's buffers and compare with the reference results."""
    buffers = {name: t.clone() for name, t in call.buffers.items()}
    args = call.args(buffers)
    out, lse = BACKENDS[backend](*args)
    expected_out, expected_lse, expected_k_cache, expected_v_cache = expected
    assert out.dtype == call.spec.dtype and lse.dtype == torch.float32
    assert_close(out, expected_out, name=f"{backend} out")
    assert_close(lse, expected_lse, dtype=torch.float32, name=f"{backend} lse")
    assert_bitwise_equal(args[3], expected_k_cache, f"{backend} k_cache")
    assert_bitwise_equal(args[4], expected_v_cache, f"{backend} v_cache")
    masks = written_masks(call)
    for name, buffer in buffers.items():
        unwritten = ~masks[name] if name in masks else torch.ones(buffer.shape, dtype=torch.bool)
        if buffer.is_floating_point():
            assert_bitwise_equal(buffer[unwritten], call.buffers[name][unwritten], f"{backend} {name} buffer")
        else:
            assert torch.equal(buffer, call.buffers[name]), f"{backend} wrote into the {name} buffer"


def run_case(seed: int) -> None:
    call = build(seed)
    reference = call.reference_args()
    out, lse = naive.block_attention_with_kvcache(*reference)
    expected = (out, lse, reference[3], reference[4])
    for backend in BACKENDS:
        try:
            check_backend(call, backend, expected)
        except (AssertionError, RuntimeError) as error:
            raise AssertionError(f"seed {seed}, {backend}, {call.spec}:\n{error}") from error


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("seed", range(300))
def test_fuzz(seed):
    """Guards against any backend reading an argument as if it were contiguous (index tensors with
    stride 2 or 0, offset views, permuted padded caches, a combined kv allocation, fused qkv), reading
    padding rows or unused page-table entries, or writing anything but the cache slots [L_b, L_b + c_b)."""
    run_case(seed)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("seed", range(300, 900))
def test_fuzz_more_seeds(seed):
    """The same property on 600 more random calls (about 60 s of CPU time)."""
    run_case(seed)


def _addresses(t: torch.Tensor) -> list[int]:
    """Element offsets of every index of `t` in its storage (brute force)."""
    grids = torch.meshgrid(*(torch.arange(n) for n in t.shape), indexing="ij")
    offsets = sum(g * stride for g, stride in zip(grids, t.stride())) + t.storage_offset()
    return offsets.flatten().tolist()


def _random_cache_pair(rng: random.Random, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Two cache views of `shape` in one buffer: either with random strides (last 1, the others 0..3 Hkv D:
    stride 0, interleaved or overlapping) and offsets, or the halves of a combined allocation (a size-2
    dim at a random place) with v's offset moved by -D..D elements half of the time (near misses)."""
    if rng.random() < 0.5:
        buffer = torch.randn(4 * math.prod(shape))
        views = []
        for _ in "kv":
            strides = tuple(rng.randint(0, 3 * shape[3] * shape[2]) for _ in range(3)) + (1,)
            span = 1 + sum((n - 1) * st for n, st in zip(shape, strides))
            views.append(buffer.as_strided(shape, strides, rng.randint(0, max(0, buffer.numel() - span))))
        return views[0], views[1]
    dim = rng.randint(0, 3)
    outer = list(shape[:3])
    outer.insert(dim, 2)
    combined = torch.randn(*outer, 2 * shape[3])[..., :shape[3]]  # rows padded to 2 D
    k_cache, v_cache = combined.select(dim, 0), combined.select(dim, 1)
    shift = rng.randint(-shape[3], shape[3]) if rng.random() < 0.5 else 0
    offset = min(max(0, v_cache.storage_offset() + shift), combined.untyped_storage().nbytes() // 4 - 1 -
                 sum((n - 1) * st for n, st in zip(shape, v_cache.stride())))
    return k_cache, v_cache.as_strided(shape, v_cache.stride(), offset)


def expected_aliasing_error(k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    """The first aliasing error the op must raise for two caches in one buffer, decided by brute force."""
    k_addresses, v_addresses = _addresses(k_cache), _addresses(v_cache)
    for name, addresses in (("k_cache", k_addresses), ("v_cache", v_addresses)):
        if len(set(addresses)) < len(addresses):
            return f"{name} is written in place and must not have elements sharing memory"
    if set(k_addresses) & set(v_addresses):
        return "k_cache is written in place and must not share memory with v_cache"
    return None


@pytest.mark.parametrize("seed", range(200))
def test_fuzz_cache_aliasing(seed):
    """Guards against an aliasing check that is not exact: two caches placed with random strides (stride 0,
    interleaved, overlapping or disjoint) in one buffer must be rejected by the C++ op and the Python
    checks (oracle, Triton launcher, fake kernel) exactly when some of their addresses coincide, with the
    same first message; accepted layouts must give the oracle's result on contiguous copies."""
    rng = random.Random(seed)
    B, S_max, Hkv, D = rng.randint(1, 2), rng.randint(1, 4), rng.randint(1, 2), rng.choice((2, 4))
    k_cache, v_cache = _random_cache_pair(rng, (B, S_max, Hkv, D))
    q, k, v = torch.randn(B, 2, 2 * Hkv, D), torch.randn(B, 2, Hkv, D), torch.randn(B, 2, Hkv, D)
    lengths = torch.tensor([rng.randint(0, S_max - 1) for _ in range(B)], dtype=torch.int32)
    causal = torch.ones(B, dtype=torch.int32)
    args = (q, k, v, k_cache, v_cache, lengths, causal, 1)
    message = expected_aliasing_error(k_cache, v_cache)
    if message is not None:
        for backend in ("cpu", "naive"):
            with pytest.raises(RuntimeError, match=message):
                BACKENDS[backend](*args)
        return
    expected = naive.block_attention_with_kvcache(q, k, v, k_cache.clone(), v_cache.clone(), lengths, causal, 1)
    for backend in ("cpu", "naive"):
        fresh = torch.empty(0).set_(k_cache.untyped_storage()).clone()
        caches = [fresh.as_strided(t.shape, t.stride(), t.storage_offset()) for t in (k_cache, v_cache)]
        out, lse = BACKENDS[backend](q, k, v, *caches, lengths, causal, 1)
        assert_close(out, expected[0], name=f"{backend} out")
        assert_close(lse, expected[1], dtype=torch.float32, name=f"{backend} lse")


def test_draws_cover_every_layout_and_size():
    """Guards against a fuzz grid that silently stops drawing some layout or size (it would then test
    nothing there): the default seeds draw every value of every axis."""
    specs = [draw(seed) for seed in range(300)]
    assert {s.B for s in specs} == {1, 2, 3, 4} and {s.C for s in specs} == set(range(5))
    assert {s.K for s in specs} == set(range(5)) and {s.D for s in specs} == {8, 16, 24}
    assert {s.Hq // s.Hkv for s in specs} == {1, 2, 4} and {s.dtype for s in specs} == set(FLOAT_DTYPES)
    assert {s.paged for s in specs} == {False, True}
    for name, values in (("cache_seqlens", INDEX_LAYOUTS), ("num_causal", INDEX_LAYOUTS), ("q", QKV_LAYOUTS),
                         ("cache", CACHE_LAYOUTS)):
        assert {s.layouts[name] for s in specs} == set(values), name
    assert {s.layouts["block_table"] for s in specs if s.paged} == set(INDEX_LAYOUTS)
    assert {s.scale is None for s in specs} == {False, True}
