"""The runnable examples in the public docstrings stay true."""
import doctest
import importlib

import pytest

DOCUMENTED_MODULES = ["sbd_kernels.ops.attention", "sbd_kernels.ops.sampling", "sbd_kernels.ops.scatter"]


@pytest.mark.parametrize("module_name", DOCUMENTED_MODULES)
def test_docstring_examples_run(module_name):
    """Guards against a docstring example drifting from what the op returns."""
    module = importlib.import_module(module_name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{module_name} has no runnable example"
    assert result.failed == 0
