"""`sbd demo`: the paper's headline (Figure 1) in small, with the `sbd` ops in the decode loop.

Tasks: `add` and `rot13` (sbd_kernels.tasks, SBD's best case: every block fills in one pass), and `code`, real
data: one-line completion of held-out transformers sources (sbd_kernels.code_completion) by the Hugging Face models
of sbd_kernels.code_models, CODE_PROMPTS prompts by default (`python -m sbd_kernels.code_models curve` gives the
full curve). For each task's held-out prompts, the SBD-trained model is decoded with NTP and with SBD at several
gamma, and the NTP-only baseline model with NTP. One table per task:
    model, method, gamma, exact-match accuracy, edit similarity (code), forward passes (NFE) per answer token,
    NFE speedup = (NFE per token of NTP) / (NFE per token of this row), same model,
    tokens/s (answer tokens, EOS included, over decode wall time, prefill included; median of a few
    identical runs for the short ones),
    wall-clock speedup = tokens/s of this row / tokens/s of NTP, same model.
Then the exact-KV check on a few prompts: block logits computed with the KV cache equal a full recompute
(docs/algorithm.md §3.10) within fp32 tolerance, and the cached decode with fused ops gives the same tokens
as the full-recompute oracle decode (NTP and SBD, temperature 0).
`--json PATH` writes one object per task; `--plot PATH` draws accuracy against NFE speedup.

The bundled checkpoints (`sbd_kernels/checkpoints/`) are loaded; if the synthetic tasks' ones are missing they
are trained first with `TRAINING_RECIPE` on a GPU or `CPU_TRAINING_RECIPE` (progress bar on stderr); missing code
models are an error (hours of training; checkpoints/README.md has the commands). `--quick` (or `--preset tiny`)
uses random `tiny` models and a few prompts instead: it checks that the whole pipeline runs, in seconds.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from sbd_kernels import argtypes, checks
from sbd_kernels.argtypes import add_option
from sbd_kernels.generate import (
    DecodeConfig,
    DecodeOps,
    DecodeResult,
    fused_ops,
    generate,
    naive_ops,
)
from sbd_kernels.model import ModelConfig, Transformer, load_checkpoint
from sbd_kernels.protocol import SbdModel
from sbd_kernels.tasks import TASKS as SYNTHETIC_TASKS
from sbd_kernels.tasks import TOKENIZER, exact_match, get_task, make_examples

CHECKPOINT_DIR = Path(__file__).parent / "checkpoints"
SBD_CHECKPOINT = CHECKPOINT_DIR / "sbd_small.pt"
NTP_CHECKPOINT = CHECKPOINT_DIR / "ntp_small.pt"
# The real-data task (sbd_kernels.code_completion): one-line completion of held-out transformers sources by the
# Hugging Face models of sbd_kernels.code_models, bundled as HF folders.
CODE_TASK = "code"
TASKS = (*SYNTHETIC_TASKS, CODE_TASK)
CODE_SBD_CHECKPOINT = CHECKPOINT_DIR / "code_sbd"
CODE_NTP_CHECKPOINT = CHECKPOINT_DIR / "code_ntp"
# Held-out code prompts by default: the code models decode ~10x slower per byte than the synthetic tasks' models
# per token (4.5M parameters through transformers), and `make demo` must stay under 3 minutes.
CODE_PROMPTS = 24
# The presets whose random models the demo decodes: the tasks' 41-character vocabulary fits their 48 ids; the
# 8B presets would build two random ~8B-parameter fp32 models (~64 GB) for the same 41 ids.
DEMO_PRESETS = ("tiny", "small")
GAMMAS = (0.0, 0.1, 0.35, 0.6, 1.0)
BLOCK_SIZE = 16             # the paper's k; the tasks' prompts are multiples of 16 long (tasks.py)

# The `sbd train` flags of the bundled checkpoints (checkpoints/README.md): the NTP-only baseline, then the
# SBD model continued from it with the SBD objective (as the paper fine-tunes; docs/performance.md §7.1: SBD
# from scratch did not reach parity at this scale). They were trained on a GPU in 2 + 7 minutes.
TRAINING_RECIPE = {
    "ntp": {"preset": "small", "objective": "ntp", "batch_size": 128, "lr": 1.5e-3, "warmup_steps": 200,
            "min_lr_ratio": 0.05, "steps": 3189, "eval_every": 1000, "eval_examples": 200},
    "sbd": {"preset": "small", "objective": "sbd", "init_from": str(NTP_CHECKPOINT), "batch_size": 128,
            "lr": 1e-3, "warmup_steps": 200, "min_lr_ratio": 0.05, "steps": 30000, "max_minutes": 7,
            "eval_every": 1500, "eval_examples": 100},
}
# Without a GPU: the CPU recipe of checkpoints/README.md. Batch 32, because a step of 128 sequences costs
# ~4x a step of 32 (1.0 s NTP, 1.7-2.4 s SBD per 32 here) and `add` needs ~1250 NTP steps before its
# exact match leaves 0%; measured result: 98% at gamma 0.1 with 6.6x fewer NFE after 41 + 45 minutes.
CPU_TRAINING_RECIPE = {
    "ntp": {"preset": "small", "objective": "ntp", "batch_size": 32, "lr": 1e-3, "warmup_steps": 100,
            "steps": 1500, "eval_every": 250, "checkpoint_every": 100},
    "sbd": {"preset": "small", "objective": "sbd", "init_from": str(NTP_CHECKPOINT), "batch_size": 32,
            "lr": 7e-4, "warmup_steps": 100, "steps": 3000, "max_minutes": 45, "eval_every": 300,
            "checkpoint_every": 100},
}
TIMING_MIN_S = 2.0


@dataclass
class Row:
    """One line of the table (and of the JSON); nfe and answer_tokens are totals over the prompts."""

    model: str
    method: str
    gamma: float | None
    accuracy: float
    nfe: int
    answer_tokens: int
    nfe_speedup: float = 1.0
    tokens_per_s: float = 0.0
    wall_speedup: float = 1.0
    block_size: int | None = None         # SBD rows: k
    rule: str | None = None               # SBD rows: the acceptance rule
    edit_similarity: float | None = None  # code task: mean CodeXGLUE edit similarity (0..100)


# ----------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------
def selected_tasks(tasks: str | None) -> list[str]:
    """The tasks to run: those of --tasks, else every task but `code` when it cannot run here (one line on
    stderr says why). RuntimeError, before any work, when --tasks names `code` and it cannot run."""
    from sbd_kernels import code_completion

    names = tasks.split(",") if tasks else list(TASKS)
    # Why the code task cannot run here (the pinned transformers sources not installed), or None.
    reason = code_completion.corpus_unavailable() if CODE_TASK in names else None
    if reason is None:
        return names
    if tasks:
        raise RuntimeError(f"--tasks {CODE_TASK}: {reason}")
    print(f"sbd demo: skipping the {CODE_TASK} task: {reason}", file=sys.stderr)
    return [name for name in names if name != CODE_TASK]


def random_models(preset: str) -> dict[str, Transformer]:
    """Untrained models (seeded) for `--quick`: they exercise every code path, their accuracy is ~0."""
    torch.manual_seed(0)
    return {"sbd": Transformer(ModelConfig.preset(preset)).eval(),
            "ntp_only": Transformer(ModelConfig.preset(preset)).eval()}


def train_missing_checkpoints(threads: int) -> None:
    """Trains the bundled checkpoints that do not exist yet (progress bar on stderr): TRAINING_RECIPE on the
    GPU when there is one, else CPU_TRAINING_RECIPE."""
    from sbd_kernels.train import TrainConfig, train

    device = "cuda" if torch.cuda.is_available() else "cpu"
    CHECKPOINT_DIR.mkdir(parents=True, exist_ok=True)
    for name, path in (("ntp", NTP_CHECKPOINT), ("sbd", SBD_CHECKPOINT)):
        if path.exists():
            continue
        recipe = dict((TRAINING_RECIPE if device == "cuda" else CPU_TRAINING_RECIPE)[name])
        print(f"checkpoint {path} missing: training it on {device} ({recipe})", flush=True)
        train(TrainConfig(out=str(path), device=device, threads=threads, **recipe))


def bundled_models(threads: int) -> dict[str, Transformer]:
    if not (SBD_CHECKPOINT.exists() and NTP_CHECKPOINT.exists()):
        train_missing_checkpoints(threads)
    return {"sbd": load_checkpoint(SBD_CHECKPOINT)[0], "ntp_only": load_checkpoint(NTP_CHECKPOINT)[0]}


def code_models(preset: str | None) -> dict[str, SbdModel]:
    """The code task's models as `SbdCausalLM` adapters: random `tiny` HF Llama models (seeded) with a preset, else
    the bundled HF folders. Missing folders raise FileNotFoundError: retraining them takes hours on a CPU, so the
    demo does not start it; checkpoints/README.md gives the commands."""
    from sbd_kernels import code_models as cm

    if preset:
        return cm.random_code_models()
    missing = [str(p) for p in (CODE_SBD_CHECKPOINT, CODE_NTP_CHECKPOINT) if not (p / "config.json").exists()]
    if missing:
        raise FileNotFoundError(f"code task: model folders missing: {', '.join(missing)}; train them with the "
                                f"commands of {CHECKPOINT_DIR / 'README.md'} or run without the task "
                                f"(--tasks {','.join(SYNTHETIC_TASKS)})")
    return {"sbd": cm.load_code_model(CODE_SBD_CHECKPOINT)[1], "ntp_only": cm.load_code_model(CODE_NTP_CHECKPOINT)[1]}


# ----------------------------------------------------------------------------------------------------
# Measurements
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TaskData:
    """What a task's table decodes: prompts, their reference answers (token ids, the committed blocks of the
    exact-KV check), the answer budget, the stop and pad ids, and `score(result)` -> (accuracy in 0..1, edit
    similarity or None)."""

    prompts: list[list[int]]
    answers: list[list[int]]
    budget: int
    eos_id: int
    pad_id: int
    score: Callable[[DecodeResult], tuple[float, float | None]]


def decode(model: SbdModel, prompts: list[list[int]], method: str, gamma: float | None,
           max_new_tokens: int, batch_size: int, ops: DecodeOps, eos_id: int = TOKENIZER.EOS,
           pad_id: int = TOKENIZER.PAD, *, cuda_graph: bool = False) -> DecodeResult:
    cfg = DecodeConfig(method=method, block_size=BLOCK_SIZE, gamma=gamma or 0.0, max_new_tokens=max_new_tokens)
    return generate(model, prompts, cfg, eos_id=eos_id, pad_id=pad_id, batch_size=batch_size, ops=ops,
                    cuda_graph=cuda_graph)


def timed_decode(model: SbdModel, prompts: list[list[int]], method: str, gamma: float | None,
                 max_new_tokens: int, batch_size: int, ops: DecodeOps, max_runs: int, eos_id: int = TOKENIZER.EOS,
                 pad_id: int = TOKENIZER.PAD, *, cuda_graph: bool = False) -> DecodeResult:
    """The run of median wall time among identical decodes (greedy: same tokens every time), repeated
    until TIMING_MIN_S of decoding or max_runs runs. A 0.3 s SBD run on this shared 2-core machine is
    easily doubled by a neighbour's burst; a 15 s NTP run averages such bursts out and is timed once.
    The median, not the fastest, so that short runs are not favoured over long ones. RuntimeError when a
    sequence stopped early on invalid logits (`DecodeResult.require_complete`): no table row from such a run.
    cuda_graph: each decode replays its steps from CUDA graphs, its captures timed with it."""
    runs = [decode(model, prompts, method, gamma, max_new_tokens, batch_size, ops, eos_id, pad_id,
                   cuda_graph=cuda_graph)]
    runs[0].require_complete(f"{method} decode (gamma {gamma})")
    while sum(r.wall_s for r in runs) < TIMING_MIN_S and len(runs) < max_runs:
        runs.append(decode(model, prompts, method, gamma, max_new_tokens, batch_size, ops, eos_id, pad_id,
                           cuda_graph=cuda_graph))
    return sorted(runs, key=lambda r: r.wall_s)[len(runs) // 2]


def accuracy(result: DecodeResult, answers: list[list[int]]) -> float:
    hits = [exact_match(pred, ref) for pred, ref in zip(result.answers, answers)]
    return sum(hits) / len(hits)


def synthetic_task_data(task: str, num_prompts: int) -> TaskData:
    """The held-out prompts of `add` / `rot13`, scored by exact match of the answer."""
    examples = make_examples(task, "held_out", num_prompts)
    answers = [TOKENIZER.encode_answer(ex.answer) for ex in examples]
    return TaskData([TOKENIZER.encode_prompt(ex.prompt) for ex in examples], answers, get_task(task).answer_tokens,
                    TOKENIZER.EOS, TOKENIZER.PAD, lambda result: (accuracy(result, answers), None))


def code_task_data(num_prompts: int) -> TaskData:
    """The held-out one-line completions of the code task, scored as CodeXGLUE does (exact match of the
    whitespace-separated tokens, edit similarity); the newline ends an answer."""
    from sbd_kernels import code_completion

    examples = code_completion.line_examples("held_out", num_prompts, lines=1)

    def score(result: DecodeResult) -> tuple[float, float]:
        scores = code_completion.score(result.tokens, examples, lines=1)
        return scores.exact_match, scores.edit_similarity

    tokenizer = code_completion.ByteTokenizer
    return TaskData([ex.prompt for ex in examples], [tokenizer.encode(ex.target + "\n") for ex in examples],
                    code_completion.BUDGET[1], tokenizer.NEWLINE, tokenizer.PAD, score)


def code_task_header(num_prompts: int) -> str:
    """One line naming the code task's data: package, prompt count, sha256 of the corpus and of each split."""
    from sbd_kernels import code_completion

    digests = code_completion.corpus().sha256
    return (f"task {CODE_TASK}: {num_prompts} held-out one-line completions of {code_completion.PACKAGE} "
            f"{code_completion.VERSION} (exact match of tokens, edit similarity as CodeXGLUE); sha256 corpus "
            f"{digests['corpus'][:16]}, train {digests['train'][:16]}, held-out {digests['held_out'][:16]}")


def measure_rows(models: dict[str, SbdModel], data: TaskData, batch_size: int, gammas: tuple[float, ...],
                 ops: DecodeOps, max_runs: int = 5, *, cuda_graph: bool = False) -> list[Row]:
    """Every row of one task's table, speedups against NTP of the same model (every decode with CUDA-graph
    replays when `cuda_graph`)."""
    runs = [("sbd", "ntp", None), *(("sbd", "sbd", g) for g in gammas), ("ntp_only", "ntp", None)]
    ids = {"eos_id": data.eos_id, "pad_id": data.pad_id}
    for model in models.values():                 # warm-up: first-call costs stay out of the timings
        for method in ("ntp", "sbd"):
            decode(model, data.prompts[:1], method, 0.1, data.budget, batch_size, ops, **ids, cuda_graph=cuda_graph)
    rows, baseline = [], {}
    for name, method, gamma in runs:
        result = timed_decode(models[name], data.prompts, method, gamma, data.budget, batch_size, ops, max_runs,
                              **ids, cuda_graph=cuda_graph)
        hit_rate, similarity = data.score(result)
        row = Row(name, method, gamma, hit_rate, result.total_nfe, result.total_generated,
                  tokens_per_s=result.tokens_per_s, block_size=BLOCK_SIZE if method == "sbd" else None,
                  rule="eb" if method == "sbd" else None, edit_similarity=similarity)
        ref = baseline.setdefault(name, row)
        row.nfe_speedup = (ref.nfe / ref.answer_tokens) / (row.nfe / row.answer_tokens)
        row.wall_speedup = row.tokens_per_s / ref.tokens_per_s
        rows.append(row)
    return rows


def measure_task(models: dict[str, SbdModel], task: str, num_prompts: int, batch_size: int,
                 gammas: tuple[float, ...], ops: DecodeOps, max_runs: int = 5, *,
                 cuda_graph: bool = False) -> list[Row]:
    """Every row of one task's table (`add`, `rot13` or `code`), speedups against NTP of the same model."""
    data = code_task_data(num_prompts) if task == CODE_TASK else synthetic_task_data(task, num_prompts)
    return measure_rows(models, data, batch_size, gammas, ops, max_runs, cuda_graph=cuda_graph)


def exact_kv_check(model: SbdModel, task: str, num_prompts: int, ops: DecodeOps) -> tuple[bool, str]:
    """(passed, one-line summary) of `sbd_kernels.checks.exact_kv_check` on the task's held-out prompts, with
    their reference answers as the committed blocks, SBD at gamma 0.1."""
    data = code_task_data(num_prompts) if task == CODE_TASK else synthetic_task_data(task, num_prompts)
    report = checks.exact_kv_check(model, data.prompts, data.answers, BLOCK_SIZE, eos_id=data.eos_id,
                                   pad_id=data.pad_id, max_new_tokens=data.budget, gamma=0.1, ops=ops)
    return report.passed, report.summary(f"{task}, {num_prompts} prompts")


# ----------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------
def format_table(task: str, rows: list[Row]) -> str:
    """The task's table; an "edit sim" column after accuracy when the task scores edit similarity (code)."""
    similarity = any(r.edit_similarity is not None for r in rows)
    head = (f"{'model':<9} {'method':<6} {'gamma':>5} {'accuracy':>8} " + (f"{'edit sim':>8} " if similarity else "")
            + f"{'NFE/token':>9} {'NFE speedup':>11} {'tokens/s':>9} {'wall speedup':>12}")
    lines = [f"task {task}", head, "-" * len(head)]
    for r in rows:
        gamma = "-" if r.gamma is None else f"{r.gamma:.2f}"
        edit = (f"{r.edit_similarity:>8.1f} " if r.edit_similarity is not None else f"{'-':>8} ") if similarity else ""
        lines.append(f"{r.model:<9} {r.method:<6} {gamma:>5} {100 * r.accuracy:>7.1f}% {edit}"
                     f"{r.nfe / r.answer_tokens:>9.3f} {r.nfe_speedup:>10.2f}x {r.tokens_per_s:>9.1f} "
                     f"{r.wall_speedup:>11.2f}x")
    return "\n".join(lines)


def write_plot(results: list[dict], path: str) -> None:
    """Accuracy against NFE speedup per task: the SBD model's NTP point and SBD gamma sweep, and the
    NTP-only baseline's accuracy as a dashed line (the paper's Figure 1 in small)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, res in zip(axes[0], results):
        sbd = [r for r in res["rows"] if r["model"] == "sbd" and r["method"] == "sbd"]
        ntp = next(r for r in res["rows"] if r["model"] == "sbd" and r["method"] == "ntp")
        base = next(r for r in res["rows"] if r["model"] == "ntp_only")
        ax.plot([r["nfe_speedup"] for r in sbd], [100 * r["accuracy"] for r in sbd], "o-", label="SBD model, SBD")
        labels: dict[tuple[float, float], list[str]] = {}     # gammas that land on the same point share one label
        for r in sbd:
            labels.setdefault((r["nfe_speedup"], 100 * r["accuracy"]), []).append(f"{r['gamma']:g}")
        for point, gammas in labels.items():
            ax.annotate("γ=" + ", ".join(gammas), point, fontsize=8, textcoords="offset points", xytext=(0, -14),
                        ha="center")
        ax.plot([1.0], [100 * ntp["accuracy"]], "s", label="SBD model, NTP")
        ax.axhline(100 * base["accuracy"], ls="--", c="gray", label="NTP-only model, NTP")
        ax.set(title=res["task"], xlabel="NFE speedup over NTP (x)", ylabel="exact match (%)", ylim=(-2, 105))
        ax.margins(x=0.15)
        ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------
PLOT_FORMATS = (".png", ".pdf", ".svg")


def _plot_file(text: str) -> str:
    if os.path.splitext(text)[1].lower() not in PLOT_FORMATS:
        raise argparse.ArgumentTypeError(f"expected a file name ending in {', '.join(PLOT_FORMATS)}, got {text!r}")
    return argtypes.output_file(text)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--quick", action="store_true",
                        help=f"random `tiny` models, 4 prompts per task ({CODE_TASK}: 2): a seconds-long pipeline "
                        "check")
    parser.add_argument("--preset", choices=DEMO_PRESETS, default=None, help="random models of this preset "
                        "instead of the bundled checkpoints (e.g. tiny; implied `tiny` by --quick)")
    parser.add_argument("--tasks", type=argtypes.choice_list(TASKS), default=None,
                        help=f"comma-separated task names (default: all, {CODE_TASK} only where the pinned "
                        "transformers is installed)")
    add_option(parser, "--num-prompts", type=argtypes.positive_int, default=None,
               help=f"held-out prompts per task (default 100, {CODE_TASK}: {CODE_PROMPTS}; with --quick or "
               f"--preset 4, {CODE_TASK}: 2)")
    add_option(parser, "--batch-size", type=argtypes.positive_int, default=1,
               help="prompts decoded together (default 1)")
    parser.add_argument("--gammas", type=argtypes.non_negative_float_list, default=",".join(str(g) for g in GAMMAS),
                        help="comma-separated SBD gamma values")
    add_option(parser, "--timing-runs", type=argtypes.positive_int, default=None,
               help=f"at most this many identical decodes per table row, fewer once they add up to {TIMING_MIN_S:g} "
               "s of decoding; the row reports the run of median wall time (default 5; 1 with --quick or --preset)")
    add_option(parser, "--kv-prompts", type=argtypes.positive_int, default=3, help="prompts of the exact-KV check")
    parser.add_argument("--ops", choices=("fused", "naive"), default="fused",
                        help="decode with the fused torch.ops.sbd kernels or their pure-PyTorch oracles")
    # One thread: a batch-1 decode of the 0.8M-parameter model is a chain of small ops (1-80 rows x 128),
    # which a second thread only slows down: NTP measured 166 tokens/s with 1 thread, 35 with 2, on this
    # 2-core machine shared with other jobs.
    parser.add_argument("--threads", type=argtypes.positive_int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--device", type=argtypes.device, default="cpu",
                        help="cpu (C++ kernels) or cuda (Triton kernels)")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="replay the decode steps from CUDA graphs (--device cuda, --ops fused): a decode pass "
                        "of these small models is otherwise bound by the host's kernel launches on a GPU")
    parser.add_argument("--json", type=argtypes.output_file, default=None, help="write the results to this JSON file")
    parser.add_argument("--plot", type=_plot_file, default=None,
                        help=f"write accuracy vs NFE speedup to this image ({', '.join(PLOT_FORMATS)})")
    return parser


def main(args: argparse.Namespace) -> list[dict]:
    usage_problem = argtypes.cuda_graph_problem(args)
    if usage_problem:
        raise argtypes.UsageError(usage_problem)
    argtypes.require_device(args.device)
    tasks = selected_tasks(args.tasks)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise RuntimeError("--plot needs matplotlib (pip install matplotlib)")
    torch.set_num_threads(args.threads)
    preset = args.preset or ("tiny" if args.quick else None)
    num_prompts = args.num_prompts or (4 if preset else 100)
    gammas = tuple(args.gammas)
    ops = fused_ops() if args.ops == "fused" else naive_ops()
    start = time.perf_counter()
    models = random_models(preset) if preset else bundled_models(args.threads)
    models = {name: model.to(args.device) for name, model in models.items()}
    source = f"random {preset} models" if preset else f"checkpoints in {CHECKPOINT_DIR}"
    replays = "; decode steps replayed from CUDA graphs" if args.cuda_graph else ""
    print(f"sbd demo: {source}; block size {BLOCK_SIZE}; batch {args.batch_size}; {num_prompts} held-out "
          f"prompts per task; {args.ops} ops on {args.device}{replays}; {torch.get_num_threads()} threads; "
          f"torch {torch.__version__}\n")
    results = []
    for task in tasks:
        task_models, task_prompts = models, num_prompts
        if task == CODE_TASK:
            task_models = {name: model.to(args.device) for name, model in code_models(preset).items()}
            task_prompts = args.num_prompts or (2 if preset else CODE_PROMPTS)
            print(code_task_header(task_prompts))
        rows = measure_task(task_models, task, task_prompts, args.batch_size, gammas, ops,
                            args.timing_runs or (1 if preset else 5), cuda_graph=args.cuda_graph)
        passed, summary = exact_kv_check(task_models["sbd"], task, min(args.kv_prompts, task_prompts), ops)
        print(format_table(task, rows))
        print(summary + "\n", flush=True)
        results.append({"task": task, "rows": [dataclasses.asdict(r) for r in rows], "exact_kv_check": passed})
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {os.path.abspath(args.json)}")
    if args.plot:
        write_plot(results, args.plot)
        print(f"wrote {os.path.abspath(args.plot)}")
    print(f"total time {time.perf_counter() - start:.1f} s")
    return results
