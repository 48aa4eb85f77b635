"""Build of the `sbd_kernels._C` extension: the `sbd` op schemas and the C++ CPU kernels.

The sources and the flags of each instruction-set build come from `csrc/sources.txt`, the list that
CMakeLists.txt reads too: the vectorised kernels are compiled once per instruction set, each in its own
`CPU_CAPABILITY` namespace, and picked at run time, so one wheel is fast on AVX2 and AVX-512 machines
without `-march=native`.

The sources compile in parallel, one compiler process per core (`build_ext --parallel N` sets another
count): the per-file flags rule out torch's ninja build, whose flags are per extension.
"""
import os
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import setup
from setuptools.errors import CompileError, ExecError


def import_installed_torch():
    """Import the torch of the target environment, also from inside an isolated build.

    The extension must be compiled against the torch it will run with. `build-system.requires` does not
    list torch on purpose: on PyPI that would be a CUDA build of several GB. An isolated build
    (plain `pip install .`) hides the environment's site-packages, so look there explicitly.
    """
    try:
        import torch  # noqa: F401
    except ImportError:
        sys.path.append(sysconfig.get_paths()["purelib"])
        try:
            import torch  # noqa: F401
        except ImportError:
            sys.exit(
                "sbd_kernels builds against an installed torch, and this build cannot import one.\n"
                "Build isolation (a plain `pip install .`, `python -m build`) hides a torch installed with\n"
                "--user or in the base of a --system-site-packages venv: build without it,\n"
                "`pip install --no-build-isolation .` (or `python -m build --no-isolation`).\n"
                "With no torch installed, install one first, e.g. the CPU wheel:\n"
                "`pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu`"
            )


import_installed_torch()
from torch.utils.cpp_extension import BuildExtension, CppExtension, include_paths  # noqa: E402

ROOT = Path(__file__).resolve().parent
SOURCE_LIST = "csrc/sources.txt"
# -fopenmp: torch's CPU build runs `at::parallel_for` on OpenMP, and its implementation is inline in the
# ATen headers; compiled without the flag the pragma is dropped and every kernel runs on one thread. The
# extension then resolves libgomp.so.1 to the copy torch has already loaded (one OpenMP runtime).
# No -std: BuildExtension adds the standard the installed torch asks for (C++17 up to torch 2.11, C++20 from
# 2.13; the ATen headers of torch 2.14 refuse C++17).
# -isystem: torch's headers as system headers (GCC then drops the -I that BuildExtension gives the same
# directories): their `#pragma unroll` lines gave about 140 -Wunknown-pragmas warnings a build, which hid ours.
TORCH_SYSTEM_INCLUDES = [flag for path in include_paths() for flag in ("-isystem", path)]
COMMON_FLAGS = ["-O3", "-g0", "-fvisibility=hidden", "-fopenmp", *TORCH_SYSTEM_INCLUDES]
LINK_FLAGS = ["-fopenmp"]


def read_source_list(path: Path = ROOT / SOURCE_LIST) -> tuple[list[str], dict[str, list[str]]]:
    """(sources in order, {source: flags of its instruction-set build}) from csrc/sources.txt, whose lines
    are `isa <name> <flag>...` and `source <path> [<isa>]`."""
    isa_flags: dict[str, list[str]] = {}
    sources: list[str] = []
    flags_of: dict[str, list[str]] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        kind, *fields = line.split() or [""]
        if kind == "isa":
            isa_flags[fields[0]] = fields[1:]
        elif kind == "source" and len(fields) in (1, 2):
            sources.append(fields[0])
            if len(fields) == 2:
                if fields[1] not in isa_flags:
                    sys.exit(f"{SOURCE_LIST}:{number}: instruction set {fields[1]!r} is not declared above")
                flags_of[fields[0]] = isa_flags[fields[1]]
        elif kind and not kind.startswith("#"):
            sys.exit(f"{SOURCE_LIST}:{number}: expected `isa <name> <flag>...` or `source <path> [<isa>]`")
    return sources, flags_of


SOURCES, ISA_FLAGS_OF = read_source_list()


def get_extensions():
    return [
        CppExtension(
            "sbd_kernels._C",
            SOURCES,
            # The headers too: setuptools rebuilds an extension only when one of these is newer than it, and
            # the kernels themselves live in headers (attention_kernel.h, sampling_kernel.h).
            depends=sorted(str(path.relative_to(ROOT)) for path in (ROOT / "csrc").rglob("*.h")),
            include_dirs=[str(ROOT / "csrc")],
            define_macros=[("SBD_PYTHON_MODULE", None)],
            extra_compile_args=COMMON_FLAGS,
            extra_link_args=LINK_FLAGS,
        )
    ]


class BuildWithIsaFlags(BuildExtension):
    """BuildExtension that appends each source's instruction-set flags and runs the compiler processes in
    parallel (one extension: setuptools' own --parallel only runs extensions side by side).

    The compile loop itself stays serial, since torch's compile wrapper swaps the compiler executable
    around each call; only the compiler processes it starts run in a thread pool, and all of them finish
    before the link."""

    def build_extensions(self):
        compiler = self.compiler
        # The method that starts one compiler process: `call` since setuptools 80, `spawn` before.
        runner = "call" if hasattr(compiler, "call") else "spawn"
        compile_one, compile_all, run = compiler._compile, compiler.compile, getattr(compiler, runner)
        flags_of = {str(ROOT / src): flags for src, flags in ISA_FLAGS_OF.items()}

        def compile_with_isa_flags(obj, src, ext, cc_args, extra_postargs, pp_opts):
            extra = flags_of.get(str(Path(src).resolve()), [])
            return compile_one(obj, src, ext, cc_args, list(extra_postargs) + extra, pp_opts)

        def compile_in_parallel(*args, **kwargs):
            with ThreadPoolExecutor(max_workers=self.parallel or os.cpu_count() or 1) as pool:
                started = []
                setattr(compiler, runner, lambda cmd, **kw: started.append(pool.submit(run, cmd, **kw)))
                try:
                    objects = compile_all(*args, **kwargs)
                finally:
                    setattr(compiler, runner, run)
                for job in started:
                    try:
                        job.result()
                    except (ExecError, subprocess.CalledProcessError, OSError) as err:
                        raise CompileError(err) from err
            return objects

        compiler._compile = compile_with_isa_flags
        compiler.compile = compile_in_parallel
        super().build_extensions()


setup(
    ext_modules=get_extensions(),
    cmdclass={"build_ext": BuildWithIsaFlags.with_options(use_ninja=False)},
)
