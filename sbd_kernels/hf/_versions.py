"""The oldest transformers and accelerate releases `sbd_kernels.hf` is tested with, checked at import."""
from __future__ import annotations

from importlib import metadata

from packaging.version import Version

# Releases the whole test suite passed with (pyproject.toml's `hf` extra says the same): before transformers
# 5.13 a cache layer must define get_max_cache_shape, and transformers 5.13's Trainer calls accelerate 1.3's
# unwrap_model(keep_torch_compile=). The Hugging Face tests pass on every minor release since; DBRX's own forward
# fails on 5.13 and 5.14 (its tests skip there, as the README says).
MINIMUM = {"transformers": "5.13", "accelerate": "1.3"}


def check_versions(installed: dict[str, str | None] | None = None) -> None:
    """Raise ImportError naming each package older than MINIMUM (`installed`: name -> version, None when the
    package is absent; default: read from the environment). An absent accelerate is left to Trainer, which
    says so when it needs it."""
    if installed is None:
        installed = {name: _installed_version(name) for name in MINIMUM}
    install = "pip install " + " ".join(f'"{name}>={version}"' for name, version in MINIMUM.items())
    if installed.get("transformers") is None:
        raise ImportError(f"sbd_kernels.hf needs transformers: {install}")
    old = [f"{name} {version} (needs >= {MINIMUM[name]})" for name, version in installed.items()
           if version is not None and Version(version) < Version(MINIMUM[name])]
    if old:
        raise ImportError(f"sbd_kernels.hf: {', '.join(old)}; upgrade: {install}")


def _installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
