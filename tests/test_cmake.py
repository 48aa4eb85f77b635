"""The CMake build for libtorch users: the same ops as a plain shared library, loadable without the Python
package, and callable from C++ through the dispatcher."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")


@pytest.fixture(scope="module")
def cmake_build(tmp_path_factory) -> Path:
    """Configures and builds CMakeLists.txt against the installed torch; returns the build folder."""
    build = tmp_path_factory.mktemp("cmake-build")
    configure = ["cmake", "-S", str(REPO), "-B", str(build), f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}"]
    if shutil.which("ccache"):
        configure.append("-DCMAKE_CXX_COMPILER_LAUNCHER=ccache")
    for cmd in (configure, ["cmake", "--build", str(build), "-j", "2"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return build


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


@pytest.mark.slow
def test_cpp_program_calls_an_op_through_the_dispatcher(cmake_build):
    """Guards against the C++ entry point (schema lookup + boxed call) not reaching the CPU kernel."""
    proc = subprocess.run([str(cmake_build / "sbd_mask_scatter_example")], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mask_scatter_ from C++: OK" in proc.stdout
