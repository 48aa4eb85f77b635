"""`make test-sanitize`: the C++ CPU kernels under AddressSanitizer and UndefinedBehaviorSanitizer.

    python tools/sanitize.py [--quick] [--shards N] [PYTEST ARGS...]     # from the repository root

Copies the sources and tests to build/sanitize/src, builds the extension there with
-fsanitize=address,undefined,float-cast-overflow (the last is not part of GCC's "undefined": a NaN or infinite
float converted to an integer, e.g. a NaN logit turned into an index; every report stops the run:
-fno-sanitize-recover), and runs the tests that call the C++ kernels (KERNEL_TESTS, without their Triton cases;
--quick: the fuzz tests alone, CI's selection) with the sanitizer runtimes preloaded into Python. torch's CPU
tensors come from malloc, so ASan puts a red zone after every tensor: a kernel that reads or writes past any
tensor's end, or into freed memory, stops with a report, as does a misaligned or overflowing access (UBSan). Each
instruction-set variant the CPU supports runs (the tests' `cpu_isa` fixture).

pytest runs with --capture=sys: it would capture file descriptor 2 for each test, and a process the sanitizer
stops takes that capture, and the report in it, with it (GCC's UBSan writes to stderr whatever its log_path).
Needs GCC's sanitizer runtimes (libasan, libubsan) for the compiler that builds the extension. Exit status: 0
when every shard passed; a sanitizer report stops its shard with status 1 (add -v to see which test it stopped).
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from run_tests import add_shards_option, run

REPO = Path(__file__).resolve().parent.parent
WORK = REPO / "build" / "sanitize"
SANITIZE_FLAGS = ("-fsanitize=address,undefined,float-cast-overflow -fno-sanitize-recover=undefined,float-cast-overflow "
                  "-fno-omit-frame-pointer")
# The tests that reach the C++ kernels: each op's oracle comparisons, filters, fuzzing, argument checks; then
# the ops inside decoding, the reference model, training and the Hugging Face path (its cache's layouts).
KERNEL_TESTS = ["tests/test_sampling.py", "tests/test_sampling_filters.py", "tests/test_attention.py",
                "tests/test_scatter.py", "tests/test_checks.py", "tests/test_trusted_values.py",
                "tests/test_overlap.py", "tests/test_fuzz_sampling.py", "tests/test_fuzz_attention.py",
                "tests/test_fuzz_scatter.py", "tests/test_generate.py", "tests/test_model.py", "tests/test_hf.py",
                "tests/test_compile.py", "tests/test_train.py", "tests/test_tasks.py"]
# Random shapes, strides and offsets of every op: the quick selection (about 1.5 minutes on 2 cores).
QUICK_TESTS = [path for path in KERNEL_TESTS if "fuzz" in path]
COPIED = ["csrc", "sbd_kernels", "tests", "tools", "setup.py", "pyproject.toml", "MANIFEST.in", "README.md"]


def runtime_library(compiler: str, name: str) -> str:
    """The path of runtime library `name` of `compiler` (e.g. libasan.so), or exit naming what is missing."""
    found = subprocess.run([compiler, f"-print-file-name={name}"], capture_output=True, text=True,
                           check=True).stdout.strip()
    if not os.path.isabs(found):    # the compiler echoes a bare name it cannot find
        sys.exit(f"sanitize: {compiler} has no {name}: install GCC's sanitizer runtimes (Debian: libgcc-12-dev "
                 f"carries libasan and libubsan), or set CXX to a GCC that has them")
    return found


def copy_sources(dst: Path) -> None:
    """What the build and the kernel tests read (COPIED), without compiled libraries or caches, into a fresh
    `dst`: the extension is built in place, so the sanitized build cannot share the checkout's package folder.
    A fixed list rather than `git ls-files`: CI's checkout need not be a git repository."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    skip = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info")
    for name in COPIED:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, dst / name, ignore=skip)
        else:
            shutil.copy2(REPO / name, dst / name)


def build(src: Path) -> None:
    env = {**os.environ, "CFLAGS": SANITIZE_FLAGS, "CXXFLAGS": SANITIZE_FLAGS,
           "LDFLAGS": "-fsanitize=address,undefined"}
    print(f"sanitize: building the extension with {SANITIZE_FLAGS} in {src}", flush=True)
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace", "--force"], cwd=src, env=env,
                   check=True, stdout=subprocess.DEVNULL)


def sanitizer_environment(compiler: str, src: Path) -> dict[str, str]:
    """The runtimes preloaded into the uninstrumented Python, ASan's first as it requires; libstdc++ too, since
    ASan looks up the real __cxa_throw when it starts, before torch would load libstdc++. Leak detection is off:
    CPython and torch keep their allocations until exit, so every leak report would be theirs."""
    preload = [runtime_library(compiler, name) for name in ("libasan.so", "libubsan.so", "libstdc++.so.6")]
    return {
        "LD_PRELOAD": " ".join(preload),
        "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1",
        "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
        "PYTHONPATH": str(src),     # this copy's package and sanitized library, not the checkout's
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the fuzz tests alone (CI's selection)")
    add_shards_option(parser)
    args, pytest_args = parser.parse_known_args(argv)
    compiler = os.environ.get("CXX", "c++").split()[-1]     # "ccache g++" -> g++
    src = WORK / "src"
    copy_sources(src)
    build(src)
    env = sanitizer_environment(compiler, src)
    tests = QUICK_TESTS if args.quick else KERNEL_TESTS
    print(f"sanitize: {shlex.join(f'{k}={v}' for k, v in env.items())}", flush=True)
    status = run(args.shards, ["-k", "not triton", "--capture=sys", *pytest_args], paths=tests, cwd=src,
                 extra_env=env)
    print(f"sanitize: {'passed' if status == 0 else 'FAILED (a sanitizer report, if any, is above)'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
