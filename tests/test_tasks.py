"""Synthetic tasks: tokenizer, answers, deterministic disjoint splits, batching, exact match."""
import random

import pytest
import torch

from sbd_kernels.tasks import (
    TASKS,
    TOKENIZER,
    TrainStream,
    collate,
    exact_match,
    generate_addition,
    generate_rot13,
    get_task,
    is_held_out,
    make_examples,
    sequence_length,
)


def test_tokenizer_reserved_ids_and_round_trip():
    """Guards against reserved ids colliding with characters or a lossy encode/decode."""
    assert (TOKENIZER.PAD, TOKENIZER.EOS, TOKENIZER.MASK, TOKENIZER.SEP) == (0, 1, 2, 3)
    assert min(TOKENIZER.char_to_id.values()) == TOKENIZER.reserved
    assert len(set(TOKENIZER.char_to_id.values())) == len(TOKENIZER.CHARS)
    text = "0123456789+abcxyz"
    assert TOKENIZER.decode(TOKENIZER.encode(text)) == text
    assert TOKENIZER.encode_prompt("12")[-1] == TOKENIZER.SEP
    assert TOKENIZER.encode_answer("12")[-1] == TOKENIZER.EOS


def test_decode_stops_at_eos_and_drops_reserved_ids():
    """Guards against decode printing tokens after EOS or the mask / pad ids as characters."""
    ids = [TOKENIZER.MASK] + TOKENIZER.encode("ab") + [TOKENIZER.PAD, TOKENIZER.EOS] + TOKENIZER.encode("c")
    assert TOKENIZER.decode(ids) == "ab"
    assert TOKENIZER.decode(torch.tensor(ids)) == "ab"


def test_unknown_character_names_it():
    """Guards against silently mapping an unknown character to some id."""
    with pytest.raises(ValueError, match="'A'"):
        TOKENIZER.encode("aA")


@pytest.mark.parametrize("seed", [0, 1, 99])
def test_addition_answers_are_correct(seed):
    """Guards against wrong digit order or carry handling in the reversed-digit addition answers."""
    rng = random.Random(seed)
    for _ in range(50):
        prompt, answer = generate_addition(rng)
        a, b = prompt.split("+")
        assert len(a) == len(b) == 31 and len(answer) == 32
        assert int(answer[::-1]) == int(a[::-1]) + int(b[::-1])


def test_rot13_answers_are_correct():
    """Guards against a wrong letter mapping: rot13 applied twice is the identity and moves every letter."""
    rng = random.Random(0)
    for _ in range(50):
        prompt, answer = generate_rot13(rng)
        assert len(prompt) == len(answer) == 47
        assert all(p != a for p, a in zip(prompt, answer))
        assert "".join(chr((ord(c) - 97 + 13) % 26 + 97) for c in answer) == prompt


@pytest.mark.parametrize("name", sorted(TASKS))
def test_declared_lengths_and_answers_of_at_least_32_tokens(name):
    """Guards against declared prompt/answer lengths drifting from the encoded examples (batches are
    padded with them) and against answers shorter than 32 tokens; prompts are multiples of 16 so that
    decode blocks of 16 line up with the training blocks."""
    task = get_task(name)
    for ex in make_examples(name, "train", 20):
        assert len(TOKENIZER.encode_prompt(ex.prompt)) == task.prompt_tokens
        assert len(TOKENIZER.encode_answer(ex.answer)) == task.answer_tokens
        assert len(ex.answer) >= 32
    assert task.prompt_tokens % 16 == 0


@pytest.mark.parametrize("name", sorted(TASKS))
def test_splits_are_deterministic_and_disjoint(name):
    """Guards against held-out prompts appearing in training, and against splits that change between
    runs (the demo's accuracy must be comparable across runs)."""
    train = make_examples(name, "train", 300, seed=3)
    held = make_examples(name, "held_out", 100, seed=3)
    assert train == make_examples(name, "train", 300, seed=3)
    assert held == make_examples(name, "held_out", 100, seed=3)
    assert held != make_examples(name, "held_out", 100, seed=4)
    assert not {e.prompt for e in train} & {e.prompt for e in held}
    assert all(is_held_out(e.prompt) for e in held) and not any(is_held_out(e.prompt) for e in train)
    stream = TrainStream([name], seed=5).next_batch(300)
    assert not any(is_held_out(e.prompt) for e in stream)


def test_train_stream_mixes_tasks_deterministically():
    """Guards against a stream that ignores a task or differs between ranks seeded alike."""
    batch = TrainStream(["add", "rot13"], seed=1).next_batch(64)
    assert {e.task for e in batch} == {"add", "rot13"}
    assert batch == TrainStream(["add", "rot13"], seed=1).next_batch(64)
    assert batch != TrainStream(["add", "rot13"], seed=2).next_batch(64)


def test_collate_layout_and_target_mask():
    """Guards against the loss being counted on prompt or padding positions, or the EOS missing."""
    examples = make_examples("add", "train", 2) + make_examples("rot13", "train", 1)
    n = sequence_length(["add", "rot13"])
    tokens, target = collate(examples, n)
    assert tokens.shape == target.shape == (3, n) and tokens.dtype == torch.long
    for row, ex in enumerate(examples):
        prompt, answer = TOKENIZER.encode_prompt(ex.prompt), TOKENIZER.encode_answer(ex.answer)
        p, a = len(prompt), len(answer)
        assert tokens[row, :p].tolist() == prompt and tokens[row, p: p + a].tolist() == answer
        assert (tokens[row, p + a:] == TOKENIZER.PAD).all()
        assert target[row].nonzero().flatten().tolist() == list(range(p, p + a))
    with pytest.raises(ValueError, match="exceeds length"):
        collate(examples, 40)


def test_exact_match():
    """Guards against partial answers, wrong tokens or text after EOS being scored as correct, and
    against trailing tokens after a correct EOS being scored as wrong."""
    answer = TOKENIZER.encode_answer("1234")
    assert exact_match(answer, answer)
    assert exact_match(answer + [5, 6], answer)
    assert exact_match(torch.tensor(answer), torch.tensor(answer))
    assert not exact_match(TOKENIZER.encode_answer("123"), answer)
    assert not exact_match(TOKENIZER.encode_answer("1235"), answer)
    assert not exact_match(TOKENIZER.encode("12345"), answer)


def test_unknown_task_and_split_name_the_problem():
    """Guards against typos silently producing another task or split."""
    with pytest.raises(ValueError, match="unknown task"):
        get_task("sort")
    with pytest.raises(ValueError, match="split"):
        make_examples("add", "test", 1)
