"""The `sbd` command: `sbd train`, `sbd generate`, `sbd demo`, `sbd roofline`, `sbd bench`, `sbd gpu-check`.

    sbd demo [--quick] [--json PATH] [--plot PATH]   # the main job: accuracy vs NFE speedup table
    sbd train --objective sbd --init-from ntp.pt --out sbd.pt ...
    sbd generate --task add --num-prompts 8 --method sbd --gamma 0.1
    sbd generate --prompt "12+34" --method ntp
    sbd roofline --project --demo-json demo.json
    sbd bench [--only sampling,attention] [-k EXPR] [--rounds N]   # from a source checkout
    sbd gpu-check [--dry-run]       # on an NVIDIA GPU: tests on CUDA, benchmarks, report (10 minutes)

Each subcommand's flags come from its module (`train`, `demo`, `roofline`: `add_arguments` and `main`).
Every value is checked as it is parsed (`sbd_kernels.argtypes`): a bad one exits with status 2 and one
`sbd <cmd>: error: argument --flag: ...` line under the usage, before any work. An error while running (a
damaged checkpoint, `--device cuda` without a GPU) exits with status 1 and one `sbd <cmd>: error: ...`
line; `--debug` (or SBD_DEBUG=1) shows its traceback instead. Flags are spelled with dashes and matched
exactly (no abbreviations); their underscore spellings are accepted but not listed.
"""
from __future__ import annotations

import argparse
import os
import sys

from sbd_kernels import argtypes
from sbd_kernels.argtypes import add_option


# ----------------------------------------------------------------------------------------------------
# sbd generate
# ----------------------------------------------------------------------------------------------------
def _prompt_text(text: str) -> str:
    from sbd_kernels.tasks import TOKENIZER

    try:
        TOKENIZER.encode(text)
    except ValueError:
        bad = next(c for c in text if c not in TOKENIZER.CHARS)
        raise argparse.ArgumentTypeError(f"character {bad!r} of {text!r} is not in the vocabulary "
                                         f"({TOKENIZER.CHARS})") from None
    return text


def add_generate_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from sbd_kernels.tasks import TASKS

    parser.add_argument("--checkpoint", type=argtypes.existing_file, default=None,
                        help="model file written by `sbd train` (default: the bundled SBD checkpoint)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", action="append", type=_prompt_text, default=None,
                        help="prompt text (repeat for several); the separator is appended")
    source.add_argument("--task", choices=list(TASKS), default="add",
                        help="decode this task's held-out prompts (default add)")
    add_option(parser, "--num-prompts", type=argtypes.positive_int, default=4, help="held-out prompts with --task")
    parser.add_argument("--method", choices=("ntp", "sbd"), default="sbd")
    parser.add_argument("--gamma", type=argtypes.non_negative_float, default=0.1, help="EB entropy budget (SBD)")
    add_option(parser, "--block-size", type=argtypes.positive_int, default=16)
    parser.add_argument("--temperature", type=argtypes.temperature, default=0.0,
                        help="0: greedy; T > 0 samples from softmax(logits / T) (finite as a float32)")
    add_option(parser, "--top-k", type=argtypes.top_k, default=0,
               help="sample among the k most probable tokens only (0: off; ignored at temperature 0)")
    add_option(parser, "--top-p", type=argtypes.top_p, default=1.0,
               help="sample among the most probable tokens holding this mass (1: off)")
    add_option(parser, "--min-p", type=argtypes.min_p, default=0.0,
               help="drop tokens below min-p x the most probable token's probability (0: off)")
    add_option(parser, "--max-new-tokens", type=argtypes.positive_int, default=None,
               help="answer budget, EOS included (default: the task's answer length, or 64)")
    parser.add_argument("--seed", type=argtypes.seed, default=0, help="prompt i samples with seed + i (default 0)")
    add_option(parser, "--batch-size", type=argtypes.positive_int, default=None,
               help="prompts per batch (default: all)")
    parser.add_argument("--ops", choices=("fused", "naive"), default="fused")
    parser.add_argument("--device", type=argtypes.device, default="cpu",
                        help="cpu (C++ kernels) or cuda (Triton kernels)")
    parser.add_argument("--threads", type=argtypes.positive_int, default=1)
    parser.add_argument("--cuda-graph", action="store_true",
                        help="replay the decode steps from CUDA graphs (--device cuda, --ops fused): the same tokens "
                        "with far less host time per pass")
    return parser


def run_generate(args: argparse.Namespace) -> None:
    import torch

    from sbd_kernels.demo import SBD_CHECKPOINT
    from sbd_kernels.generate import DecodeConfig, fused_ops, generate, naive_ops, seeds_overflow
    from sbd_kernels.model import load_checkpoint
    from sbd_kernels.tasks import TOKENIZER, exact_match, get_task, make_examples

    seed_problem = seeds_overflow("--seed", args.seed, len(args.prompt) if args.prompt else args.num_prompts)
    usage_problem = seed_problem or argtypes.cuda_graph_problem(args)
    if usage_problem:
        raise argtypes.UsageError(usage_problem)
    argtypes.require_device(args.device)
    torch.set_num_threads(args.threads)
    checkpoint = args.checkpoint or SBD_CHECKPOINT
    model, _ = load_checkpoint(checkpoint, map_location=args.device)
    if model.config.vocab_size < TOKENIZER.vocab_size:
        raise ValueError(f"{checkpoint}: its vocabulary ({model.config.vocab_size} ids) is smaller than the "
                         f"character tokenizer's ({TOKENIZER.vocab_size} ids); not a model of these tasks")
    if args.prompt:
        texts, references = args.prompt, None
        budget = 64 if args.max_new_tokens is None else args.max_new_tokens
    else:
        examples = make_examples(args.task, "held_out", args.num_prompts)
        texts, references = [ex.prompt for ex in examples], [ex.answer for ex in examples]
        budget = get_task(args.task).answer_tokens if args.max_new_tokens is None else args.max_new_tokens
    cfg = DecodeConfig(method=args.method, block_size=args.block_size, gamma=args.gamma,
                       temperature=args.temperature, max_new_tokens=budget, seed=args.seed, top_k=args.top_k,
                       top_p=args.top_p, min_p=args.min_p)
    result = generate(model, [TOKENIZER.encode_prompt(t) for t in texts], cfg, eos_id=TOKENIZER.EOS,
                      pad_id=TOKENIZER.PAD, batch_size=args.batch_size,
                      ops=fused_ops() if args.ops == "fused" else naive_ops(), cuda_graph=args.cuda_graph)
    hits = 0
    for i, (text, answer) in enumerate(zip(texts, result.answers)):
        decoded = TOKENIZER.decode(answer)
        line = f"{text} -> {decoded}  [NFE {int(result.nfe[i])}, {int(result.generated[i])} tokens]"
        if references is not None:
            ok = exact_match(answer, TOKENIZER.encode_answer(references[i]))
            hits += ok
            line += "  correct" if ok else f"  WRONG (expected {references[i]})"
        if bool(result.stopped_early[i]):
            line += "  STOPPED EARLY (invalid logits)"
        print(line)
    setting = f"block {cfg.block_size}, gamma {cfg.gamma}, " if args.method == "sbd" else ""
    print(f"\n{args.method.upper()} ({setting}temperature {cfg.temperature}): "
          f"{result.total_nfe} forward passes for {result.total_generated} tokens = "
          f"{result.nfe_per_token:.3f} NFE/token; {result.tokens_per_s:.1f} tokens/s")
    if args.method == "sbd":
        hist = ", ".join(f"{a}: {n}" for a, n in enumerate(result.accepted_hist.tolist()) if n)
        print(f"tokens accepted per pass (count of passes): {hist}")
    if references is not None:
        print(f"exact match {hits}/{len(texts)}")
    if result.num_stopped_early:
        print(f"warning: {result.num_stopped_early} of {len(texts)} sequences stopped early on invalid (NaN / +inf) "
              "logits")


# ----------------------------------------------------------------------------------------------------
# sbd train / sbd demo
# ----------------------------------------------------------------------------------------------------
def add_train_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from sbd_kernels import train

    return train.add_arguments(parser)


def run_train(args: argparse.Namespace) -> None:
    from sbd_kernels import train

    train.main(args)


def add_demo_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from sbd_kernels import demo

    return demo.add_arguments(parser)


def run_demo(args: argparse.Namespace) -> None:
    from sbd_kernels import demo

    demo.main(args)


def add_roofline_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from sbd_kernels import roofline

    return roofline.add_arguments(parser)


def run_roofline(args: argparse.Namespace) -> None:
    from sbd_kernels import roofline

    roofline.main(args)


# ----------------------------------------------------------------------------------------------------
# sbd bench
# ----------------------------------------------------------------------------------------------------
def add_bench_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from sbd_kernels import bench_report

    return bench_report.add_arguments(parser)


def run_bench(args: argparse.Namespace) -> None:
    from sbd_kernels import bench_report

    sys.exit(bench_report.run(args))


# ----------------------------------------------------------------------------------------------------
# sbd gpu-check
# ----------------------------------------------------------------------------------------------------
def add_gpu_check_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from sbd_kernels import gpucheck

    return gpucheck.add_arguments(parser)


def run_gpu_check(args: argparse.Namespace) -> None:
    from sbd_kernels import gpucheck

    sys.exit(gpucheck.run(args))


# ----------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------
SUBCOMMANDS = {
    "train": ("train the reference model with the SBD objective or NTP only", add_train_arguments, run_train),
    "generate": ("decode prompts with a checkpoint, NTP or SBD, and print answers and statistics",
                 add_generate_arguments, run_generate),
    "demo": ("the main job: accuracy vs forward-pass speedup of SBD against NTP on the held-out tasks",
             add_demo_arguments, run_demo),
    "roofline": ("roofline model of a decoder forward: SBD wall-clock speedup from NFE statistics, GPU projection",
                 add_roofline_arguments, run_roofline),
    "bench": ("run every benchmark family and write one report (Markdown, JSON, CSV, plots) under bench/results",
              add_bench_arguments, run_bench),
    "gpu-check": (("on an NVIDIA GPU: build, the tests on CUDA, the benchmarks on the GPU and a report under "
                   "bench/reference/<gpu>, within 10 minutes"), add_gpu_check_arguments, run_gpu_check),
}


def build_parser() -> argparse.ArgumentParser:
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the traceback of an error (also: SBD_DEBUG=1)")
    parser = argparse.ArgumentParser(prog="sbd", description="Set Block Decoding: train, decode, demo.",
                                     parents=[debug], allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, (help_text, add_arguments, run) in SUBCOMMANDS.items():
        # No abbreviations: `--batch` would be ambiguous between a flag and its hidden alias, and a flag
        # added later would change what an abbreviation in an existing script means.
        command = sub.add_parser(name, help=help_text, description=help_text, parents=[debug], allow_abbrev=False)
        add_arguments(command).set_defaults(run=run, parser=command)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Parses argv (sys.argv[1:] by default) and runs the subcommand. Exit status 2 for bad arguments
    (argparse's message), 1 for an error while running (one line on stderr), 130 when interrupted."""
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:     # reported by the subcommand, with its usage, rather than as `sbd: error: ...`
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    debug = getattr(args, "debug", False) or os.environ.get("SBD_DEBUG", "") not in ("", "0")
    try:
        args.run(args)
    except argtypes.UsageError as err:
        args.parser.error(str(err))
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"sbd {args.command}: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as err:
        if debug:
            raise
        print(f"sbd {args.command}: error: {_one_line(err)}", file=sys.stderr)
        sys.exit(1)


def _one_line(err: Exception) -> str:
    """The first line of err's message, after the exception's type unless that is ValueError (our
    checks, CheckpointError), OSError or RuntimeError, whose messages say what is wrong by themselves."""
    text = str(err).strip()
    first = text.splitlines()[0] if text else "(no message)"
    more = " (--debug for the rest)" if "\n" in text else ""
    if isinstance(err, (ValueError, OSError)) or type(err) is RuntimeError:
        return first + more
    return f"{type(err).__name__}: {first}{more}"


if __name__ == "__main__":
    main(sys.argv[1:])
