"""The package's layers: imports point one way, and the installed package stands alone.

    csrc  <-  ops  <-  model, tasks, aot  <-  generate, train, hf, roofline
          <-  demo, bench_report, bench_plots, gpucheck  <-  cli  <-  bench/ (the repository's benchmark files,
          not installed)

A module may import modules of its own layer and of the layers below it, never above; nothing in the
package imports `bench` (the README's map of the code states the same rule, and its layer table must list
the layers of LAYERS).
"""
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "sbd_kernels"

# Layer of every module of the package, lowest first; a subpackage's modules share its layer. Adding a
# module means placing it here and in the README's map (test_readme_map_lists_the_checked_layers holds the two
# equal).
LAYERS = [
    # The ops and what they need: no model, no decoding, no tooling.
    ["sbd_kernels", "sbd_kernels._loader", "sbd_kernels.ops", "sbd_kernels.testing", "sbd_kernels.benchmark_grid",
     "sbd_kernels.machine", "sbd_kernels.argtypes", "sbd_kernels.protocol"],
    # The reference model, the tasks and their data, the GPU compile check of the ops.
    ["sbd_kernels.model", "sbd_kernels.tasks", "sbd_kernels.code_completion", "sbd_kernels.aot"],
    # Decoding (and its graph replay and exact-KV check), training, the Hugging Face path, the roofline model.
    ["sbd_kernels.generate", "sbd_kernels.graphs", "sbd_kernels.checks", "sbd_kernels.train", "sbd_kernels.hf",
     "sbd_kernels.roofline"],
    # What the commands run: the demo, the code models, the benchmark report and its plots, the GPU check.
    ["sbd_kernels.demo", "sbd_kernels.code_models", "sbd_kernels.bench_report", "sbd_kernels.bench_plots",
     "sbd_kernels.gpucheck"],
    # The `sbd` command.
    ["sbd_kernels.cli"],
]


def readme_layers() -> list[list[str]]:
    """The package's layers as the README's map of the code lists them, lowest first: the module column of
    each row of its layer table, package names spelt out (`ops/` -> sbd_kernels.ops, `__init__` ->
    sbd_kernels), without the C++ (`csrc/`) and benchmark (`bench/`) rows, which are outside the package."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Map of the code", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| ")]
    assert rows and [cell.strip() for cell in rows[0]] == ["layer", "modules", "may import"], rows[:1]
    layers = []
    for _, modules, _ in rows[1:]:
        names = re.findall(r"`([^`]+)`", modules)
        if names in (["csrc/"], ["bench/"]):
            continue
        layers.append([_readme_module(name) for name in names])
    return layers


def _readme_module(name: str) -> str:
    name = name.removeprefix("sbd_kernels/").rstrip("/")
    return "sbd_kernels" if name == "__init__" else "sbd_kernels." + name.replace("/", ".")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    """Index in LAYERS of `module`, or of its longest listed subpackage; fails for a module no layer lists."""
    best = max((entry for layer in LAYERS for entry in layer
                if module == entry or (entry != "sbd_kernels" and module.startswith(entry + "."))),
               key=len, default=None)
    assert best is not None, f"{module} has no layer: place it in LAYERS (tests/test_layers.py) and the README map"
    return next(i for i, layer in enumerate(LAYERS) if best in layer)


def imported_modules(path: Path) -> set[str]:
    """Absolute names of every module `path` imports, at module level or inside functions.
    `from sbd_kernels import x` names the module sbd_kernels.x when x is one."""
    names = set()
    tree = ast.parse(path.read_text(), str(path))
    # A module's `if __name__ == "__main__":` block is a command-line entry point (`python -m sbd_kernels.train`
    # runs `sbd train`): it may call the command line, the module itself may not.
    tree.body = [node for node in tree.body if not _is_main_guard(node)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import; the package uses absolute imports"
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                is_module = any((REPO / candidate.replace(".", "/")).with_suffix(suffix).exists()
                                for suffix in (".py", ""))
                names.add(candidate if is_module else node.module)
    return names


def _is_main_guard(node: ast.stmt) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")


PACKAGE_FILES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", PACKAGE_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_module_imports_upward(path):
    """Guards against a module importing a higher layer (ops importing the model or the demo, the model
    importing decoding, ...) or the repository's `bench/`, which an installed package does not have."""
    module = module_name(path)
    own = layer_of(module)
    for name in imported_modules(path):
        assert name != "bench" and not name.startswith("bench."), f"{module} imports {name}"
        if name == "sbd_kernels" or name.startswith("sbd_kernels."):
            assert layer_of(name) <= own, (f"{module} (layer {own}) imports {name} (layer {layer_of(name)}): "
                                           "imports point down only")


def test_readme_map_lists_the_checked_layers():
    """Guards against the README's map of the code drifting from the layers this file enforces: a module
    moved, added or dropped in LAYERS but not in the map's table (or the reverse), or layers reordered."""
    assert [sorted(layer) for layer in readme_layers()] == [sorted(layer) for layer in LAYERS]


def test_readme_map_parser_sees_a_drift():
    """Guards against a map check that cannot fail: the parser reads every package row, and a module in a
    different row gives a different answer."""
    parsed = readme_layers()
    assert len(parsed) == len(LAYERS) >= 5 and "sbd_kernels.hf" in parsed[2] and parsed[-1] == ["sbd_kernels.cli"]
    moved = [sorted(layer) for layer in LAYERS]
    moved[0].append("sbd_kernels.model")
    assert [sorted(layer) for layer in parsed] != moved


def test_layer_rule_catches_an_upward_import(tmp_path):
    """Guards against a layer check that cannot fail: an ops module importing the demo is flagged."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from sbd_kernels import demo\n    from sbd_kernels.model import Transformer\n")
    names = imported_modules(bad)
    assert names == {"sbd_kernels.demo", "sbd_kernels.model"}
    assert all(layer_of(name) > layer_of("sbd_kernels.ops.attention.triton") for name in names)


# A meta-path finder that makes `bench` unimportable, as for a user who pip-installed the package.
BLOCK_BENCH = """
import importlib.abc, sys
class BlockBench(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "bench" or name.startswith("bench."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)")
        return None
sys.meta_path.insert(0, BlockBench())
"""


def test_every_module_imports_without_bench():
    """Guards against the installed package needing the repository's `bench/` folder at run time: every
    module imports, and the `sbd` parser (each subcommand's flags) builds, with `bench` unimportable."""
    modules = sorted({module_name(p) for p in PACKAGE_FILES})
    code = BLOCK_BENCH + (
        "import importlib\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "from sbd_kernels import cli\n"
        "cli.build_parser()\n"
        "print('ok')\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_roofline_of_this_cpu_runs_outside_the_checkout(tmp_path):
    """Guards against `sbd roofline --hardware cpu` importing the measuring code from the repository's
    `bench/` (ModuleNotFoundError from any folder but the repository root)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the ceilings of one core: a gentle, quick measurement
    proc = subprocess.run([sys.executable, "-m", "sbd_kernels.cli", "roofline", "--hardware", "cpu", "--batch", "1"],
                          cwd=tmp_path, capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "this CPU (measured)" in proc.stdout
