"""Real-data task: line-level code completion on the Python sources of a pinned package (`code` in `sbd demo`).

Data. The `.py` files of transformers 5.23.0 as installed from its wheel: the same bytes on every machine, and every
file is checked against the wheel's RECORD (sha256) before use. They are read from a copy of the package installed
beside the environment, in `corpus_folder()` (`pip install --no-deps --ignore-requires-python --target <folder>
transformers==5.23.0`, which `make` runs from requirements-corpus.txt), so the environment's own transformers, and
its Python, can be any release; or from the environment's transformers where it is 5.23.0 (2860 files, 52.8 MB).
Files are split by file name: a file is held out when crc32 of its path (relative to site-packages) is 0 mod 10 (258
files, 5.4 MB). `corpus()` returns both splits and a sha256 of the corpus and of each split (over path and bytes of
every file, in path order), printed by `python -m sbd_kernels.code_models corpus`, the training runs and the curve.
Transformers copies code between models ("Copied from", modular and generated files), so a held-out line often has a
near-copy in the training files: `duplicate_rate` measures it.

Tokens. Bytes 0..255 plus PAD, BOS and the mask token (vocabulary of 264, a multiple of 8). BOS starts every prompt
and every training window; the newline byte ends a one-line answer.

Task (as CodeXGLUE's line-level completion scores it). From the context before a line start (the last CONTEXT_BYTES
bytes of the file before the line, cut at a line start), generate the line (`lines=1`), or the line and the next 3
lines (`lines=4`). Metrics of `microsoft/CodeXGLUE` Code-Code/CodeCompletion-line/evaluator: exact match of the
whitespace-separated tokens (`pred.split() == target.split()`) and edit similarity (fuzzywuzzy's `ratio`: the
indel similarity 100 * 2 LCS / (|a| + |b|) of the stripped strings; unrounded here, lines stripped one by one).
Kept targets (`keep_target`): the first line has at least MIN_TARGET_CHARS non-space characters (no blank line, no
bare `)` / `else:` / `pass`), is not a comment, not only closing brackets and punctuation, not equal to the line
before it (trivially repeated), and the target with its final newline fits the generation budget `BUDGET[lines]`
(99% of kept lines fit 128 bytes; 4-line targets longer than 240 bytes, about 20%, are dropped so that prompt +
answer stays within the 512 positions the models are trained on).
"""
from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata
import io
import random
import sys
import zlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

PACKAGE, VERSION = "transformers", "5.23.0"
CONTEXT_BYTES = 256
TRAIN_WINDOW = 512          # positions of a training window: BOS + 511 bytes >= BOS + context + the 4-line budget
BUDGET = {1: 128, 4: 240}   # max_new_tokens per number of target lines (answer bytes, final newline included)
MIN_TARGET_CHARS = 6
HELD_OUT_MODULUS = 10


class ByteTokenizer:
    """Bytes are their own ids; PAD = 256, BOS = 257, MASK = 258; VOCAB_SIZE = 264 (a multiple of 8)."""

    PAD, BOS, MASK = 256, 257, 258
    NEWLINE = ord("\n")
    VOCAB_SIZE = 264

    @staticmethod
    def encode(text: str | bytes) -> list[int]:
        """UTF-8 bytes of `text` (or the bytes themselves) as ids."""
        return list(text.encode("utf-8") if isinstance(text, str) else text)

    @staticmethod
    def decode(ids: list[int]) -> str:
        """The text of the byte ids (special ids dropped; invalid UTF-8 replaced by U+FFFD)."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


TOKENIZER = ByteTokenizer()


@dataclass(frozen=True)
class Corpus:
    """The files of each split (paths relative to the package's site-packages folder) and the sha256 of the corpus
    and of each split ("corpus", "train", "held_out")."""

    root: Path
    train: tuple[str, ...]
    held_out: tuple[str, ...]
    sha256: dict[str, str]

    def read(self, relative: str) -> bytes:
        return (self.root / relative).read_bytes()

    def files(self, split: str) -> tuple[str, ...]:
        """The files of `split` ("train" or "held_out"); ValueError for another name."""
        if split not in ("train", "held_out"):
            raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
        return self.train if split == "train" else self.held_out


class CorpusError(RuntimeError):
    """The pinned package's sources are not installed, or a file differs from its wheel."""


def corpus_folder() -> Path:
    """Where the corpus's copy of the pinned package is installed, beside this environment (its sys.prefix: the
    venv's folder), whatever release of the package the environment itself runs."""
    return Path(sys.prefix) / "sbd-code-corpus"


def install_command() -> str:
    return f"pip install --no-deps --ignore-requires-python --target {corpus_folder()} {PACKAGE}=={VERSION}"


def pinned_distribution() -> importlib.metadata.Distribution:
    """The pinned package's distribution: the copy in corpus_folder(), else the environment's own when it is the
    pinned version; CorpusError naming the install command otherwise."""
    copy = next(iter(importlib.metadata.distributions(name=PACKAGE, path=[str(corpus_folder())])), None)
    if copy is not None and copy.version == VERSION:
        return copy
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        found = "none is installed"
    else:
        if dist.version == VERSION:
            return dist
        found = f"found {dist.version}, whose bytes would give another held-out set"
    raise CorpusError(f"the code task reads the sources of {PACKAGE}=={VERSION} ({found}); install them beside "
                      f"the environment: {install_command()}")


def corpus_unavailable() -> str | None:
    """Why the corpus cannot be read here (the pinned package missing, or another version of it), or None.
    Cheap: the files' bytes are checked when corpus() reads them."""
    try:
        pinned_distribution()
    except CorpusError as err:
        return str(err)
    return None


def _recorded_hashes() -> tuple[Path, dict[str, str]]:
    """(site-packages folder, {relative path: urlsafe-base64 sha256}) of the pinned package's .py files."""
    dist = pinned_distribution()
    root = Path(dist.locate_file(""))
    record = dist.read_text("RECORD") or ""
    hashes = {path: digest.removeprefix("sha256=") for path, digest, _ in csv.reader(io.StringIO(record))
              if path.startswith(f"{PACKAGE}/") and path.endswith(".py") and digest}
    return root, hashes


def is_held_out(relative: str) -> bool:
    """The split of one file, from its path alone: held out iff crc32(path) % HELD_OUT_MODULUS == 0."""
    return zlib.crc32(relative.encode()) % HELD_OUT_MODULUS == 0


@cache
def corpus() -> Corpus:
    """The checked corpus (every file's sha256 equals its wheel RECORD entry; CorpusError otherwise)."""
    root, hashes = _recorded_hashes()
    digests = {"corpus": hashlib.sha256(), "train": hashlib.sha256(), "held_out": hashlib.sha256()}
    train, held_out = [], []
    for relative in sorted(hashes):
        data = (root / relative).read_bytes()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        if digest != hashes[relative]:
            raise CorpusError(f"{root / relative} differs from the {PACKAGE} {VERSION} wheel: reinstall the package")
        side = "held_out" if is_held_out(relative) else "train"
        (held_out if side == "held_out" else train).append(relative)
        entry = relative.encode() + b"\0" + len(data).to_bytes(8, "little") + data
        digests["corpus"].update(entry)
        digests[side].update(entry)
    return Corpus(root, tuple(train), tuple(held_out), {k: v.hexdigest() for k, v in digests.items()})


# ----------------------------------------------------------------------------------------------------
# Examples and metrics
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Example:
    """source: the file; line: the 0-based index of the target's first line in it; prompt: the context as ids,
    BOS first; target: the text to generate, newlines between its lines but not after the last one."""

    source: str
    line: int
    prompt: list[int]
    target: str


def keep_target(lines: list[str], index: int, count: int = 1) -> bool:
    """Whether lines[index : index + count] is a kept target (the rules of the module docstring)."""
    if index + count > len(lines):
        return False
    line = lines[index].strip()
    if len(line.replace(" ", "")) < MIN_TARGET_CHARS or line.startswith("#"):
        return False
    if set(line) <= set(")]}:,; "):
        return False
    if index > 0 and line == lines[index - 1].strip():
        return False
    target = "\n".join(lines[index:index + count]) + "\n"
    return len(target.encode("utf-8")) <= BUDGET[count]


def prompt_before(lines: list[str], index: int) -> list[int]:
    """BOS + the file before line `index`, whole when it fits in CONTEXT_BYTES bytes, else its last CONTEXT_BYTES
    bytes from the first line start after their first byte. A window that begins exactly at a line start so
    loses that line too (22 of the first 1000 held-out one-line prompts, 1 of the demo's 24): kept, since every
    figure measured on the held-out examples was measured on these prompts."""
    context = ("\n".join(lines[:index]) + "\n").encode("utf-8") if index else b""
    if len(context) > CONTEXT_BYTES:
        tail = context[-CONTEXT_BYTES:]
        context = tail[tail.find(b"\n") + 1:] if b"\n" in tail[:-1] else tail
    return [ByteTokenizer.BOS, *context]


def line_examples(split: str, count: int, lines: int = 1, seed: int = 0) -> list[Example]:
    """`count` completion examples of `lines` target lines (1 or 4) from the files of `split`, the same on every
    machine: files visited in a seeded order, one kept target per file per round (so the examples spread over
    many files), chosen uniformly among the file's kept targets not chosen before. ValueError if fewer exist."""
    if lines not in BUDGET:
        raise ValueError(f"line_examples: lines must be one of {sorted(BUDGET)}, got {lines}")
    data = corpus()
    files = list(data.files(split))
    rng = random.Random(f"{seed}/{split}/{lines}")
    rng.shuffle(files)
    candidates: dict[str, list[int]] = {}
    texts: dict[str, list[str]] = {}
    examples: list[Example] = []
    while len(examples) < count:
        added = 0
        for relative in files:
            if relative not in texts:
                texts[relative] = data.read(relative).decode("utf-8", errors="replace").split("\n")
                candidates[relative] = [i for i in range(1, len(texts[relative]))
                                        if keep_target(texts[relative], i, lines)]
            if not candidates[relative]:
                continue
            i = candidates[relative].pop(rng.randrange(len(candidates[relative])))
            file_lines = texts[relative]
            examples.append(Example(relative, i, prompt_before(file_lines, i), "\n".join(file_lines[i:i + lines])))
            added += 1
            if len(examples) == count:
                break
        if not added:
            raise ValueError(f"line_examples: only {len(examples)} examples in {split}, asked for {count}")
    return examples


def completion_text(tokens: list[int], lines: int = 1) -> str:
    """The generated text up to (not including) the `lines`-th newline."""
    return "\n".join(ByteTokenizer.decode(tokens).split("\n")[:lines])


def exact_match(prediction: str, target: str) -> bool:
    """CodeXGLUE's exact match: the same whitespace-separated tokens (`prediction.split() == target.split()`)."""
    return prediction.split() == target.split()


def lcs_length(a: str, b: str) -> int:
    """Length of the longest common subsequence of a and b, bit-parallel (Allison & Dix 1986; Hyyroe 2004):
    V starts all ones over |a| bits; per character c of b, U = V & match(c), V = (V + U) | (V - U); the LCS is the
    number of zero bits left. O(|b|) big-integer operations of |a| bits each."""
    if not a or not b:
        return 0
    match: dict[str, int] = {}
    for i, ch in enumerate(a):
        match[ch] = match.get(ch, 0) | (1 << i)
    full = (1 << len(a)) - 1
    v = full
    for ch in b:
        u = v & match.get(ch, 0)
        v = ((v + u) | (v - u)) & full
    return len(a) - v.bit_count()


def _normalise(text: str) -> str:
    return "\n".join(line.strip() for line in text.strip().split("\n"))


def edit_similarity(prediction: str, target: str) -> float:
    """fuzzywuzzy's ratio without rounding (0..100): 100 * 2 LCS / (|p| + |t|) of the prediction and target, each
    line stripped; 100 when both are empty."""
    p, t = _normalise(prediction), _normalise(target)
    if not p and not t:
        return 100.0
    return 200.0 * lcs_length(p, t) / (len(p) + len(t))


def duplicate_rate(examples: list[Example]) -> float:
    """Share of examples whose target (each line stripped) occurs verbatim, as whole lines, in a training file."""
    data = corpus()
    train_lines = {line.strip() for relative in data.train
                   for line in data.read(relative).decode("utf-8", errors="replace").split("\n")}
    if not examples:
        return 0.0
    hits = 0
    for ex in examples:
        hits += all(line.strip() in train_lines for line in ex.target.split("\n"))
    return hits / len(examples)


# ----------------------------------------------------------------------------------------------------
# Training stream
# ----------------------------------------------------------------------------------------------------
class TrainWindows:
    """Windows of `length` ids: BOS + the `length - 1` bytes that follow a line start of `split` (files joined by a
    newline), the line start drawn uniformly among all line starts; batch `step` of a seeded, endless stream."""

    def __init__(self, length: int, seed: int, split: str = "train"):
        data = corpus()
        joined = b"\n".join(data.read(relative) for relative in data.files(split)) + b"\n" * length
        self.buffer = torch.frombuffer(bytearray(joined), dtype=torch.uint8)
        limit = self.buffer.numel() - length
        newlines = torch.nonzero(self.buffer[:limit] == ByteTokenizer.NEWLINE).flatten() + 1
        self.starts = torch.cat([torch.zeros(1, dtype=torch.int64), newlines[newlines < limit]])
        self.length = length
        self.seed = seed

    def batch(self, size: int, step: int) -> torch.Tensor:
        """[size, length] int64: BOS, then the bytes from a random line start; the same for the same (seed, step),
        so a resumed run sees the data it would have seen."""
        rng = torch.Generator().manual_seed(zlib.crc32(f"windows/{self.seed}/{step}".encode()))
        pick = torch.randint(0, self.starts.numel(), (size,), generator=rng)
        offsets = self.starts[pick, None] + torch.arange(self.length - 1)
        bos = torch.full((size, 1), ByteTokenizer.BOS, dtype=torch.int64)
        return torch.cat([bos, self.buffer[offsets].long()], dim=1)


# ----------------------------------------------------------------------------------------------------
# Scoring a decode
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scores:
    """exact_match: fraction of examples (0..1); edit_similarity: mean over examples (0..100); predictions: the
    scored text of each example; hits: exact match of each example."""

    exact_match: float
    edit_similarity: float
    predictions: list[str]
    hits: list[bool]


def score(generated: list[list[int]], examples: list[Example], lines: int) -> Scores:
    """Scores generated token lists (EOS included or not) against the examples' targets: each prediction is the
    text up to the `lines`-th newline (`completion_text`)."""
    if len(generated) != len(examples) or not examples:
        raise ValueError(f"score: {len(generated)} generations for {len(examples)} examples")
    predictions = [completion_text(tokens, lines) for tokens in generated]
    hits = [exact_match(p, ex.target) for p, ex in zip(predictions, examples)]
    similarity = [edit_similarity(p, ex.target) for p, ex in zip(predictions, examples)]
    return Scores(sum(hits) / len(hits), sum(similarity) / len(similarity), predictions, hits)
