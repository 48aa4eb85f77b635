"""Build of the `sbd_kernels._C` extension: the `sbd` op schemas and the C++ CPU kernels.

CPU kernels are compiled once per instruction set (files named `*_default.cpp`, `*_avx2.cpp`,
`*_avx512.cpp`, each with its own flags and `CPU_CAPABILITY` namespace) and picked at run time, so one
wheel is fast on AVX2 and AVX-512 machines without `-march=native`. No `-ffast-math`: NaN and inf
handling must stay exact.
"""
import sys
import sysconfig
from pathlib import Path

from setuptools import find_packages, setup


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
                "sbd_kernels builds against an installed torch, and none was found.\n"
                "Install one first, e.g. `pip install torch==2.13.0` (CPU), then\n"
                "`pip install --no-build-isolation -e .`"
            )


import_installed_torch()
from torch.utils.cpp_extension import BuildExtension, CppExtension  # noqa: E402

ROOT = Path(__file__).parent
# -fopenmp: torch's CPU build runs `at::parallel_for` on OpenMP, and its implementation is inline in the
# ATen headers; compiled without the flag the pragma is dropped and every kernel runs on one thread. The
# extension then resolves libgomp.so.1 to the copy torch has already loaded (one OpenMP runtime).
COMMON_FLAGS = ["-O3", "-g0", "-std=c++17", "-fvisibility=hidden", "-fopenmp"]
LINK_FLAGS = ["-fopenmp"]
# Flags per instruction-set variant, chosen by the source file's suffix.
ISA_FLAGS = {
    "_default.cpp": ["-DCPU_CAPABILITY=DEFAULT", "-DCPU_CAPABILITY_DEFAULT"],
    "_avx2.cpp": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "_avx512.cpp": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
                    "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
}
# Families whose inner loops are vectorised: one kernel file per ISA beside the dispatch file.
VECTORISED_FAMILIES = ["sampling", "attention"]
# Families whose work is a few hundred scalars per sequence: a single file.
SCALAR_FAMILIES = ["scatter"]


def sources() -> list[str]:
    """Explicit source list: schemas, the ISA switch, one file per family, one kernel file per ISA."""
    srcs = ["csrc/sbd_ops.cpp", "csrc/cpu/isa.cpp"]
    srcs += [f"csrc/cpu/{family}.cpp" for family in VECTORISED_FAMILIES + SCALAR_FAMILIES]
    for family in VECTORISED_FAMILIES:
        srcs += [f"csrc/cpu/{family}_kernel{suffix}" for suffix in ISA_FLAGS]
    return srcs


def get_extensions():
    return [
        CppExtension(
            "sbd_kernels._C",
            sources(),
            include_dirs=[str(ROOT / "csrc")],
            define_macros=[("SBD_PYTHON_MODULE", None)],
            extra_compile_args=COMMON_FLAGS,
            extra_link_args=LINK_FLAGS,
        )
    ]


class BuildWithIsaFlags(BuildExtension):
    """BuildExtension that appends the per-instruction-set flags of each kernel file."""

    def build_extensions(self):
        compile_one = self.compiler._compile

        def compile_with_isa_flags(obj, src, ext, cc_args, extra_postargs, pp_opts):
            extra = [f for suffix, flags in ISA_FLAGS.items() if src.endswith(suffix) for f in flags]
            return compile_one(obj, src, ext, cc_args, list(extra_postargs) + extra, pp_opts)

        self.compiler._compile = compile_with_isa_flags
        super().build_extensions()


setup(
    packages=find_packages(include=["sbd_kernels", "sbd_kernels.*"]),
    ext_modules=get_extensions(),
    cmdclass={"build_ext": BuildWithIsaFlags.with_options(use_ninja=False)},
)
