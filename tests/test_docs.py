"""The runnable examples in the public docstrings stay true."""
import doctest
import importlib
from pathlib import Path

import pytest

DOCUMENTED_MODULES = ["sbd_kernels.ops.attention", "sbd_kernels.ops.sampling", "sbd_kernels.ops.scatter"]


@pytest.mark.parametrize("module_name", DOCUMENTED_MODULES)
def test_docstring_examples_run(module_name):
    """Guards against a docstring example drifting from what the op returns."""
    module = importlib.import_module(module_name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{module_name} has no runnable example"
    assert result.failed == 0


def test_readme_python_example_runs():
    """Guards against the README's example of calling the ops drifting from the ops' signatures."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    start = readme.index("```python\nimport torch, sbd_kernels") + len("```python\n")
    code = readme[start:readme.index("```", start)]
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102  (our own README)
    assert namespace["out"].shape == namespace["q"].shape
    assert namespace["accepted"].any(dim=1).all(), "EB accepts at least one position per row"
