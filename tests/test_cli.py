"""The `sbd` command line: subcommands wired to their modules, `sbd generate` output, `sbd train`."""
import subprocess
import sys

import pytest
import torch

from sbd_kernels import cli
from sbd_kernels.model import ModelConfig, Transformer, load_checkpoint, save_checkpoint


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("ckpt") / "tiny.pt"
    save_checkpoint(Transformer(ModelConfig.preset("tiny")), path)
    return path


def test_help_lists_subcommands():
    """Guards against a subcommand that fails to register (an import error in its module breaks `sbd`)."""
    out = subprocess.run([sys.executable, "-m", "sbd_kernels.cli", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for name in ("train", "generate", "demo", "roofline"):
        assert name in out


@pytest.mark.parametrize("name,run", [("train", cli.run_train), ("generate", cli.run_generate),
                                      ("demo", cli.run_demo), ("roofline", cli.run_roofline)])
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


def test_generate_on_a_prompt_text(tiny_checkpoint, capsys):
    """Guards against the free-text prompt path (encoding with the separator, no reference answer)."""
    cli.main(["generate", "--checkpoint", str(tiny_checkpoint), "--prompt", "12+34", "--prompt", "abc",
              "--method", "sbd", "--max-new-tokens", "5", "--threads", "1"])
    out = capsys.readouterr().out
    assert "12+34 -> " in out and "abc -> " in out and "exact match" not in out


def test_generate_rejects_unknown_method(tiny_checkpoint):
    """Guards against silently falling back to a default decoding method."""
    with pytest.raises(SystemExit):
        cli.main(["generate", "--checkpoint", str(tiny_checkpoint), "--method", "beam"])


def test_train_writes_a_loadable_checkpoint(tmp_path):
    """Guards against `sbd train` flags not reaching the training loop (`train.add_arguments` / `main`)."""
    out = tmp_path / "m.pt"
    cli.main(["train", "--preset", "tiny", "--objective", "sbd", "--tasks", "add", "--steps", "2",
              "--batch_size", "2", "--eval_every", "1000", "--eval_examples", "1", "--checkpoint_every", "1000",
              "--out", str(out)])
    model, meta = load_checkpoint(out)
    assert model.config == ModelConfig.preset("tiny")
    assert meta["train_config"]["steps"] == 2
