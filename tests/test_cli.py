"""The `sbd` command line: subcommands wired to their modules, `sbd generate` output, `sbd train`; bad
arguments (exit 2, one argparse error line), errors while running (exit 1, one line, a traceback only with
--debug), `sbd train --overwrite`, and the dashed flag spellings with their hidden underscore aliases."""
import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sbd_kernels import cli
from sbd_kernels.model import CheckpointError, ModelConfig, Transformer, load_checkpoint, save_checkpoint
from sbd_kernels.train import TrainConfig

REPO = Path(__file__).resolve().parents[1]
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("ckpt") / "tiny.pt"
    save_checkpoint(Transformer(ModelConfig.preset("tiny")), path)
    return path


@pytest.fixture(scope="module")
def paths(tmp_path_factory, tiny_checkpoint):
    """Files the argument lists below name as {ckpt}, {damaged}, {dir}, {missing}, {file}, {garbage}."""
    root = tmp_path_factory.mktemp("cli")
    damaged = root / "damaged.pt"
    damaged.write_bytes(tiny_checkpoint.read_bytes()[:1000])
    (root / "garbage.json").write_text("not json {")
    (root / "file.txt").write_text("a file")
    return {"ckpt": str(tiny_checkpoint), "damaged": str(damaged), "dir": str(root),
            "missing": str(root / "missing" / "x.pt"), "file": str(root / "file.txt"),
            "garbage": str(root / "garbage.json")}


def fill(argv: list[str], paths: dict) -> list[str]:
    return [arg.format(**paths) for arg in argv]


def error_line(stderr: str, command: str) -> str:
    """The single `sbd <command>: error: ...` line of stderr (argparse puts the usage above it)."""
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith(f"sbd {command}: error: ")]
    assert len(errors) == 1 and stderr.rstrip().endswith(errors[0]), stderr
    return errors[0]


def run_sbd(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sbd_kernels.cli", *argv], check=False, capture_output=True,
                          text=True, cwd=REPO, timeout=120, env={**os.environ, **(env or {})})


# ----------------------------------------------------------------------------------------------------
# Subcommands and their output
# ----------------------------------------------------------------------------------------------------
def test_help_lists_subcommands():
    """Guards against a subcommand that fails to register (an import error in its module breaks `sbd`)."""
    out = run_sbd("--help")
    assert out.returncode == 0, out.stderr
    for name in ("train", "generate", "demo", "roofline", "bench"):
        assert name in out.stdout


@pytest.mark.parametrize("name,run", [("train", cli.run_train), ("generate", cli.run_generate),
                                      ("demo", cli.run_demo), ("roofline", cli.run_roofline),
                                      ("bench", cli.run_bench)])
def test_subcommand_dispatch(name, run):
    """Guards against a subcommand wired to another command's runner."""
    assert cli.build_parser().parse_args([name]).run is run


@pytest.mark.parametrize("method", ["ntp", "sbd"])
def test_generate_on_task_prompts(tiny_checkpoint, capsys, method):
    """Guards against `sbd generate` not printing answers, statistics and the exact-match score."""
    cli.main(["generate", "--checkpoint", str(tiny_checkpoint), "--task", "add", "--num-prompts", "2",
              "--method", method, "--max-new-tokens", "8", "--threads", "1"])
    out = capsys.readouterr().out
    assert out.count(" -> ") == 2 and "NFE/token" in out and "exact match 0/2" in out
    assert ("tokens accepted per pass" in out) == (method == "sbd")


@pytest.mark.parametrize("method", ["ntp", "sbd"])
def test_generate_marks_sequences_stopped_on_nan_logits(tmp_path, capsys, method):
    """Guards against `sbd generate` printing the answers of a model with NaN logits as if they had ended
    normally: each cut-short line is marked and a warning counts them."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset("tiny"))
    with torch.no_grad():
        next(p for name, p in model.named_parameters() if "embed" in name).fill_(float("nan"))
    save_checkpoint(model, tmp_path / "nan.pt")
    cli.main(["generate", "--checkpoint", str(tmp_path / "nan.pt"), "--prompt", "12+34", "--prompt", "abc",
              "--method", method, "--max-new-tokens", "5", "--threads", "1"])
    out = capsys.readouterr().out
    assert out.count("STOPPED EARLY (invalid logits)") == 2
    assert "warning: 2 of 2 sequences stopped early on invalid (NaN / +inf) logits" in out


def test_generate_on_a_prompt_text(tiny_checkpoint, capsys):
    """Guards against the free-text prompt path (encoding with the separator, no reference answer)."""
    cli.main(["generate", "--checkpoint", str(tiny_checkpoint), "--prompt", "12+34", "--prompt", "abc",
              "--method", "sbd", "--max-new-tokens", "5", "--threads", "1"])
    out = capsys.readouterr().out
    assert "12+34 -> " in out and "abc -> " in out and "exact match" not in out


def tiny_train_argv(out, *extra: str) -> list[str]:
    return ["train", "--preset", "tiny", "--objective", "sbd", "--tasks", "add", "--steps", "2", "--batch-size", "2",
            "--eval-every", "1000", "--eval-examples", "1", "--checkpoint-every", "1000", "--out", str(out), *extra]


def test_train_writes_a_loadable_checkpoint(tmp_path):
    """Guards against `sbd train` flags not reaching the training loop (`train.add_arguments` / `main`)."""
    out = tmp_path / "m.pt"
    cli.main(tiny_train_argv(out))
    model, meta = load_checkpoint(out)
    assert model.config == ModelConfig.preset("tiny")
    assert meta["train_config"]["steps"] == 2 and meta["train_config"]["batch_size"] == 2


# ----------------------------------------------------------------------------------------------------
# Bad arguments: exit 2, one `sbd <cmd>: error: argument --flag: ...` line, no traceback
# ----------------------------------------------------------------------------------------------------
GENERATE = ["generate", "--checkpoint", "{ckpt}", "--num-prompts", "1", "--max-new-tokens", "4"]
TRAIN = ["train", "--preset", "tiny", "--tasks", "add", "--steps", "1", "--batch-size", "1", "--eval-examples", "1",
         "--out", "{dir}/trained.pt"]
DEMO = ["demo", "--quick", "--tasks", "add", "--num-prompts", "1"]
ROOFLINE = ["roofline", "--batch", "1"]
BENCH = ["bench", "--no-gpu-static"]    # each case below also names a bad --from-json after the bad flag

# (argument list, words the error line must contain). Each list is complete but for its one bad value, so
# that a flag that stops being checked runs a few seconds and fails the test, instead of hanging it.
BAD_ARGUMENTS = [
    # sbd generate
    (["generate", "--checkpoint", "{missing}"], "argument --checkpoint: no such file"),
    (["generate", "--checkpoint", "{dir}"], "argument --checkpoint: "),
    ([*GENERATE, "--task", "mul"], "argument --task: invalid choice: 'mul'"),
    ([*GENERATE, "--prompt", "ABC"], "argument --prompt: "),
    ([*GENERATE, "--num-prompts", "0"], "argument --num-prompts: must be a positive integer"),
    ([*GENERATE, "--num-prompts", "-3"], "argument --num-prompts: "),
    ([*GENERATE, "--method", "beam"], "argument --method: invalid choice"),
    ([*GENERATE, "--gamma", "-1"], "argument --gamma: must be a finite number >= 0"),
    ([*GENERATE, "--gamma", "nan"], "argument --gamma: "),
    ([*GENERATE, "--gamma", "x"], "argument --gamma: expected a finite number >= 0"),
    ([*GENERATE, "--block-size", "0"], "argument --block-size: "),
    ([*GENERATE, "--temperature", "nan"], "argument --temperature: "),
    ([*GENERATE, "--top-k", "-1"], "argument --top-k: "),
    ([*GENERATE, "--top-p", "0"], "argument --top-p: "),
    ([*GENERATE, "--top-p", "1.5"], "argument --top-p: "),
    ([*GENERATE, "--min-p", "1"], "argument --min-p: "),
    ([*GENERATE, "--temperature", "-0.5"], "argument --temperature: "),
    ([*GENERATE, "--temperature", "inf"], "argument --temperature: "),
    ([*GENERATE, "--max-new-tokens", "0"], "argument --max-new-tokens: "),
    ([*GENERATE, "--seed", "-1"], "argument --seed: "),
    ([*GENERATE, "--seed", "9223372036854775808"], "argument --seed: must be an integer in [0, 2**63)"),
    ([*GENERATE, "--cuda-graph"], "--cuda-graph needs --device cuda (CUDA graphs replay on a GPU), got --device cpu"),
    ([*GENERATE, "--device", "cuda", "--ops", "naive", "--cuda-graph"],
     "--cuda-graph needs --ops fused: the naive ops read values on the host"),
    ([*GENERATE, "--num-prompts", "3", "--seed", "9223372036854775806"],
     ("--seed 9223372036854775806: prompt i samples with seed + i, and with 3 prompts the last seed, "
     "9223372036854775808, does not fit in int64 (use --seed <= 9223372036854775805)")),
    ([*GENERATE, "--top-k", "9223372036854775808"],
     "argument --top-k: must be an integer in [0, 2**63) (0: off), got '9223372036854775808'"),
    ([*GENERATE, "--temperature", "1e39"],
     "argument --temperature: must be finite and >= 0 as a float32 (at most 3.4028235e+38), got '1e39'"),
    ([*GENERATE, "--top-p", "1e-50"], ("argument --top-p: must be in (0, 1] as a float32 (1: off), got '1e-50' "
     "(0 as a float32)")),
    ([*GENERATE, "--top-p", "nan"], "argument --top-p: must be in (0, 1] as a float32 (1: off), got 'nan'"),
    ([*GENERATE, "--min-p", "x"], "argument --min-p: expected a number, got 'x'"),
    ([*GENERATE, "--min-p", "0.99999999999"], ("argument --min-p: must be in [0, 1) as a float32 (0: off), got "
     "'0.99999999999' (1 as a float32)")),
    ([*GENERATE, "--batch-size", "0"], "argument --batch-size: "),
    ([*GENERATE, "--ops", "fast"], "argument --ops: invalid choice"),
    ([*GENERATE, "--device", "gpu"], "argument --device: expected cpu, cuda or cuda:N"),
    ([*GENERATE, "--threads", "0"], "argument --threads: "),
    # sbd train
    ([*TRAIN, "--steps", "-5"], "argument --steps: "),
    ([*TRAIN, "--steps", "0"], "argument --steps: "),
    ([*TRAIN, "--batch-size", "0"], "argument --batch-size: "),
    ([*TRAIN, "--batch_size", "0"], "argument --batch_size: "),
    ([*TRAIN, "--checkpoint_every", "0"], "argument --checkpoint_every: "),
    ([*TRAIN, "--eval-every", "0"], "argument --eval-every: "),
    ([*TRAIN, "--eval-examples", "0"], "argument --eval-examples: "),
    ([*TRAIN, "--log-every", "0"], "argument --log-every: "),
    ([*TRAIN, "--lr", "nan"], "argument --lr: "),
    ([*TRAIN, "--lr", "-1"], "argument --lr: "),
    ([*TRAIN, "--max-minutes", "-1"], "argument --max-minutes: "),
    ([*TRAIN, "--min-lr-ratio", "2"], "argument --min-lr-ratio: "),
    ([*TRAIN, "--warmup-steps", "-1"], "argument --warmup-steps: "),
    ([*TRAIN, "--weight-decay", "-0.1"], "argument --weight-decay: "),
    ([*TRAIN, "--grad-clip", "0"], "argument --grad-clip: "),
    ([*TRAIN, "--block-min", "0"], "argument --block-min: "),
    ([*TRAIN, "--block-min", "5", "--block-max", "3"], "--block-min (5) must be <= --block-max (3)"),
    ([*TRAIN, "--preset", "huge"], "argument --preset: invalid choice"),
    ([*TRAIN, "--tasks", "add,mul"], "argument --tasks: unknown name 'mul'"),
    ([*TRAIN, "--tasks", ","], "argument --tasks: "),
    ([*TRAIN, "--objective", "matp"], "argument --objective: invalid choice"),
    ([*TRAIN, "--attention", "dense"], "argument --attention: invalid choice"),
    ([*TRAIN, "--init-from", "{missing}"], "argument --init-from: no such file"),
    ([*TRAIN, "--out", "{dir}"], "argument --out: "),
    ([*TRAIN, "--out", "{missing}"], "argument --out: directory "),
    ([*TRAIN, "--seed", "-1"], "argument --seed: "),
    ([*TRAIN, "--threads", "0"], "argument --threads: "),
    ([*TRAIN, "--device", "tpu"], "argument --device: "),
    ([*TRAIN, "--out", "{file}"], "--out {file} exists"),
    # sbd demo
    ([*DEMO, "--num-prompts", "0"], "argument --num-prompts: "),
    ([*DEMO, "--batch-size", "0"], "argument --batch-size: "),
    ([*DEMO, "--timing-runs", "0"], "argument --timing-runs: "),
    ([*DEMO, "--cuda-graph"], "--cuda-graph needs --device cuda (CUDA graphs replay on a GPU), got --device cpu"),
    ([*DEMO, "--device", "cuda", "--ops", "naive", "--cuda-graph"], "--cuda-graph needs --ops fused"),
    ([*DEMO, "--kv-prompts", "0"], "argument --kv-prompts: "),
    ([*DEMO, "--threads", "0"], "argument --threads: "),
    ([*DEMO, "--gammas", "0.1,abc"], "argument --gammas: "),
    ([*DEMO, "--gammas", "-1"], "argument --gammas: "),
    ([*DEMO, "--tasks", "mul"], "argument --tasks: "),
    ([*DEMO, "--preset", "huge"], "argument --preset: invalid choice"),
    ([*DEMO, "--preset", "llama3.1-8b"], "argument --preset: invalid choice"),
    ([*TRAIN, "--attention", "flex"], "--attention flex runs on --device cuda only, not --device cpu"),
    ([*DEMO, "--ops", "fast"], "argument --ops: invalid choice"),
    ([*DEMO, "--device", "gpu"], "argument --device: "),
    ([*DEMO, "--json", "{missing}"], "argument --json: directory "),
    ([*DEMO, "--plot", "{dir}"], "argument --plot: "),
    ([*DEMO, "--plot", "{dir}/plot.txt"], "argument --plot: "),
    # sbd roofline
    ([*ROOFLINE, "--k", "0"], "argument --k: "),
    ([*ROOFLINE, "--kv-len", "-100"], "argument --kv-len: "),
    (["roofline", "--batch", "0"], "argument --batch: "),
    (["roofline", "--batch", "1,x"], "argument --batch: "),
    ([*ROOFLINE, "--passes", "0.5"], "argument --passes: "),
    ([*ROOFLINE, "--passes", "nan"], "argument --passes: "),
    ([*ROOFLINE, "--passes", "20"], "--passes (20.0) must be <= --k (16)"),
    ([*ROOFLINE, "--model", "huge"], "argument --model: invalid choice"),
    ([*ROOFLINE, "--hardware", "tpu"], "argument --hardware: invalid choice"),
    ([*ROOFLINE, "--precision", "int4"], "argument --precision: invalid choice"),
    (["roofline", "--project", "--demo-json", "{missing}"], "argument --demo-json: no such file"),
    (["roofline", "--measured", "{dir}"], "argument --measured: "),
    ([*ROOFLINE, "--json", "{missing}"], "argument --json: directory "),
    (["roofline", "--paper", "--project"], "argument --project: not allowed with argument --paper"),
    (["roofline", "--project", "--hardware", "cpu"], "--project projects for a datasheet GPU"),
    (["roofline", "--project", "--k", "8"], "--project does not take --k"),
    (["roofline", "--project", "--passes", "2"], "--project does not take --passes"),
    (["roofline", "--project", "--model", "qwen3-8b"], "--project does not take --model"),
    (["roofline", "--paper", "--model", "qwen3-8b"], "--paper does not take --model: it compares the paper's Table 3"),
    (["roofline", "--paper", "--hardware", "a100"], "--paper does not take --hardware"),
    (["roofline", "--paper", "--precision", "fp16", "--batch", "4", "--kv-len", "512"],
     "--paper does not take --precision, --batch, --kv-len"),
    (["roofline", "--paper", "--k", "8"], "--paper does not take --k"),
    (["roofline", "--measured", "{garbage}", "--hardware", "h100"],
     "--measured does not take --hardware: each decode case of the JSON carries"),
    (["roofline", "--measured", "{garbage}", "--model", "small", "--passes", "2"],
     "--measured does not take --model, --passes"),
    # sbd bench
    ([*BENCH, "--rounds", "0", "--from-json", "{garbage}"], "argument --rounds: "),
    ([*BENCH, "--only", "sampling,bogus", "--from-json", "{garbage}"], "argument --only: unknown name 'bogus'"),
    ([*BENCH, "--out", "{file}", "--from-json", "{garbage}"], "argument --out: "),
    ([*BENCH, "--from-json", "{missing}"], "argument --from-json: no such file"),
]


@pytest.mark.parametrize("argv,words", BAD_ARGUMENTS, ids=[f"{argv[0]} {' '.join(argv[-2:])}" for argv, _ in BAD_ARGUMENTS])
def test_bad_argument_exits_2_naming_it(paths, capsys, argv, words):
    """Guards against bad values ending in a traceback deep in the run (--block-size 0, --gamma -1,
    --checkpoint_every 0, a missing checkpoint, an unknown task), or running with a nonsensical meaning
    (--max-new-tokens 0 taken as the default, --batch-size 0 as "all", --steps -5 writing a checkpoint of
    step -5, roofline --k 0 / --kv-len -100), or failing only when its results are written (--json in a
    missing folder): each exits 2 before any work, with argparse's one error line naming the argument."""
    argv = fill(argv, paths)
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    line = error_line(capsys.readouterr().err, argv[0])
    assert words.format(**paths) in line


def test_sampling_flags_take_every_value_the_sampler_takes(tiny_checkpoint, capsys):
    """Guards against the float32 / int64 bounds of --temperature, --top-k, --top-p, --min-p and --seed refusing
    values the sampler runs with: the largest seeds (the last prompt's seed 2^63 - 1), the largest top-k, a
    temperature that rounds to the largest float32, top-p 1 and min-p just below 1 as a float32."""
    cli.main(["generate", "--checkpoint", str(tiny_checkpoint), "--num-prompts", "2", "--max-new-tokens", "4",
              "--seed", str(2**63 - 2), "--temperature", "3.40282356e38", "--top-k", str(2**63 - 1), "--top-p", "1",
              "--min-p", "0.99999994"])
    assert capsys.readouterr().out.count(" -> ") == 2


# The bad arguments that a user reported ending in a traceback or running with a nonsensical meaning, one per
# kind of check (a file that must exist, a choice, a positive integer, a finite number, a flag alias, a rule
# between flags, an existing output): each also runs in a real process. A process costs ~2 s here, nearly all
# of it importing torch, so the other cases of BAD_ARGUMENTS, which go through the same parser and the same
# `main`, run in-process only (test_bad_argument_exits_2_naming_it).
REAL_PROCESS_CASES = [
    ("generate", "--checkpoint", "{missing}"), ("generate", "--task", "mul"), ("generate", "--block-size", "0"),
    ("generate", "--gamma", "-1"), ("generate", "--temperature", "nan"), ("generate", "--threads", "0"),
    ("generate", "--num-prompts", "-3"), ("generate", "--max-new-tokens", "0"), ("generate", "--batch-size", "0"),
    ("train", "--steps", "-5"), ("train", "--checkpoint_every", "0"), ("train", "--out", "{file}"),
    ("roofline", "--k", "0"), ("roofline", "--kv-len", "-100"),
]
REAL_PROCESS_ARGUMENTS = [(argv, words) for argv, words in BAD_ARGUMENTS
                          if (argv[0], *argv[-2:]) in REAL_PROCESS_CASES]


def test_real_process_cases_are_bad_arguments():
    """Guards against a real-process case silently dropped by a change of BAD_ARGUMENTS."""
    assert len(REAL_PROCESS_ARGUMENTS) == len(REAL_PROCESS_CASES)


@pytest.mark.parametrize("argv,words", REAL_PROCESS_ARGUMENTS,
                         ids=[f"{argv[0]} {' '.join(argv[-2:])}" for argv, _ in REAL_PROCESS_ARGUMENTS])
def test_bad_argument_in_a_real_process(paths, argv, words):
    """Guards against a bad value that only the in-process test above sees rejected: a real `sbd` process
    (python -m sbd_kernels.cli, what the `sbd` script runs) exits 2 with nothing on stdout, and its stderr
    is argparse's usage and one `sbd <cmd>: error:` line naming the flag, without a traceback."""
    argv = fill(argv, paths)
    out = run_sbd(*argv)
    words = words.format(**paths)
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert out.stdout == "", out.stdout
    line = error_line(out.stderr, argv[0])
    assert words in line and re.search(r"--[\w-]+", words), (words, line)
    usage = out.stderr.splitlines()[:-1]
    assert usage and usage[0].startswith(f"usage: sbd {argv[0]} "), out.stderr
    assert all(row.startswith(" ") for row in usage[1:]), out.stderr


def test_every_flag_that_takes_a_value_is_checked():
    """Guards against a new flag added without a type or choices (its bad values would reach the run)."""
    free_text = {("bench", "keyword")}      # a pytest -k expression: pytest checks it
    parser = cli.build_parser()
    for name, sub in parser._subparsers._group_actions[0].choices.items():
        for action in sub._actions:
            if action.option_strings and action.nargs != 0 and action.dest != "help":
                assert action.type is not None or action.choices is not None or (name, action.dest) in free_text, \
                    f"sbd {name} {action.option_strings[0]}"


def test_train_config_checks_its_values():
    """Guards against TrainConfig taking values the command line rejects when built from Python."""
    for bad in ({"steps": -5}, {"checkpoint_every": 0}, {"lr": float("nan")}, {"preset": "huge"},
                {"tasks": "mul"}, {"min_lr_ratio": 2.0}, {"batch_size": 0}, {"block_min": 5, "block_max": 3}):
        with pytest.raises(ValueError, match=f"TrainConfig: {next(iter(bad))}"):
            TrainConfig(**bad)


# ----------------------------------------------------------------------------------------------------
# Errors while running: exit 1, one line `sbd <cmd>: error: ...`, a traceback only with --debug
# ----------------------------------------------------------------------------------------------------
def small_vocab_checkpoint(folder: Path) -> str:
    path = folder / "small_vocab.pt"
    save_checkpoint(Transformer(ModelConfig(vocab_size=8, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=8,
                                            max_seq_len=16)), path)
    return str(path)


RUN_ERRORS = [
    (["generate", "--checkpoint", "{damaged}"], "{damaged}: truncated"),
    (["generate", "--checkpoint", "{file}"], "{file}: not an sbd_kernels checkpoint"),
    (["generate", "--checkpoint", "{small_vocab}", "--num-prompts", "1"], "vocabulary"),
    (["train", "--preset", "tiny", "--init-from", "{damaged}", "--out", "{dir}/from_damaged.pt"],
     "{damaged}: truncated"),
    (["roofline", "--project", "--demo-json", "{garbage}"], "{garbage}: not JSON"),
    (["roofline", "--project", "--demo-json", "{file_json}"], "{file_json}: not the output of `sbd demo --json`"),
    (["roofline", "--measured", "{file_json}"], "{file_json}: not a pytest-benchmark JSON"),
]


@pytest.mark.parametrize("argv,words", RUN_ERRORS, ids=[" ".join(argv[:2]) + " " + argv[-1] for argv, _ in RUN_ERRORS])
def test_error_while_running_exits_1_with_one_line(paths, tmp_path, capsys, argv, words):
    """Guards against a damaged checkpoint, a model that does not fit the tokenizer or an input JSON of the
    wrong kind ending in a traceback (or, for a damaged file, torch's OSError('Invalid argument'))."""
    (tmp_path / "list.json").write_text("[1, 2]")
    paths = {**paths, "small_vocab": small_vocab_checkpoint(tmp_path), "file_json": str(tmp_path / "list.json")}
    argv = fill(argv, paths)
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 1
    line = error_line(capsys.readouterr().err, argv[0])
    assert words.format(**paths) in line


@pytest.mark.parametrize("command", ["generate", "demo"])
def test_cuda_graph_reaches_the_decode(tiny_checkpoint, monkeypatch, command):
    """Guards against --cuda-graph being parsed and then dropped on the way to the decode (the run would be eager
    and its tokens/s host-bound on a GPU): with the device check passed, both commands decode with
    cuda_graph=True, which on this CPU model is refused by the decode itself."""
    monkeypatch.setattr(cli.argtypes, "require_device", lambda name: None)
    monkeypatch.setattr("sbd_kernels.model.load_checkpoint",
                        lambda path, map_location: load_checkpoint(path, map_location="cpu"))
    monkeypatch.setattr(torch.nn.Module, "to", lambda module, *args, **kwargs: module)  # the demo's models stay here
    argv = {"generate": ["generate", "--checkpoint", str(tiny_checkpoint), "--num-prompts", "1"],
            "demo": ["demo", "--quick", "--tasks", "add", "--num-prompts", "1"]}[command]
    with pytest.raises(ValueError, match="cuda_graph=True needs the model on a CUDA device, it is on cpu"):
        cli.main([*argv, "--device", "cuda", "--cuda-graph", "--debug"])


@NO_GPU
@pytest.mark.parametrize("argv", [["generate", "--checkpoint", "{ckpt}", "--device", "cuda"],
                                  ["demo", "--quick", "--device", "cuda:0"],
                                  ["train", "--preset", "tiny", "--device", "cuda", "--out", "{dir}/gpu.pt"]])
def test_cuda_without_a_gpu_exits_1(paths, capsys, argv):
    """Guards against --device cuda on a machine without a GPU ending in torch's traceback."""
    argv = fill(argv, paths)
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 1
    assert "--device cuda" in error_line(capsys.readouterr().err, argv[0])


def test_debug_raises_the_original_error(paths):
    """Guards against --debug hiding the exception (and its traceback) it exists to show."""
    with pytest.raises(CheckpointError, match="truncated"):
        cli.main(["generate", "--debug", "--checkpoint", paths["damaged"]])
    with pytest.raises(CheckpointError, match="truncated"):
        cli.main(["--debug", "generate", "--checkpoint", paths["damaged"]])


def test_subprocess_bad_argument_exit_status_and_stderr():
    """Guards against the exit status / stderr contract of a real `sbd` process for a bad value: 2, the
    usage and one error line, nothing on stdout."""
    out = run_sbd("generate", "--block-size", "0")
    assert out.returncode == 2 and out.stdout == ""
    assert "argument --block-size: must be a positive integer, got '0'" in error_line(out.stderr, "generate")


def test_subprocess_error_while_running_is_one_line(paths):
    """Guards against a traceback (or more than one line) on stderr for an error while running."""
    out = run_sbd("generate", "--checkpoint", paths["damaged"])
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1 and "truncated" in error_line(out.stderr, "generate")


@pytest.mark.parametrize("how", ["flag", "env"])
def test_subprocess_debug_shows_the_traceback(paths, how):
    """Guards against --debug / SBD_DEBUG=1 not showing where an error came from."""
    argv = ["generate", "--checkpoint", paths["damaged"]] + (["--debug"] if how == "flag" else [])
    out = run_sbd(*argv, env={"SBD_DEBUG": "1"} if how == "env" else None)
    assert out.returncode == 1
    assert "Traceback (most recent call last)" in out.stderr and "CheckpointError" in out.stderr


def test_train_module_entry_point_shares_the_checks(tmp_path):
    """Guards against `python -m sbd_kernels.train` (torchrun's entry point) skipping the checks of `sbd train`."""
    out = subprocess.run([sys.executable, "-m", "sbd_kernels.train", "--steps", "-5", "--out", str(tmp_path / "m.pt")],
                         check=False, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 2 and "argument --steps: " in error_line(out.stderr, "train")
    assert not (tmp_path / "m.pt").exists()


# ----------------------------------------------------------------------------------------------------
# sbd train --out: never replaces a file unless --overwrite (or --resume of its own run)
# ----------------------------------------------------------------------------------------------------
def test_train_refuses_to_replace_an_existing_file(tmp_path, capsys):
    """Guards against `sbd train --out` silently replacing a bundled checkpoint or a day of training."""
    out = tmp_path / "precious.pt"
    out.write_bytes(b"a day of training")
    with pytest.raises(SystemExit) as info:
        cli.main(tiny_train_argv(out))
    assert info.value.code == 2
    assert "--overwrite" in error_line(capsys.readouterr().err, "train")
    assert out.read_bytes() == b"a day of training"


def test_train_overwrite_replaces_the_file(tmp_path):
    """Guards against --overwrite not being honoured."""
    out = tmp_path / "old.pt"
    out.write_bytes(b"old")
    cli.main(tiny_train_argv(out, "--overwrite"))
    assert load_checkpoint(out)[1]["steps_done"] == 2


def test_failed_run_leaves_the_file_untouched(tmp_path, paths, capsys):
    """Guards against a run that fails (here: a damaged --init-from) destroying the file it would replace."""
    out = tmp_path / "old.pt"
    out.write_bytes(b"old")
    with pytest.raises(SystemExit) as info:
        cli.main(tiny_train_argv(out, "--overwrite", "--init-from", paths["damaged"]))
    assert info.value.code == 1 and out.read_bytes() == b"old"
    assert "truncated" in error_line(capsys.readouterr().err, "train")


def test_train_resume_continues_its_own_run(tmp_path, capsys):
    """Guards against the --out check blocking --resume of a run (its <out>.state beside it), and against
    --resume replacing a file that has no state to resume from."""
    out = tmp_path / "run.pt"
    cli.main(tiny_train_argv(out))
    cli.main([*tiny_train_argv(out), "--steps", "3", "--resume"])
    assert load_checkpoint(out)[1]["steps_done"] == 3
    other = tmp_path / "other.pt"
    other.write_bytes(b"not a run")
    with pytest.raises(SystemExit) as info:
        cli.main(tiny_train_argv(other, "--resume"))
    assert info.value.code == 2 and other.read_bytes() == b"not a run"
    assert "--overwrite" in error_line(capsys.readouterr().err, "train")


@pytest.mark.parametrize("damage", ["truncated", "not_a_state", "other_model"])
def test_train_resume_from_a_damaged_state_is_one_line(tmp_path, capsys, damage):
    """Guards against --resume from a damaged or foreign <out>.state ending in a raw torch.load / state-dict
    traceback (OSError('Invalid argument'), KeyError 'model', size mismatch) instead of naming the file, and
    against the failed run touching the checkpoint."""
    out = tmp_path / "run.pt"
    cli.main(tiny_train_argv(out))
    state = tmp_path / "run.pt.state"
    if damage == "truncated":
        state.write_bytes(state.read_bytes()[:-100])
    elif damage == "not_a_state":
        torch.save({"step": 2}, state)
    else:
        weights = torch.load(state, weights_only=True)
        weights["model"] = {name: t[:1] for name, t in weights["model"].items()}
        torch.save(weights, state)
    before = out.read_bytes()
    with pytest.raises(SystemExit) as info:
        cli.main([*tiny_train_argv(out), "--steps", "3", "--resume"])
    line = error_line(capsys.readouterr().err, "train")
    assert info.value.code == 1 and str(state) in line
    assert {"truncated": "truncated", "not_a_state": "missing model, optimizer, seconds, eval",
            "other_model": "the training state of another model"}[damage] in line
    assert out.read_bytes() == before


# ----------------------------------------------------------------------------------------------------
# One flag style: dashes, with the underscore spellings as hidden aliases
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dashed,underscored", [
    (["train", "--batch-size", "3", "--checkpoint-every", "7", "--init-from", ""],
     ["train", "--batch_size", "3", "--checkpoint_every", "7", "--init_from", ""]),
    (["generate", "--num-prompts", "3", "--batch-size", "2", "--max-new-tokens", "5", "--block-size", "4"],
     ["generate", "--num_prompts", "3", "--batch_size", "2", "--max_new_tokens", "5", "--block_size", "4"]),
    (["demo", "--num-prompts", "3", "--batch-size", "2", "--timing-runs", "1", "--kv-prompts", "1"],
     ["demo", "--num_prompts", "3", "--batch_size", "2", "--timing_runs", "1", "--kv_prompts", "1"]),
    (["roofline", "--kv-len", "7"], ["roofline", "--kv_len", "7"]),
])
def test_underscore_aliases_parse_like_the_dashed_flags(dashed, underscored):
    """Guards against scripts written with `sbd train --batch_size ...` breaking with the dashed spelling."""
    parser = cli.build_parser()
    assert vars(parser.parse_args(underscored)) == vars(parser.parse_args(dashed))


@pytest.mark.parametrize("command", list(cli.SUBCOMMANDS))
def test_help_shows_dashed_flags_only(command, capsys):
    """Guards against the hidden underscore aliases showing up in --help (or in the usage line)."""
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert not re.findall(r"--\w*_\w*", text)
    if command == "train":
        assert "--batch-size" in text and "--checkpoint-every" in text and "--overwrite" in text


DOCUMENTS = ["README.md", "Makefile", "sbd_kernels/checkpoints/README.md", "sbd_kernels/cli.py", "sbd_kernels/train.py",
             "sbd_kernels/demo.py", "sbd_kernels/roofline.py"]


@pytest.mark.parametrize("name", DOCUMENTS)
def test_documents_spell_flags_with_dashes(name):
    """Guards against commands in the docs teaching the old underscore spellings."""
    text = (REPO / name).read_text()
    assert not re.findall(r"(?<![\w{])--[a-z0-9]+_[a-z0-9_]+", text)


def subcommand_flags() -> dict[str, set[str]]:
    """{subcommand: every option string it accepts}, from the parser itself."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: set(command._option_string_actions) for name, command in sub.choices.items()}


def unknown_flags(text: str, flags: dict[str, set[str]]) -> list[str]:
    """"sbd <subcommand> --flag" for each flag a command line in `text` gives its subcommand that it does not
    take (the line up to a comment, a backquote or a table cell's end)."""
    command = re.compile(r"\bsbd (" + "|".join(map(re.escape, flags)) + r")\b([^`\n|#]*)")
    return [f"sbd {m.group(1)} {flag}" for m in command.finditer(text)
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", m.group(2)) if flag not in flags[m.group(1)]]


def test_documented_commands_use_flags_their_subcommand_takes():
    """Guards against a command in the README, docs or docstrings that fails as written (a flag renamed,
    removed or given to the wrong subcommand); the scan itself must see a wrong flag."""
    flags = subcommand_flags()
    assert unknown_flags("`sbd bench --only sampling --budget 480`, sbd roofline --paper", flags) == [
        "sbd bench --budget"]
    files = [REPO / "README.md", REPO / "Makefile", *sorted((REPO / "docs").glob("*.md")),
             *sorted((REPO / "sbd_kernels").rglob("*.py")), *sorted((REPO / "sbd_kernels").rglob("*.md")),
             *sorted((REPO / "bench").glob("*.py")), *sorted((REPO / "tools").glob("*.py"))]
    wrong = {str(path.relative_to(REPO)): unknown_flags(path.read_text(), flags) for path in files}
    assert not {name: found for name, found in wrong.items() if found}


def test_abbreviations_are_not_accepted(capsys):
    """Guards against `--batch` silently meaning `--batch-size` (or being ambiguous with its alias):
    flags are matched exactly, so a new flag never changes what an existing script means."""
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", "--batch", "2"])
    assert info.value.code == 2
    assert "unrecognized arguments: --batch" in error_line(capsys.readouterr().err, "generate")
