"""Real-data task: line-level code completion on the Python sources of a pinned package (`code` in `sbd demo`).

Data. The `.py` files of transformers 5.23.0 as installed from its wheel (pinned in requirements-dev.txt): the same
bytes on every machine, no download, and every file is checked against the wheel's RECORD (sha256) before use.
Files are split by directory (all files of `models/<name>/` fall on the same side, so a model's modular and
generated copies do not straddle the split): a directory is held out when crc32 of its path is 0 mod 10. `corpus()`
returns the files and a sha256 of each split, printed by the demo and the training script.

Tokens. Bytes 0..255 plus PAD, BOS and the mask token (vocabulary of 264, padded to a multiple of 8). The newline
byte is the end of an answer.

Task (as CodeXGLUE's line-level completion scores it). From the context before a line start (the last
CONTEXT_BYTES bytes of the file before the line, cut at a line start), generate the line: exact match of the
stripped line, and edit similarity (difflib ratio x 100, CodeXGLUE uses fuzzywuzzy's ratio). A second variant,
`lines=4`, generates the line and the next 3 lines (stops after the 4th newline). Kept targets: not blank, at least
MIN_TARGET_CHARS non-space characters, not equal to the line before them, not a pure comment or a pure closing
bracket.
"""
from __future__ import annotations

import base64
import csv
import difflib
import hashlib
import importlib.metadata
import io
import random
import zlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

PACKAGE, VERSION = "transformers", "5.23.0"
CONTEXT_BYTES = 384
MIN_TARGET_CHARS = 6
HELD_OUT_MODULUS = 10


class ByteTokenizer:
    """Bytes are their own ids; PAD = 256, BOS = 257, MASK = 258; VOCAB_SIZE = 264 (a multiple of 8)."""

    PAD, BOS, MASK = 256, 257, 258
    NEWLINE = ord("\n")
    VOCAB_SIZE = 264

    @staticmethod
    def encode(text: str | bytes) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else text)

    @staticmethod
    def decode(ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


TOKENIZER = ByteTokenizer()


@dataclass(frozen=True)
class Corpus:
    """The files of each split (paths relative to the package's site-packages folder) and their sha256."""

    root: Path
    train: tuple[str, ...]
    held_out: tuple[str, ...]
    sha256: dict[str, str]

    def read(self, relative: str) -> bytes:
        return (self.root / relative).read_bytes()


class CorpusError(RuntimeError):
    """The installed package is not the pinned one, or a file differs from its wheel."""


def _recorded_hashes() -> tuple[Path, dict[str, str]]:
    """(site-packages folder, {relative path: urlsafe-base64 sha256}) of the pinned package's .py files."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError as err:
        raise CorpusError(f"the code task reads the sources of {PACKAGE}=={VERSION}; install it "
                          f"(pip install {PACKAGE}=={VERSION})") from err
    if dist.version != VERSION:
        raise CorpusError(f"the code task reads the sources of {PACKAGE}=={VERSION}, found {dist.version}: other "
                          f"bytes would give another held-out set (pip install {PACKAGE}=={VERSION})")
    root = Path(dist.locate_file(""))
    record = dist.read_text("RECORD") or ""
    hashes = {path: digest.removeprefix("sha256=") for path, digest, _ in csv.reader(io.StringIO(record))
              if path.startswith(f"{PACKAGE}/") and path.endswith(".py") and digest}
    return root, hashes


def _held_out(relative: str) -> bool:
    """Whole directories go to one side: `transformers/models/llama/...` is decided by `transformers/models/llama`."""
    parts = relative.split("/")
    group = "/".join(parts[:3]) if len(parts) > 3 and parts[1] == "models" else "/".join(parts[:-1])
    return zlib.crc32(group.encode()) % HELD_OUT_MODULUS == 0


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
        side = "held_out" if _held_out(relative) else "train"
        (held_out if side == "held_out" else train).append(relative)
        entry = relative.encode() + b"\0" + data
        digests["corpus"].update(entry)
        digests[side].update(entry)
    return Corpus(root, tuple(train), tuple(held_out), {k: v.hexdigest() for k, v in digests.items()})


# ----------------------------------------------------------------------------------------------------
# Examples and metrics
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Example:
    """prompt: the context bytes (ids, BOS first); target: the text to generate, newlines included between lines
    but not after the last one."""

    source: str
    prompt: list[int]
    target: str


def _keep(lines: list[str], index: int) -> bool:
    line = lines[index].strip()
    if len(line.replace(" ", "")) < MIN_TARGET_CHARS or line.startswith("#"):
        return False
    if set(line) <= set(")]}:,; "):
        return False
    return index == 0 or line != lines[index - 1].strip()


def line_examples(split: str, count: int, lines: int = 1, seed: int = 0) -> list[Example]:
    """`count` completion examples from the files of `split` ("train" or "held_out"), the same on every machine:
    files visited in a seeded order, one kept line per file per round."""
    data = corpus()
    files = list(data.held_out if split == "held_out" else data.train)
    rng = random.Random(f"{seed}/{split}/{lines}")
    rng.shuffle(files)
    examples: list[Example] = []
    for relative in files * 4:
        if len(examples) == count:
            break
        text = data.read(relative).decode("utf-8", errors="replace")
        file_lines = text.split("\n")
        candidates = [i for i in range(1, len(file_lines) - lines) if _keep(file_lines, i)]
        if not candidates:
            continue
        i = rng.choice(candidates)
        context = "\n".join(file_lines[:i]) + "\n"
        context_bytes = context.encode("utf-8")[-CONTEXT_BYTES:]
        cut = context_bytes.find(b"\n") + 1 if len(context.encode("utf-8")) > CONTEXT_BYTES else 0
        target = "\n".join(file_lines[i:i + lines])
        examples.append(Example(relative, [ByteTokenizer.BOS] + list(context_bytes[cut:]), target))
    if len(examples) < count:
        raise ValueError(f"line_examples: only {len(examples)} examples in {split}, asked for {count}")
    return examples


def completion_text(tokens: list[int], lines: int = 1) -> str:
    """The generated text up to (not including) the `lines`-th newline."""
    text = ByteTokenizer.decode(tokens)
    return "\n".join(text.split("\n")[:lines])


def exact_match(prediction: str, target: str) -> bool:
    """CodeXGLUE: equal after stripping surrounding whitespace (of every line)."""
    return [line.strip() for line in prediction.split("\n")] == [line.strip() for line in target.split("\n")]


def edit_similarity(prediction: str, target: str) -> float:
    """difflib's ratio x 100 of the stripped strings (0..100; CodeXGLUE's fuzzy ratio)."""
    return 100.0 * difflib.SequenceMatcher(None, prediction.strip(), target.strip(), autojunk=False).ratio()


# ----------------------------------------------------------------------------------------------------
# Training stream
# ----------------------------------------------------------------------------------------------------
class TrainWindows:
    """Random windows of `length` bytes from the training files (joined with newlines), a seeded, endless stream."""

    def __init__(self, length: int, seed: int):
        data = corpus()
        joined = b"\n".join(data.read(relative) for relative in data.train)
        self.buffer = torch.frombuffer(bytearray(joined), dtype=torch.uint8)
        self.length = length
        self.rng = torch.Generator().manual_seed(seed)

    def next_batch(self, batch: int) -> torch.Tensor:
        """[batch, length] int64 byte ids of windows starting anywhere in the training text."""
        starts = torch.randint(0, self.buffer.numel() - self.length, (batch,), generator=self.rng)
        return self.buffer[starts[:, None] + torch.arange(self.length)].long()
