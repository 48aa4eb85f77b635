"""The `sbd` command: `sbd train`, `sbd generate`, `sbd demo`, `sbd roofline`, `sbd bench`.

    sbd demo [--quick] [--json PATH] [--plot PATH]   # the main job: accuracy vs NFE speedup table
    sbd train --objective sbd --init_from ntp.pt --out sbd.pt ...
    sbd generate --task add --num-prompts 8 --method sbd --gamma 0.1
    sbd generate --prompt "12+34" --method ntp
    sbd roofline --project --demo-json demo.json
    sbd bench [--only sampling,attention] [-k EXPR] [--rounds N]   # from a source checkout

Each subcommand's flags come from its module (`train`, `demo`, `roofline`: `add_arguments` and `main`).
"""
from __future__ import annotations

import argparse
import sys


# ----------------------------------------------------------------------------------------------------
# sbd generate
# ----------------------------------------------------------------------------------------------------
def add_generate_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--checkpoint", default=None,
                        help="model file written by `sbd train` (default: the bundled SBD checkpoint)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", action="append", default=None,
                        help="prompt text (repeat for several); the separator is appended")
    source.add_argument("--task", default="add", help="decode this task's held-out prompts (default add)")
    parser.add_argument("--num-prompts", type=int, default=4, help="held-out prompts with --task")
    parser.add_argument("--method", choices=("ntp", "sbd"), default="sbd")
    parser.add_argument("--gamma", type=float, default=0.1, help="EB entropy budget (SBD)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="answer budget, EOS included (default: the task's answer length, or 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=None, help="prompts per batch (default: all)")
    parser.add_argument("--ops", choices=("fused", "naive"), default="fused")
    parser.add_argument("--device", default="cpu", help="cpu (C++ kernels) or cuda (Triton kernels)")
    parser.add_argument("--threads", type=int, default=1)
    return parser


def run_generate(args: argparse.Namespace) -> None:
    import torch

    from sbd_kernels.demo import SBD_CHECKPOINT
    from sbd_kernels.generate import DecodeConfig, fused_ops, generate, naive_ops
    from sbd_kernels.model import load_checkpoint
    from sbd_kernels.tasks import TOKENIZER, exact_match, get_task, make_examples

    torch.set_num_threads(args.threads)
    model, _ = load_checkpoint(args.checkpoint or SBD_CHECKPOINT, map_location=args.device)
    if args.prompt:
        texts, references, budget = args.prompt, None, args.max_new_tokens or 64
    else:
        examples = make_examples(args.task, "held_out", args.num_prompts)
        texts, references = [ex.prompt for ex in examples], [ex.answer for ex in examples]
        budget = args.max_new_tokens or get_task(args.task).answer_tokens
    cfg = DecodeConfig(method=args.method, block_size=args.block_size, gamma=args.gamma,
                       temperature=args.temperature, max_new_tokens=budget, seed=args.seed)
    result = generate(model, [TOKENIZER.encode_prompt(t) for t in texts], cfg, eos_id=TOKENIZER.EOS,
                      pad_id=TOKENIZER.PAD, batch_size=args.batch_size,
                      ops=fused_ops() if args.ops == "fused" else naive_ops())
    hits = 0
    for i, (text, answer) in enumerate(zip(texts, result.answers)):
        decoded = TOKENIZER.decode(answer)
        line = f"{text} -> {decoded}  [NFE {int(result.nfe[i])}, {int(result.generated[i])} tokens]"
        if references is not None:
            ok = exact_match(answer, TOKENIZER.encode_answer(references[i]))
            hits += ok
            line += "  correct" if ok else f"  WRONG (expected {references[i]})"
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
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sbd", description="Set Block Decoding: train, decode, demo.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, (help_text, add_arguments, run) in SUBCOMMANDS.items():
        add_arguments(sub.add_parser(name, help=help_text, description=help_text)).set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
