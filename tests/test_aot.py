"""Tests of the AOT compile specs and the GPU static report's bookkeeping (`sbd_kernels.ops._aot`,
`sbd_kernels.aot`), without compiling any kernel (`make aot`, in CI, compiles them), and of the device the
CUDA registration launches on (`sbd_kernels.ops._cuda`), with stand-ins for CUDA devices.

The specs are derived from the launchers' own launch-building code run on META tensors; the sweeps below
run that code on many more shapes and layouts than `aot_specs()` enumerates and check that each launch's
configuration is one `aot_specs()` lists under the same name.
"""
from __future__ import annotations

import contextlib
import importlib
import itertools
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import triton

from sbd_kernels.aot import (
    FAMILIES,
    HINT_ARCH,
    CompileResult,
    collect_picks,
    count_global_accesses,
    format_hints,
    format_picks,
    hinted_picks,
    theoretical_occupancy,
    unhinted,
)
from sbd_kernels.ops import _aot, _cuda
from sbd_kernels.ops._aot import (
    DEFAULT_SM_COUNT,
    KernelLaunch,
    kernel_parameters,
    spec_of_launch,
    unique_specs,
)
from sbd_kernels.ops.attention import triton as attention_triton
from sbd_kernels.ops.sampling import triton as sampling_triton
from sbd_kernels.ops.scatter import triton as scatter_triton

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _module(family: str):
    return importlib.import_module(f"sbd_kernels.ops.{family}.triton")


@pytest.fixture(scope="module")
def listed() -> dict[str, dict[str, _aot.KernelSpec]]:
    """aot_specs() of each family, by name."""
    return {family: {spec.name: spec for spec in _module(family).aot_specs()} for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_benchmark_picks_name_listed_specs(family, listed):
    """Guards against a launcher picking, at a shape of the benchmark grid, a configuration that
    `aot_specs()` does not list (it would never be compiled nor checked for spills), or a spec renamed on
    one side only."""
    picks = collect_picks((family,))
    assert picks, f"{family}: no benchmark picks"
    missing = [(shape, spec) for shape, spec in picks if spec not in listed[family]]
    assert not missing, f"{family}: picks not in aot_specs(): {missing}"


def test_docs_state_the_current_compile_count():
    """Guards against the README and docs/performance.md quoting a stale number of `make aot` compiles (the
    launchers gained or lost configurations): the "(N compiles" each states is len(specs) x architectures."""
    from pathlib import Path

    from sbd_kernels.aot import DEFAULT_ARCHS, collect_specs

    compiles = len(collect_specs()) * len(DEFAULT_ARCHS)
    repo = Path(__file__).resolve().parent.parent
    for doc in ("README.md", "docs/performance.md"):
        stated = re.findall(r"\((\d+)\s+compiles\b", (repo / doc).read_text())
        assert stated and {int(n) for n in stated} == {compiles}, f"{doc} states {stated}, `make aot` runs {compiles}"


def test_spec_names_are_unique():
    """Guards against two configurations sharing a name, which would make a pick ambiguous."""
    names = [spec.name for family in FAMILIES for spec in _module(family).aot_specs()]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("family", FAMILIES)
def test_specs_type_every_kernel_argument(family, listed):
    """Guards against a compile spec that does not follow its kernel's parameter list (an argument added,
    removed or renamed): every argument in order, constexprs with a value, the others with a Triton type."""
    for spec in listed[family].values():
        params = kernel_parameters(spec.fn)
        assert list(spec.signature) == [name for name, _, _ in params], spec.name
        for name, is_constexpr, _ in params:
            if is_constexpr:
                assert spec.signature[name] == "constexpr" and name in spec.constexprs, (spec.name, name)
            else:
                assert spec.signature[name] != "constexpr", (spec.name, name)


@pytest.mark.parametrize("family", FAMILIES)
def test_kernels_compile_without_value_specialisation(family, listed):
    """Guards against a kernel built with a plain `@triton.jit`: Triton would then compile it apart for each
    runtime int equal to 1 and each int or pointer divisible by 16 or not (4148 compiles for the kernel test
    files on CUDA, against 175), variants that `aot_specs()` never compiles nor checks for spills."""
    for spec in listed[family].values():
        runtime = [name for name, is_constexpr, _ in kernel_parameters(spec.fn) if not is_constexpr]
        options = getattr(spec.fn, "kwargs", None) or vars(spec.fn)  # interpreted, or compiled, kernels
        assert not [name for name, is_constexpr, specialised in kernel_parameters(spec.fn)
                    if specialised and not is_constexpr], spec.name
        assert set(options.get("do_not_specialize_on_alignment") or ()) >= set(runtime), spec.name


def test_triton_type_is_the_jit_specialisation():
    """Guards against deriving signatures by rules other than the JIT's: pointer dtypes (bool is *u1, not
    *i1), ints by range, 1 specialised to a constexpr unless do_not_specialize, floats as fp32."""
    meta = {"device": "meta"}
    assert _aot.triton_type(torch.empty(2, dtype=torch.bfloat16, **meta)) == "*bf16"
    assert _aot.triton_type(torch.empty(2, dtype=torch.bool, **meta)) == "*u1"
    assert _aot.triton_type(torch.empty(2, dtype=torch.int64, **meta)) == "*i64"
    assert [_aot.triton_type(v) for v in (0, 1, 2**31 - 1, 2**31, -2**31 - 1)] == [
        "i32", "constexpr", "i32", "i64", "i64"]
    assert _aot.triton_type(1, specialise=False) == "i32"
    assert _aot.triton_type(0.5) == "fp32"


PTXAS_RERUN = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sbd_kernels import aot
spec = min(aot.collect_specs(("scatter",)), key=lambda s: s.name)
result = aot.compile_spec(spec, 90)
assert result.ok, result.error
compiled = triton.compile(ASTSource(fn=spec.fn, signature=spec.signature, constexprs=spec.constexprs),
                          target=GPUTarget("cuda", 90, 32),
                          options=spec.options())
print(result.regs, result.spill_bytes, *aot.ptxas_usage(compiled.asm["ptx"], 90))
"""


def test_ptxas_rerun_reads_the_usage_of_the_compile():
    """Guards against the ptxas rerun of a cached compile (`aot.ptxas_usage`, whose register and spill counts
    are what `python -m sbd_kernels.aot` reports on a cache hit) breaking with Triton's internals (triton 3.5's
    get_ptxas takes no arch): on one configuration, compiled for sm_90 (not interpreted, hence a process of
    its own), it reads the registers and spills of the compile itself."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", PTXAS_RERUN], capture_output=True, text=True, env=env,
                          check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    regs, spills, rerun_regs, rerun_spills = map(int, proc.stdout.split())
    assert (rerun_regs, rerun_spills) == (regs, spills) and regs > 0


def test_host_integer_helpers_match_triton():
    """Guards against an off-by-one in the host replacements of triton.cdiv and triton.next_power_of_2
    (tile counts, split lengths, BLOCK_K / BLOCK_D / BLOCK_M)."""
    for a in range(600):
        assert _aot.next_power_of_2(a) == max(1, triton.next_power_of_2(a)), a
        for b in (1, 2, 16, 63, 512):
            assert _aot.cdiv(a, b) == triton.cdiv(a, b), (a, b)
    assert _aot.next_power_of_2(2**40 + 1) == 2**41


def _one_launch(family: str) -> KernelLaunch:
    if family == "attention":
        return attention_triton.meta_launches(2, 64, 8, 2, 64, 4, 4, torch.bfloat16)[0]
    if family == "sampling":
        return sampling_triton.meta_launches(2, 4, 1000, torch.bfloat16, top_k_val=50)[0]
    return scatter_triton.meta_launches(2, 16)[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_spec_of_launch_rejects_launches_that_miss_the_kernel(family):
    """Guards against a launch whose argument names drift from its kernel's (a parameter renamed or added
    on one side), or that passes a constexpr as a runtime argument, turning into a spec silently."""
    kl = _one_launch(family)
    spec_of_launch("ok", kl)
    first_arg, first_constexpr = next(iter(kl.args)), next(iter(kl.constexprs))
    missing = {name: value for name, value in kl.args.items() if name != first_arg}
    moved = {**kl.args, first_constexpr: kl.constexprs[first_constexpr]}
    kept = {name: value for name, value in kl.constexprs.items() if name != first_constexpr}
    for bad in (kl._replace(args=missing), kl._replace(args={**kl.args, "extra": 3}),
                kl._replace(args=moved, constexprs=kept)):
        with pytest.raises(ValueError, match="launch arguments do not match"):
            spec_of_launch("bad", bad)


def test_unique_specs_rejects_one_name_for_two_configurations():
    """Guards against a constexpr choice that the spec name does not show: two configurations would then
    share a name and only one of them would be compiled."""
    kl = _one_launch("scatter")
    spec = spec_of_launch("same", kl)
    other = spec_of_launch("same", kl._replace(constexprs={**kl.constexprs, "IS_EB": not kl.constexprs["IS_EB"]}))
    assert unique_specs([spec, spec]) == [spec]
    with pytest.raises(ValueError, match="two configurations are named 'same'"):
        unique_specs([spec, other])


def _assert_listed(family: str, launches: list[KernelLaunch], listed, case) -> None:
    """Each launch compiles exactly a listed spec: its name, argument types, constexprs, warps and stages."""
    for spec in _module(family).specs_of_launches(launches):
        aot = listed[family].get(spec.name)
        assert aot is not None, f"{case}: {spec.name} not in aot_specs()"
        assert spec == aot, f"{case}: {spec.name} differs from its aot spec:\n{spec}\n{aot}"


def _meta(shape, dtype, layout: str = "contiguous") -> torch.Tensor:
    """A META tensor of `shape`: contiguous, at a data pointer 2 elements past an aligned one ("offset"),
    with rows padded by one element ("padded") or every other element of the last dim ("strided")."""
    if layout == "offset":
        return torch.empty(torch.Size(shape).numel() + 2, dtype=dtype, device="meta")[2:].view(shape)
    if layout == "padded":
        return torch.empty(*shape[:-1], shape[-1] + 1, dtype=dtype, device="meta")[..., :shape[-1]]
    if layout == "strided":
        return torch.empty(*shape[:-1], 2 * shape[-1], dtype=dtype, device="meta")[..., ::2]
    return torch.empty(shape, dtype=dtype, device="meta")


HEAD_DIMS = (1, 8, 15, 16, 17, 33, 64, 80, 100, 128, 129, 200, 256)
# (B, Hq, Hkv, C, K, cache slots): MHA and GQA, one row to 128 rows, caches below and above a split.
ATTENTION_SHAPES = ((1, 1, 1, 0, 1, 7), (2, 4, 1, 1, 0, 600), (3, 8, 2, 5, 7, 1024), (1, 32, 8, 16, 16, 4096),
                    (2, 12, 4, 64, 64, 100))


def _attention_call(b, hq, hkv, c, k, slots, head_dim, dtype, paged, layout="contiguous"):
    """Launches of a META call; `layout` applies to q, and to k_cache unless "strided" (caches must have a
    contiguous last dim)."""
    seq = c + k
    cache_shape, block_table = (b, slots, hkv, head_dim), None
    if paged:
        pages = -(-slots // 16)
        cache_shape = (b * pages, 16, hkv, head_dim)
        block_table = _meta((b, pages), torch.int32)
    q = _meta((b, seq, hq, head_dim), dtype, layout)
    kv = [_meta((b, seq, hkv, head_dim), dtype) for _ in range(2)]
    caches = [_meta(cache_shape, dtype, "contiguous" if layout == "strided" else layout), _meta(cache_shape, dtype)]
    index = [_meta((b,), torch.int32), torch.empty(1, dtype=torch.int32, device="meta").expand(b)]
    return attention_triton._attention_launches(q, *kv, *caches, *index, k, block_table)[2]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_attention_launches_on_a_sweep_are_listed(dtype, listed):
    """Guards against a launch configuration that the GPU compile check never compiles (it would first
    fail, or spill, on a user's GPU), or one named like a listed spec but compiled differently: every head
    dim (each BLOCK_D, aligned or not), rows of a KV group from 1 to 512, contiguous and paged caches."""
    for head_dim, shape, paged in itertools.product(HEAD_DIMS, ATTENTION_SHAPES, (False, True)):
        case = (dtype, head_dim, shape, paged)
        _assert_listed("attention", _attention_call(*shape, head_dim, dtype, paged), listed, case)


@pytest.mark.parametrize("layout", ["offset", "padded", "strided"])
def test_attention_launches_of_unaligned_layouts_are_listed(layout, listed):
    """Guards against an unaligned layout (a data pointer off 16 bytes, padded rows, a strided last dim)
    reaching a configuration that `aot_specs()` (which makes rows unaligned by an odd D) never lists."""
    for dtype, head_dim, paged in itertools.product(FLOATS, (16, 64, 128, 256), (False, True)):
        launches = _attention_call(2, 8, 2, 4, 4, 600, head_dim, dtype, paged, layout)
        assert not launches[0].constexprs["ALIGNED"]
        _assert_listed("attention", launches, listed, (layout, dtype, head_dim, paged))


def test_attention_rows_aligned_only_when_the_head_dim_fills_16_bytes():
    """Guards against ALIGNED on a head dim whose rows are padded to 16 bytes but not filled (bf16 D = 12 in
    rows of 16): the head-dim mask's hint would then load elements 12-15 of each row as if they were in it,
    a silently wrong result. Every input is padded to 16-byte rows here: only `out` tells them apart.
    fp32 D = 12 (48 bytes) is aligned."""
    def aligned(dtype, head_dim, stored):
        def rows(*shape):  # every input's rows padded from head_dim to `stored` entries
            return torch.empty(*shape, stored, dtype=dtype, device="meta")[..., :head_dim]

        q, kv, caches = rows(2, 8, 8), [rows(2, 8, 2) for _ in range(2)], [rows(2, 64, 2) for _ in range(2)]
        index = [torch.empty(2, dtype=torch.int32, device="meta") for _ in range(2)]
        launches = attention_triton._attention_launches(q, *kv, *caches, *index, 4)[2]
        return launches[0].constexprs["ALIGNED"]

    assert not aligned(torch.bfloat16, 12, 16)
    assert aligned(torch.float32, 12, 16)
    assert aligned(torch.bfloat16, 16, 24)  # padded q rows, each 32 bytes: aligned


def _scatter_call(batch, k, rule, gamma_tensor, valid, layout):
    """Launches of a META call; `layout` applies to every [B, K] tensor ("transposed": [K, B].T)."""
    def make(dtype):
        if layout == "transposed":
            return _meta((k, batch), dtype).t()
        return _meta((batch, k), dtype, layout)

    tokens, masks = make(torch.int64), make(torch.bool)
    gamma = _meta((batch,), torch.float32, "strided") if gamma_tensor else None
    return scatter_triton._scatter_launches(tokens, masks, make(torch.int64), make(torch.float32), gamma, 0.2,
                                            rule, make(torch.bool) if valid else None)[1]


def test_scatter_launches_on_a_sweep_are_listed(listed):
    """Guards against a scatter launch configuration that `aot_specs()` does not list: K from 1 to 256,
    both rules, gamma tensor or scalar, valid or not, contiguous, transposed and strided layouts."""
    for k, batch, rule, gamma_tensor, valid, layout in itertools.product(
            (1, 2, 15, 16, 17, 31, 63, 64, 100, 128, 200, 256), (1, 3), ("eb", "threshold"), (True, False),
            (True, False), ("contiguous", "transposed", "strided")):
        case = (k, batch, rule, gamma_tensor, valid, layout)
        _assert_listed("scatter", _scatter_call(batch, k, rule, gamma_tensor, valid, layout), listed, case)


# Filter arguments of entropy_sample: off, each scalar (a subnormal top_p goes to the kernel as a tensor),
# one tensor (the launcher fills the other two), all three tensors.
SAMPLING_FILTERS = ("off", "top_k", "top_p", "min_p", "subnormal top_p", "top_k tensor", "tensors")


def _sampling_call(batch, positions, vocab, dtype, temperature, compute_mask, filters, layout):
    """Launches of a META call. temperature: "tensor", or a scalar (1.0, 0.0: greedy, 1e-40: subnormal,
    which goes to the kernels as a tensor). layout applies to logits ("strided": the launcher copies it);
    seed and offset are [B] when contiguous, one shared element ([]) otherwise."""
    meta = {"device": "meta"}
    per_row = (batch,) if layout == "contiguous" else ()
    seed, offset = (torch.empty(per_row, dtype=torch.int64, **meta) for _ in range(2))
    vector = torch.empty(batch, **meta)
    kwargs = {"off": {}, "top_k": {"top_k_val": 50}, "top_p": {"top_p_val": 0.9}, "min_p": {"min_p_val": 0.05},
              "subnormal top_p": {"top_p_val": 1e-40},
              "top_k tensor": {"top_k": torch.empty(batch, dtype=torch.int64, **meta)},
              "tensors": {"top_k": torch.empty(batch, dtype=torch.int64, **meta), "top_p": vector,
                          "min_p": vector.clone()}}[filters]
    tensor = temperature == "tensor"
    return sampling_triton._sampling_launches(
        _meta((batch, positions, vocab), dtype, layout), seed, offset, vector.clone() if tensor else None,
        0.0 if tensor else temperature,
        torch.empty(batch, positions, dtype=torch.bool, **meta) if compute_mask else None, vocab - 1, **kwargs)[1]


def test_sampling_rows_are_aligned_only_when_they_load_as_vectors():
    """Guards against ALIGNED (16-byte vector loads of the logits, partial kernel) on rows that do not start
    on 16 bytes or whose last tile's mask would split a vector (V * element size % 16 != 0): a misaligned
    vector load faults on a GPU; against losing it on the layouts most vocabularies have; and against hints
    on the threshold kernel, whose search loads one entry per thread in the layout of its pivot sums."""
    def flags(vocab, dtype=torch.float32, layout="contiguous"):
        launches = _sampling_call(2, 4, vocab, dtype, 1.0, False, "top_k", layout)
        assert launches[0].kernel is sampling_triton._sampling_threshold_kernel
        assert "ALIGNED" not in launches[0].constexprs
        return [kl.constexprs["ALIGNED"] for kl in launches if "ALIGNED" in kl.constexprs]

    assert flags(32000) == [True]  # partial
    assert flags(128256, torch.bfloat16) == [True]
    assert flags(32004, torch.bfloat16) == [False]  # 64 008 bytes a row: not a multiple of 16
    assert flags(32001) == [False]
    assert flags(32000, layout="offset") == [False]
    assert flags(32000, layout="padded") == [False]
    assert flags(32000, layout="strided") == [True]  # copied to contiguous rows first
    assert flags(1024) == [False]  # the small tile has no aligned configuration


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_sampling_launches_on_a_sweep_are_listed(dtype, listed):
    """Guards against an entropy_sample launch configuration that `aot_specs()` does not list (never
    compiled nor checked for spills), or one named like a listed spec but compiled differently: vocabularies
    from 1 to 151936 (both tiles), every filter form, temperature as tensor / scalar / greedy / subnormal,
    compute_mask or not, and logits rows contiguous, padded or strided."""
    cases = itertools.product((1, 100, 4095, 4096, 32000, 151936), SAMPLING_FILTERS,
                              ((1, 1, "tensor", False), (3, 16, 1.0, True), (2, 4, 0.0, False), (2, 1, 1e-40, True)),
                              ("contiguous", "padded", "strided"))
    for vocab, filters, (batch, positions, temperature, mask), layout in cases:
        case = (dtype, vocab, filters, batch, positions, temperature, mask, layout)
        _assert_listed("sampling", _sampling_call(batch, positions, vocab, dtype, temperature, mask, filters, layout),
                       listed, case)


def test_sm_count_default_off_cuda(monkeypatch):
    """Guards against the interpreter path (CPU tensors) and the AOT enumeration (META tensors) asking CUDA
    for an SM count: they plan for DEFAULT_SM_COUNT."""
    def no_cuda(*args):
        raise AssertionError("torch.cuda queried")

    monkeypatch.setattr(torch.cuda, "get_device_properties", no_cuda)
    assert _aot.sm_count(torch.device("cpu")) == _aot.sm_count(torch.device("meta")) == DEFAULT_SM_COUNT == 132


def test_sm_count_reads_each_cuda_device_once(monkeypatch):
    """Guards against a hard-coded SM count on CUDA (a 108-SM A100 or a 78-SM H20 would get the H100's
    split counts) and against reading the device properties at every launch."""
    asked = []

    def properties(index):
        asked.append(index)
        return SimpleNamespace(multi_processor_count={0: 108, 1: 78}[index])

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(_aot, "_SM_COUNTS", {})
    counts = [_aot.sm_count(torch.device("cuda", i)) for i in (0, 1, 0, 1)]
    assert counts == [108, 78, 108, 78]
    assert asked == [0, 1]


def test_attention_splits_follow_the_sm_count(monkeypatch):
    """Guards against the split plan ignoring the device's SM count: B = 1, Hkv = 8 and two M tiles make
    16 programs per split, so two waves of 132 SMs want cdiv(264, 16) = 17 cache splits and of 66 SMs 9; a
    cache of 9792 = 17 * 9 * 64 slots (it allows 20 splits) cuts into 17 or 9 splits of whole 64-key tiles."""
    asked = []

    def splits(sms: int) -> int:
        monkeypatch.setattr(attention_triton, "sm_count", lambda device: asked.append(device.type) or sms)
        split, _ = attention_triton.meta_launches(1, 9792, 32, 8, 128, 16, 16, torch.bfloat16)
        return split.args["num_splits"]

    assert (splits(132), splits(66)) == (1 + 17, 1 + 9)
    assert asked == ["meta", "meta"]


def test_sampling_splits_follow_the_sm_count(monkeypatch):
    """Guards against the vocabulary split ignoring the device's SM count, and against chunks (the unit of
    the partial sums) that follow it: 16 rows and four programs per SM want cdiv(528, 16) = 33 splits per
    row on 132 SMs and cdiv(264, 16) = 17 on 66; a vocabulary of 132 tiles of 1024 has 33 chunks of 4
    tiles on both, run 1 or 2 to a program."""
    asked = []

    def plan(sms: int) -> tuple[int, int]:
        monkeypatch.setattr(sampling_triton, "sm_count", lambda device: asked.append(device.type) or sms)
        partial, _ = sampling_triton.meta_launches(1, 16, 132 * 1024, torch.float32)
        return partial.grid[1], partial.args["num_chunks"]

    assert (plan(132), plan(66)) == ((33, 33), (17, 33))
    assert asked == ["meta", "meta"]


def test_sampling_vocabulary_limit_keeps_entry_indices_in_int32():
    """Guards against int32 entry indices wrapping at 2^31, to -2^31, which the kernels' `v < vocab` masks let
    through: the launcher takes V up to MAX_VOCAB, where the first pass's loop counter, one step of 8 tiles
    past V at most, stays below 2^31, and names V above it (META tensors: no memory)."""
    limit = sampling_triton.MAX_VOCAB
    step = sampling_triton.THRESHOLD_FIRST_PASS_TILES * sampling_triton.THRESHOLD_BLOCK
    assert limit - 1 + step < 2**31
    assert len(sampling_triton.meta_launches(9, 1, limit, torch.bfloat16, top_k_val=50)) == 3
    with pytest.raises(RuntimeError, match=f"logits vocabulary V = {limit + 1} must be at most 2\\^31 - 2\\^16"):
        sampling_triton.meta_launches(9, 1, limit + 1, torch.bfloat16, top_k_val=50)


def test_theoretical_occupancy_hand_computed():
    """Guards against a wrong register rounding or limit order in the occupancy formula.

    sm_90, 8 warps, 62 registers, 4096 B shared: 62 * 32 = 1984 registers per warp, rounded up to 2048;
    a block needs 8 * 2048 = 16384 of 65536 -> 4 blocks; shared (4096 + 1024 reserved) allows 44; warps 64 / 8
    allow 8: 4 blocks * 8 warps / 64 = 50%. With 230 registers: 7360 -> 7424 per warp, 59392 per block,
    1 block: 8 / 64 = 12.5%.
    """
    assert theoretical_occupancy(90, regs=62, shared=4096, num_warps=8) == 0.5
    assert theoretical_occupancy(90, regs=230, shared=4096, num_warps=8) == 0.125
    # Shared memory bound on sm_80: 164 KiB / (48 KiB + 1 KiB) = 3 blocks of 4 warps -> 12 / 64.
    assert theoretical_occupancy(80, regs=32, shared=48 * 1024, num_warps=4) == 12 / 64


def test_format_picks_flags_spills_and_unlisted():
    """Guards against the picks table passing a benchmark configuration that spills or was never listed."""
    results = [CompileResult("good", arch, 4, True, 40, 0, 0, 0.5) for arch in (80, 90)]
    results += [CompileResult("spilling", 80, 4, True, 255, 16, 0, 0.125),
                CompileResult("spilling", 90, 4, True, 200, 0, 0, 0.125)]
    picks = [("shape a", "good"), ("shape b", "spilling"), ("shape c", "unknown")]
    table, bad = format_picks(picks, results, (80, 90))
    assert len(table.splitlines()) == 1 + len(picks)
    assert bad == ["shape b: spilling SPILLS", "shape c: unknown NOT LISTED"]


def test_count_global_accesses_reads_loads_and_stores_of_any_width():
    ptx = """
    ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
    @%p1 ld.global.b16 { %rs1 }, [ %rd2 + 0 ];
    st.global.v2.b32 [ %rd3 + 0 ], { %r5, %r6 };
    ld.shared.b32 %r7, [ %r8 ];
    ld.param.u64 %rd4, [param_0];
    """
    assert count_global_accesses(ptx) == 3


def test_unhinted_twin_differs_in_alignment_only():
    """Guards against the hint check comparing a configuration with another tile or warp count (the saving
    would then not be the hints')."""
    spec = next(s for s in _module("attention").aot_specs() if s.constexprs.get("ALIGNED"))
    twin = unhinted(spec)
    assert twin.constexprs == {**spec.constexprs, "ALIGNED": False}
    assert (twin.signature, twin.num_warps, twin.num_stages, twin.fn) == (
        spec.signature, spec.num_warps, spec.num_stages, spec.fn)
    assert twin.name == f"{spec.name} (unhinted)"


def test_hinted_picks_are_the_aligned_benchmark_configurations():
    """Guards against the hint check missing the configurations the benchmarks run (every family with an
    ALIGNED constexpr has aligned picks) or taking an unaligned one."""
    from sbd_kernels.aot import collect_specs

    specs = collect_specs()
    indices = hinted_picks(collect_picks())
    assert all(specs[i].constexprs["ALIGNED"] for i in indices)
    families = {specs[i].name.split("/")[0] for i in indices}
    assert families == {"attention", "entropy_sample"}


def test_format_hints_flags_hints_that_save_no_access():
    """Guards against the hint check passing an aligned configuration that loads element by element (the
    compiler ignored the hints) or one that failed to compile."""
    results = [CompileResult(name, HINT_ARCH, 4, True, 40, 0, 0, 0.5, global_accesses=n)
               for name, n in (("vectors", 6), ("scalars", 162), ("broken", None))]
    results[2].ok = False
    twins = [CompileResult(f"{name} (unhinted)", HINT_ARCH, 4, True, 40, 0, 0, 0.5, global_accesses=162)
             for name in ("vectors", "scalars", "broken")]
    table, bad = format_hints(results, twins)
    assert len(table.splitlines()) == 4
    assert bad == ["scalars: NO VECTORS", "broken: FAILED"]


def test_warmup_arguments_type_as_each_spec():
    """Guards against `--warm` (gpu-check's compile stage) filling Triton's cache under keys no launch asks
    for: the JIT must type each warmup argument as the spec types it (pointer dtypes, i32 / i64, fp32)."""
    from sbd_kernels.aot import collect_specs, warmup_arguments

    for spec in collect_specs():
        runtime = [ty for ty in spec.signature.values() if ty != "constexpr"]
        assert [_aot.triton_type(arg, specialise=False) for arg in warmup_arguments(spec)] == runtime, spec.name


def test_warm_without_a_gpu_says_so_and_compiles_nothing(capsys, monkeypatch):
    """Guards against `python -m sbd_kernels.aot --warm` on a machine without a GPU compiling for some default
    target (a cache no run here would use) instead of stopping with the reason."""
    from sbd_kernels import aot

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(aot, "warm_cache", lambda jobs: pytest.fail("compiled without a GPU"))
    with pytest.raises(SystemExit) as info:
        aot.main(["--warm"])
    assert info.value.code == 2
    assert "--warm compiles for this machine's GPU, and torch" in capsys.readouterr().err


def test_unspecialised_jit_refuses_an_annotated_runtime_argument():
    """Guards against a kernel whose runtime argument carries a type annotation: Triton would type it by the
    annotation, which neither the compile specs nor the warmup arguments follow."""
    def kernel(x_ptr, n: int, BLOCK: triton.language.constexpr):
        pass

    with pytest.raises(ValueError, match="argument n is annotated"):
        _aot.unspecialised_jit(kernel)


def _reports_cuda(index: int) -> torch.Tensor:
    """A CPU tensor whose `device` says cuda:<index>: what the CUDA registration reads of its arguments."""
    class OnCuda(torch.Tensor):
        @property
        def device(self):
            return torch.device("cuda", index)

    return torch.zeros(1).as_subclass(OnCuda)


@pytest.fixture
def cuda_devices(monkeypatch):
    """torch.cuda.current_device and torch.cuda.device on stand-ins: cuda:0 current, and `device(i)` makes i
    current inside its block. Returns the state: {"current": index}."""
    state = {"current": 0}

    @contextlib.contextmanager
    def device(index):
        previous, state["current"] = state["current"], index
        try:
            yield
        finally:
            state["current"] = previous

    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["current"])
    monkeypatch.setattr(torch.cuda, "device", device)
    return state


def test_device_to_enter_follows_the_first_cuda_tensor(cuda_devices):
    """Guards against picking the launch device from the wrong argument: the first CUDA tensor decides (CPU
    tensors and numbers are skipped), and no device is entered when it is the current one."""
    cpu = torch.zeros(1)
    assert _cuda.device_to_enter((cpu, 3, _reports_cuda(1), _reports_cuda(0))) == 1
    assert _cuda.device_to_enter((_reports_cuda(0), _reports_cuda(1))) is None
    assert _cuda.device_to_enter((cpu, 2.0, None)) is None
    cuda_devices["current"] = 1
    assert _cuda.device_to_enter((_reports_cuda(1),)) is None
    assert _cuda.device_to_enter((_reports_cuda(0),)) == 0


def test_cuda_kernel_launches_on_the_device_of_its_tensors(cuda_devices, monkeypatch):
    """Guards against the CUDA kernel of an op launching on the current device: Triton launches on torch's
    current device and stream, so tensors on cuda:1 with cuda:0 current ran on cuda:0 (a model spread over
    GPUs, `sbd generate --device cuda:1`). The launcher (a stand-in here) must run with cuda:1 current, the
    previous device current again afterwards, and with no switch when the tensors are on the current device."""
    seen = []

    def launcher(*args):
        seen.append(cuda_devices["current"])
        return args

    monkeypatch.setitem(sys.modules, "sbd_kernels.ops.standin.triton", SimpleNamespace(standin_op=launcher))
    kernel = _cuda.cuda_kernel_of("standin_op", "standin")
    on_1 = _reports_cuda(1)
    assert kernel(on_1, 5) == (on_1, 5)
    assert kernel(_reports_cuda(0)) and kernel(torch.zeros(1))
    assert seen == [1, 0, 0]
    assert cuda_devices["current"] == 0
