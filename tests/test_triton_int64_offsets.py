"""Addresses of the Triton kernels as compiled for a GPU: int64 wherever an offset can pass 2^31 elements.

Compiled, an index times a stride typed i32 (Triton types any int argument below 2^31 so) is an int32
product, which wraps once it passes 2^31: the kernel then reads or writes another address, silently. The
interpreter wraps int32 products too, and a few kernel tests reach past 2^31 through views of sparse file
mappings (`sbd_kernels.testing.sparse_strided_copy`), but most offsets need real sizes no test can allocate
(the partials of 306M rows, a cache of 2^31 elements in one head). So the kernels are compiled here to
Triton's IR (TTIR) for sm_90 with no GPU present (the front end of `triton.compile`, a fraction of a second
per kernel), and the offset operand of every `tt.addptr` is read: each i32 one must be among the few the
kernels keep in int32 on purpose, an index bounded far below 2^31 whatever the tensors' sizes and strides
(`I32_OFFSETS`), every other one is a defect.
"""
from __future__ import annotations

import json
import linecache
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from sbd_kernels.ops.attention import triton as attention_triton
from sbd_kernels.ops.sampling import triton as sampling_triton
from sbd_kernels.ops.scatter import triton as scatter_triton
from sbd_kernels.testing import WRAP_GUARD, sparse_strided_copy

REPO = Path(__file__).resolve().parents[1]

# Offsets the kernels keep in int32, by a pattern of the source line that computes them, with the bound
# that keeps them below 2^31 (vector offsets in int64 take two registers an entry).
I32_OFFSETS = {
    r"\brow_ptr \+ (v|token)\b": "an entry of a row of logits, below V + 8192 <= MAX_VOCAB + 8192 (checked by "
                                 "the sampling launcher)",
    r"\bcand_ptr \+ (\d \* )?(BLOCK \+ )?lane\b": "an entry of a row's candidates, below 8 x 1024",
    r"\bs \* _PARTIAL_(FLOATS|INTS)\b": "a chunk's entry in a row's partials, below 64 x 7",
}

# The configurations compiled, per family: every kernel with each optional tensor read (temperature,
# compute_mask, filters, gamma, valid, a paged cache) and both alignments, so that every address
# computation of the kernels appears. fp32: the dtype changes no offset.
CONFIGURATIONS = {
    "scatter": [
        "mask_scatter_/accept BLOCK_K=16 rule=eb gamma=tensor valid=yes",
        "mask_scatter_/accept BLOCK_K=16 rule=threshold gamma=tensor valid=yes",
    ],
    "sampling": [
        "entropy_sample/threshold fp32 temperature=tensor mask=True filters=tensor BLOCK=1024 PIVOTS=16",
        "entropy_sample/partial fp32 temperature=tensor mask=True filtered BLOCK=1024 aligned",
        "entropy_sample/partial fp32 temperature=tensor mask=True filtered BLOCK=128 unaligned",
        "entropy_sample/combine fp32 temperature=tensor mask=True SPLITS=64",
    ],
    "attention": [
        "attention/split fp32 M16 N32 D16 paged aligned",
        "attention/split fp32 M16 N16 D16 contig unaligned",
        "attention/split fp32 M16 N16 D16 paged unaligned",
        "attention/combine fp32 D16 aligned",
        "attention/combine fp32 D16 unaligned",
    ],
}
MODULES = {"scatter": scatter_triton, "sampling": sampling_triton, "attention": attention_triton}

# Prints {spec name: TTIR} of the named configurations of one family, compiled for sm_90: the stages of
# `triton.compile` up to TTIR (its make_ir and the backend's "ttir" stage), in a process without
# TRITON_INTERPRET (under it, the kernels are not compilable functions).
TTIR_OF_SPECS = """
import json, sys
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from sbd_kernels import aot

family, names = sys.argv[1], sys.argv[2:]
specs = {spec.name: spec for spec in aot.collect_specs((family,))}
target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)
ttir = {}
for name in names:
    spec = specs[name]
    options = backend.parse_options(spec.options())
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    src = ASTSource(fn=spec.fn, signature=spec.signature, constexprs=spec.constexprs)
    module = src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                         context)
    stages = {}
    backend.add_stages(stages, options, src.language)
    ttir[name] = str(stages["ttir"](module, {}))
print(json.dumps(ttir))
"""


class Offset(NamedTuple):
    """An i32 offset of a `tt.addptr`: the source line that computes it."""

    path: str
    line: int
    source: str


_LOC_ALIAS = re.compile(r"^(#loc\d*) = loc\((.*)\)$", re.MULTILINE)
_ADDPTR = re.compile(r"= tt\.addptr %[\w#.]+, (%[\w#.]+) : [^,]+, (\S+) loc\((.*)\)$", re.MULTILINE)
_CONSTANT = re.compile(r"^\s*(%[\w#.]+) = arith\.constant ", re.MULTILINE)


def _source_location(loc: str, aliases: dict[str, str]) -> tuple[str, int] | None:
    """(file, line) of an MLIR location: a file location, an alias, a named location, or the callee's of an
    inlined call site (the line of the jit function that computes the value)."""
    if loc in aliases:
        return _source_location(aliases[loc], aliases)
    if m := re.fullmatch(r'"([^"]+)":(\d+):\d+', loc):
        return m.group(1), int(m.group(2))
    if m := re.fullmatch(r"callsite\((#loc\d*) at (#loc\d*)\)", loc):
        return _source_location(m.group(1), aliases) or _source_location(m.group(2), aliases)
    if m := re.fullmatch(r'"[^"]*"\((#loc\d*)\)', loc):
        return _source_location(m.group(1), aliases)
    return None


def addptr_offsets(ttir: str) -> tuple[int, list[Offset]]:
    """(number of `tt.addptr`, the i32 offsets among them that are not constants) of a TTIR module."""
    aliases = dict(_LOC_ALIAS.findall(ttir))
    constants = set(_CONSTANT.findall(ttir))
    addptrs = _ADDPTR.findall(ttir)
    i32 = []
    for offset, offset_type, loc in addptrs:
        if not re.fullmatch(r"i32|tensor<[\dx]+xi32>", offset_type) or offset in constants:
            continue
        where = _source_location(loc, aliases)
        if where is None:
            i32.append(Offset("?", 0, f"{offset} at loc({loc})"))
        else:
            i32.append(Offset(where[0], where[1], linecache.getline(where[0], where[1]).strip()))
    return len(addptrs), i32


def unexplained(offsets: list[Offset]) -> list[Offset]:
    """The offsets that no pattern of I32_OFFSETS explains."""
    return [o for o in offsets if not any(re.search(pattern, o.source) for pattern in I32_OFFSETS)]


def compile_ttir(family: str, names: list[str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", TTIR_OF_SPECS, family, *names], cwd=REPO, env=env,
                          capture_output=True, text=True, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


SAMPLE_TTIR = """
#loc = loc("/k.py":1:0)
module {
  tt.func public @k(%x_ptr: !tt.ptr<f32> loc("x_ptr"(#loc)), %stride: i32 loc("stride"(#loc))) {
    %c1_i32 = arith.constant 1 : i32 loc(#loc)
    %offs = tt.make_range {end = 16 : i32, start = 0 : i32} : tensor<16xi32> loc(#loc1)
    %0 = arith.muli %offs, %stride_0 : tensor<16xi32> loc(#loc2)
    %1 = tt.addptr %x_0, %0 : tensor<16x!tt.ptr<f32>>, tensor<16xi32> loc(#loc3)
    %2 = tt.addptr %x_ptr, %c1_i32 : !tt.ptr<f32>, i32 loc(#loc3)
    %3 = tt.addptr %x_ptr, %row : !tt.ptr<f32>, i64 loc(#loc4)
    %4 = tt.addptr %x_ptr, %row_32 : !tt.ptr<f32>, i32 loc(callsite(#loc5 at #loc4))
  } loc(#loc)
} loc(#loc)
#loc1 = loc("/k.py":2:0)
#loc2 = loc("/k.py":3:0)
#loc3 = loc("/k.py":4:0)
#loc4 = loc("/k.py":5:0)
#loc5 = loc("x_ptr"(#loc6))
#loc6 = loc("/helper.py":7:3)
"""


def test_addptr_offsets_finds_i32_offsets_and_their_lines():
    """Guards against a parser that misses what the kernels' test must see (it would pass on any kernel): an
    i32 vector offset and an i32 scalar one computed in an inlined helper are found with their source lines;
    a constant offset and an i64 one are not reported."""
    count, offsets = addptr_offsets(SAMPLE_TTIR)
    assert count == 4
    assert [(o.path, o.line) for o in offsets] == [("/k.py", 4), ("/helper.py", 7)]


def test_the_compiled_configurations_are_listed():
    """Guards against a configuration name that `aot_specs()` no longer lists (the compile would fail on a
    missing key instead of checking the kernel)."""
    for family, names in CONFIGURATIONS.items():
        listed = {spec.name for spec in MODULES[family].aot_specs()}
        assert set(names) <= listed, sorted(set(names) - listed)


@pytest.mark.parametrize("family", sorted(CONFIGURATIONS))
def test_offsets_are_int64_unless_bounded(family):
    """Guards against int32 addresses on the GPU: a position times its stride in mask_scatter_ (position 255
    of positions 2^24 elements apart lands 4.3e9 elements in); in entropy_sample the sequence index times the
    stride of a strided seed, offset, temperature or filter view, or a row's partials at row x splits x 7
    (past 306M rows); in the attention kernels any q, k, v, cache, out, lse or partial state offset (a
    head-major cache [B, 32, 600000, 128] passes 2^31 elements from KV head 28 on), whatever sizes the
    kernel tests can reach."""
    report = []
    for name, ttir in compile_ttir(family, CONFIGURATIONS[family]).items():
        count, offsets = addptr_offsets(ttir)
        assert count > 0, f"{name}: no tt.addptr found in its TTIR"
        report += [f"{name}: {o.path}:{o.line}: {o.source}" for o in unexplained(offsets)]
    assert not report, "int32 offsets:\n" + "\n".join(report)


def test_sparse_strided_copy_keeps_the_tensor_and_refuses_overlapping_slices(tmp_path):
    """Guards the helper of the tests past 2^31 elements: a copy equals its tensor, its dimension `dim` at the
    stride asked, WRAP_GUARD elements into the mapping; a stride below the other dimensions' packed extent
    would overlap the slices (the copy keeping the last one, a test passing on wrong data), and is refused."""
    t = torch.arange(16, dtype=torch.int32).reshape(2, 8)
    wide = sparse_strided_copy(t, 0, 2**20, tmp_path / "wide")
    assert torch.equal(wide, t) and wide.stride() == (2**20, 1) and wide.storage_offset() == WRAP_GUARD
    with pytest.raises(ValueError, match=r"dimension 0 of t \[2, 8\] needs a stride of at least 8 elements"):
        sparse_strided_copy(t, 0, 4, tmp_path / "overlapping")
