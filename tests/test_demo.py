"""`sbd demo` end to end on random `tiny` models (`--quick`), its JSON schema, table and plot; and, with the
bundled checkpoints, the headline numbers on a few held-out prompts (synthetic and code tasks)."""
import argparse
import json

import pytest
from test_code_completion import needs_corpus  # the demo's code task reads the same pinned corpus

from sbd_kernels import demo
from sbd_kernels.model import load_checkpoint

ROW_KEYS = {"model": str, "method": str, "gamma": (float, type(None)), "accuracy": float, "nfe": int,
            "answer_tokens": int, "nfe_speedup": float, "tokens_per_s": float, "wall_speedup": float,
            "block_size": (int, type(None)), "rule": (str, type(None)), "edit_similarity": (float, type(None))}


pytestmark = pytest.mark.usefixtures("one_thread")


def demo_args(*argv: str) -> argparse.Namespace:
    return demo.add_arguments(argparse.ArgumentParser()).parse_args(list(argv))


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One `--quick` run shared by the tests below: (results returned, JSON file, PNG file)."""
    out = tmp_path_factory.mktemp("demo")
    json_path, png_path = out / "demo.json", out / "demo.png"
    results = demo.main(demo_args("--quick", "--num-prompts", "2", "--kv-prompts", "1", "--threads", "1",
                                  "--json", str(json_path), "--plot", str(png_path)))
    return results, json_path, png_path


@needs_corpus
def test_quick_demo_writes_the_documented_json(quick_run):
    """Guards against a JSON file that drifts from the documented schema (keys, types, one object per
    task, one row per model/method/gamma)."""
    results, json_path, _ = quick_run
    written = json.loads(json_path.read_text())
    assert written == json.loads(json.dumps(results))
    assert [r["task"] for r in written] == ["add", "rot13", "code"]
    for task in written:
        assert set(task) == {"task", "rows", "exact_kv_check"}
        assert task["exact_kv_check"] is True
        runs = [(r["model"], r["method"], r["gamma"]) for r in task["rows"]]
        assert runs == [("sbd", "ntp", None), *(("sbd", "sbd", g) for g in demo.GAMMAS), ("ntp_only", "ntp", None)]
        for row in task["rows"]:
            assert set(row) == set(ROW_KEYS)
            for key, kind in ROW_KEYS.items():
                assert isinstance(row[key], kind), (key, row[key])
            assert 0.0 <= row["accuracy"] <= 1.0 and row["nfe"] >= 1 and row["answer_tokens"] >= 1
            sbd = row["method"] == "sbd"
            assert (row["block_size"], row["rule"]) == ((demo.BLOCK_SIZE, "eb") if sbd else (None, None))
            assert (row["edit_similarity"] is not None) == (task["task"] == "code")


@needs_corpus
def test_speedups_are_relative_to_ntp_of_the_same_model(quick_run):
    """Guards against speedups taken against the wrong baseline row (the other model, or SBD itself)."""
    results, _, _ = quick_run
    for task in results:
        rows = task["rows"]
        base = {r["model"]: r for r in rows if r["method"] == "ntp"}
        for row in rows:
            ref = base[row["model"]]
            nfe_ratio = (ref["nfe"] / ref["answer_tokens"]) / (row["nfe"] / row["answer_tokens"])
            assert row["nfe_speedup"] == pytest.approx(nfe_ratio)
            assert row["wall_speedup"] == pytest.approx(row["tokens_per_s"] / ref["tokens_per_s"])
        assert base["sbd"]["nfe"] == base["sbd"]["answer_tokens"], "NTP must pay one pass per token"


@needs_corpus
def test_quick_demo_prints_table_and_plot(quick_run, capsys):
    """Guards against a demo that computes results but shows no table, no exact-KV line or no plot."""
    _, _, png_path = quick_run
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = [demo.Row("sbd", "ntp", None, 1.0, 33, 33, 1.0, 100.0, 1.0),
            demo.Row("sbd", "sbd", 0.1, 0.5, 3, 33, 11.0, 900.0, 9.0)]
    table = demo.format_table("add", rows)
    assert "NFE speedup" in table and "11.00x" in table and "50.0%" in table and "edit sim" not in table
    rows[1].edit_similarity = 87.25
    table = demo.format_table("code", rows)
    assert "edit sim" in table and "87.2" in table


@pytest.mark.slow
def test_bundled_checkpoints_reach_the_headline():
    """Guards against a regression of the decode loop on the trained models: on held-out prompts the SBD
    model decoded with SBD at gamma 0.1 is as accurate as NTP with >= 3x fewer forward passes."""
    if not (demo.SBD_CHECKPOINT.exists() and demo.NTP_CHECKPOINT.exists()):
        pytest.skip("bundled checkpoints missing")
    models = demo.bundled_models(threads=1)
    rows = demo.measure_task(models, "add", num_prompts=4, batch_size=4, gammas=(0.1,), ops=demo.fused_ops(),
                             max_runs=1)
    ntp, sbd, baseline = rows
    assert sbd.accuracy >= ntp.accuracy - 0.01 and ntp.accuracy >= baseline.accuracy - 0.01
    assert sbd.nfe_speedup >= 3.0


@needs_corpus
@pytest.mark.slow
def test_bundled_code_models_decode_as_measured():
    """Guards against a regression of the HF decode path, or a damaged bundled code model: on 32 held-out
    lines NTP of the SBD model keeps the NTP-only baseline's edit similarity (57.8 vs 55.9 when written), and
    SBD saves passes at the quality docs/performance.md §7.3 measured on 500 lines (gamma 0.1: 1.22x fewer
    passes, edit similarity 37.8; gamma 1: 1.79x, 33.9). A broken cache or mask decodes garbage (edit
    similarity far below 25)."""
    for path in (demo.CODE_SBD_CHECKPOINT, demo.CODE_NTP_CHECKPOINT):
        assert (path / "config.json").exists() and (path / "model.safetensors").exists(), f"missing: {path}"
    models = demo.code_models(preset=None)
    ntp, low, high, baseline = demo.measure_task(models, demo.CODE_TASK, num_prompts=32, batch_size=32,
                                                 gammas=(0.1, 1.0), ops=demo.fused_ops(), max_runs=1)
    assert ntp.edit_similarity >= max(45.0, baseline.edit_similarity - 5.0)
    assert low.edit_similarity >= 28.0 and low.nfe_speedup >= 1.1
    assert high.edit_similarity >= 25.0 and high.nfe_speedup >= 1.5


def test_missing_code_models_are_named(tmp_path, monkeypatch):
    """Guards against a bare error (or an hours-long training) when the code models are missing: the error names
    the folders and the way out."""
    monkeypatch.setattr(demo, "CODE_SBD_CHECKPOINT", tmp_path / "code_sbd")
    with pytest.raises(FileNotFoundError, match="code_sbd.*README.md.*--tasks add,rot13"):
        demo.code_models(preset=None)


def test_missing_checkpoints_are_trained(tmp_path, monkeypatch):
    """Guards against `sbd demo` failing instead of training when the bundled checkpoints are absent, and
    against the SBD run not starting from the NTP baseline it is meant to fine-tune."""
    ntp_path, sbd_path = tmp_path / "ntp.pt", tmp_path / "sbd.pt"
    tiny = {"preset": "tiny", "tasks": "add", "steps": 2, "batch_size": 2, "eval_every": 1000,
            "eval_examples": 1, "checkpoint_every": 1000}
    monkeypatch.setattr(demo, "CHECKPOINT_DIR", tmp_path)
    monkeypatch.setattr(demo, "NTP_CHECKPOINT", ntp_path)
    monkeypatch.setattr(demo, "SBD_CHECKPOINT", sbd_path)
    recipe = {"ntp": {**tiny, "objective": "ntp"}, "sbd": {**tiny, "objective": "sbd", "init_from": str(ntp_path)}}
    monkeypatch.setattr(demo, "TRAINING_RECIPE", recipe)
    monkeypatch.setattr(demo, "CPU_TRAINING_RECIPE", recipe)
    models = demo.bundled_models(threads=1)
    assert ntp_path.exists() and sbd_path.exists()
    assert set(models) == {"sbd", "ntp_only"}
    assert load_checkpoint(sbd_path)[1]["train_config"]["init_from"] == str(ntp_path)


WRONG_TRANSFORMERS = "the code task reads the sources of transformers==5.23.0 (found 5.24.0, whose bytes would give another held-out set)"


def test_code_task_without_pinned_transformers_is_skipped_by_default(tmp_path, monkeypatch, capsys):
    """Guards against the default `sbd demo` failing after a minute of work (no JSON written) where transformers
    is missing or another version: the code task is skipped with one line, add and rot13 still run."""
    from sbd_kernels import code_completion

    monkeypatch.setattr(code_completion, "corpus_unavailable", lambda: WRONG_TRANSFORMERS)
    json_path = tmp_path / "demo.json"
    results = demo.main(demo_args("--quick", "--num-prompts", "1", "--kv-prompts", "1", "--gammas", "0.1",
                                  "--json", str(json_path)))
    assert [r["task"] for r in results] == ["add", "rot13"] and json_path.exists()
    skipped = [line for line in capsys.readouterr().err.splitlines() if "skipping" in line]
    assert len(skipped) == 1 and "code task" in skipped[0] and "5.24.0" in skipped[0]


def test_code_task_named_without_pinned_transformers_fails_before_work(monkeypatch):
    """Guards against `--tasks code` running the other tasks (or building models) before failing on the missing
    pinned transformers: the error comes first, naming --tasks and the version."""
    from sbd_kernels import code_completion

    monkeypatch.setattr(code_completion, "corpus_unavailable", lambda: WRONG_TRANSFORMERS)
    monkeypatch.setattr(demo, "random_models", lambda preset: pytest.fail("models built before the check"))
    with pytest.raises(RuntimeError, match="--tasks code: .*5.24.0"):
        demo.main(demo_args("--quick", "--tasks", "add,code"))


def test_help_states_the_code_task_prompt_counts():
    """Guards against --help promising 4 prompts with --quick and 100 by default where the code task uses 2 and
    CODE_PROMPTS."""
    text = demo.add_arguments(argparse.ArgumentParser()).format_help()
    assert f"code: {demo.CODE_PROMPTS}" in " ".join(text.split()) and "code: 2" in " ".join(text.split())


def test_help_says_what_timing_runs_does(monkeypatch):
    """Guards against --timing-runs help that hides when the runs stop: "most identical runs per row" read as
    a fixed count, where `timed_decode` stops once the runs add up to TIMING_MIN_S, and "1 with --quick" left out
    --preset, which also defaults it to 1. The help states both; the stop is checked on a decode of known times."""
    parser = demo.add_arguments(argparse.ArgumentParser())
    text = " ".join(next(a for a in parser._actions if "--timing-runs" in a.option_strings).help.split())
    assert text == (f"at most this many identical decodes per table row, fewer once they add up to "
                    f"{demo.TIMING_MIN_S:g} s of decoding; the row reports the run of median wall time "
                    "(default 5; 1 with --quick or --preset)")
    runs = []

    def decode(*args, **kwargs):
        runs.append(argparse.Namespace(wall_s=0.9 - 0.1 * len(runs), require_complete=lambda what: None))
        return runs[-1]

    monkeypatch.setattr(demo, "decode", decode)
    chosen = demo.timed_decode(None, [], "ntp", None, 4, 1, None, max_runs=5)
    assert len(runs) == 3 and chosen is runs[1]     # 0.9 + 0.8 + 0.7 s >= 2 s: the median of the three


@pytest.mark.parametrize("preset", ["llama3.1-8b", "qwen3-8b"])
def test_demo_refuses_presets_it_cannot_run(preset, capsys):
    """Guards against `sbd demo --preset llama3.1-8b` building two random ~8B fp32 models (~64 GB) for the
    tasks' 41-token vocabulary: a usage error naming the presets the demo takes."""
    with pytest.raises(SystemExit) as exit_info:
        demo_args("--preset", preset)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --preset: invalid choice" in err and "'tiny', 'small'" in err
