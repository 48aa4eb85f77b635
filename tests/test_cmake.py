"""The two builds, setup.py (the Python extension) and CMakeLists.txt (the op library for libtorch users):
one source list for both, the same sources with the same instruction-set flags, and the CMake library
loadable without the Python package and callable from C++ through the dispatcher; the extension's build free of
warnings, and the sanitized build of tools/sanitize.py set up to run."""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SOURCE_LIST = REPO / "csrc" / "sources.txt"
ISA_FLAG = re.compile(r"-m(avx|fma|f16c)|-DCPU_CAPABILITY")

needs_cmake = pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
# The tests of the CMake build share one configure and build (module fixtures): in one shard of a sharded run,
# one unit weighing their recorded durations (tests/durations.json), the build's 65-95 s on a 2-core AMD EPYC Zen 4
# included.
one_cmake_build = pytest.mark.same_shard("cmake_build")
# What torch's own CMake config (Caffe2Config.cmake) stops with when torch is a CUDA build and CMake finds no
# CUDA toolkit: a requirement of libtorch, not of this project's CPU-only library.
TORCH_NEEDS_CUDA_TOOLKIT = "uses CUDA but I cannot find the CUDA"


def declared_sources() -> dict[str, list[str]]:
    """{source: flags of its instruction-set build} as csrc/sources.txt declares them (a test-side reading
    of the format, independent of both builds' parsers)."""
    isa, sources = {}, {}
    for line in SOURCE_LIST.read_text().splitlines():
        kind, *fields = line.split() or [""]
        if kind == "isa":
            isa[fields[0]] = fields[1:]
        elif kind == "source":
            sources[fields[0]] = isa[fields[1]] if len(fields) == 2 else []
    return sources


def isa_flags_by_source(commands: list[list[str]]) -> dict[str, list[str]]:
    """{source relative to the repository: its instruction-set flags, in order} from compiler command lines."""
    result = {}
    for cmd in commands:
        src = next(arg for arg in cmd if arg.endswith(".cpp"))
        result[str(Path(src).resolve().relative_to(REPO))] = [arg for arg in cmd if ISA_FLAG.match(arg)]
    return result


def test_sources_are_named_in_one_list():
    """Guards against a second source list drifting from the first: neither build names a C++ file, and
    csrc/sources.txt lists every .cpp under csrc exactly once (a new file is not silently left out)."""
    for build_file in ("setup.py", "CMakeLists.txt"):
        named = re.findall(r"csrc/[\w/]+\.cpp\b", (REPO / build_file).read_text())
        assert not named, f"{build_file} names sources itself: {named}; list them in csrc/sources.txt"
    listed = [line.split()[1] for line in SOURCE_LIST.read_text().splitlines() if line.startswith("source ")]
    on_disk = sorted(str(p.relative_to(REPO)) for p in (REPO / "csrc").rglob("*.cpp"))
    assert sorted(listed) == on_disk


# Records every compile as a JSON line (its arguments, start and end time) and writes empty objects and
# library: what setup.py would run, in seconds. Each compile lasts `seconds`, so that compiles running side by
# side overlap in time. Version queries (torch's compiler check) go to the real compiler.
FAKE_COMPILER = """#!{python}
import json, os, sys, time
args = sys.argv[1:]
if "-o" in args:
    start = time.monotonic()
    if "-c" in args:
        time.sleep({seconds})
    open(args[args.index("-o") + 1], "w").close()
    if "-c" in args:
        with open({log!r}, "a") as f:
            f.write(json.dumps({{"args": args, "start": start, "end": time.monotonic()}}) + "\\n")
else:
    os.execvp("c++", ["c++", *args])
"""


def setup_py_compiles(tmp_path: Path, *build_args: str, seconds: float = 0.0) -> list[dict]:
    """The compiles of `setup.py build_ext *build_args`, run with a recording compiler whose compiles last
    `seconds`: {"args": command line, "start": ..., "end": ...} (monotonic seconds) each."""
    log = tmp_path / "compiles.jsonl"
    fake = tmp_path / "fake-c++"
    fake.write_text(FAKE_COMPILER.format(python=sys.executable, log=str(log), seconds=seconds))
    fake.chmod(0o755)
    env = {**os.environ, "CC": str(fake), "CXX": str(fake), "LDSHARED": f"{fake} -shared",
           "TORCH_NO_COMPILER_WRAPPER": "1"}
    cmd = [sys.executable, "setup.py", "-q", "build_ext", "--build-temp", str(tmp_path / "temp"),
           "--build-lib", str(tmp_path / "lib"), *build_args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in log.read_text().splitlines()]


def most_at_once(compiles: list[dict]) -> int:
    """The largest number of compiles running at the same moment."""
    events = sorted([(c["start"], 1) for c in compiles] + [(c["end"], -1) for c in compiles])
    running = peak = 0
    for _, step in events:  # at equal times an end (-1) sorts before a start
        running += step
        peak = max(peak, running)
    return peak


@pytest.mark.parametrize("build_args, expected", [
    # -j is setuptools' short form of --parallel; 3 is more than this machine's 2 cores, so the flag, not
    # the core count, sets the number.
    (("-j", "3"), 3),
    ((), None),         # default: one compiler per core
], ids=["j3", "default"])
def test_setup_py_compiles_in_parallel(tmp_path, build_args, expected):
    """Guards against the extension's sources compiling one at a time again (the thread pool of
    BuildWithIsaFlags bypassed, or its jobs waited for one by one) and against `-j N` / `--parallel N` not
    setting the number of compilers: with compiles that last 0.3 s each, exactly N run at once, and by
    default more than one (at most one per core) where the machine has several cores."""
    compiles = setup_py_compiles(tmp_path, *build_args, seconds=0.3)
    assert len(compiles) == len(declared_sources())
    if expected is not None:
        assert most_at_once(compiles) == expected, compiles
    else:
        cores = os.cpu_count() or 1
        assert min(cores, 2) <= most_at_once(compiles) <= cores, compiles


@pytest.mark.slow
def test_avx512_kernels_compile_without_warnings(tmp_path):
    """Guards against warnings that drown our own in the extension's build: torch's headers read as ours
    (140 `#pragma unroll` -Wunknown-pragmas a build) and GCC 12.0-12.2's false "'__Y' may be used
    uninitialized" inside avx512fintrin.h (GCC bug 105593, about 300 a build). Compiles the two AVX-512
    kernels, where both showed, with setup.py's own command lines and -Wall."""
    commands = [c["args"] for c in setup_py_compiles(tmp_path) if any(a.endswith("_avx512.cpp") for a in c["args"])]
    assert len(commands) == 2
    for args in commands:
        args = [*args, "-Wall"]
        args[args.index("-o") + 1] = str(tmp_path / "kernel.o")
        proc = subprocess.run(["c++", *args], cwd=REPO, capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        warnings = [line for line in proc.stderr.splitlines() if "warning:" in line]
        assert not warnings, "\n".join(warnings[:20])


@pytest.fixture(scope="module")
def cmake_configured(tmp_path_factory) -> Path:
    """Configures CMakeLists.txt against the installed torch, with compile_commands.json; returns the build
    folder."""
    build = tmp_path_factory.mktemp("cmake-build")
    configure = ["cmake", "-S", str(REPO), "-B", str(build), f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
                 "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON"]
    if shutil.which("ccache"):
        configure.append("-DCMAKE_CXX_COMPILER_LAUNCHER=ccache")
    proc = subprocess.run(configure, capture_output=True, text=True, check=False)
    if proc.returncode != 0 and TORCH_NEEDS_CUDA_TOOLKIT in proc.stderr:
        pytest.skip("torch is a CUDA build, whose CMake config needs the CUDA toolkit (headers, cudart), and "
                    "CMake found none")
    assert proc.returncode == 0, f"{' '.join(configure)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return build


@needs_cmake
@one_cmake_build
def test_both_builds_compile_the_same_sources_with_the_same_isa_flags(cmake_configured, tmp_path):
    """Guards against the Python extension and the libtorch library compiling different sources, or a kernel
    file without (or with another) instruction set's flags in one of them: an AVX-512 kernel built without
    -mavx512f, or a default build with AVX2 code that faults on older CPUs."""
    cmake = json.loads((cmake_configured / "compile_commands.json").read_text())
    cmake_commands = [shlex.split(entry["command"]) for entry in cmake if "examples" not in entry["file"]]
    declared = declared_sources()
    assert isa_flags_by_source(cmake_commands) == declared
    assert isa_flags_by_source([c["args"] for c in setup_py_compiles(tmp_path)]) == declared


@pytest.fixture(scope="module")
def cmake_build(cmake_configured) -> Path:
    """Builds the configured CMake project; returns the build folder."""
    cmd = ["cmake", "--build", str(cmake_configured), "-j", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return cmake_configured


@needs_cmake
@one_cmake_build
@pytest.mark.slow
def test_library_loads_without_the_python_package(cmake_build):
    """Guards against the libtorch build missing a schema or a CPU kernel that the wheel has."""
    code = f"""
import torch
torch.ops.load_library({str(cmake_build / "libsbd_ops.so")!r})
tokens = torch.full((2, 3), -1, dtype=torch.long)
masked = torch.ones(2, 3, dtype=torch.bool)
sampled = torch.arange(6).reshape(2, 3)
entropy = torch.tensor([[0.5, 0.0, 2.0], [3.0, 1.0, 0.0]])
accepted, num, done = torch.ops.sbd.mask_scatter_(tokens, masked, sampled, entropy, gamma_val=0.6)
# EB, gamma 0.6. Row 0 ranks positions 1, 0, 2 with sums before them 0, 0, 0.5: all accepted.
# Row 1 ranks positions 2, 1, 0 with sums 0, 0, 1.0: position 0 stays masked.
assert accepted.tolist() == [[True, True, True], [False, True, True]], accepted
assert tokens.tolist() == [[0, 1, 2], [-1, 4, 5]], tokens
assert num.tolist() == [3, 2] and done.tolist() == [True, False]
for op in ("block_attention_with_kvcache", "entropy_sample", "mask_scatter_"):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"sbd::{{op}}", "CPU"), op
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


@needs_cmake
@one_cmake_build
@pytest.mark.slow
def test_cpp_program_calls_an_op_through_the_dispatcher(cmake_build):
    """Guards against the C++ entry point (schema lookup + boxed call) not reaching the CPU kernel."""
    proc = subprocess.run([str(cmake_build / "sbd_mask_scatter_example")], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mask_scatter_ from C++: OK" in proc.stdout


def sanitize_tool(monkeypatch):
    """tools/sanitize.py imported as a module (it imports tools/run_tests.py as its neighbour)."""
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import sanitize

    return sanitize


def test_sanitizer_run_preloads_asan_first_and_reads_the_copy(monkeypatch, tmp_path):
    """Guards against a sanitized run that cannot start or tests the wrong library: ASan's runtime must come
    first in the preload list of the uninstrumented Python ("ASan runtime does not come first"), libstdc++ must
    be there (ASan's __cxa_throw lookup at start-up), and the copy's package, with its sanitized library, must
    come before the checkout's."""
    sanitize = sanitize_tool(monkeypatch)
    env = sanitize.sanitizer_environment("c++", tmp_path)
    preload = env["LD_PRELOAD"].split()
    assert [Path(p).name.split(".so")[0] for p in preload] == ["libasan", "libubsan", "libstdc++"]
    assert all(Path(p).is_file() for p in preload), preload
    assert env["PYTHONPATH"] == str(tmp_path) and "detect_leaks=0" in env["ASAN_OPTIONS"]
    assert set(sanitize.QUICK_TESTS) < set(sanitize.KERNEL_TESTS)
    assert all((REPO / path).is_file() for path in sanitize.KERNEL_TESTS)


def test_sanitizer_run_names_a_missing_runtime(monkeypatch):
    """Guards against a cryptic failure where the compiler has no sanitizer runtime: the loader skips a bare
    name in LD_PRELOAD with a warning, and the sanitized library then stops every test on ASan's message."""
    sanitize = sanitize_tool(monkeypatch)
    with pytest.raises(SystemExit, match="true has no libasan.so: install GCC's sanitizer runtimes"):
        sanitize.runtime_library("true", "libasan.so")
