"""Synthetic tasks with exact-match scoring, a character tokenizer, and batching for training.

Both task families have answers whose positions can be predicted in parallel, which SBD needs
(docs/performance.md §7.1: sorting failed at this scale, reversed-digit addition worked):
- `add`: two 31-digit numbers written least-significant digit first; the answer is their sum as exactly
  32 digits, least-significant first (zero-padded). Answer digit i depends on digits i and one carry.
  Prompt `a+b` = 63 characters.
- `rot13`: a string of 47 lowercase letters; the answer is the same string with every letter shifted
  13 places. Answer character i depends on prompt character i only. Prompt = 47 characters.
Each encoded prompt ends with the separator id, so prompts are 64 and 48 tokens long: both multiples of
16, so the SBD decode blocks (k = 16, aligned to the start of the answer) coincide with the training
blocks of k = 16 (aligned to position 0). Answers are 32 and 47 characters plus EOS.

Splits: an example belongs to the held-out split iff crc32(prompt) % 10 == 0, so the splits are disjoint
by construction and deterministic from the seed, whatever the number of examples drawn.
"""
from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

HELD_OUT_BUCKETS = 10  # one prompt in 10 is held out


class CharTokenizer:
    """Character vocabulary: pad 0, eos 1, mask 2, separator 3, then digits, lowercase letters, '+'.

    `encode_prompt` appends the separator, `encode_answer` appends EOS; `decode` stops at EOS and drops
    reserved ids.
    """

    PAD, EOS, MASK, SEP = 0, 1, 2, 3
    CHARS = "0123456789abcdefghijklmnopqrstuvwxyz+"

    def __init__(self) -> None:
        self.reserved = 4
        self.char_to_id = {c: i + self.reserved for i, c in enumerate(self.CHARS)}
        self.id_to_char = {i: c for c, i in self.char_to_id.items()}

    @property
    def vocab_size(self) -> int:
        return self.reserved + len(self.CHARS)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.char_to_id[c] for c in text]
        except KeyError as err:
            char = err.args[0]
            raise ValueError(f"CharTokenizer.encode: character {char!r} not in the vocabulary") from None

    def encode_prompt(self, prompt: str) -> list[int]:
        return self.encode(prompt) + [self.SEP]

    def encode_answer(self, answer: str) -> list[int]:
        return self.encode(answer) + [self.EOS]

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        out = []
        for i in _as_list(ids):
            if i == self.EOS:
                break
            if i in self.id_to_char:
                out.append(self.id_to_char[i])
        return "".join(out)


TOKENIZER = CharTokenizer()


@dataclass(frozen=True)
class Example:
    task: str
    prompt: str
    answer: str


@dataclass(frozen=True)
class Task:
    """A task family: `generate(rng) -> (prompt, answer)` and the longest encoded prompt + answer."""

    name: str
    generate: Callable[[random.Random], tuple[str, str]]
    prompt_tokens: int  # encoded prompt length, separator included
    answer_tokens: int  # encoded answer length, EOS included


def _random_digits(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(n))


def generate_addition(rng: random.Random, digits: int = 31) -> tuple[str, str]:
    """a+b with digits reversed (least significant first) -> sum as digits + 1 digits, reversed."""
    a, b = _random_digits(rng, digits), _random_digits(rng, digits)
    total = int(a[::-1]) + int(b[::-1])
    return f"{a}+{b}", str(total).zfill(digits + 1)[::-1]


def generate_rot13(rng: random.Random, length: int = 47) -> tuple[str, str]:
    """A random lowercase string -> every letter shifted 13 places in the alphabet."""
    text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(length))
    return text, "".join(chr((ord(c) - 97 + 13) % 26 + 97) for c in text)


TASKS: dict[str, Task] = {
    "add": Task("add", generate_addition, prompt_tokens=64, answer_tokens=33),
    "rot13": Task("rot13", generate_rot13, prompt_tokens=48, answer_tokens=48),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {sorted(TASKS)}")
    return TASKS[name]


def is_held_out(prompt: str) -> bool:
    return zlib.crc32(prompt.encode()) % HELD_OUT_BUCKETS == 0


def _split_stream_seed(task: str, split: str, seed: int) -> int:
    return zlib.crc32(f"{task}/{split}/{seed}".encode())


def make_examples(task: str, split: str, count: int, seed: int = 0) -> list[Example]:
    """`count` deterministic examples of `task` from `split` ("train" or "held_out")."""
    if split not in ("train", "held_out"):
        raise ValueError(f"make_examples: split must be 'train' or 'held_out', got {split!r}")
    spec = get_task(task)
    rng = random.Random(_split_stream_seed(task, split, seed))
    out: list[Example] = []
    while len(out) < count:
        prompt, answer = spec.generate(rng)
        if is_held_out(prompt) == (split == "held_out"):
            out.append(Example(task, prompt, answer))
    return out


class TrainStream:
    """Endless training examples drawn uniformly over `tasks` (train split only), deterministic in seed."""

    def __init__(self, tasks: Sequence[str], seed: int):
        self.tasks = [get_task(t) for t in tasks]
        self.rng = random.Random(_split_stream_seed(",".join(tasks), "train", seed))

    def next_batch(self, batch_size: int) -> list[Example]:
        out: list[Example] = []
        while len(out) < batch_size:
            task = self.rng.choice(self.tasks)
            prompt, answer = task.generate(self.rng)
            if not is_held_out(prompt):
                out.append(Example(task.name, prompt, answer))
        return out


def sequence_length(tasks: Sequence[str]) -> int:
    """Padded length of a training sequence holding any of `tasks` (prompt + answer + EOS)."""
    return max(get_task(t).prompt_tokens + get_task(t).answer_tokens for t in tasks)


def collate(examples: Sequence[Example], length: int) -> tuple[Tensor, Tensor]:
    """tokens `[B, length]` int64 (prompt + SEP + answer + EOS, then PAD) and target_mask `[B, length]`
    bool, True at the answer and EOS positions (where training losses are counted)."""
    tokens = torch.full((len(examples), length), TOKENIZER.PAD, dtype=torch.long)
    target_mask = torch.zeros((len(examples), length), dtype=torch.bool)
    for row, ex in enumerate(examples):
        prompt, answer = TOKENIZER.encode_prompt(ex.prompt), TOKENIZER.encode_answer(ex.answer)
        if len(prompt) + len(answer) > length:
            total = len(prompt) + len(answer)
            raise ValueError(f"collate: example of {total} tokens exceeds length {length}")
        tokens[row, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        target_mask[row, len(prompt): len(prompt) + len(answer)] = True
    return tokens, target_mask


def _as_list(ids: Sequence[int] | Tensor) -> list[int]:
    return ids.tolist() if isinstance(ids, Tensor) else list(ids)


def _until_eos(ids: Sequence[int] | Tensor) -> list[int]:
    ids = _as_list(ids)
    return ids[: ids.index(TOKENIZER.EOS)] if TOKENIZER.EOS in ids else ids


def exact_match(pred_ids: Sequence[int] | Tensor, answer_ids: Sequence[int] | Tensor) -> bool:
    """True iff the prediction equals the answer up to the first EOS of each (a missing EOS in the
    prediction only matches if the tokens produced equal the whole answer)."""
    return _until_eos(pred_ids) == _until_eos(answer_ids)
