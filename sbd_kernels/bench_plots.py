"""PNG plots of the benchmark report (matplotlib, headless).

    python -m sbd_kernels.bench_plots bench/results [--demo-json demo.json]

Input: the `results` of the report.json that `sbd bench` writes ({family: [row, ...]}, each row with its
grid record under "shape", the provider, median_ms and gflops) and, for the two SBD plots, `sbd demo
--json` output. Axes and legends come from the records' fields and generated labels
(`sbd_kernels.benchmark_grid`). Each plot function takes the parsed results and writes one PNG, or returns
None and prints why when its input is missing:

- sampling_latency.png: entropy_sample latency vs vocabulary size, one line per provider and (B, K, dtype);
- attention_gflops.png: block attention GFLOP/s vs cache length, one line per provider and shape;
- decode_tokens_per_s.png: tokens/s vs batch for NTP and SBD, from the measured forward times of the decode
  benchmark: NTP = B / time(1); SBD = B k / (time(2k) + (l - 1) time(k)) with l the mean passes per block of
  each SBD setting of the demo (docs/algorithm.md §4);
- accuracy_vs_nfe.png: accuracy vs NFE speedup per task (`sbd_kernels.demo.write_plot`).
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from sbd_kernels.benchmark_grid import Shape, shape_from_dict
from sbd_kernels.roofline import NfeStat, nfe_stats_from_demo


def row_shapes(rows: list[dict], family: str) -> list[tuple[dict, Shape]]:
    """(row, its grid record) for the rows of `family` that carry one."""
    return [(r, shape_from_dict(family, r["shape"])) for r in rows if "shape" in r]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _skip(name: str, why: str) -> None:
    print(f"plots: {name} skipped: {why}")


def _series(rows: list[dict], family: str, x_field: str, value: str) -> dict[str, list]:
    """{label: [(x, value), ...] sorted by x}: one series per provider and record less its `x_field`."""
    series: dict[str, list] = defaultdict(list)
    for r, shape in row_shapes(rows, family):
        if r.get(value) is not None:
            series[f"{r['provider']} {shape.label_without(x_field)}"].append((getattr(shape, x_field), r[value]))
    return {label: sorted(points) for label, points in series.items()}


def _line_plot(series: dict[str, list], path: Path, title: str, xlabel: str, ylabel: str,
               logy: bool = False) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in series.items():
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=label)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel, xscale="log")
    if logy:
        ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_sampling_latency(families: dict[str, list[dict]], path: Path) -> Path | None:
    rows = families.get("sampling")
    if not rows:
        return _skip(path.name, "no sampling results")
    series = _series(rows, "sampling", "vocab", "median_ms")
    if not series:
        return _skip(path.name, "no sampling row with its grid record")
    return _line_plot(series, path, "entropy_sample latency vs vocabulary size", "vocabulary size V",
                      "median latency (ms)", logy=True)


def plot_attention_gflops(families: dict[str, list[dict]], path: Path) -> Path | None:
    rows = families.get("attention")
    if not rows:
        return _skip(path.name, "no attention results")
    series = _series(rows, "attention", "length", "gflops")
    if not series:
        return _skip(path.name, "no attention row with its grid record and GFLOP/s")
    return _line_plot(series, path, "block attention throughput vs cache length", "cache length L",
                      "GFLOP/s")


def decode_times(rows: list[dict]) -> dict[tuple[str, int], dict[int, dict[int, float]]]:
    """{(model and dtype, cache length): {batch: {tokens: median seconds}}} from the decode family's rows."""
    times: dict = defaultdict(lambda: defaultdict(dict))
    for r, shape in row_shapes(rows, "decode"):
        model = shape.label_without("batch", "kv_len", "k")
        times[model, shape.kv_len][shape.batch][shape.tokens] = r["median_ms"] / 1e3
    return times


def tokens_per_s(per_tokens: dict[int, float], batch: int, k: int, stat: NfeStat | None) -> float | None:
    """NTP (stat None): B / time(1); SBD: B k / (time(2k) + (l - 1) time(k)); None if a width is missing."""
    if stat is None:
        return batch / per_tokens[1] if 1 in per_tokens else None
    if k not in per_tokens or 2 * k not in per_tokens:
        return None
    return batch * k / (per_tokens[2 * k] + (stat.passes_per_block - 1) * per_tokens[k])


def _stat_name(stat: NfeStat | None) -> str:
    if stat is None:
        return "NTP"
    task = stat.label.removeprefix("measured: ").split(",")[0]
    return f"SBD {task} (l={stat.passes_per_block:.2f} passes/block)"


def plot_decode_tokens_per_s(families: dict[str, list[dict]], demo: list[dict] | None, path: Path,
                             k: int = 16) -> Path | None:
    """One panel per (config, cache length): NTP and each measured SBD setting, tokens/s against batch."""
    rows = families.get("decode")
    if not rows:
        return _skip(path.name, "no decode results")
    if not demo:
        return _skip(path.name, "no `sbd demo --json` results for the passes per block")
    stats: list[NfeStat | None] = [None, *nfe_stats_from_demo(demo, k)]
    panels = {}
    for (words, kv_len), by_batch in sorted(decode_times(rows).items()):
        series = {}
        for stat in stats:
            points = [(b, tokens_per_s(by_batch[b], b, k, stat)) for b in sorted(by_batch)]
            if all(p[1] is not None for p in points):
                series[_stat_name(stat)] = points
        if len(series) == len(stats):
            panels[f"{words} L={kv_len}"] = series
    if not panels:
        return _skip(path.name, "decode results lack the 1, k, 2k widths")
    plt = _pyplot()
    cols = min(3, len(panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.5 * cols, 3.6 * nrows), squeeze=False)
    for ax, (title, series) in zip(axes.flat, panels.items()):
        for label, points in series.items():
            ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=label)
        ax.set(title=title, xlabel="batch", ylabel="tokens/s", xscale="log", yscale="log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle("decode tokens/s from measured forward times: NTP B/time(1), SBD Bk/(time(2k)+(l-1)time(k))",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_accuracy_vs_nfe(demo: list[dict] | None, path: Path) -> Path | None:
    if not demo:
        return _skip(path.name, "no `sbd demo --json` results")
    from sbd_kernels.demo import write_plot

    write_plot(demo, str(path))
    return path


def write_plots(results_dir: Path, families: dict[str, list[dict]] | None = None,
                demo_json: Path | None = None) -> list[Path]:
    """Every plot whose input exists, as PNGs in results_dir. families default to results_dir/report.json's
    results; demo_json to results_dir/demo.json when it exists."""
    results_dir = Path(results_dir)
    if families is None:
        report = results_dir / "report.json"
        families = json.loads(report.read_text())["results"] if report.exists() else {}
    demo_json = demo_json or results_dir / "demo.json"
    demo = json.loads(Path(demo_json).read_text()) if Path(demo_json).exists() else None
    written = [
        plot_sampling_latency(families, results_dir / "sampling_latency.png"),
        plot_attention_gflops(families, results_dir / "attention_gflops.png"),
        plot_decode_tokens_per_s(families, demo, results_dir / "decode_tokens_per_s.png"),
        plot_accuracy_vs_nfe(demo, results_dir / "accuracy_vs_nfe.png"),
    ]
    return [p for p in written if p is not None]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results_dir", type=Path, help="folder with the report.json of `sbd bench`")
    parser.add_argument("--demo-json", type=Path,
                        help="`sbd demo --json` output (default results_dir/demo.json)")
    args = parser.parse_args(argv)
    for path in write_plots(args.results_dir, demo_json=args.demo_json):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
