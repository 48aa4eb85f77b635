"""Kernel launches as data: what a Triton launcher runs, and what `python -m sbd_kernels.aot` compiles.

Each launcher in `sbd_kernels/ops/<family>/triton.py` builds its launches as `KernelLaunch` records (kernel,
grid, every argument by name, the constexprs it picked, warps, stages) and runs them with `launch`. Its
`aot_specs()` runs the same building code on META tensors (no memory, no data) of representative calls that
reach every configuration the launcher can pick, and turns each launch into a `KernelSpec` with
`spec_of_launch`: the signature is what Triton's JIT derives from the argument values at run time, so a
change of a launcher's arguments or constexprs changes the compiled configurations with it.

`python -m sbd_kernels.aot` compiles every spec for sm_80 and sm_90 with no GPU present, which catches what
the interpreter lets through.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import triton

# Streaming multiprocessors of an H100 SXM, the GPU the launchers' occupancy targets were measured on: the
# count used where no CUDA device is asked (CPU tensors under TRITON_INTERPRET, META tensors of the AOT
# enumeration). A launch on a CUDA tensor reads its device's count (`sm_count`).
DEFAULT_SM_COUNT = 132
# Software-pipelining depth of a launch that does not choose one: Triton's own default on CUDA
# (`CUDAOptions.num_stages` in Triton 3.8), passed explicitly so that the AOT compile uses it too.
TRITON_DEFAULT_NUM_STAGES = 3
# CUDA's limits on a launch grid (CUDA C Programming Guide, "Technical Specifications per Compute Capability",
# every capability Triton targets): 2^31 - 1 programs along axis 0 (x), 65535 along axes 1 and 2 (y, z). A
# launch past them fails. The launchers put every size-dependent count on axis 0 and name the argument that
# passes MAX_GRID_X; axis 1 holds only a split count bounded by the SM count.
MAX_GRID_X = 2**31 - 1
# Floating-point contraction (a * b + c as one FMA), as the kernels were tuned and their tolerances set with:
# Triton's default through 3.9, which warns that the default turns to off in 3.10 (TRITON_DEFAULT_FP_FUSION).
# Passed with every launch, compile and warm-up, so that the version installed changes neither the code nor
# the cache key; TRITON_FORCE_DISABLE_FP_FUSION=1 still turns it off.
ENABLE_FP_FUSION = True


def unspecialised_jit(fn):
    """`@triton.jit` with Triton's specialisation on argument values turned off: no int argument becomes a
    constexpr when it equals 1, and no int or pointer argument is compiled apart when it is divisible by
    16 (`do_not_specialize` and `do_not_specialize_on_alignment` name every runtime argument). A kernel then
    compiles once per configuration its launcher picks (dtypes, the constexprs, warps, stages; an int
    argument is still i32 or i64 by its range), exactly the configurations `aot_specs()` lists, and what
    alignment buys is passed on purpose: each launcher checks pointers and strides on the host and sets a
    constexpr under which the kernel hints the compiler (`tl.multiple_of`, `tl.max_contiguous`).

    Why: with the JIT's own specialisation, the 5477 launches of the kernel test files (keys recorded under
    the interpreter) ask for 4148 distinct compiles on CUDA (offset views, strides and sizes of 1, sizes off
    a multiple of 16: each combination is one more variant), 175 without it; at 2-5 s a compile on one
    core, that is what kept the test stage of `sbd gpu-check` from finishing in 10 minutes. In an engine,
    each new batch size or block length whose divisibility differs would likewise stall a step for a
    compile."""
    runtime = [name for name, is_constexpr, _ in kernel_parameters(fn) if not is_constexpr]
    return triton.jit(fn, do_not_specialize=runtime, do_not_specialize_on_alignment=runtime)


class KernelLaunch(NamedTuple):
    """One launch `kernel[grid](**args, **constexprs, **compile_options(num_warps, num_stages))`.

    args: every runtime argument of `kernel` by name (tensors, ints, floats).
    constexprs: every `tl.constexpr` argument by name: the compile-time choices of the launch.
    """

    kernel: Any
    grid: tuple[int, ...]
    args: dict[str, Any]
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int = TRITON_DEFAULT_NUM_STAGES


def compile_options(num_warps: int, num_stages: int) -> dict[str, Any]:
    """The compile options of a launch, an AOT compile or a warm-up of the same configuration: one key."""
    return {"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": ENABLE_FP_FUSION}


def launch(launches: list[KernelLaunch]) -> None:
    """Run the launches in order (one stream, no host sync)."""
    for kl in launches:
        kl.kernel[kl.grid](**kl.args, **kl.constexprs, **compile_options(kl.num_warps, kl.num_stages))


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, b > 0. On the host instead of `triton.cdiv`, a constexpr_function whose call
    costs 1.4 us against 0.01 us (Triton 3.8); a launch computes about ten of these."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1). On the host instead of `triton.next_power_of_2` (1.4 us
    a call, as `cdiv`)."""
    return 1 << max(n - 1, 0).bit_length()


_SM_COUNTS: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA `device` (read once per device: a driver attribute, no host
    sync), DEFAULT_SM_COUNT for any other device."""
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    index = device.index if device.index is not None else torch.cuda.current_device()
    count = _SM_COUNTS.get(index)
    if count is None:
        count = _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


def rows_aligned(*tensors: torch.Tensor) -> bool:
    """True when every tensor has a contiguous last dim and 16-byte aligned data and row strides: what a
    kernel's ALIGNED constexpr promises, under which its rows load and store as 16-byte vectors (kernels
    compile without Triton's own alignment specialisation, see `unspecialised_jit`). Reads pointers and
    strides only, never data; META tensors (data pointer 0) of contiguous shapes are aligned."""
    for t in tensors:
        if t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any(stride * t.element_size() % 16 for stride in t.stride()[:-1]):
            return False
    return True


def compiles_for_gpu(device: torch.device) -> bool:
    """Whether a launch on `device` runs compiled GPU code: CUDA tensors, and the META tensors that stand for
    them in the AOT enumeration; CPU tensors run under the interpreter."""
    return device.type in ("cuda", "meta")


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
    num_stages: int = TRITON_DEFAULT_NUM_STAGES

    def options(self) -> dict[str, Any]:
        """`compile_options` of this configuration: what its launches pass."""
        return compile_options(self.num_warps, self.num_stages)

    @property
    def configuration(self) -> tuple:
        """What is compiled: (kernel, argument types, constexpr values, warps, stages). The kernels are built
        with `unspecialised_jit`, so every GPU launch of this configuration runs this one compile."""
        return (_function_name(self.fn), tuple(self.signature.items()), tuple(sorted(self.constexprs.items())),
                self.num_warps, self.num_stages)


def _function_name(kernel) -> str:
    fn = getattr(kernel, "fn", kernel)
    return f"{fn.__module__}.{fn.__qualname__}"


@functools.cache
def kernel_parameters(kernel) -> tuple[tuple[str, bool, bool], ...]:
    """(name, is constexpr, specialised) of every argument of a `@triton.jit` function, in order, read from
    its Python signature as Triton does (a `tl.constexpr` annotation); works for compiled and interpreted
    functions. specialised: False for the arguments named in `do_not_specialize`. Raises ValueError for a
    runtime argument with a type annotation (Triton then types it by the annotation, which `spec_of_launch`
    does not follow)."""
    fn = getattr(kernel, "fn", kernel)
    unspecialised = getattr(kernel, "do_not_specialize", None) or getattr(kernel, "kwargs", {}).get(
        "do_not_specialize") or ()
    params = []
    for i, p in enumerate(inspect.signature(fn).parameters.values()):
        annotation = "" if p.annotation is inspect.Parameter.empty else str(p.annotation)
        is_constexpr = "constexpr" in annotation
        if annotation and not is_constexpr:
            raise ValueError(f"{_function_name(kernel)}: argument {p.name} is annotated {annotation}; compile specs "
                             "are derived for unannotated runtime arguments only")
        params.append((p.name, is_constexpr, p.name not in unspecialised and i not in unspecialised))
    return tuple(params)


def triton_type(value: Any, specialise: bool = True) -> str:
    """The signature type Triton's JIT gives a runtime argument value: "*<dtype>" for a tensor, "i32" /
    "i64" / "u64" for an int by its range, "u1" for a bool, "fp32" for a float, and "constexpr" for an int
    equal to 1 (unless not `specialise`d) or None. Triton's own rule (`triton.runtime.jit.mangle_type`), asked
    without value specialisation, which changes no type but that of the int 1 (triton 3.5's mangle_type
    raises TypeError when asked to specialise a tensor or an int)."""
    from triton.runtime.jit import mangle_type

    if specialise and type(value) is int and value == 1:
        return "constexpr"
    return mangle_type(value, False)


def spec_of_launch(name: str, kl: KernelLaunch) -> KernelSpec:
    """The compile job a GPU run of `kl` starts: each runtime argument typed by `triton_type` of its value,
    each constexpr as given. Raises ValueError when the launch does not name every argument of its kernel
    exactly once, or passes a constexpr as a runtime argument (or the reverse)."""
    params = kernel_parameters(kl.kernel)
    runtime = [p for p, is_constexpr, _ in params if not is_constexpr]
    constant = [p for p, is_constexpr, _ in params if is_constexpr]
    if set(kl.args) != set(runtime) or set(kl.constexprs) != set(constant):
        raise ValueError(
            f"{name}: launch arguments do not match {_function_name(kl.kernel)}: runtime arguments missing "
            f"{sorted(set(runtime) - set(kl.args))}, unknown {sorted(set(kl.args) - set(runtime))}; "
            f"constexprs missing {sorted(set(constant) - set(kl.constexprs))}, unknown "
            f"{sorted(set(kl.constexprs) - set(constant))}")
    signature, constexprs = {}, {}
    for param, is_constexpr, specialised in params:
        if is_constexpr:
            signature[param] = "constexpr"
            constexprs[param] = kl.constexprs[param]
            continue
        value = kl.args[param]
        signature[param] = triton_type(value, specialised)
        if signature[param] == "constexpr":
            constexprs[param] = value
    return KernelSpec(name, kl.kernel, signature, constexprs, kl.num_warps, kl.num_stages)


def unique_specs(specs: list[KernelSpec]) -> list[KernelSpec]:
    """The specs with one per name, in first-seen order. Raises ValueError when two specs share a name but
    not a configuration (the name would not identify what is compiled)."""
    by_name: dict[str, KernelSpec] = {}
    for spec in specs:
        seen = by_name.setdefault(spec.name, spec)
        if seen.configuration != spec.configuration:
            raise ValueError(f"two configurations are named {spec.name!r}:\n{seen}\n{spec}")
    return list(by_name.values())
