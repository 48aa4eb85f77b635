"""The code-completion task (sbd_kernels.code_completion) and its models (sbd_kernels.code_models): the pinned
corpus and its split, the examples and their filter, the CodeXGLUE metrics, the byte tokenizer, the training
windows, a few training steps of a tiny model, the curve command and the demo's code task on random models."""
import argparse
import json
import random
import re
import types
from pathlib import Path

import pytest
import torch

from sbd_kernels import code_completion as cc
from sbd_kernels import code_models as cm
from sbd_kernels import demo

# sha256 of the transformers 5.23.0 sources (path, length and bytes of every .py file, in path order) and of each
# split; the files are checked against the wheel's RECORD, so these are the same on every machine.
CORPUS_SHA256 = {
    "corpus": "c3c70da3ccd884e6c35015d8e72b0553c8ccd63edc277c670a91d060f5adb42c",
    "train": "0e30ac013250b82d0aac4fd23a91934a595cf1582ffbe509c70b809739c43493",
    "held_out": "92fc8f2b46ff59dddb0e276e4fb070b277fdb2e9a091eb24a8e154afc95cfa29",
}

pytestmark = pytest.mark.usefixtures("one_thread")
# Tests that read the corpus run where the pinned transformers sources are installed: in CI, beside the venv (`make`
# installs requirements-corpus.txt, whose pin test_make_installs_the_corpus_version_where_the_corpus_reads_it holds
# to cc.VERSION). Elsewhere (a GPU machine without them) they are skipped with the reason. tests/test_demo.py marks
# the demo's code task with it too.
needs_corpus = pytest.mark.skipif(cc.corpus_unavailable() is not None, reason=str(cc.corpus_unavailable()))


# ----------------------------------------------------------------------------------------------------
# Corpus and split
# ----------------------------------------------------------------------------------------------------
@needs_corpus
def test_corpus_hashes_are_pinned():
    """Guards against a corpus that silently changes (another file set, another split rule, another hash input):
    the held-out numbers of the README would then be about other data."""
    data = cc.corpus()
    assert data.sha256 == CORPUS_SHA256
    assert (len(data.train), len(data.held_out)) == (2602, 258)


@needs_corpus
def test_split_is_by_file_deterministic_and_disjoint():
    """Guards against a split that depends on the machine or the visiting order, or that puts a file on both
    sides (or on none)."""
    data = cc.corpus()
    assert not set(data.train) & set(data.held_out)
    _, recorded = cc._recorded_hashes()
    assert set(data.train) | set(data.held_out) == set(recorded)
    assert all(cc.is_held_out(f) for f in data.held_out) and not any(cc.is_held_out(f) for f in data.train)
    # Some directories have files on both sides: the split is by file, not by directory.
    held_dirs = {f.rsplit("/", 1)[0] for f in data.held_out}
    assert held_dirs & {f.rsplit("/", 1)[0] for f in data.train}
    assert data.files("held_out") == data.held_out
    with pytest.raises(ValueError, match="split"):
        data.files("test")


@needs_corpus
def test_corpus_refuses_other_bytes(monkeypatch):
    """Guards against a held-out set computed from a file that differs from the pinned wheel (a locally edited
    transformers): the corpus must refuse, naming the file."""
    root, recorded = cc._recorded_hashes()
    victim = min(recorded)
    tampered = dict(recorded, **{victim: "A" * 43})
    monkeypatch.setattr(cc, "_recorded_hashes", lambda: (root, tampered))
    cc.corpus.cache_clear()
    try:
        with pytest.raises(cc.CorpusError, match=victim.split("/")[-1]):
            cc.corpus()
    finally:
        monkeypatch.undo()
        cc.corpus.cache_clear()


def test_make_installs_the_corpus_version_where_the_corpus_reads_it():
    """Guards against the corpus tests being skipped in CI: `make` installs requirements-corpus.txt's pin, the
    corpus's version, into the folder corpus_folder() names (sys.prefix is the venv)."""
    repo = Path(__file__).resolve().parent.parent
    pins = (repo / "requirements-corpus.txt").read_text().split()
    assert f"{cc.PACKAGE}=={cc.VERSION}" in pins
    assert f"--target $(VENV)/{cc.corpus_folder().name} -r requirements-corpus.txt" in (repo / "Makefile").read_text()


def _fake_dist_info(folder: Path, version: str) -> None:
    info = folder / f"{cc.PACKAGE}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {cc.PACKAGE}\nVersion: {version}\n")


def test_corpus_reads_the_copy_beside_the_environment(tmp_path, monkeypatch):
    """Guards against the corpus following the environment's own transformers (a newer release: another held-out
    set) where the pinned copy is installed beside it."""
    monkeypatch.setattr(cc, "corpus_folder", lambda: tmp_path)
    monkeypatch.setattr(cc.importlib.metadata, "distribution", lambda name: types.SimpleNamespace(version="5.25.0"))
    _fake_dist_info(tmp_path, cc.VERSION)
    assert Path(cc.pinned_distribution().locate_file("")) == tmp_path


def test_corpus_refuses_another_version(tmp_path, monkeypatch):
    """Guards against reading another transformers version without a word, in the environment or in the copy
    beside it: its bytes give another data set. The error names the command that installs the pinned one."""
    monkeypatch.setattr(cc, "corpus_folder", lambda: tmp_path)
    _fake_dist_info(tmp_path, "5.22.0")
    monkeypatch.setattr(cc.importlib.metadata, "distribution", lambda name: types.SimpleNamespace(version="4.0.0"))
    with pytest.raises(cc.CorpusError, match=f"5.23.0 \\(found 4.0.0.*--target {re.escape(str(tmp_path))} "
                                             "transformers==5.23.0"):
        cc._recorded_hashes()


# ----------------------------------------------------------------------------------------------------
# Examples
# ----------------------------------------------------------------------------------------------------
@needs_corpus
@pytest.mark.parametrize("lines", [1, 4])
def test_examples_are_deterministic_and_kept(lines):
    """Guards against examples that change between runs or machines, a prompt that is not the file's text right
    before the target line, and targets the filter should have dropped."""
    first = cc.line_examples("held_out", 40, lines=lines)
    assert first == cc.line_examples("held_out", 40, lines=lines)
    assert first != cc.line_examples("held_out", 40, lines=lines, seed=1)
    data = cc.corpus()
    assert len({ex.source for ex in first}) == 40, "one example per file per round"
    for ex in first:
        assert ex.source in data.held_out
        file_lines = data.read(ex.source).decode("utf-8", errors="replace").split("\n")
        assert cc.keep_target(file_lines, ex.line, lines)
        assert ex.target == "\n".join(file_lines[ex.line:ex.line + lines])
        assert ex.prompt[0] == cc.ByteTokenizer.BOS and len(ex.prompt) <= 1 + cc.CONTEXT_BYTES
        before, context = ("\n".join(file_lines[:ex.line]) + "\n").encode(), bytes(ex.prompt[1:])
        start = len(before) - len(context)
        assert before.endswith(context) and (start == 0 or before[start - 1:start] == b"\n"), \
            "the context is the file's text right before the target, from a line start"


@needs_corpus
def test_examples_refuse_more_than_exist():
    """Guards against a silent short list (or an endless loop) when more examples are asked than kept lines, and
    against a line count without a budget."""
    with pytest.raises(ValueError, match="only .* examples in held_out"):
        cc.line_examples("held_out", 10**7, lines=4)
    with pytest.raises(ValueError, match="lines must be one of"):
        cc.line_examples("held_out", 1, lines=2)


@pytest.mark.parametrize("lines,index,kept", [
    (["x = 1", "    return value", ""], 1, True),
    (["x = 1", "", ""], 1, False),                               # blank
    (["x = 1", "    pass", ""], 1, False),                       # fewer than MIN_TARGET_CHARS non-space characters
    (["x = 1", "    # a comment here", ""], 1, False),           # comment
    (["x = 1", "    ))]]}}),", ""], 1, False),                  # closing brackets only
    (["y = compute(x)", "  y = compute(x)", ""], 1, False),      # trivially repeated: the line before it
    (["x = 1", "value = " + "a" * 130, ""], 1, False),          # longer than the one-line budget
])
def test_keep_target(lines, index, kept):
    """Guards against the documented target filter drifting (blank, short, comment, brackets, repeated, budget)."""
    assert cc.keep_target(lines, index) is kept


def test_keep_target_four_lines_needs_the_lines_and_the_budget():
    """Guards against 4-line targets that run past the file's end or past the 4-line budget."""
    body = ["x = 1", "result = compute(x)", "a = 1", "b = 2", "c = 3"]
    assert cc.keep_target(body, 1, 4)
    assert not cc.keep_target(body, 2, 4)                        # only 3 lines left
    assert not cc.keep_target(body[:1] + ["result = compute(x)" + " " * 230] + body[2:], 1, 4)


def test_prompt_is_cut_at_a_line_start():
    """Guards against a context that starts in the middle of a line, or that exceeds CONTEXT_BYTES."""
    file_lines = [f"line_{i} = {'v' * 30}" for i in range(40)]
    prompt = cc.prompt_before(file_lines, 30)
    text = bytes(prompt[1:]).decode()
    assert len(prompt) - 1 <= cc.CONTEXT_BYTES and text.startswith("line_") and text.endswith("\n")
    assert cc.prompt_before(file_lines, 0) == [cc.ByteTokenizer.BOS]


# ----------------------------------------------------------------------------------------------------
# Metrics and tokenizer
# ----------------------------------------------------------------------------------------------------
def test_exact_match_compares_whitespace_tokens():
    """Guards against an exact match stricter or looser than CodeXGLUE's `pred.split() == gt.split()`."""
    assert cc.exact_match("  x  =  f(a, b)  ", "x = f(a, b)")
    assert cc.exact_match("a\n    b", "a b")
    assert not cc.exact_match("x=f(a, b)", "x = f(a, b)")
    assert not cc.exact_match("x = f(a, b", "x = f(a, b)")


def _lcs_reference(a: str, b: str) -> int:
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            table[i + 1][j + 1] = table[i][j] + 1 if x == y else max(table[i][j + 1], table[i + 1][j])
    return table[-1][-1]


def test_lcs_matches_dynamic_programming():
    """Guards against the bit-parallel LCS (carries, masks past |a|) disagreeing with the textbook recurrence."""
    rng = random.Random(0)
    for _ in range(300):
        a = "".join(rng.choice("ab(x) ") for _ in range(rng.randint(0, 70)))
        b = "".join(rng.choice("ab(x) ") for _ in range(rng.randint(0, 70)))
        assert cc.lcs_length(a, b) == _lcs_reference(a, b), (a, b)


@pytest.mark.parametrize("prediction,target,expected", [
    ("x = f(a)", "x = f(a)", 100.0),
    ("", "", 100.0),
    ("", "abc", 0.0),
    ("abc", "abd", 200 * 2 / 6),                     # LCS "ab": fuzzywuzzy's ratio 67 before rounding
    ("  self.x = 1  ", "self.x = 1", 100.0),         # stripped, as the CodeXGLUE evaluator strips predictions
    ("a\n    b", "a\nb", 100.0),                     # lines stripped one by one
    ("kitten", "sitting", 200 * 4 / 13),
])
def test_edit_similarity(prediction, target, expected):
    """Guards against an edit similarity that is not the indel ratio fuzzywuzzy computes."""
    assert cc.edit_similarity(prediction, target) == pytest.approx(expected)


def test_completion_text_and_score():
    """Guards against scoring text past the last target line, or special ids leaking into the prediction."""
    tokens = cc.ByteTokenizer.encode("a = 1\nb = 2\nc = 3\n") + [cc.ByteTokenizer.PAD]
    assert cc.completion_text(tokens, 1) == "a = 1"
    assert cc.completion_text(tokens, 2) == "a = 1\nb = 2"
    examples = [cc.Example("f.py", 3, [cc.ByteTokenizer.BOS], "a = 1"),
                cc.Example("g.py", 5, [cc.ByteTokenizer.BOS], "a = 2")]
    scores = cc.score([tokens, tokens], examples, lines=1)
    assert scores.hits == [True, False] and scores.exact_match == 0.5
    assert scores.edit_similarity == pytest.approx((100 + 200 * 4 / 10) / 2)
    with pytest.raises(ValueError, match="generations"):
        cc.score([tokens], examples, lines=1)


def test_tokenizer_round_trip():
    """Guards against a tokenizer that loses bytes (non-ASCII UTF-8) or decodes special ids into text."""
    text = "def f(x):  # \u00e9t\u00e9 \u2192 \U0001f600\n\treturn x\r\n"
    ids = cc.ByteTokenizer.encode(text)
    assert max(ids) < 256 and len(ids) == len(text.encode())
    assert cc.ByteTokenizer.decode(ids) == text
    assert cc.ByteTokenizer.decode([cc.ByteTokenizer.BOS, *ids, cc.ByteTokenizer.PAD, cc.ByteTokenizer.MASK]) == text
    assert cc.ByteTokenizer.VOCAB_SIZE % 8 == 0 and cc.ByteTokenizer.MASK < cc.ByteTokenizer.VOCAB_SIZE


@needs_corpus
def test_train_windows_start_at_line_starts():
    """Guards against training windows that do not look like prompts (BOS, then a line start) or that change
    between runs, which would break a resumed run."""
    windows = cc.TrainWindows(64, seed=3)
    batch = windows.batch(8, step=5)
    assert batch.shape == (8, 64) and batch.dtype == torch.int64
    assert (batch[:, 0] == cc.ByteTokenizer.BOS).all() and (batch[:, 1:] < 256).all()
    assert torch.equal(batch, cc.TrainWindows(64, seed=3).batch(8, step=5))
    assert not torch.equal(batch, windows.batch(8, step=6))
    starts = windows.starts
    assert starts[0] == 0 and (windows.buffer[starts[1:] - 1] == cc.ByteTokenizer.NEWLINE).all()


# ----------------------------------------------------------------------------------------------------
# Models: training, curve, demo
# ----------------------------------------------------------------------------------------------------
@pytest.fixture
def tiny_shape(monkeypatch):
    monkeypatch.setattr(cm, "MODEL_SHAPE", cm.TINY_SHAPE)
    monkeypatch.setattr(cm, "EVAL_WINDOWS", 2)


def _train(out, **overrides):
    settings = {"steps": 2, "batch_size": 2, "warmup_steps": 1, "eval_every": 1000, "save_every": 1000, **overrides}
    return cm.train_code_model(cm.CodeTrainConfig(out=str(out), **settings))


@needs_corpus
@pytest.mark.parametrize("objective", ["ntp", "sbd"])
def test_training_steps_write_a_loadable_model(tmp_path, tiny_shape, objective):
    """Guards against a training run that does not write a model folder `load_code_model` can decode, or a
    training record without the command, the corpus hash and the loss curve."""
    record = _train(tmp_path / "m", objective=objective)
    assert record["steps"] == 2 and record["corpus"] == CORPUS_SHA256
    written = json.loads((tmp_path / "m" / "training.json").read_text())
    assert written["config"]["objective"] == objective and len(written["eval"]) == 2
    assert {"ntp_loss", "matp_loss", "matp_accuracy"} <= set(written["eval"][-1])
    model, sbd_model = cm.load_code_model(tmp_path / "m")
    assert model.config.sbd_mask_token_id == cc.ByteTokenizer.MASK and not model.training
    result, scores = cm.decode_examples(sbd_model, cc.line_examples("held_out", 2), 1,
                                        cm.Setting("sbd", 16, 0.35, "eb"), batch_size=2)
    assert result.total_generated >= 2 and 0 <= scores.edit_similarity <= 100


@needs_corpus
def test_loading_a_code_model_prints_no_progress_bar(tmp_path, tiny_shape, capfd):
    """Guards against transformers' "Loading weights" progress bar landing between the demo's tables, and
    against loading turning the user's own progress bars off."""
    import transformers

    _train(tmp_path / "m", objective="ntp")
    capfd.readouterr()
    assert transformers.utils.logging.is_progress_bar_enabled()
    cm.load_code_model(tmp_path / "m")
    assert "Loading weights" not in capfd.readouterr().err
    assert transformers.utils.logging.is_progress_bar_enabled()


@needs_corpus
def test_training_continues_and_resumes(tmp_path, tiny_shape):
    """Guards against a continued run that does not start from its init weights, and a resumed run that does
    not pick up its step count and optimizer state."""
    _train(tmp_path / "base", objective="ntp")
    base, _ = cm.load_code_model(tmp_path / "base")
    record = _train(tmp_path / "cont", objective="sbd", init_from=str(tmp_path / "base"), steps=1, lr=0.0)
    cont, _ = cm.load_code_model(tmp_path / "cont")
    assert record["steps"] == 1
    for (name, a), b in zip(base.named_parameters(), cont.parameters()):
        assert torch.equal(a, b), name                                    # lr 0: the weights are the init's
    resumed = _train(tmp_path / "cont", objective="sbd", init_from=str(tmp_path / "base"), steps=3, resume=True)
    assert resumed["steps"] == 3 and [e["step"] for e in resumed["eval"]] == [0, 1, 3]


@needs_corpus
def test_resume_after_a_stop_between_the_model_and_its_state(tmp_path, tiny_shape, monkeypatch):
    """Guards against a run stopped while it saved (model folder written, train_state.pt not) resuming silently
    wrong: the folder's newer weights with the older optimizer state and step, so that steps ran twice. It must
    end with the weights and step count of a run that was never stopped."""
    settings = {"objective": "sbd", "steps": 3, "save_every": 1}
    _train(tmp_path / "whole", **settings)
    save = torch.save

    def stopped_at_step_2(obj, path, *args, **kwargs):
        if str(path).endswith("train_state.pt.tmp") and obj["step"] == 2:
            raise KeyboardInterrupt
        save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", stopped_at_step_2)
    with pytest.raises(KeyboardInterrupt):
        _train(tmp_path / "stopped", **settings)
    monkeypatch.setattr(torch, "save", save)
    record = _train(tmp_path / "stopped", resume=True, **settings)
    assert record["steps"] == 3
    whole, stopped = cm.load_code_model(tmp_path / "whole")[0], cm.load_code_model(tmp_path / "stopped")[0]
    for (name, a), b in zip(whole.state_dict().items(), stopped.state_dict().values()):
        assert torch.equal(a, b), name


def test_window_targets_skip_the_first_position():
    """Guards against a masked-prediction target at position 0 (BOS, the given start of every window, which no
    decode predicts); every later position is a target of both terms."""
    windows = torch.tensor([[cc.ByteTokenizer.BOS, 10, 11, 12], [cc.ByteTokenizer.BOS, 20, 21, 22]])
    targets = cm.window_targets(windows)
    assert targets.dtype == torch.bool and not targets[:, 0].any() and targets[:, 1:].all()
    all_masked = torch.full_like(windows, cc.ByteTokenizer.MASK)
    labels = cm.sbd_labels(windows, targets, all_masked, cc.ByteTokenizer.MASK)
    assert torch.equal(labels[:, :3], windows[:, 1:]) and torch.equal(labels[:, 5:], windows[:, 1:])
    assert (labels[:, 4] == cm.IGNORE).all()


@needs_corpus
def test_training_and_evaluation_use_the_window_targets(tmp_path, tiny_shape, monkeypatch):
    """Guards against the training loss or the held-out MATP metrics counting position 0 (targets all True)."""
    masks = []
    sbd_loss, sbd_labels = cm.sbd_loss, cm.sbd_labels

    def recorded_loss(model, tokens, target_mask, *args):
        masks.append(target_mask)
        return sbd_loss(model, tokens, target_mask, *args)

    def recorded_labels(tokens, target_mask, *args):
        masks.append(target_mask)
        return sbd_labels(tokens, target_mask, *args)

    monkeypatch.setattr(cm, "sbd_loss", recorded_loss)
    monkeypatch.setattr(cm, "sbd_labels", recorded_labels)
    _train(tmp_path / "m", objective="sbd", steps=1)
    assert len(masks) == 3                          # the evaluations at steps 0 and 1, the training step
    for mask in masks:
        assert not mask[:, 0].any() and mask[:, 1:].all()


@needs_corpus
def test_curve_command_writes_json_and_plot(tmp_path, tiny_shape):
    """Guards against a curve command whose JSON misses points (every setting for each model and line count),
    speedups taken against the wrong NTP row, or no plot."""
    _train(tmp_path / "sbd", objective="sbd")
    _train(tmp_path / "ntp", objective="ntp")
    json_path, png_path = tmp_path / "curve.json", tmp_path / "curve.png"
    cm.main(["curve", "--sbd", str(tmp_path / "sbd"), "--ntp", str(tmp_path / "ntp"), "--compare",
             str(tmp_path / "ntp"), "--examples", "2", "--examples-4", "1", "--gammas", "0,1", "--block-sizes",
             "4,8", "--timing-examples", "1", "--json", str(json_path), "--plot", str(png_path)])
    result = json.loads(json_path.read_text())
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["corpus"] == CORPUS_SHA256 and result["examples"] == {"1": 2, "4": 1}
    points = result["points"]
    one_line = [(p["model"], p["method"], p["rule"], p["block_size"], p["gamma"]) for p in points if p["lines"] == 1]
    expected_sbd = [("sbd", "ntp", None, None, None), *(("sbd", "sbd", "eb", k, g) for k in (4, 8) for g in (0, 1)),
                    ("sbd", "sbd", "threshold", 8, 1.0)]
    assert one_line[:len(expected_sbd)] == expected_sbd
    assert ("ntp_only", "ntp", None, None, None) in one_line
    assert [p[1:] for p in one_line if p[0] == "ntp"] == [("ntp", None, None, None), ("sbd", "eb", 8, 0), ("sbd", "eb", 8, 1)]
    assert {p["lines"] for p in points} == {1, 4}
    for p in points:
        ntp = next(q for q in points if q["model"] == p["model"] and q["lines"] == p["lines"] and q["method"] == "ntp")
        assert p["nfe_speedup"] == pytest.approx(ntp["nfe_per_token"] / p["nfe_per_token"])
        assert p["wall_speedup"] == pytest.approx(p["tokens_per_s"] / ntp["tokens_per_s"])
        assert 0 <= p["exact_match"] <= 1 and p["timing_examples"] == 1


@needs_corpus
def test_demo_code_task_quick(tmp_path):
    """Guards against the demo's code task failing on its quick path (random tiny HF models): table, JSON rows
    in the demo's schema with edit similarity, and the exact-KV check on the HF models."""
    args = demo.add_arguments(argparse.ArgumentParser()).parse_args(
        ["--quick", "--tasks", "code", "--kv-prompts", "1", "--json", str(tmp_path / "d.json")])
    results = demo.main(args)
    assert [r["task"] for r in results] == ["code"] and results[0]["exact_kv_check"] is True
    rows = results[0]["rows"]
    assert [(r["model"], r["method"]) for r in rows][:2] == [("sbd", "ntp"), ("sbd", "sbd")]
    assert all(0 <= r["edit_similarity"] <= 100 and r["answer_tokens"] >= 2 for r in rows)
    assert json.loads((tmp_path / "d.json").read_text()) == json.loads(json.dumps(results))


def test_summary_picks_the_fastest_point_within_one_point():
    """Guards against a summary that reports a faster point whose exact match is more than 1 point below the
    NTP-only baseline as 'matched'."""
    def point(model, method, em, speedup, gamma=None):
        return {"model": model, "lines": 1, "method": method, "exact_match": em, "edit_similarity": 50.0,
                "rule": "eb" if method == "sbd" else None, "block_size": 16 if method == "sbd" else None,
                "gamma": gamma, "nfe_per_token": 1 / speedup, "nfe_speedup": speedup, "wall_speedup": speedup / 2}
    points = [point("sbd", "ntp", 0.205, 1.0), point("sbd", "sbd", 0.204, 2.0, 0.1), point("sbd", "sbd", 0.196, 3.0, 0.35),
              point("sbd", "sbd", 0.150, 5.0, 3.0), point("ntp_only", "ntp", 0.210, 1.0)]
    summary = cm.summarize(points)["1"]
    assert summary["ntp_only"]["exact_match"] == 0.210
    assert summary["matched"]["gamma"] == 0.1 and summary["fastest"]["gamma"] == 3.0
