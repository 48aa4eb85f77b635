"""Description of one Triton kernel configuration to compile ahead of time for real GPUs.

Each `sbd_kernels/ops/<family>/triton.py` lists, in `aot_specs()`, every configuration its launcher can
pick (block sizes, dtypes, constexpr flags, warps, stages). `python -m sbd_kernels.aot` compiles them all
for sm_80 and sm_90 with no GPU present, which catches what the interpreter lets through.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class KernelSpec:
    """One compile job: `triton.compile(ASTSource(fn, signature, constexprs), target, options)`.

    name: readable id shown in reports, e.g. "entropy_sample/partial bf16 BLOCK_V=2048".
    fn: the `@triton.jit` function.
    signature: every argument of `fn` in order, mapped to a Triton type string ("*fp32", "*bf16", "i32",
        "i64", "fp32", ...) or "constexpr".
    constexprs: values of the constexpr arguments.
    """

    name: str
    fn: Any
    signature: dict[str, str]
    constexprs: dict[str, Any] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 2
