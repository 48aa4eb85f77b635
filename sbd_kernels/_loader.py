"""Loads the compiled `sbd` operator library, or says exactly what failed and how to rebuild it."""
from __future__ import annotations

import importlib

REBUILD_HINT = (
    "Rebuild it against the installed torch (the extension must be compiled against the torch version that "
    "imports it):\n"
    "    from a checkout, in its root:  pip install --no-build-isolation -e .\n"
    "    installed from the sdist:      pip install --no-build-isolation --force-reinstall --no-deps "
    "<the sdist file, or the checkout folder>"
)


class SbdLibraryLoadError(ImportError):
    """The compiled extension `sbd_kernels._C` is missing or does not match the installed torch."""


SbdLibraryLoadError.__module__ = "sbd_kernels"  # its public name, which the traceback's last line shows


def load_extension() -> None:
    """Import `sbd_kernels._C`, which registers every `torch.ops.sbd` schema and the CPU kernels."""
    import torch

    try:
        importlib.import_module("sbd_kernels._C")
    except ImportError as err:  # missing file, undefined symbol from a torch ABI mismatch, ...
        # from None: the message holds the cause; its chained traceback (importlib's frames) would print
        # above the fix as a second error, which is all `sbd --help` shows when the library is missing.
        raise SbdLibraryLoadError(
            f"sbd_kernels: could not load the compiled library sbd_kernels._C "
            f"(torch {torch.__version__}): {err}\n{REBUILD_HINT}"
        ) from None
    if not hasattr(torch.ops.sbd, "entropy_sample"):
        raise SbdLibraryLoadError(
            "sbd_kernels: sbd_kernels._C loaded but registered no `sbd` ops.\n" + REBUILD_HINT
        )
