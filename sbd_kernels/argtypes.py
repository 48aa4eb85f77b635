"""Argument types of the `sbd` command line, shared by every subcommand.

Each type parses one flag's text or raises `argparse.ArgumentTypeError`, which argparse prints as one line
`sbd <cmd>: error: argument --flag: <message>` under the usage and exits with status 2. A bad combination
of flags found after parsing is a `UsageError`, which `sbd` reports the same way.

Flags are spelled with dashes (`--batch-size`); `add_option` also registers the underscore spelling
(`--batch_size`) as a hidden alias, so scripts written against older `sbd train` flags keep working.
"""
from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable, Iterable
from typing import Any

from sbd_kernels.ops._float32 import FLOAT32_MAX, as_float32, exact_g

__all__ = [
    "UsageError",
    "add_option",
    "checked_number",
    "choice_list",
    "cuda_graph_problem",
    "device",
    "existing_file",
    "existing_file_or_none",
    "float32_number",
    "fraction",
    "min_p",
    "non_negative_float",
    "non_negative_float_list",
    "non_negative_int",
    "output_dir",
    "output_file",
    "positive_float",
    "positive_int",
    "positive_int_list",
    "require_device",
    "seed",
    "temperature",
    "top_k",
    "top_p",
]


class UsageError(ValueError):
    """Flags that parse one by one but not together (e.g. `--out` names an existing file without
    `--overwrite`); `sbd` prints it like an argparse error and exits with status 2."""


def add_option(parser: Any, flag: str, **kwargs: Any) -> argparse.Action:
    """parser.add_argument(flag, **kwargs), plus the underscore spelling of a dashed flag as a hidden
    alias: same destination, type and choices, absent from --help and from the usage line."""
    action = parser.add_argument(flag, **kwargs)
    alias = "--" + flag[2:].replace("-", "_")
    if alias != flag:
        shared = {k: v for k, v in kwargs.items() if k in ("action", "type", "choices", "nargs", "const", "metavar")}
        parser.add_argument(alias, dest=action.dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **shared)
    return action


# ----------------------------------------------------------------------------------------------------
# Numbers
# ----------------------------------------------------------------------------------------------------
def checked_number(text: str, kind: type, accept: Callable[[Any], bool], what: str) -> Any:
    """kind(text) if accept() takes it, else ArgumentTypeError "must be <what>": the building block of a
    numeric type, e.g. `lambda text: checked_number(text, float, lambda x: 1 <= x <= 8, "in [1, 8]")`."""
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not accept(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return checked_number(text, int, lambda n: n >= 1, "a positive integer")


def non_negative_int(text: str) -> int:
    return checked_number(text, int, lambda n: n >= 0, "an integer >= 0")


def seed(text: str) -> int:
    """A random seed: an integer in [0, 2**63), the range of the int64 seed tensors of the ops. Sequence i of a
    decode samples with seed + i: `generate.seeds_overflow` checks the last one once the prompt count is known."""
    return checked_number(text, int, lambda n: 0 <= n < 2**63, "an integer in [0, 2**63)")


def top_k(text: str) -> int:
    """A top-k count: an integer in [0, 2**63), the op's int64 (0: off)."""
    return checked_number(text, int, lambda n: 0 <= n < 2**63, "an integer in [0, 2**63) (0: off)")


def float32_number(text: str, accept: Callable[[float], bool], what: str) -> float:
    """float(text) if `accept` takes it as the float32 the sampler runs at (`DecodeConfig`, the op's checks),
    else ArgumentTypeError "must be <what>", naming the float32 when only the rounding rejects it (1e39 is inf,
    1e-50 is 0, 0.99999999999 is 1 as a float32)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    value32 = as_float32(value)
    if accept(value32):
        return value
    rounded = f" ({exact_g(value32)} as a float32)" if accept(value) else ""
    raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}{rounded}")


def temperature(text: str) -> float:
    """A sampling temperature: finite and >= 0 as a float32 (0: greedy)."""
    return float32_number(text, lambda t: 0 <= t <= FLOAT32_MAX,
                          f"finite and >= 0 as a float32 (at most {FLOAT32_MAX:.8g})")


def positive_float(text: str) -> float:
    return checked_number(text, float, lambda x: math.isfinite(x) and x > 0, "a finite number > 0")


def non_negative_float(text: str) -> float:
    return checked_number(text, float, lambda x: math.isfinite(x) and x >= 0, "a finite number >= 0")


def fraction(text: str) -> float:
    return checked_number(text, float, lambda x: 0 <= x <= 1, "a number in [0, 1]")


def top_p(text: str) -> float:
    """A top-p mass: in (0, 1] as a float32, 1 = off."""
    return float32_number(text, lambda x: 0 < x <= 1, "in (0, 1] as a float32 (1: off)")


def min_p(text: str) -> float:
    """A min-p ratio: in [0, 1) as a float32, 0 = off."""
    return float32_number(text, lambda x: 0 <= x < 1, "in [0, 1) as a float32 (0: off)")


def _items(text: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return items


def positive_int_list(text: str) -> list[int]:
    """`1,4,8` -> [1, 4, 8]; every item a positive integer, at least one."""
    return [positive_int(item) for item in _items(text)]


def non_negative_float_list(text: str) -> list[float]:
    """`0,0.1,0.35` -> [0.0, 0.1, 0.35]; every item a finite number >= 0, at least one."""
    return [non_negative_float(item) for item in _items(text)]


def choice_list(choices: Iterable[str]) -> Callable[[str], str]:
    """Type of a comma-separated subset of choices (e.g. task names); returns the text, normalised."""
    allowed = tuple(choices)

    def parse(text: str) -> str:
        items = _items(text)
        for item in items:
            if item not in allowed:
                raise argparse.ArgumentTypeError(f"unknown name {item!r} in {text!r} (choose from {', '.join(allowed)})")
        return ",".join(items)

    parse.__name__ = "choice_list"
    return parse


# ----------------------------------------------------------------------------------------------------
# Paths
# ----------------------------------------------------------------------------------------------------
def existing_file(text: str) -> str:
    """A readable file that exists (its content is checked by whoever reads it)."""
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")
    if not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not readable")
    return text


def existing_file_or_none(text: str) -> str:
    """existing_file, or the empty string for "none" (the default of optional input files)."""
    return text if text == "" else existing_file(text)


def output_file(text: str) -> str:
    """A file that can be written: not a directory, in a directory that exists and is writable (checked
    before the run, not when its results are ready). Whether it may replace an existing file is the
    caller's decision."""
    if text == "" or os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, expected a file name")
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"directory {folder!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"directory {folder!r} is not writable")
    return text


def output_dir(text: str) -> str:
    """A folder for results: an existing directory, or a path that does not exist yet (created)."""
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a file, expected a directory")
    return text


# ----------------------------------------------------------------------------------------------------
# Devices
# ----------------------------------------------------------------------------------------------------
_DEVICE = re.compile(r"(cpu|cuda)(:\d+)?")


def device(text: str) -> str:
    """`cpu` (the C++ kernels) or `cuda` / `cuda:N` (the Triton kernels). Whether that GPU exists is
    checked when the command runs (`require_device`), so that --help works anywhere."""
    if not _DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def cuda_graph_problem(args: argparse.Namespace) -> str | None:
    """Why --cuda-graph cannot apply to these arguments (None: it can, or it is off)."""
    if not args.cuda_graph:
        return None
    if not args.device.startswith("cuda"):
        return f"--cuda-graph needs --device cuda (CUDA graphs replay on a GPU), got --device {args.device}"
    if args.ops != "fused":
        return ("--cuda-graph needs --ops fused: the naive ops read values on the host, which a CUDA graph "
                "capture refuses")
    return None


def require_device(name: str) -> None:
    """Raises RuntimeError (one line, naming --device) when `name` is a CUDA device this machine lacks."""
    import torch

    if not name.startswith("cuda"):
        return
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise RuntimeError(f"--device {name}: no CUDA GPU is available (torch {torch.__version__}, {build})")
    index = int(name.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise RuntimeError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
