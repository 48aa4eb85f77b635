"""The test set-up's change to Triton's interpreter (`patch_the_interpreter_once_per_launch`): triton.language
patched once per launch instead of once per helper call, with nothing left unpatched that a helper needs and
nothing left patched after a launch."""
import os
import types

import pytest
import triton.language as tl

from sbd_kernels.testing import patch_the_interpreter_once_per_launch


class RecordingInterpreter:
    """What `patch_the_interpreter_once_per_launch` uses of triton.runtime.interpreter: `tl` and a
    `_patch_lang(fn)` that records its calls and returns a scope that records its restore."""

    def __init__(self, restores: bool = True):
        self.tl = tl
        self.calls: list[str] = []
        self.restored: list[str] = []
        self.restores = restores

    def _patch_lang(self, fn):
        self.calls.append(fn.__name__)
        if not self.restores:  # triton 3.5: nothing returned, nothing restored
            return None
        return types.SimpleNamespace(restore=lambda: self.restored.append(fn.__name__))


def function_seeing(name: str, **globals_):
    """A function called `name` whose globals are `globals_` (the modules a kernel's source file imports)."""
    return types.FunctionType((lambda: None).__code__, dict(globals_), name)


def test_a_launch_patches_once_and_its_helpers_not_again():
    """Guards against the saving being lost (every helper call repatching the language) and against a launch
    whose patch is not restored, or a later launch that is not patched because an earlier one was."""
    interpreter = RecordingInterpreter()
    assert patch_the_interpreter_once_per_launch(interpreter)
    kernel, helper = function_seeing("kernel", tl=tl), function_seeing("helper", tl=tl)
    scope = interpreter._patch_lang(kernel)
    for _ in range(3):
        interpreter._patch_lang(helper).restore()  # the interpreter never restores a helper's; harmless here
    assert interpreter.calls == ["kernel"] and interpreter.restored == []
    scope.restore()
    assert interpreter.restored == ["kernel"]
    interpreter._patch_lang(kernel)
    assert interpreter.calls == ["kernel", "kernel"]


def test_a_helper_seeing_another_language_module_is_patched():
    """Guards against a helper from a file that imports triton.language.core (not triton.language) running
    with that module unpatched, where the launch's kernel only saw triton.language."""
    interpreter = RecordingInterpreter()
    patch_the_interpreter_once_per_launch(interpreter)
    interpreter._patch_lang(function_seeing("kernel", tl=tl))
    interpreter._patch_lang(function_seeing("core_helper", core=tl.core))
    interpreter._patch_lang(function_seeing("core_helper_again", core=tl.core, tl=tl))
    assert interpreter.calls == ["kernel", "core_helper"]


def test_without_restores_the_language_is_patched_once():
    """triton 3.5's interpreter restores nothing: once patched, the modules stay patched, and every later
    call, launches included, would bind the same functions again."""
    interpreter = RecordingInterpreter(restores=False)
    patch_the_interpreter_once_per_launch(interpreter)
    for name in ("kernel", "helper", "next_kernel"):
        interpreter._patch_lang(function_seeing(name, tl=tl))
    assert interpreter.calls == ["kernel"]


def test_patching_twice_wraps_once_and_an_interpreter_without_the_hook_is_left():
    interpreter = RecordingInterpreter()
    assert patch_the_interpreter_once_per_launch(interpreter)
    wrapped = interpreter._patch_lang
    assert patch_the_interpreter_once_per_launch(interpreter) and interpreter._patch_lang is wrapped
    assert not patch_the_interpreter_once_per_launch(types.SimpleNamespace(tl=tl))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernels run compiled here")
def test_the_test_run_interprets_with_the_change():
    """Guards against the conftest no longer installing it: the interpreted kernel tests then take ~1.7x as
    long (24 s against 14 s for a filtered sampling test on a 2-core Xeon)."""
    from triton.runtime import interpreter

    assert getattr(interpreter._patch_lang, "patches_once", False)
