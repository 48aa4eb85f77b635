"""Package-level guarantees: the public schemas, the extension loader, the CPU instruction-set switch,
and what a plain `pip install .` would pull."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# The op schemas of csrc/sbd_ops.cpp, as the dispatcher prints them. Other codebases call these exact names.
EXPECTED_SCHEMAS = {
    "block_attention_with_kvcache": (
        "sbd::block_attention_with_kvcache(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor cache_seqlens, Tensor num_causal, int block_size, "
        "Tensor? block_table=None, float? softmax_scale=None) -> (Tensor out, Tensor lse)"
    ),
    "entropy_sample": (
        "sbd::entropy_sample(Tensor logits, Tensor seed, Tensor offset, Tensor? temperature=None, "
        "float temperature_val=0., Tensor? compute_mask=None, int mask_token_id=-1, Tensor? top_k=None, "
        "int top_k_val=0, Tensor? top_p=None, float top_p_val=1., Tensor? min_p=None, float min_p_val=0.) "
        "-> (Tensor tokens, Tensor entropy, Tensor logprob, Tensor valid)"
    ),
    "mask_scatter_": (
        "sbd::mask_scatter_(Tensor(a!) block_tokens, Tensor(b!) is_masked, Tensor sampled, "
        "Tensor entropy, Tensor? gamma=None, float gamma_val=0.10000000000000001, str rule=\"eb\", "
        "Tensor? valid=None) -> (Tensor accepted, Tensor num_accepted, Tensor block_done)"
    ),
}


@pytest.mark.parametrize("op", sorted(EXPECTED_SCHEMAS))
def test_schema_is_the_contract(op):
    """Guards against a schema drifting from the published contract (names, defaults, aliasing)."""
    assert str(getattr(torch.ops.sbd, op).default._schema) == EXPECTED_SCHEMAS[op]


@pytest.mark.parametrize("entry", ["import sbd_kernels", "from sbd_kernels.cli import main; main(['--help'])"])
def test_missing_extension_names_the_cause_and_the_fix(entry):
    """Guards against a silent or cryptic failure when the compiled library cannot load, from the package or
    the `sbd` command: one traceback (no chained import error above the fix), ending in the cause and the fix."""
    code = f"import sys; sys.modules['sbd_kernels._C'] = None\n{entry}\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode != 0
    assert proc.stderr.count("Traceback") == 1, proc.stderr
    assert "sbd_kernels.SbdLibraryLoadError: sbd_kernels: could not load the compiled library sbd_kernels._C" \
        in proc.stderr
    assert "pip install --no-build-isolation -e ." in proc.stderr
    assert "pip install --no-build-isolation --force-reinstall --no-deps" in proc.stderr  # an install, no checkout


def test_build_without_visible_torch_says_build_isolation_hides_it():
    """Guards against "none was found. Install one first" where torch is installed but hidden by build isolation
    (a --user torch, a --system-site-packages venv, `python -m build`): the message names the isolation and the
    commands that build without it."""
    root = Path(__file__).resolve().parents[1]
    code = "import sys; sys.modules['torch'] = None; sys.argv = ['setup.py', '--name']; exec(open('setup.py').read())"
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=False)
    assert proc.returncode == 1
    for words in ("Build isolation", "hides", "pip install --no-build-isolation .", "python -m build --no-isolation"):
        assert words in proc.stderr, proc.stderr


def test_cpu_isa_switch_rejects_unknown_names():
    """Guards against a typo in SBD_CPU_ISA silently running another kernel variant."""
    with pytest.raises(RuntimeError, match="unknown CPU instruction set 'avx9'"):
        torch.ops.sbd._set_cpu_isa("avx9")
    assert torch.ops.sbd._cpu_isa() in ("default", "avx2", "avx512")


def test_cpu_isa_environment_variable_is_honoured():
    """Guards against SBD_CPU_ISA being ignored (benchmarks use it to time each variant)."""
    code = "import torch, sbd_kernels; print(torch.ops.sbd._cpu_isa())"
    env = {**__import__("os").environ, "SBD_CPU_ISA": "default"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "default"


def test_plain_pip_install_keeps_the_installed_torch(tmp_path):
    """Guards against `pip install .` replacing the user's torch (a CUDA build of several GB from PyPI).

    A dry run with build isolation, as a user would type it: pip builds the metadata in an isolated
    environment without torch (setup.py must find the installed torch from there) and resolves the
    dependencies against this environment. The only package it may install is ours.
    """
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    root = Path(__file__).resolve().parents[1]
    build_requires = tomllib.loads((root / "pyproject.toml").read_text())["build-system"]["requires"]
    assert not [r for r in build_requires if r.startswith("torch")], build_requires
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report), "."],
        cwd=root, capture_output=True, text=True, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    to_install = sorted(item["metadata"]["name"] for item in json.loads(report.read_text())["install"])
    assert to_install == ["sbd_kernels"], to_install
    assert "BuildBackendWarning" not in proc.stderr, proc.stderr


def test_install_instructions_name_what_exists():
    """Guards against install lines that cannot work: `sbd_kernels[hf]` names a package that is not on PyPI,
    `torch==2.13.0` alone is said to avoid CUDA (true only where the index serves the +cpu wheel), and a
    --no-build-isolation build needs the build requirements (license = "MIT" needs setuptools >= 77)."""
    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    texts = [readme, (root / "Makefile").read_text(), (root / "sbd_kernels" / "bench_report.py").read_text()]
    assert not [t for t in texts if "sbd_kernels[" in t]
    assert "so that no CUDA build of torch is pulled" not in readme
    assert "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in readme
    assert 'pip install "setuptools>=77" wheel' in readme


def _pyproject() -> dict:
    """pyproject.toml of the checkout, parsed (skips the test before Python 3.11, which has no tomllib)."""
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())


def test_hf_import_minimums_are_the_hf_extra_of_pyproject():
    """Guards against the two copies of the HF minimums drifting apart: what `sbd_kernels.hf` refuses at import
    and what pyproject.toml's `hf` extra asks pip for."""
    pytest.importorskip("transformers")
    from sbd_kernels.hf._versions import MINIMUM

    extra = _pyproject()["project"]["optional-dependencies"]["hf"]
    assert extra == [f"{name}>={version}" for name, version in MINIMUM.items()]


def test_package_discovery_ships_the_checkpoint_folders():
    """Guards against the bundled checkpoints (what `sbd demo` decodes) dropped from wheels: their folders hold no
    __init__.py, so plain discovery leaves them out of the packages, and setuptools warned it would stop shipping
    their files ("Package would be ignored"). Namespace discovery takes them, and no __pycache__ folder."""
    import setuptools

    find = _pyproject()["tool"]["setuptools"]["packages"]["find"]
    assert find["namespaces"] is True
    repo = str(Path(__file__).resolve().parents[1])
    packages = set(setuptools.find_namespace_packages(repo, include=find["include"], exclude=find["exclude"]))
    assert {"sbd_kernels.checkpoints", "sbd_kernels.checkpoints.code_sbd", "sbd_kernels.checkpoints.code_ntp",
            "sbd_kernels.ops.attention"} <= packages
    assert not any("__pycache__" in name for name in packages)
