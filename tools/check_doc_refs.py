"""Checks that every reference to the project's documents resolves (standard library only).

A reference names a document under docs/ and optionally a numbered section of it or a range of sections:

    docs/algorithm.md            docs/algorithm.md §2.4            docs/algorithm.md §3.2-3.3

A section exists when the document has a numbered heading for it, one scheme for every document:
`## 2.` (or `## 2 Title`) defines section 2, `### 2.4 Title` section 2.4, one more `#` per level. Inside a
document under docs/, a section sign and number without a document name refer to that document; anywhere
else the document's name must come first.

Fails (exit 1), listing `file:line: problem` for each, when:
- a referenced document or section does not exist, or a bare `§` number appears outside docs/;
- a numbered heading of a document breaks the scheme (its level does not match its depth, or it repeats);
- a file mentions the internal notes that live outside the repository (`NOTE_NAMES`): cite docs/ instead.
  This file itself is exempt, since it names them (and, below, a module that is gone);
- a command runs a module of the repository that does not exist (`python -m bench.report` after the
  module moved): `python -m <module>` (python3, .venv/bin/python, ... alike) whose first part is one of the
  repository's packages (PROJECT_PACKAGES) must name a .py file or a package folder in it;
- a Markdown file (the reports under bench/reference/ aside) gives a GPU figure without its source: a
  paragraph, or a paragraph with the tables right after it, that names a GPU model (H100, A100, ...) and gives
  a figure in us, ms, GB/s, TB/s, GFLOP/s or TFLOP/s must name an existing bench/reference/ path (the
  committed report), or say "no committed report" (a one-off run), or "datasheet" (a vendor's figure, not
  a measurement).

Usage (from anywhere inside the repository):
    python tools/check_doc_refs.py             # every tracked text file (`git ls-files`)
    python tools/check_doc_refs.py FILE ...    # only these files; references resolve against the
                                               # repository's docs/
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SELF = Path(__file__).resolve()

SECTION = r"\d+(?:\.\d+)*"
# docs/<name>.md, optionally followed by " §<section>" or " §<first>-<last>".
REFERENCE = re.compile(rf"(?<![\w./-])(docs/[\w./-]+?\.md)(?![\w-])(?: §({SECTION})(?:-({SECTION}))?)?")
BARE_SECTION = re.compile(rf"§({SECTION})(?:-({SECTION}))?")
HEADING = re.compile(rf"^(#{{1,6}})\s+({SECTION})\.?(?:\s|$)")
FENCE = re.compile(r"^\s*(```|~~~)")

# Internal notes that never ship with the repository; the code must cite docs/ instead.
NOTE_NAMES = ("SBD_SPEC", "FINDINGS", "DESIGN.md", "STYLE.md", "PAPER_ROOFLINE", "/work/shared")
NOTES = re.compile("|".join(re.escape(name) for name in NOTE_NAMES))

# `python -m <module>`, the module of the repository's own packages checked to exist.
MODULE_RUN = re.compile(r"\bpython(?:3(?:\.\d+)?)?\s+-m\s+([A-Za-z_]\w*(?:\.\w+)*)")
PROJECT_PACKAGES = ("sbd_kernels", "bench", "tools", "tests")


# GPU figures in Markdown: a GPU model, a number with a time or throughput unit, and what names the source.
GPU_MODEL = re.compile(r"\b(?:A100|H100|H200|B100|B200|GH200|L40S?|L4|V100)\b")
GPU_FIGURE = re.compile(r"\d(?:[\d.,]*\d)?\s?(?:us|µs|ms|[GT]B/s|[GT]FLOP/s)(?!\w)")
REPORT_PATH = re.compile(r"bench/reference/[\w./-]+")
UNREPORTED_LABEL = "no committed report"
DATASHEET = "datasheet"
REPORTS_DIR = "bench/reference/"


@dataclass(frozen=True)
class Problem:
    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


def tracked_files(root: Path) -> list[Path]:
    """Every file `git ls-files` lists under root (raises RuntimeError outside a git checkout)."""
    try:
        listing = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError) as err:
        raise RuntimeError(f"check_doc_refs: cannot list the tracked files of {root} ({err})") from err
    out = listing.stdout
    return [root / name for name in out.decode().split("\0") if name]


def read_text(path: Path) -> str | None:
    """The file as UTF-8 text, or None for a binary, undecodable or missing file."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def display(path: Path, root: Path) -> str:
    try:
        return str(path.resolve().relative_to(root))
    except ValueError:
        return str(path)


def document_sections(doc: Path, root: Path) -> tuple[set[str], list[Problem]]:
    """(section numbers of the numbered headings of `doc`, problems with its heading scheme)."""
    sections: set[str] = set()
    problems: list[Problem] = []
    in_fence = False
    for number, line in enumerate((read_text(doc) or "").splitlines(), start=1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        match = None if in_fence else HEADING.match(line)
        if not match:
            continue
        hashes, section = match.groups()
        depth = section.count(".") + 1
        if len(hashes) != depth + 1:
            message = f"heading of §{section} has {len(hashes)} '#', expected {depth + 1} (parts + 1)"
            problems.append(Problem(display(doc, root), number, message))
        if section in sections:
            problems.append(Problem(display(doc, root), number, f"§{section} is defined twice"))
        sections.add(section)
    return sections, problems


class Documents:
    """The documents under root/docs and their sections, read once each."""

    def __init__(self, root: Path):
        self.root = root
        self._sections: dict[str, set[str] | None] = {}
        self.problems: list[Problem] = []

    def sections(self, name: str) -> set[str] | None:
        """Section numbers of the document `name` (e.g. "docs/algorithm.md"), None if it does not exist."""
        if name not in self._sections:
            path = self.root / name
            if path.is_file():
                self._sections[name], problems = document_sections(path, self.root)
                self.problems += problems
            else:
                self._sections[name] = None
        return self._sections[name]


def check_range(docs: Documents, name: str, first: str | None, last: str | None) -> str | None:
    """None when `name` (and its sections first..last, where given) exist; else what is missing."""
    sections = docs.sections(name)
    if sections is None:
        return f"no document {name}"
    missing = [s for s in (first, last) if s is not None and s not in sections]
    if missing:
        return f"no section §{missing[0]} in {name}"
    return None


def missing_module(module: str, root: Path) -> str | None:
    """None when `module` is outside the repository's packages or is a file (or package) of root; else what
    is missing."""
    parts = module.split(".")
    if parts[0] not in PROJECT_PACKAGES:
        return None
    base = root.joinpath(*parts)
    if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file() or (base / "__main__.py").is_file():
        return None
    return f"no {'/'.join(parts)}.py in the repository"


def check_text(path: Path, text: str, docs: Documents) -> list[Problem]:
    """Every problem of one file: unresolved references, bare section numbers, modules run that do not
    exist, mentions of the notes."""
    shown = display(path, docs.root)
    own_doc = shown if shown.startswith("docs/") and shown.endswith(".md") else None
    problems = []
    for number, line in enumerate(text.splitlines(), start=1):
        spans = []
        for match in REFERENCE.finditer(line):
            spans.append(match.span())
            name, first, last = match.groups()
            missing = check_range(docs, name, first, last)
            if missing:
                problems.append(Problem(shown, number, f"'{match.group(0)}' does not resolve: {missing}"))
        for match in BARE_SECTION.finditer(line):
            if any(start <= match.start() < end for start, end in spans):
                continue
            if own_doc is None:
                problems.append(Problem(shown, number, f"'{match.group(0)}' names no document: write "
                                        f"'docs/<name>.md {match.group(0)}'"))
                continue
            missing = check_range(docs, own_doc, *match.groups())
            if missing:
                problems.append(Problem(shown, number, f"'{match.group(0)}' does not resolve: {missing}"))
        if path.resolve() == SELF:  # names the notes, and a module that is gone, as examples
            continue
        for match in MODULE_RUN.finditer(line):
            missing = missing_module(match.group(1), docs.root)
            if missing:
                problems.append(Problem(shown, number, f"'{match.group(0)}' runs no module: {missing}"))
        for match in NOTES.finditer(line):
            message = (f"mentions '{match.group(0)}', an internal note outside the repository: cite "
                       "docs/algorithm.md or docs/performance.md")
            problems.append(Problem(shown, number, message))
    return problems


def markdown_units(text: str) -> list[tuple[int, str]]:
    """(first line number, text on one line) of each paragraph of a Markdown text, the tables right after a
    paragraph joined to it (a table's figures are introduced by the paragraph above); headings, blank lines
    and fences end a unit, fenced lines belong to none."""
    units: list[tuple[int, list[str]]] = []
    current: list[str] | None = None
    joinable = False  # the last unit is a paragraph (or a paragraph and its tables) and may take a table
    in_fence = False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            in_fence, current, joinable = not in_fence, None, False
            continue
        if in_fence or line.startswith("#"):
            current, joinable = None, False
            continue
        if not line.strip():
            current = None
            continue
        if current is None:
            if line.startswith("|") and joinable:
                current = units[-1][1]
            else:
                current = []
                units.append((number, current))
                joinable = not line.startswith("|")
        current.append(line)
    return [(number, " ".join(" ".join(lines).split())) for number, lines in units]  # one space between words


def gpu_figure_problems(path: Path, text: str, root: Path) -> list[Problem]:
    """Paragraphs (with their tables) of a Markdown file that give a GPU figure without naming its source."""
    problems = []
    for number, unit in markdown_units(text):
        if not (GPU_MODEL.search(unit) and GPU_FIGURE.search(unit)):
            continue
        reported = any((root / match.group(0).rstrip(".")).exists() for match in REPORT_PATH.finditer(unit))
        if reported or UNREPORTED_LABEL in unit or DATASHEET in unit:
            continue
        figure = GPU_FIGURE.search(unit).group(0)
        problems.append(Problem(display(path, root), number, (
            f"GPU figure '{figure}' without its source: name its report (an existing bench/reference/ path), "
            f"or label it '{UNREPORTED_LABEL}' (a one-off run) or as a {DATASHEET} value")))
    return problems


def check_files(files: list[Path], root: Path) -> tuple[list[Problem], int]:
    """(problems, number of text files read) for `files`, references resolved against root/docs."""
    docs = Documents(root)
    problems: list[Problem] = []
    scanned = 0
    for path in files:
        text = read_text(path)
        if text is None:
            continue
        scanned += 1
        problems += check_text(path, text, docs)
        if path.suffix == ".md" and not display(path, root).startswith(REPORTS_DIR):
            problems += gpu_figure_problems(path, text, root)
    # Heading problems of every document, referenced or not.
    for doc in sorted((root / "docs").glob("**/*.md")):
        docs.sections(display(doc, root))
    return problems + docs.problems, scanned


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("files", nargs="*", type=Path, help="files to check (default: every tracked file)")
    args = parser.parse_args(argv)
    try:
        files = args.files or tracked_files(REPO_ROOT)
    except RuntimeError as err:
        print(err, file=sys.stderr)
        return 2
    problems, scanned = check_files(files, REPO_ROOT)
    if problems:
        for problem in problems:
            print(problem, file=sys.stderr)
        print(f"check_doc_refs: {len(problems)} problem(s) in {scanned} files", file=sys.stderr)
        return 1
    print(f"check_doc_refs: every document reference in {scanned} files resolves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
