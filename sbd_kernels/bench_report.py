"""`sbd bench`: run the benchmark files and write one report: Markdown tables + JSON + CSV + plots, headed by
the machine.

    sbd bench                                     # every bench_*.py of the benchmark folder
    sbd bench --only sampling -k "128256"         # one family, a subset of cases (pytest -k on the ids)
    sbd bench --from-json bench/results/raw.json  # rebuild the report without re-timing
    sbd bench --bench-dir ~/src/sbd_kernels/bench # from outside the checkout

The benchmark files (`bench/bench_<family>.py`, pytest-benchmark modules) are part of the source
repository, not of the installed package: `sbd bench` runs those of `--bench-dir` (the `bench` folder of
a checkout), by default `./bench`, and otherwise stops with one line saying so; a pip-installed package
runs them from a clone of the repository, `sbd bench --bench-dir CLONE/bench`. What the report needs at
run time is in the package: the grid records (`sbd_kernels.benchmark_grid`), the ceilings and header
(`sbd_kernels.machine`), the plots (`sbd_kernels.bench_plots`).

For each case the table lists every provider with its median time and p20-p80 spread, achieved GB/s and
its fraction of the measured copy bandwidth (ops that stream memory), achieved GFLOP/s and its fraction of
the measured matmul peak (ops with flops), and the speedup against the case's baseline provider measured in
the same run. On a GPU (the bench files run on CUDA wherever torch sees one) the tables also give each
call's time replayed from a CUDA graph, and achieved TB/s and TFLOP/s are taken from that time (from the
median, marked so, for a row without one) and set against the GPU's datasheet (`datasheet_ceilings`;
`sbd_kernels.roofline.HARDWARE`). A CPU result is set against the ceilings measured at the thread count it
ran with (the decode and HF benchmarks run at 1 thread).
A provider that failed its oracle check on the benchmark inputs gets no speedup, nor does any provider of a
case whose baseline failed it: the cell says so instead. After the tables: the roofline model's prediction
against the measured decode forwards (`sbd_kernels.roofline`), the GPU static report of every Triton kernel
configuration (`sbd_kernels.aot`: registers, spills, shared memory, occupancy on sm_80 / sm_90), and the
plots.

The header (machine, GPU, versions, commit, date, ceilings) is the one the bench run stored in its JSON
(machine_info[HEADER_KEY], written by bench/conftest.py), also with --from-json: a report rebuilt elsewhere
keeps the machine that took the timings. A JSON written before runs stored it gives what pytest-benchmark
recorded (CPU, cores, python, commit, date) and says "not stored" for the rest, with no ceilings.
"""
from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import subprocess
import sys
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

from sbd_kernels import argtypes
from sbd_kernels.argtypes import add_option
from sbd_kernels.bench_plots import write_plots
from sbd_kernels.benchmark_grid import GRIDS, shape_from_dict
from sbd_kernels.machine import PEAK_DTYPE_FOR, gpu_load_text
from sbd_kernels.roofline import HARDWARE, read_json

COLUMNS = ["case", "provider", "threads", "median_ms", "p20_ms", "p80_ms", "graph_ms", "rate_from", "gbs", "pct_copy",
           "gflops", "pct_peak", "speedup", "graph_speedup", "oracle", "withheld"]
# machine_info[HEADER_KEY] of a bench run's pytest-benchmark JSON: `machine_header` of the machine that ran it,
# with "ceilings_by_threads" (bench/conftest.py).
HEADER_KEY = "sbd"
NOT_STORED = "not stored"


def datasheet_key(gpu_name: str) -> str | None:
    """The `roofline.HARDWARE` entry of a GPU by its NVML / torch name ("NVIDIA H100 80GB HBM3" is the H100
    SXM5, "NVIDIA H200" the H200 SXM, "NVIDIA A100-SXM4-80GB"), or None: the PCIe and NVL cards, GH200 and
    the 40 GB A100 have other datasheet numbers than the SXM columns listed there."""
    name = gpu_name.upper()
    if any(other in name for other in ("GH200", "NVL", "PCIE")):
        return None
    if "H200" in name:
        return "h200"
    if "H100" in name and ("HBM3" in name or "SXM" in name):
        return "h100"
    if "A100" in name and "SXM4" in name and "80GB" in name:
        return "a100"
    return None


def datasheet_ceilings(gpu_name: str) -> dict | None:
    """The datasheet ceilings of a GPU in `machine_ceilings()` units: {"copy_gbs": memory bandwidth in GB/s,
    "matmul_gflops": {"fp32", "fp16", "bf16"} dense GFLOP/s, "source": the datasheet}; None without an entry
    (`datasheet_key`). fp32 is the rate without tensor cores: kernels using TF32 tensor cores can exceed it."""
    key = datasheet_key(gpu_name)
    if key is None:
        return None
    hw = HARDWARE[key]
    return {"copy_gbs": hw.bandwidth / 1e9,
            "matmul_gflops": {dtype: hw.matmul_flops[dtype] / 1e9 for dtype in ("fp32", "fp16", "bf16")},
            "source": f"datasheet of the {hw.name}: {hw.source}"}


def report_ceilings(header: dict, raw: dict) -> dict:
    """The ceilings the results are set against: the CPU's measured ones, at torch's default thread count
    ("threads") and at every thread count a CPU timing ran with ("by_threads", see `row_ceilings`), or when
    any result ran on CUDA the datasheet of the run's GPU (copy_gbs None and no matmul peaks for a GPU
    without a datasheet entry, or one the JSON does not name)."""
    on_gpu = any(b.get("extra_info", {}).get("device") == "cuda" for b in raw.get("benchmarks", []))
    if not on_gpu:
        return {"copy_gbs": header["copy_gbs"], "matmul_gflops": header["matmul_gflops"], "source": "measured",
                "threads": header["torch_threads"], "by_threads": header.get("ceilings_by_threads", {})}
    if header["gpu"] == NOT_STORED:
        return {"copy_gbs": None, "matmul_gflops": {}, "source": "the GPU of the run is not stored in its JSON"}
    name = (header["gpu"] or {}).get("name", "")
    return datasheet_ceilings(name) or {"copy_gbs": None, "matmul_gflops": {},
                                        "source": f"no datasheet entry for {name or 'this GPU'}"}


def row_ceilings(info: dict, ceilings: dict) -> dict:
    """The ceilings one timing (its extra_info `info`) is set against: those stored with it (the decode
    bench's extra_info["decode"]["ceilings"]: the CPU's measured at its thread count, or the GPU's
    datasheet); else on a GPU the report's `ceilings`; else the CPU's measured at the timing's thread count
    (`info["threads"]`, ceilings["by_threads"]), {} where none were: no fraction rather than one against
    another thread count's ceilings (the 1-thread decode forwards reached 97% of the 1-thread bf16 peak, 49%
    of the 2-thread one). A timing without a thread count (runs before it was recorded) gets the report's."""
    stored = (info.get("decode") or {}).get("ceilings")
    if stored:
        return stored
    threads = info.get("threads")
    if ceilings.get("source") != "measured" or threads is None or threads == ceilings.get("threads"):
        return ceilings
    return ceilings.get("by_threads", {}).get(str(threads), {})


def stored_header(raw: dict) -> dict:
    """The header the bench run stored in its JSON (machine_info[HEADER_KEY]); for a JSON without it, the
    fields pytest-benchmark stores in every JSON (CPU model, cores, python, commit, date of the run) and
    NOT_STORED for the rest (torch threads, CPU kernels, GPU, torch and triton versions), no ceilings."""
    machine = raw.get("machine_info") or {}
    if HEADER_KEY in machine:
        return {**machine[HEADER_KEY], "stored": True}
    cpu, commit = machine.get("cpu") or {}, raw.get("commit_info") or {}
    commit_id = commit.get("id")
    date = raw.get("datetime")
    return {
        "cpu": cpu.get("brand_raw", NOT_STORED), "cores": cpu.get("count", NOT_STORED),
        "torch_threads": NOT_STORED, "cpu_isa": NOT_STORED, "gpu": NOT_STORED, "torch": NOT_STORED,
        "triton": NOT_STORED, "python": machine.get("python_version", NOT_STORED),
        "commit": f"{commit_id[:7]}{'+dirty' if commit.get('dirty') else ''}" if commit_id else NOT_STORED,
        "date": (datetime.fromisoformat(date).astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M UTC") if date
                 else NOT_STORED),
        "copy_gbs": None, "matmul_gflops": {}, "stored": False,
    }


def find_bench_dir(given: Path | None) -> Path:
    """The folder of the benchmark files: `given`, else ./bench. Exits with one line when it holds no
    bench_*.py files."""
    folder = given if given is not None else Path("bench")
    if not any(folder.glob("bench_*.py")):
        raise SystemExit(f"sbd bench: no benchmark files (bench_*.py) in {folder.resolve()}; they are in the "
                         "source repository, not the installed package: run `sbd bench` at the root of a checkout "
                         "or pass --bench-dir CHECKOUT/bench")
    return folder.resolve()


# SBD_BENCH_PARTIAL=path: the bench run appends each finished timing there at once, one pytest-benchmark JSON
# entry per line (bench/conftest.py), so that a run killed before pytest-benchmark writes its JSON at the end
# keeps them (read_raw).
PARTIAL_VARIABLE = "SBD_BENCH_PARTIAL"


def partial_path(raw_json: Path) -> Path:
    """Where the timings of the run writing `raw_json` are appended as they finish (PARTIAL_VARIABLE)."""
    return raw_json.with_suffix(".partial.jsonl")


def read_raw(raw_json: Path) -> list[dict]:
    """The timings of a pytest-benchmark JSON; when it is missing or unreadable (a run killed before writing
    it, or while), those appended to its partial_path as they finished; none when neither is there."""
    try:
        return json.loads(raw_json.read_text()).get("benchmarks", [])
    except (OSError, ValueError):
        pass
    try:
        lines = partial_path(raw_json).read_text().splitlines()
    except OSError:
        return []
    timings = []
    for line in lines:
        try:
            timings.append(json.loads(line))
        except ValueError:  # the last line, cut short by the kill
            continue
    return timings


def benchmark_command(python: str, files: list[str], raw_json: Path,
                      pytest_args: tuple[str, ...] = ()) -> list[str]:
    """The pytest-benchmark command line that times `files` with `python` and writes the raw timings to
    `raw_json` (the one command of `sbd bench` and of `sbd gpu-check`'s bench stages). pytest_args go before
    the benchmark options (e.g. "-rs", or "-k", expression)."""
    return [python, "-m", "pytest", *files, "-q", *pytest_args, "-p", "no:cacheprovider",
            f"--benchmark-json={raw_json}", "--benchmark-save-data", "--benchmark-disable-gc",
            "--benchmark-columns=median,iqr,rounds"]


def run_benchmarks(bench_dir: Path, raw_json: Path, only: list[str], keyword: str | None,
                   rounds: int | None) -> int:
    """Run the bench files with pytest-benchmark in a child process; raw timings go to `raw_json`."""
    if importlib.util.find_spec("pytest_benchmark") is None:
        raise SystemExit("sbd bench: pytest-benchmark is not installed (pip install '.[bench]' in the checkout)")
    files = sorted(str(p) for p in bench_dir.glob("bench_*.py")
                   if not only or p.stem.removeprefix("bench_") in only)
    if not files:
        raise SystemExit(f"sbd bench: no benchmark files in {bench_dir} match --only {','.join(only)}")
    cmd = benchmark_command(sys.executable, files, raw_json, ("-k", keyword) if keyword else ())
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if rounds:
        env["SBD_BENCH_ROUNDS"] = str(rounds)
    return subprocess.run(cmd, check=False, cwd=bench_dir.parent, env=env).returncode


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile of already sorted values, q in [0, 1]."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def rows_from_raw(raw: dict, ceilings: dict) -> dict[str, list[dict]]:
    """One row per (family, case, provider), grouped by family, with ratios against the row of its baseline
    provider in the same case (most rows share the case's baseline; sampling's "sbd plain" is timed against
    "sbd").

    Achieved GB/s and GFLOP/s come from the CUDA-graph time where the harness measured one (GPU time alone),
    else from the median ("rate_from" says which), set against the timing's own ceilings (`row_ceilings`); the
    matmul peak is that of the record's dtype, or of PEAK_DTYPE_FOR's stand-in when the ceilings have none
    (fp16 on a CPU); a missing ceiling leaves its fraction empty. No ratio for a row that failed its oracle
    check, nor for a row whose baseline failed it: "withheld" says why."""
    by_case: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for bench in raw["benchmarks"]:
        info = bench.get("extra_info", {})
        if "family" in info:
            row = timing_row(bench, row_ceilings(info, ceilings))
            by_case[(row["family"], row["case"])].append(row)

    families: dict[str, list[dict]] = defaultdict(list)
    for (family, _case), rows in by_case.items():
        by_provider = {r["provider"]: r for r in rows}
        for row in rows:
            set_ratios(row, by_provider.get(row["baseline"]))
        families[family].extend(sorted(rows, key=lambda r: r["provider"] != "sbd"))
    return families


def timing_row(bench: dict, ceilings: dict) -> dict:
    """The report row of one pytest-benchmark entry, its achieved GB/s and GFLOP/s set against `ceilings`."""
    info = bench["extra_info"]
    times = sorted(bench["stats"].get("data") or [bench["stats"]["median"]])
    median = bench["stats"]["median"]
    shape = shape_from_dict(info["family"], info["shape"])
    graph_ms = info.get("graph_ms")
    row = {
        "family": info["family"], "case": shape.label, "shape": info["shape"], "provider": info["provider"],
        "baseline": info["baseline"], "threads": info.get("threads"), "median_ms": median * 1e3,
        "p20_ms": percentile(times, 0.2) * 1e3, "p80_ms": percentile(times, 0.8) * 1e3, "graph_ms": graph_ms,
        "rate_from": "graph ms" if graph_ms else "median ms", "gbs": None, "pct_copy": None, "gflops": None,
        "pct_peak": None, "speedup": None, "graph_speedup": None,
        "oracle": {True: "pass", False: "FAIL", None: "-"}[info.get("correct")], "withheld": None,
    }
    seconds = graph_ms / 1e3 if graph_ms else median
    if info.get("bytes_moved"):
        row["gbs"] = info["bytes_moved"] / seconds / 1e9
        if ceilings.get("copy_gbs"):
            row["pct_copy"] = 100 * row["gbs"] / ceilings["copy_gbs"]
    if info.get("flops"):
        row["gflops"] = info["flops"] / seconds / 1e9
        peaks = ceilings.get("matmul_gflops") or {}
        peak = peaks.get(shape.dtype) or peaks.get(PEAK_DTYPE_FOR[shape.dtype])
        if peak:
            row["pct_peak"] = 100 * row["gflops"] / peak
    return row


def set_ratios(row: dict, base: dict | None) -> None:
    """speedup = base median / row median (and the same on CUDA-graph times), or "withheld" saying why
    there is none: the row's own oracle check failed, or its baseline's did (a ratio against a baseline
    that computed something else measures nothing)."""
    if row["oracle"] == "FAIL":
        row["withheld"] = "oracle check FAILED"
    elif base is not None and base["oracle"] == "FAIL":
        row["withheld"] = f"baseline {base['provider']} failed its oracle check"
    elif base is not None:
        row["speedup"] = base["median_ms"] / row["median_ms"]
        if base["graph_ms"] and row["graph_ms"]:
            row["graph_speedup"] = base["graph_ms"] / row["graph_ms"]


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(header: dict, families: dict[str, list[dict]], ceilings: dict | None = None) -> str:
    """The report: a header with the machine of the run and its ceilings, then one table per family. With
    GPU `ceilings` (`report_ceilings` of a CUDA run): the datasheet line, TB/s and TFLOP/s against it, and
    the CUDA-graph time and speedup of each row. Header fields the run's JSON did not store say so."""
    on_gpu = ceilings is not None and ceilings.get("source", "measured") != "measured"
    lines = [
        "# sbd_kernels benchmark report",
        "",
        (f"- machine: {header['cpu']}, {header['cores']} cores, torch threads {header['torch_threads']}, "
        f"CPU kernels {header['cpu_isa']}{features_text(header)}"),
        f"- GPU: {gpu_line(header['gpu'])}",
        *cpu_ceilings_lines(header),
    ]
    if header.get("gpu_load"):
        lines.append(f"- GPU while the benchmarks ran (NVML; clocks: medians of the busy samples): "
                     f"{gpu_load_text(header['gpu_load'])}")
    if on_gpu:
        lines.append(f"- GPU ceilings: {gpu_ceilings_line(ceilings)}")
    lines.append(f"- torch {header['torch']}, triton {header['triton']}, python {header['python']}, "
                 f"commit {header['commit']}, {header['date']}")
    if not header.get("stored", True):
        lines.append(f"- \"{NOT_STORED}\": the JSON of this run predates runs storing their header (machine, GPU, "
                     "versions, ceilings); CPU, cores, python, commit and date are pytest-benchmark's record of the "
                     "run, and nothing is taken from the machine that rebuilt this report")
    lines += [
        "",
        ("Times are medians with the p20-p80 spread; speedup = baseline median / provider median, same run. "
        "A provider whose outputs failed the oracle check on these inputs gets no speedup, nor does any "
        "provider of a case whose baseline failed it."),
    ]
    if not on_gpu:
        lines.append("Each row's % copy BW and % matmul peak are taken against the ceilings measured at the "
                     "torch thread count it ran with (threads column).")
    else:
        lines.append("On the GPU, median ms is one eager call (rounds of back-to-back calls, launch overhead "
                     "included); graph ms the same call replayed from a CUDA graph (GPU time alone, '-' where "
                     "the call cannot be captured or is not replayed: the oracle, whole decodes), which TB/s and "
                     "TFLOP/s are taken from. Where a row has no graph ms, its TB/s, TFLOP/s and their fractions "
                     "are taken from median ms, and marked (median).")
    for family, rows in families.items():
        lines += ["", f"## {family}", ""] + (_gpu_table(rows) if on_gpu else _cpu_table(rows))
    return "\n".join(lines) + "\n"


def features_text(header: dict) -> str:
    """", CPU features avx2 avx512f ..." (`machine.cpu_features`), or nothing for a run that stored none."""
    features = header.get("cpu_features")
    return f", CPU features {' '.join(features) or 'none listed'}" if isinstance(features, list) else ""


def gpu_line(gpu: dict | str | None) -> str:
    """The header's GPU: its NVML / torch fields, none, or not stored."""
    if gpu is None:
        return "none (CPU kernels timed; Triton kernels are not timed without an NVIDIA GPU)"
    if gpu == NOT_STORED:
        return f"{NOT_STORED} (no datasheet to set GPU results against)"
    return ", ".join(f"{k} {v}" for k, v in gpu.items())


def cpu_ceilings_lines(header: dict) -> list[str]:
    """The CPU ceilings measured by the run: at torch's default thread count, and at every other thread
    count a CPU result ran with (`header["ceilings_by_threads"]`)."""
    if header["copy_gbs"] is None:
        why = NOT_STORED if header.get("stored") is False else "not measured by a run on the GPU"
        return [f"- measured ceilings: {why} (CPU results get no % of copy bandwidth or matmul peak)"]

    def numbers(ceilings: dict) -> str:
        peaks = ", ".join(f"{k} {v:.0f}" for k, v in ceilings["matmul_gflops"].items())
        return f"copy bandwidth {ceilings['copy_gbs']:.1f} GB/s (read + write), torch.mm peak GFLOP/s: {peaks}"

    threads = header["torch_threads"]
    lines = [f"- measured ceilings: {numbers(header)} (torch threads {threads})"]
    lines += [f"- measured ceilings at {count} torch thread{'s' if count != '1' else ''}: {numbers(ceilings)}"
              for count, ceilings in header.get("ceilings_by_threads", {}).items() if count != str(threads)]
    return lines


def gpu_ceilings_line(ceilings: dict) -> str:
    """The datasheet numbers the GPU results are set against, in one line."""
    if not ceilings.get("copy_gbs"):
        return f"{ceilings['source']}: achieved TB/s and TFLOP/s without fractions"
    peaks = ceilings["matmul_gflops"]
    return (f"{ceilings['copy_gbs'] / 1e3:.2f} TB/s, dense TFLOP/s bf16 {peaks['bf16'] / 1e3:.0f}, fp16 "
            f"{peaks['fp16'] / 1e3:.0f}, fp32 {peaks['fp32'] / 1e3:.1f} (without tensor cores: 3xTF32 kernels "
            f"can exceed it); {ceilings['source']}")


def _speed(r: dict, key: str = "speedup") -> str:
    if r.get("withheld"):
        return r["withheld"]
    return f"{fmt(r[key], '.2f')}x vs {r['baseline']}" if r[key] else "-"


def _cpu_table(rows: list[dict]) -> list[str]:
    lines = [("| case | provider | threads | median ms | p20-p80 ms | GB/s | % copy BW | GFLOP/s | % matmul peak "
              "| speedup vs baseline | oracle |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['provider']} | {fmt(r.get('threads'), 'd')} | {r['median_ms']:.3f} "
            f"| {r['p20_ms']:.3f}-{r['p80_ms']:.3f} "
            f"| {fmt(r['gbs'], '.1f')} | {fmt(r['pct_copy'], '.0f')} | {fmt(r['gflops'], '.1f')} "
            f"| {fmt(r['pct_peak'], '.0f')} | {_speed(r)} | {r['oracle']} |"
        )
    return lines


def _gpu_table(rows: list[dict]) -> list[str]:
    lines = [("| case | provider | median ms | p20-p80 ms | graph ms | TB/s | % datasheet BW | TFLOP/s "
              "| % datasheet peak | speedup vs baseline | graph speedup | oracle |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tbs = None if r["gbs"] is None else r["gbs"] / 1e3
        tflops = None if r["gflops"] is None else r["gflops"] / 1e3
        rate = _median_marked(r)
        lines.append(
            f"| {r['case']} | {r['provider']} | {r['median_ms']:.3f} | {r['p20_ms']:.3f}-{r['p80_ms']:.3f} "
            f"| {fmt(r['graph_ms'], '.4f')} | {rate(tbs, '.3f')} | {rate(r['pct_copy'], '.0f')} "
            f"| {rate(tflops, '.2f')} | {rate(r['pct_peak'], '.0f')} | {_speed(r)} | {_speed(r, 'graph_speedup')} "
            f"| {r['oracle']} |"
        )
    return lines


def _median_marked(row: dict):
    """`fmt` for the rate cells of a GPU row: a value taken from the median (no CUDA-graph time) says so."""
    from_median = row.get("rate_from") == "median ms"

    def cell(value, spec: str) -> str:
        return f"{fmt(value, spec)} (median)" if from_median and value is not None else fmt(value, spec)
    return cell


def roofline_section(raw: dict) -> str:
    """Roofline prediction vs the measured decode forwards of this run ("" without decode results, or on a
    GPU without datasheet ceilings)."""
    from sbd_kernels.roofline import compare_markdown, compare_rows, measured_cases

    cases = [case for case in measured_cases(raw) if case.ceilings is not None]
    rows = compare_rows(cases)
    if not rows:
        return ""
    sources = sorted({case.ceilings["source"] for case in cases if "source" in case.ceilings})
    note = "".join(f"\nOn the GPU the ceilings are not measured but those of the {source}.\n" for source in sources)
    return f"\n## decode: roofline vs measurement\n{note}\n{compare_markdown(rows)}\n"


def gpu_static_section() -> tuple[str, int]:
    """The GPU compile check's table for every Triton kernel configuration, and its exit status; one line saying
    so, and status 0, where triton is not installed (the check compiles with it)."""
    if importlib.util.find_spec("triton") is None:
        return "\n## GPU static report\n\nSkipped: triton is not installed.\n", 0
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "sbd_kernels.aot"], check=False, env=env,
                          capture_output=True, text=True)
    body = (proc.stdout + proc.stderr).strip()
    return (("\n## GPU static report (compiled with no GPU present; not timed)\n\n"
            "Every Triton kernel configuration the launchers can pick, compiled to cubin: registers per "
            "thread, spilled bytes, shared memory per block, theoretical occupancy.\n\n"
            f"```\n{body}\n```\n"), proc.returncode)


def write_outputs(out_dir: Path, header: dict, families: dict[str, list[dict]], extra: str = "",
                  ceilings: dict | None = None) -> Path:
    """report.md (`markdown` + `extra`), report.json and report.csv under `out_dir`; returns report.md."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report = out_dir / "report.md"
    report.write_text(markdown(header, families, ceilings) + extra)
    (out_dir / "report.json").write_text(json.dumps({"machine": header, "ceilings": ceilings, "results": families},
                                                    indent=1))
    with open(out_dir / "report.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["family", *COLUMNS, "baseline"], extrasaction="ignore")
        writer.writeheader()
        for rows in families.values():
            writer.writerows(rows)
    return report


FAMILIES = sorted(GRIDS)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--only", type=argtypes.choice_list(FAMILIES), default=None,
                        help=f"comma-separated families among {', '.join(FAMILIES)} (default: all)")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression selecting cases")
    parser.add_argument("--rounds", type=argtypes.positive_int, help="timed rounds per provider and case (default 20)")
    add_option(parser, "--bench-dir", type=Path, help="folder of the benchmark files (default: ./bench)")
    parser.add_argument("--out", type=lambda text: Path(argtypes.output_dir(text)),
                        help="results folder (default: BENCH_DIR/results; with --from-json, its folder)")
    add_option(parser, "--from-json", type=lambda text: Path(argtypes.existing_file(text)),
               help="build the report from an earlier raw.json")
    add_option(parser, "--no-gpu-static", action="store_true", help="skip the GPU compile check section")
    return parser


def load_raw(raw_json: Path) -> dict:
    """The pytest-benchmark JSON at `raw_json`, checked to hold what the report reads (`raw_problem`); ValueError
    naming the file and the problem otherwise."""
    raw = read_json(raw_json)
    problem = raw_problem(raw)
    if problem:
        raise ValueError(f"{raw_json}: not a pytest-benchmark JSON of `sbd bench`: {problem}")
    return raw


# What the report reads: of a stored header (`machine.machine_header`), of every entry the harness tagged
# (`bench.harness.record`), and of the decode entries' extra_info["decode"] (`roofline.measured_cases`).
HEADER_FIELDS = ("cpu", "cores", "torch_threads", "cpu_isa", "gpu", "torch", "triton", "python", "commit", "date",
                 "copy_gbs", "matmul_gflops")
TAGGED_FIELDS = ("case", "shape", "provider", "baseline")
DECODE_FIELDS = ("config", "dtype", "batch", "kv_len", "k", "tokens")


def _kind(value: object) -> str:
    """"an object" for a JSON object, else "a list", "an int", ... by the Python type json.loads gave."""
    name = "object" if isinstance(value, dict) else type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _missing(where: str, value: object, fields: tuple[str, ...]) -> str | None:
    """"<where> is <kind>, expected an object" or "<where> has no '<field>'" for the first of `fields` that
    `value` lacks, or None."""
    if not isinstance(value, dict):
        return f"{where} is {_kind(value)}, expected an object"
    absent = next((name for name in fields if name not in value), None)
    return None if absent is None else f"{where} has no {absent!r}"


def raw_problem(raw: object) -> str | None:
    """The first thing the report would miss in a pytest-benchmark JSON, in words, or None: an object with a
    "benchmarks" list; a stored header (machine_info[HEADER_KEY]) with HEADER_FIELDS; each entry an object
    whose stats hold a number "median" and, when extra_info names a family, a valid `entry_problem`."""
    if not isinstance(raw, dict) or not isinstance(raw.get("benchmarks"), list):
        got = f"an object with keys {', '.join(raw)}" if isinstance(raw, dict) else _kind(raw)
        return f'expected an object with a "benchmarks" list, got {got}'
    machine = raw.get("machine_info") or {}
    if not isinstance(machine, dict):
        return f"machine_info is {_kind(machine)}, expected an object"
    if HEADER_KEY in machine:
        problem = _missing(f"machine_info.{HEADER_KEY}", machine[HEADER_KEY], HEADER_FIELDS)
        if problem:
            return problem
    for index, bench in enumerate(raw["benchmarks"]):
        problem = entry_problem(f"benchmarks[{index}]", bench)
        if problem:
            return problem
    return None


def entry_problem(where: str, bench: object) -> str | None:
    """What the report would miss in one pytest-benchmark entry, or None (`raw_problem`)."""
    if not isinstance(bench, dict):
        return f"{where} is {_kind(bench)}, expected an object"
    stats = bench.get("stats")
    if not isinstance(stats, dict) or not isinstance(stats.get("median"), (int, float)):
        return f"{where}.stats has no number 'median'"
    info = bench.get("extra_info", {})
    if not isinstance(info, dict):
        return f"{where}.extra_info is {_kind(info)}, expected an object"
    if "family" not in info:
        return None     # an entry the harness did not tag: not in the report
    if info["family"] not in GRIDS:
        return f"{where}.extra_info.family {info['family']!r} is none of {', '.join(FAMILIES)}"
    problem = _missing(f"{where}.extra_info", info, TAGGED_FIELDS)
    if problem:
        return problem
    try:
        shape_from_dict(info["family"], info["shape"])
    except (TypeError, ValueError) as err:
        return f"{where}.extra_info.shape is not a {info['family']} record ({err})"
    if info["family"] == "decode" and info.get("decode") is not None:
        return _missing(f"{where}.extra_info.decode", info["decode"], DECODE_FIELDS)
    return None


def fresh_raw(raw_json: Path, status: int) -> dict:
    """The JSON the benchmark run that exited with `status` just wrote (`run` removed any earlier one first);
    exits with one line when it wrote none, or one without timings (every case skipped or deselected)."""
    if not raw_json.exists():
        raise SystemExit(f"sbd bench: the benchmark run (pytest exit status {status}) wrote no results in "
                         f"{raw_json}; no report written")
    raw = load_raw(raw_json)
    if not raw.get("benchmarks"):
        raise SystemExit(f"sbd bench: the benchmark run (pytest exit status {status}) recorded no timings in "
                         f"{raw_json}; no report written")
    return raw


def run(args: argparse.Namespace) -> int:
    """Runs the selected benchmarks (or reads --from-json), writes the report; returns an exit status."""
    status = 0
    if args.from_json is None:
        bench_dir = find_bench_dir(args.bench_dir)
        out = args.out or bench_dir / "results"
        raw_json = out / "raw.json"
        out.mkdir(parents=True, exist_ok=True)
        raw_json.unlink(missing_ok=True)  # an earlier run's timings must never be reported as this run's
        only = args.only.split(",") if args.only else []
        status = run_benchmarks(bench_dir, raw_json, only, args.keyword, args.rounds)
        raw = fresh_raw(raw_json, status)
    else:
        raw_json = args.from_json
        out = args.out or raw_json.parent
        raw = load_raw(raw_json)
    header = stored_header(raw)
    ceilings = report_ceilings(header, raw)
    families = rows_from_raw(raw, ceilings)
    extra = roofline_section(raw)
    if not args.no_gpu_static:
        section, aot_status = gpu_static_section()
        extra += section
        status = status or aot_status
    report = write_outputs(out, header, families, extra, ceilings)
    print(report.read_text())
    print(f"written: {report}, {report.with_suffix('.json')}, {report.with_suffix('.csv')}")
    for plot in write_plots(out, families):
        print(f"written: {plot}")
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sbd bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    return run(add_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
