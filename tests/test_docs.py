"""The runnable examples in the public docstrings stay true, and every reference to docs/ resolves."""
import doctest
import functools
import importlib
import importlib.util
import subprocess
import sys
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


# ---------------------------------------------------------------------------------------------------------
# References to docs/ (tools/check_doc_refs.py, also run by `make lint`)
# ---------------------------------------------------------------------------------------------------------
REPO_ROOT = Path(__file__).resolve().parent.parent
CHECKER = REPO_ROOT / "tools" / "check_doc_refs.py"


def _run_checker(*files: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECKER), *map(str, files)], capture_output=True, text=True,
                          cwd=REPO_ROOT, check=False)


@functools.cache
def tool_module(name: str):
    """tools/<name>.py imported as a module (the tools are scripts, not part of the package), once."""
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_reference_in_the_repository_resolves():
    """Guards against a comment, docstring or document citing a section of docs/ that does not exist (or
    was renumbered), and against citations of internal notes that never ship with the repository."""
    in_git = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--is-inside-work-tree"],
                            capture_output=True, check=False).returncode == 0
    if not in_git:
        pytest.skip("not a git checkout: the checker scans `git ls-files`")
    result = _run_checker()
    assert result.returncode == 0, result.stdout + result.stderr


def test_checker_reports_each_broken_reference(tmp_path):
    """Guards against a checker that passes everything: a file with a missing section, a missing range end,
    a missing document, a section number without a document and a mention of an internal note must fail
    with file:line and the missing target, while the valid references beside them are not reported."""
    note = tool_module(CHECKER.stem).NOTE_NAMES[0]
    lines = [
        "see docs/algorithm.md §2.4 and docs/performance.md §7.1",      # 1: valid
        "see docs/algorithm.md §3.2-3.3",                               # 2: valid range
        "see docs/algorithm.md " + "§" + "99.1",                        # 3: no such section
        "see docs/algorithm.md " + "§" + "3.2-3.99",                    # 4: range end missing
        "see docs/" + "nowhere.md",                                     # 5: no such document
        "see " + "§" + "3.5",                                           # 6: no document named
        f"see {note} 3.5",                                              # 7: internal note
    ]
    source = tmp_path / "example.py"
    source.write_text("\n".join(lines) + "\n")
    result = _run_checker(source)
    assert result.returncode == 1, result.stdout + result.stderr
    reported = {int(line.split(":")[1]): line for line in result.stderr.splitlines()
                if line.startswith(str(source))}
    expected = {3: "99.1 in docs/algorithm.md", 4: "3.99 in docs/algorithm.md",
                5: "no document docs/" + "nowhere.md", 6: "names no document", 7: f"mentions '{note}'"}
    assert sorted(reported) == sorted(expected), result.stderr
    for number, target in expected.items():
        assert target in reported[number], reported[number]

    source.write_text("\n".join(lines[:2]) + "\n")
    assert _run_checker(source).returncode == 0, "valid references alone must pass"


def test_checker_finds_commands_that_run_a_module_that_is_gone(tmp_path):
    """Guards against documented commands that fail as written because the module they run moved or never
    existed (the docs ran bench/report.py as a module after it moved into the package): a module of the
    repository's packages must exist; other modules (pytest, pip, venv) are not the checker's to know."""
    module = tool_module(CHECKER.stem)
    gone, never = "bench" + ".report", "tools" + ".nothing"  # split: this file is checked too
    lines = ["python -m sbd_kernels.aot --warm", ".venv/bin/python3 -m pytest tests -q", "python -m venv .venv",
             "python3 -m sbd_kernels.cli gpu-check", f"run `python -m {gone} --only sampling`",
             f"python3.12 -m {never}"]
    source = tmp_path / "example.md"
    source.write_text("\n".join(lines) + "\n")
    problems = module.check_text(source, source.read_text(), module.Documents(REPO_ROOT))
    assert [(p.line, p.message) for p in problems] == [
        (5, f"'python -m {gone}' runs no module: no bench/report.py in the repository"),
        (6, f"'python3.12 -m {never}' runs no module: no tools/nothing.py in the repository")]


def test_checker_enforces_one_heading_scheme(tmp_path):
    """Guards against documents whose numbered headings cannot be cited unambiguously: a section number
    defined twice, or a heading level that does not match the number's depth."""
    doc = tmp_path / "doc.md"
    doc.write_text("# Title\n## 1. One\n### 1.1 Sub\n## 1.2 Wrong level\n### 1.1 Again\n"
                   "```\n## 9. In a fence\n```\n")
    sections, problems = tool_module(CHECKER.stem).document_sections(doc, tmp_path)
    assert sections == {"1", "1.1", "1.2"}
    assert [(p.line, "twice" in p.message) for p in problems] == [(4, False), (5, True)]


def test_checker_wants_the_source_of_every_gpu_figure(tmp_path):
    """Guards against a GPU timing in the docs that names no source (a one-off run passed off as a result of
    this repository's commands): a paragraph, or a table under a paragraph, that names a GPU and gives a
    figure in us / ms / TB/s fails unless it names an existing bench/reference/ report, says "no committed
    report", or quotes a datasheet; a CPU figure, or a GPU named without a figure, needs none."""
    unsourced = ["On an H100 the kernel took 57 us at L = 4096.",
                 "Timed on one NVIDIA H100:\n\n| L | time |\n|---|---|\n| 4096 | 57 us |",
                 "On an A100: 1.2 TB/s, see bench/reference/no-such-gpu/report.md."]
    sourced = ["On an H100 the kernel took 57 us (one-off run, no committed\nreport).",
               "On an H100 the kernel took 57 us (bench/reference/epyc-zen4-2core/report.md).",
               "An H100 datasheet gives 3.35 TB/s.",
               "The kernel took 57 us on this CPU.", "The checkpoints were trained on an H100.",
               "## Timings on an H100\n\n| L | time |\n|---|---|\n| 4096 | 57 us |",
               "```\nH100: 57 us\n```"]
    module = tool_module(CHECKER.stem)
    for text in unsourced:
        problems = module.gpu_figure_problems(tmp_path / "doc.md", text + "\n", REPO_ROOT)
        assert len(problems) == 1 and "without its source" in problems[0].message, text
    for text in sourced:
        assert module.gpu_figure_problems(tmp_path / "doc.md", text + "\n", REPO_ROOT) == [], text
    doc = tmp_path / "doc.md"
    doc.write_text("# Doc\n\nSome text.\n\n" + unsourced[1] + "\n")
    result = _run_checker(doc)
    assert result.returncode == 1 and f"{doc}:5: GPU figure '57 us'" in result.stderr, result.stderr
