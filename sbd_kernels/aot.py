"""GPU compile check: compile every Triton kernel configuration for real GPUs, with no GPU present.

    python -m sbd_kernels.aot                 # sm_80 and sm_90, table on stdout
    python -m sbd_kernels.aot --json out.json --arch 90 --jobs 4
    python -m sbd_kernels.aot --warm          # on a CUDA GPU: fill Triton's cache with every configuration

Each `sbd_kernels/ops/<family>/triton.py` lists in `aot_specs()` every configuration its launcher can pick,
derived from the launcher's own launch-building code run on META tensors (`sbd_kernels.ops._aot`): each
argument is typed as Triton's JIT types it at run time, and the kernels are built without Triton's
specialisation on argument values (`unspecialised_jit`), so these are exactly the compiles a GPU runs. Each
is compiled to PTX and cubin for the target (what the interpreter cannot catch: tl.dot shape limits, shared
memory overflow, unsupported ops, register pressure), then `ptxas -v` is run on the PTX with the flags Triton
uses to read registers and spill bytes, and the theoretical occupancy is derived from registers, shared
memory and warps.

A second table shows, for every shape of the benchmark grid (`sbd_kernels.benchmark_grid`, the shapes
`bench/` times), the configurations the launchers pick there (each family's `picked_specs()`: the same
launch-building code on META tensors of that shape) with their registers, spills and occupancy. A third
checks the alignment hints: each picked configuration with ALIGNED set is compiled again with it off (same
tiles and warps), and must need fewer global load and store instructions, i.e. load its rows as vectors.
Exits 1 if any configuration fails to compile or spills registers, if a picked configuration is not among
the listed ones, or if the hints of an aligned pick save no access.

`--warm`, on a machine with a CUDA GPU, compiles every configuration for that GPU through Triton's own JIT
(`warmup`, with an argument of each type in its signature: the JIT derives the same cache key as a launch of
that configuration) in `--jobs` processes, so that the test and benchmark processes that follow load the
binaries from Triton's cache instead of each compiling them (`sbd gpu-check` runs it before the tests).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import inspect
import io
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import torch

from sbd_kernels import benchmark_grid as grid

FAMILIES = ("sampling", "scatter", "attention")
DEFAULT_ARCHS = (80, 90)

# Per-SM limits used for theoretical occupancy (CUDA C Programming Guide, compute capabilities table):
# registers, max resident warps, max resident blocks, shared memory usable by blocks (bytes), and the
# shared memory the runtime reserves per block (1 KiB on sm_80+).
SM_LIMITS = {
    80: {"regs": 65536, "warps": 64, "blocks": 32, "smem": 164 * 1024, "smem_reserved": 1024},
    90: {"regs": 65536, "warps": 64, "blocks": 32, "smem": 228 * 1024, "smem_reserved": 1024},
}
REG_ALLOC_UNIT = 256  # registers are allocated per warp in units of 256


@dataclass
class CompileResult:
    kernel: str
    arch: int
    num_warps: int
    ok: bool
    regs: int | None = None
    spill_bytes: int | None = None
    shared_bytes: int | None = None
    occupancy: float | None = None
    error: str | None = None
    global_accesses: int | None = None  # ld.global / st.global instructions in the PTX


def theoretical_occupancy(arch: int, regs: int, shared: int, num_warps: int) -> float:
    """Resident warps / max warps per SM, limited by registers, shared memory, warps and blocks."""
    lim = SM_LIMITS[arch]
    regs_per_warp = -(-max(regs, 1) * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    by_regs = lim["regs"] // (regs_per_warp * num_warps)
    by_smem = lim["smem"] // (shared + lim["smem_reserved"]) if shared else lim["blocks"]
    by_warps = lim["warps"] // num_warps
    blocks = min(by_regs, by_smem, by_warps, lim["blocks"])
    return blocks * num_warps / lim["warps"]


def parse_ptxas_log(log: str) -> tuple[int, int] | None:
    """(registers, spill store + load bytes) from a `ptxas -v` log, or None if it holds no usage line."""
    regs = [int(m) for m in re.findall(r"Used (\d+) registers", log)]
    if not regs:
        return None
    return max(regs), sum(int(m) for m in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))


def ptxas_path(arch: int) -> str:
    """The ptxas Triton compiles for `arch` with: `get_ptxas(arch)` from triton 3.6 on (3.9 gives sm_90 the
    newer of its two, ptxas-blackwell, which alone reads its PTX), `get_ptxas()` in 3.5."""
    from triton.backends.nvidia.compiler import get_ptxas

    takes_arch = bool(inspect.signature(get_ptxas).parameters)
    return (get_ptxas(arch) if takes_arch else get_ptxas()).path


def ptxas_usage(ptx: str, arch: int) -> tuple[int, int]:
    """(registers, spill store + load bytes) from `ptxas -v`, run with the flags Triton uses, by the ptxas
    Triton uses for `arch` (`ptxas_path`)."""
    from triton.backends.nvidia.compiler import sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run(
            [ptxas_path(arch), "-v", "--regAllocOptLevel=2", f"--gpu-name={sm_arch_from_capability(arch)}",
             src, "-o", os.path.join(tmp, "k.cubin")],
            capture_output=True, text=True, check=True,
        )
    return parse_ptxas_log(proc.stderr + proc.stdout)


def count_global_accesses(ptx: str) -> int:
    """Global load and store instructions in PTX (`ld.global...`, `st.global...`): a tile that loads as
    16-byte vectors needs 4-8 times fewer than one loaded element by element."""
    return len(re.findall(r"\b(?:ld|st)\.global\.", ptx))


def compile_spec(spec, arch: int) -> CompileResult:
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    result = CompileResult(kernel=spec.name, arch=arch, num_warps=spec.num_warps, ok=False)
    try:
        src = ASTSource(fn=spec.fn, signature=spec.signature, constexprs=spec.constexprs)
        # Triton prints the `ptxas -v` log of the compile it runs; a cache hit runs no ptxas, so then
        # ptxas is run again on the cached PTX (0.6 s against 2-5 s for a whole compile here).
        knobs.nvidia.dump_ptxas_log = True
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=spec.options())
        usage = parse_ptxas_log(log.getvalue()) or ptxas_usage(compiled.asm["ptx"], arch)
        result.regs, result.spill_bytes = usage
        result.shared_bytes = compiled.metadata.shared
        result.occupancy = theoretical_occupancy(arch, result.regs, result.shared_bytes, spec.num_warps)
        result.global_accesses = count_global_accesses(compiled.asm["ptx"])
        result.ok = True
    except Exception as err:  # noqa: BLE001  (report every failing configuration, not just the first)
        result.error = compile_error_line(err)
    return result


def compile_error_line(err: Exception) -> str:
    """One line for a failed compile: the exception's type and the last non-empty line of its message (where
    Triton and ptxas put the cause, below the source excerpt)."""
    lines = [line for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"


@functools.cache
def collect_specs(families=FAMILIES) -> tuple:
    """Every family's `aot_specs()`, computed once per process (each runs its launcher on a few hundred
    META calls: about 0.5 s)."""
    specs = []
    for family in families:
        module = importlib.import_module(f"sbd_kernels.ops.{family}.triton")
        specs.extend(module.aot_specs())
    return tuple(specs)


def picked_at(family: str, shape: grid.Shape) -> list[str]:
    """Spec names the launcher of `family` compiles for one benchmark record, called as the benchmark calls
    it (bench/bench_<family>.py), on fresh contiguous tensors: sampling with a scalar temperature, no
    compute_mask and the record's filters as scalars; scatter with a [B] gamma tensor and no valid mask;
    attention on a contiguous cache."""
    kernels = importlib.import_module(f"sbd_kernels.ops.{family}.triton")
    if family == "sampling":
        return kernels.picked_specs(shape.batch, shape.positions, shape.vocab, grid.TORCH_DTYPES[shape.dtype],
                                    temperature_tensor=False, compute_mask=False, top_k_val=shape.top_k,
                                    top_p_val=shape.top_p)
    if family == "scatter":
        return kernels.picked_specs(shape.batch, shape.block, shape.rule, gamma_tensor=True, valid=False)
    return kernels.picked_specs(shape.batch, shape.length, shape.q_heads, shape.kv_heads, shape.head_dim,
                                shape.causal, shape.block, grid.TORCH_DTYPES[shape.dtype], paged=False)


OP_NAMES = {"sampling": "entropy_sample", "scatter": "mask_scatter_", "attention": "attention"}


def collect_picks(families=FAMILIES) -> list[tuple[str, str]]:
    """(shape label, spec name) of every kernel launched at every shape of the full benchmark grid."""
    return [(f"{OP_NAMES[family]} {shape.label}", spec)
            for family in families for shape in grid.GRIDS[family]() for spec in picked_at(family, shape)]


HINT_ARCH = 90  # the architecture the hint check compiles for


def unhinted(spec):
    """The spec compiled as if its rows were not aligned (ALIGNED False), tiles and warps unchanged: what
    the kernel would run without the launcher's alignment hints."""
    return dataclasses.replace(spec, name=f"{spec.name} (unhinted)", constexprs={**spec.constexprs, "ALIGNED": False})


def hinted_picks(picks: list[tuple[str, str]]) -> list[int]:
    """Indices in `collect_specs()` of the configurations picked for the benchmark shapes with ALIGNED set."""
    picked = {spec for _, spec in picks}
    return [i for i, spec in enumerate(collect_specs()) if spec.name in picked and spec.constexprs.get("ALIGNED")]


def _compile_job(job: tuple[int, int, bool]) -> CompileResult:
    """Worker side of `compile_all`: specs are rebuilt in the worker (jit functions do not pickle)."""
    index, arch, without_hints = job
    spec = collect_specs()[index]
    return compile_spec(unhinted(spec) if without_hints else spec, arch)


def compile_all(archs, jobs: int, unhinted_indices: Sequence[int] = ()) -> list[CompileResult]:
    """Every spec for every arch, then the `unhinted` twin of each spec of `unhinted_indices` for
    HINT_ARCH, in `jobs` processes (one compile keeps one core busy for 2-5 s and there are a few hundred),
    in that order."""
    todo = [(i, arch, False) for i in range(len(collect_specs())) for arch in archs]
    todo += [(i, HINT_ARCH, True) for i in unhinted_indices]
    if jobs <= 1:
        return [_compile_job(job) for job in todo]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(_compile_job, todo, chunksize=4))


def format_hints(results: list[CompileResult], twins: list[CompileResult]) -> tuple[str, list[str]]:
    """Table of the global memory instructions of each hinted configuration against its unhinted twin
    (HINT_ARCH), and the configurations whose hints saved none: the compiler did not take the alignment
    the launcher checked, so their rows load element by element."""
    by_name = {r.kernel: r for r in results if r.arch == HINT_ARCH}
    width = max([len("aligned configuration")] + [len(t.kernel) for t in twins])
    lines = [f"{'aligned configuration':<{width}} {'accesses':>9} {'unhinted':>9}  status"]
    bad = []
    for twin in twins:
        name = twin.kernel.removesuffix(" (unhinted)")
        hinted = by_name.get(name)
        if hinted is None or not hinted.ok or not twin.ok:
            status = "FAILED"
        else:
            status = "ok" if hinted.global_accesses < twin.global_accesses else "NO VECTORS"
        if status != "ok":
            bad.append(f"{name}: {status}")
        counts = (f"{hinted.global_accesses:>9} {twin.global_accesses:>9}" if status != "FAILED"
                  else f"{'-':>9} {'-':>9}")
        lines.append(f"{name:<{width}} {counts}  {status}")
    return "\n".join(lines), bad


# A runtime argument of each Triton type, as `warmup` takes it: a pointer by its dtype (Triton's MockTensor),
# an int by a value in the type's range, a float.
_WARMUP_POINTEE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "i32": torch.int32,
                   "i64": torch.int64, "i8": torch.int8, "u8": torch.uint8, "u1": torch.bool}
_WARMUP_SCALARS = {"i32": 2, "i64": 2**40, "fp32": 0.5}


def warmup_arguments(spec) -> list:
    """The runtime arguments of `spec.fn`, in order, with which `spec.fn.warmup` compiles exactly `spec`: the
    kernels are not specialised on values (`unspecialised_jit`), so the JIT types each argument from its type
    alone. Raises KeyError for a type not covered."""
    from triton.runtime.jit import MockTensor

    return [MockTensor(_WARMUP_POINTEE[ty[1:]]) if ty.startswith("*") else _WARMUP_SCALARS[ty]
            for ty in spec.signature.values() if ty != "constexpr"]


def _warm_job(index: int) -> tuple[str, float, str | None]:
    """Worker side of `warm_cache`: (spec name, seconds, error or None)."""
    spec = collect_specs()[index]
    start = time.monotonic()
    try:
        spec.fn.warmup(*warmup_arguments(spec), grid=(1,), **spec.options(), **spec.constexprs)
    except Exception as err:  # noqa: BLE001  (report every failing configuration, not just the first)
        return spec.name, time.monotonic() - start, compile_error_line(err)
    return spec.name, time.monotonic() - start, None


def warm_cache(jobs: int) -> int:
    """Compile every configuration for this machine's GPU through the JIT, in `jobs` processes; prints the
    failures and a summary line. Returns the number of failed compiles."""
    count = len(collect_specs())
    start = time.monotonic()
    # Spawned, not forked: this process has asked the CUDA driver for devices, and CUDA does not survive a fork.
    with ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(_warm_job, range(count), chunksize=2))
    failed = [(name, error) for name, _, error in results if error is not None]
    for name, error in failed:
        print(f"FAILED {name}: {error}")
    slowest = max(results, key=lambda r: r[1])
    print(f"{count} configurations compiled for this GPU in {time.monotonic() - start:.0f} s ({jobs} processes, "
          f"slowest {slowest[1]:.1f} s: {slowest[0]}); {len(failed)} failed")
    return len(failed)


def format_table(results: list[CompileResult]) -> str:
    header = (f"{'kernel configuration':<64} {'arch':>5} {'warps':>5} {'regs':>5} {'spill B':>8} "
              f"{'smem B':>8} {'occup.':>6}  status")
    lines = [header]
    for r in results:
        if r.ok:
            lines.append(f"{r.kernel:<64} sm_{r.arch:<2} {r.num_warps:>5} {r.regs:>5} {r.spill_bytes:>8} "
                         f"{r.shared_bytes:>8} {r.occupancy:>6.0%}  {'SPILLS' if r.spill_bytes else 'ok'}")
        else:
            lines.append(f"{r.kernel:<64} sm_{r.arch:<2} {r.num_warps:>5} {'-':>5} {'-':>8} {'-':>8} "
                         f"{'-':>6}  FAILED {r.error}")
    return "\n".join(lines)


def _pick_cell(result: CompileResult | None) -> str:
    """`regs spill occupancy` of one compile, or why there is none."""
    if result is None:
        return f"{'missing':>22}"
    if not result.ok:
        return f"{'FAILED':>22}"
    return f"{result.regs:>10} {result.spill_bytes:>5} {result.occupancy:>5.0%}"


def format_picks(picks: list[tuple[str, str]], results: list[CompileResult], archs) -> tuple[str, list[str]]:
    """Table of the configurations picked for the benchmark shapes, and the list of bad picks (a spec
    that is not listed, failed to compile or spills)."""
    by_key = {(r.kernel, r.arch): r for r in results}
    listed = {r.kernel for r in results}
    shape_w = max([len("benchmark shape")] + [len(shape) for shape, _ in picks])
    spec_w = max([len("picked configuration")] + [len(spec) for _, spec in picks])
    header = (f"{'benchmark shape':<{shape_w}} {'picked configuration':<{spec_w}}"
              + "".join(f" {f'sm_{arch} regs':>10} {'spill':>5} {'occ.':>5}" for arch in archs) + "  status")
    lines, bad = [header], []
    for shape, spec in picks:
        cells = [by_key.get((spec, arch)) for arch in archs]
        if spec not in listed:
            status = "NOT LISTED"
        elif any(c is None or not c.ok for c in cells):
            status = "FAILED"
        elif any(c.spill_bytes for c in cells):
            status = "SPILLS"
        else:
            status = "ok"
        if status != "ok":
            bad.append(f"{shape}: {spec} {status}")
        cells_text = "".join(f" {_pick_cell(c)}" for c in cells)
        lines.append(f"{shape:<{shape_w}} {spec:<{spec_w}}{cells_text}  {status}")
    return "\n".join(lines), bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, action="append", choices=sorted(SM_LIMITS),
                        help="compute capability (repeatable); default 80 and 90")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes (default: cores)")
    parser.add_argument("--warm", action="store_true",
                        help="on a CUDA GPU: compile every configuration for it into Triton's cache, nothing else")
    args = parser.parse_args(argv)
    # The interpreter replaces @triton.jit functions with Python ones that cannot be compiled.
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: interpreted kernels cannot be compiled for a GPU")
    if args.warm:
        if not torch.cuda.is_available():
            parser.error(f"--warm compiles for this machine's GPU, and torch {torch.__version__} sees none")
        return 1 if warm_cache(args.jobs) else 0

    archs = args.arch or DEFAULT_ARCHS
    picks = collect_picks()
    hinted = hinted_picks(picks) if HINT_ARCH in archs else []
    results = compile_all(archs, args.jobs, hinted)
    results, twins = results[:len(results) - len(hinted)], results[len(results) - len(hinted):]
    print(format_table(results))
    failed = [r for r in results if not r.ok]
    spilled = [r for r in results if r.ok and r.spill_bytes]
    print(f"\n{len(results)} compiles: {len(results) - len(failed)} ok, {len(failed)} failed, "
          f"{len(spilled)} with register spills")
    picks_table, bad_picks = format_picks(picks, results, archs)
    print("\nconfigurations picked for the benchmark shapes\n" + picks_table)
    print(f"\n{len(picks)} picks: {len(bad_picks)} not listed, failed or spilling")
    hints_table, bad_hints = format_hints(results, twins)
    print(f"\nglobal memory instructions (sm_{HINT_ARCH} PTX) of the aligned configurations picked for the "
          f"benchmark shapes, against the same configuration compiled unhinted\n{hints_table}")
    print(f"\n{len(twins)} aligned picks: {len(bad_hints)} without fewer accesses than unhinted")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    return 1 if failed or spilled or bad_picks or bad_hints else 0


if __name__ == "__main__":
    sys.exit(main())
