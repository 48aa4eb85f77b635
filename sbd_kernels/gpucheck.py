"""`sbd gpu-check` (`make gpu-check`): on an NVIDIA GPU, the test suite on CUDA, the benchmarks on the GPU and
their report, in one command that fits in 10 minutes on an H100.

    make gpu-check                 # builds the extension in place with $(PYTHON), then `sbd gpu-check
                                   # --started-at <before the build>`: the build counts against the 10 minutes
    sbd gpu-check [--out DIR]      # at the root of a checkout whose extension is built
    sbd gpu-check --budget 480 --only tests,bench-sampling   # less time; some stages, sharing it
    sbd gpu-check --dry-run        # any machine: the plan and its commands, a report of stages not run

It is meant for a machine with a CUDA build of torch and triton already installed: nothing is downloaded or
installed (no virtual environment, no pip), every stage runs this interpreter (`sys.executable`) from the
root of the checkout. The stages, in order, each with a time budget (BUDGETS_S):

    build            the C++ extension, in place, when a source is newer than it (`make gpu-check` builds first)
    compile          every Triton kernel configuration compiled for this GPU into Triton's cache, in one process
                     per core (`python -m sbd_kernels.aot --warm`): the test and bench processes that follow load
                     the binaries instead of each compiling the same kernels side by side
    tests            the whole suite with SBD_TEST_DEVICE=cuda: the Triton kernels compiled (not interpreted)
                     on CUDA tensors against the oracles on CPU copies; in `test_shards()` pytest processes
                     side by side (SBD_TEST_SHARD), in `gpu_run_order` (the CUDA-only tests, then the kernel
                     test files in turns), each writing what it is about to run (SBD_TEST_PLAN) and its
                     outcomes (JUnit XML): the report counts the tests run and not reached, by file
    bench-attention  quick grid (SBD_BENCH_QUICK=1), on CUDA: sbd (Triton) against SDPA + cache append,
                     FlexAttention and the oracle
    bench-sampling   quick grid, on CUDA: sbd against eager torch, torch.compile and the oracle
    bench-scatter    the same for mask_scatter_
    bench-decode     the end-to-end decode forwards (bench/bench_decode.py), quick grid
    bench-hf         the Hugging Face decode (bench/bench_hf.py), quick grid, when transformers is installed

Every stage runs offline (HF_HUB_OFFLINE=1); the one test that needs the network (a `pip install --dry-run`
with build isolation) is left out and listed in the report (DESELECTED_TESTS).

The budgets are BUDGETS_S scaled to `--budget` (default TOTAL_BUDGET_S) and shared among the stages that run
(`--only`; the build only when it has work, the compile stage always; a stage missing a module gets none). The
seconds a stage leaves unused go to the stages after it: each is stopped at the end of its budget counted
from the deadline of those before, one deadline for all. On a GPU every stage is bound by compiling, so a stage is
ordered for a stop: a stage still running at its budget gets SIGINT (pytest then prints its summary, writes
its JUnit XML, and pytest-benchmark the timings it finished), GRACE_S later SIGKILL (a bench stage's finished
timings are also appended one by one as they end: SBD_BENCH_PARTIAL), and the summary says it overran. A
stage that cannot run (pytest, pytest-benchmark or transformers missing, or the build failed or overran) is
skipped with the reason. The report goes to bench/reference/<gpu-name>/, written again after every stage (a
check killed at the time limit leaves the report of the stages it finished), with only this check's timings:
an earlier check's raw JSON, logs and plots there are removed first. report.md (the GPU from NVML: name, driver,
clocks; the stages, each with the GPU's clocks, temperature, power and clock event reasons while it ran,
sampled from NVML (`machine.GpuMonitor`); the tests by file; what was skipped and why; the benchmark tables
with achieved TB/s and TFLOP/s against the GPU's datasheet), report.json, report.csv, gpu-check.json (the stages), raw/
(pytest-benchmark JSON) and logs/. Exit status: 0 when every stage that ran passed, 1 when one failed or
overran, 1 with one line when torch sees no GPU.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.util
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from xml.etree import ElementTree

import torch

from sbd_kernels import argtypes, bench_report
from sbd_kernels.argtypes import add_option
from sbd_kernels.machine import GpuMonitor, gpu_load_text, machine_header
from sbd_kernels.testing import GPU_TEST_FILES, PLAN_VARIABLE

# Seconds per stage, for a 16-core H100 or H200 machine. On the first H200 run (a 470 s budget) no stage
# finished, each bound by compiling (Triton kernels, torch.compile, FlexAttention), not by the GPU: the tests
# ran 484 of ~4,800 in 140 s on 4 processes, the attention grid 2 cases in 48 s, sampling 33 timings in 44 s,
# scatter 13 in 18 s, decode 14 in 33 s, HF 1 in 22 s. The kernels now compile once per configuration (278,
# `unspecialised_jit`; the kernel test files asked for 4148 compiles before) and the compile stage builds them
# all first, on every core: 0.3-3.3 s each for sm_90 on a CPU here, so 40 s covers 278 on 16 cores. The
# attention grid keeps the largest bench budget (FlexAttention compiles per case); a stage stopped at its
# budget keeps and reports what it finished.
BUDGETS_S = {"build": 50, "compile": 40, "tests": 145, "bench-attention": 100, "bench-sampling": 55,
             "bench-scatter": 25, "bench-decode": 45, "bench-hf": 45}
AUTOMATIC_STAGES = ("build", "compile")  # run when needed, not named in `--only`
GRACE_S = 10  # from SIGINT to SIGKILL of a stage past its budget
REPORT_BUDGET_S = 15  # NVML, this machine's header (CPU ceilings measured: a few seconds), the report
TOTAL_BUDGET_S = 600  # sum(BUDGETS_S) + GRACE_S per stage + REPORT_BUDGET_S stays within it
# Tests the check leaves out, with the reason (the report lists them).
DESELECTED_TESTS = {
    "tests/test_package.py::test_plain_pip_install_keeps_the_installed_torch":
        "runs `pip install --dry-run` with build isolation, which downloads setuptools; gpu-check downloads nothing",
}
# Set for every stage: Hugging Face code never reaches for the network (all models are built from configs).
OFFLINE_ENV = (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"))
BENCH_FAMILIES = ("attention", "sampling", "scatter", "decode", "hf")
# Modules a stage needs beyond torch, by the import name that tells whether they are installed.
OPTIONAL_MODULES = ("triton", "pytest", "pytest_benchmark", "transformers", "pynvml", "matplotlib")
# The OPTIONAL_MODULES each stage needs: a stage missing one is skipped with the reason and gets no share of the
# budget (its share goes to the stages that run).
STAGE_MODULES = {"compile": ("triton",), "tests": ("pytest",),
                 **{f"bench-{family}": ("pytest", "pytest_benchmark") for family in BENCH_FAMILIES},
                 "bench-hf": ("pytest", "pytest_benchmark", "transformers")}
# The statuses of a stage that ran this time: its timings, logs and outcomes are this run's.
RAN = ("passed", "failed", "overran")
# The plots `bench_plots.write_plots` draws from the benchmark rows: an earlier run's would outlive a run that
# times less (accuracy_vs_nfe.png comes from a demo's JSON, not from the rows).
PLOT_FILES = ("sampling_latency.png", "attention_gflops.png", "decode_tokens_per_s.png")
# Sources whose change means a rebuild (as the Makefile's BUILD_INPUTS).
BUILD_INPUT_GLOBS = ("csrc/**/*.cpp", "csrc/**/*.h", "csrc/sources.txt", "setup.py", "pyproject.toml")


class GpuCheckError(ValueError):
    """The check cannot start here (no GPU, no triton, not a checkout): one line says why."""


@dataclass(frozen=True)
class Checkout:
    """Where and with what the stages run."""

    repo: Path
    out: Path
    python: str
    cpu_count: int
    missing: frozenset[str]  # OPTIONAL_MODULES that are not installed
    extension_current: bool  # the compiled extension is newer than every build input
    budget_s: int = TOTAL_BUDGET_S  # the whole check, at most (`--budget`): the stages' budgets are scaled to it
    only: tuple[str, ...] = ()  # the stages to run (`--only`; the build too when it has work); empty: all
    # Seconds of the check before its first stage (`--started-at`: make gpu-check's CUDA check and build, and this
    # command's own start-up, its imports of torch and triton: 2-5 s).
    spent_s: int = 0

    def wanted(self, name: str) -> bool:
        """Whether stage `name` is asked for: those of `only` (all when empty), the build when it has work, and
        the compile stage (every other stage runs the kernels it compiles)."""
        if name == "build":
            return not self.extension_current
        return name in AUTOMATIC_STAGES or not self.only or name in self.only

    def cannot_run(self, name: str) -> str | None:
        """Why stage `name` cannot run here (the modules of STAGE_MODULES[name] not installed), or None."""
        absent = [module for module in STAGE_MODULES.get(name, ()) if module in self.missing]
        return f"{', '.join(absent)} not installed" if absent else None

    def selected(self) -> tuple[str, ...]:
        """The stages that get a budget: those asked for (`wanted`) that can run here."""
        return tuple(name for name in BUDGETS_S if self.wanted(name) and self.cannot_run(name) is None)

    def stage_room_s(self) -> int:
        """What the stages share: the budget less the seconds spent before the first stage, at least the least
        budget that gives each stage a second (a build slower than the whole budget still leaves a check)."""
        return max(least_budget_s(), self.budget_s - self.spent_s)

    def stage_budget(self, name: str) -> int:
        """The budget of stage `name`; 0 for a stage not selected."""
        return stage_budgets(self.stage_room_s(), self.selected()).get(name, 0)


@dataclass(frozen=True)
class Stage:
    """One step of the check: its commands (several run side by side), extra environment, budget."""

    name: str
    budget_s: int
    what: str
    commands: tuple[tuple[str, ...], ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # set for every command (a shard's own SBD_TEST_SHARD: shard_env)
    shard_env: tuple[tuple[tuple[str, str], ...], ...] = ()
    raw_json: Path | None = None  # bench stages: the pytest-benchmark JSON they write
    junit: tuple[Path, ...] = ()  # the test stage: the JUnit XML of each command (outcomes by file)
    plans: tuple[Path, ...] = ()  # the test stage: the node ids each command collected to run (SBD_TEST_PLAN)
    skip: str | None = None  # why it cannot run; None when it can
    nothing_to_do: str | None = None  # why it need not run (a stage without commands that passes)
    carried_s: float = 0.0  # seconds the stages before it left unused, added to its budget (`run`)

    def environment(self, index: int, repo: Path) -> dict[str, str]:
        """The environment of command `index`: this process's, without TRITON_INTERPRET (the kernels are to
        be compiled), with the checkout first on PYTHONPATH (the extension is built in place, not installed:
        the processes that tests start, torchrun's ranks among them, import it from there), plus the stage's
        variables."""
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo), env.get("PYTHONPATH")) if p)
        env.update(self.env)
        if self.shard_env:
            env.update(self.shard_env[index])
        return env

    def command_lines(self) -> list[str]:
        """Each command as a shell line, with the variables it sets."""
        lines = []
        for i, command in enumerate(self.commands):
            variables = dict(self.env) | (dict(self.shard_env[i]) if self.shard_env else {})
            lines.append(" ".join([*(f"{k}={v}" for k, v in variables.items()), shlex.join(command)]))
        return lines


@dataclass
class StageResult:
    name: str
    status: str  # "passed", "failed", "overran" (stopped at its budget), "skipped" (cannot run), "not run"
    seconds: float
    budget_s: int
    detail: str
    failures: list[str] = field(default_factory=list)  # FAILED / ERROR lines of pytest
    skipped: list[str] = field(default_factory=list)  # SKIPPED reasons of pytest
    by_file: dict[str, dict[str, int]] = field(default_factory=dict)  # outcomes_by_file of the test stage
    gpu_load: dict = field(default_factory=dict)  # GpuMonitor.summary() while its commands ran; {} if none ran
    carried_s: float = 0.0  # seconds the stages before it left unused, given to it on top of budget_s

    def budget_text(self) -> str:
        """Its budget in seconds, with the seconds carried over from the stages before: "145" or "145+38"."""
        carried = round(self.carried_s)
        return f"{self.budget_s}+{carried}" if carried else str(self.budget_s)


# ----------------------------------------------------------------------------------------------------
# What the machine offers
# ----------------------------------------------------------------------------------------------------
def cuda_available() -> bool:
    return torch.cuda.is_available()


def find_repo() -> Path:
    """The checkout this package was imported from (setup.py, tests/ and bench/ beside sbd_kernels/)."""
    repo = Path(__file__).resolve().parent.parent
    if not all((repo / name).exists() for name in ("setup.py", "tests", "bench")):
        raise GpuCheckError(f"it runs from a source checkout (setup.py, tests/ and bench/ beside sbd_kernels/); "
                            f"this sbd_kernels is installed in {repo}")
    return repo


def missing_modules() -> frozenset[str]:
    return frozenset(name for name in OPTIONAL_MODULES if importlib.util.find_spec(name) is None)


def extension_is_current(repo: Path) -> bool:
    """Whether the compiled extension exists and is newer than every build input."""
    built = list((repo / "sbd_kernels").glob("_C*.so"))
    if not built:
        return False
    inputs = [p for pattern in BUILD_INPUT_GLOBS for p in repo.glob(pattern)]
    return max(p.stat().st_mtime for p in built) > max((p.stat().st_mtime for p in inputs), default=0.0)


def test_shards(cpu_count: int) -> int:
    """pytest processes of the test stage: one per 2 cores, at most 8. On an H200 with 16 cores, 4 processes
    ran 484 tests in 140 s, mostly compiling Triton kernels one at a time per process; the compile stage now
    compiles them beforehand, and what is left (oracles on CPU copies, CPU-only tests) still spreads over the
    processes; each runs its CPU tests on cpu_count / shards torch threads."""
    return max(1, min(8, cpu_count // 2))


def fixed_cost_s(stages: int = len(BUDGETS_S)) -> int:
    """Seconds of the check that no stage budget covers: each stage's grace period, and the report."""
    return GRACE_S * stages + REPORT_BUDGET_S


def stage_budgets(total_s: int, names: tuple[str, ...] = tuple(BUDGETS_S)) -> dict[str, int]:
    """The budgets of the stages `names` (default: all) within total_s, in BUDGETS_S's proportions.

    budget = BUDGETS_S[name] * (total_s - fixed) * u / sum(BUDGETS_S[n] for n in names), fixed =
    fixed_cost_s(len(names)), u = sum(BUDGETS_S) / (TOTAL_BUDGET_S - fixed_cost_s()) the share of its room the
    default plan gives its stages (505 / 515): all stages at the default total get BUDGETS_S; a shorter total (a
    machine lent for less), a longer one (a slower GPU) or fewer stages (`--only`, or stages that cannot run)
    keep the proportions, and the stages, their grace and the report stay within total_s. No stage: {}."""
    if not names:
        return {}
    fixed = fixed_cost_s(len(names))
    share = sum(BUDGETS_S.values()) / (TOTAL_BUDGET_S - fixed_cost_s())
    scale = (total_s - fixed) * share / sum(BUDGETS_S[name] for name in names)
    budgets = {name: int(BUDGETS_S[name] * scale) for name in names}
    if min(budgets.values()) < 1:
        raise GpuCheckError(f"a budget of {total_s} s leaves a stage no second (at least {least_budget_s()} s)")
    return budgets


def least_budget_s() -> int:
    """The shortest whole-check budget that gives the shortest stage one second."""
    return fixed_cost_s() + math.ceil((TOTAL_BUDGET_S - fixed_cost_s()) / min(BUDGETS_S.values()))


def budget_seconds(text: str) -> int:
    """`--budget`: whole seconds that leave each stage at least one (stage_budgets)."""
    least = least_budget_s()
    return argtypes.checked_number(text, int, lambda n: n >= least, f"whole seconds, at least {least}")


def gpu_slug(name: str) -> str:
    """A folder name from a GPU name: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split()) or "unknown-gpu"


# ----------------------------------------------------------------------------------------------------
# The plan
# ----------------------------------------------------------------------------------------------------
def plan(checkout: Checkout) -> list[Stage]:
    """Every stage, in order, with its commands or the reason it is skipped (not asked for, or a module
    missing: `Checkout.cannot_run`); only the stages that run have a budget."""
    stages = [build_stage(checkout), compile_stage(checkout), test_stage(checkout),
              *(bench_stage(checkout, f) for f in BENCH_FAMILIES)]
    return [s if checkout.wanted(s.name) or s.nothing_to_do is not None
            else dataclasses.replace(s, skip="not selected (--only)") for s in stages]


def build_stage(checkout: Checkout) -> Stage:
    what = "the C++ extension, in place, with this interpreter"
    if checkout.extension_current:
        done = (f"built before this command (`make gpu-check`; {checkout.spent_s} s before the first stage)"
                if checkout.spent_s else "up to date: newer than every source")
        return Stage("build", checkout.stage_budget("build"), what, nothing_to_do=done)
    # --force: distutils compares the sources and headers with the library, not csrc/sources.txt (its flags),
    # setup.py or pyproject.toml, which BUILD_INPUT_GLOBS counts too. The build replaces the
    # library file (distutils unlinks it before copying), so this process's loaded copy stays intact.
    command = (checkout.python, "setup.py", "build_ext", "--inplace", "--force")
    return Stage("build", checkout.stage_budget("build"), what, commands=(command,))


def compile_stage(checkout: Checkout) -> Stage:
    what = (f"every Triton kernel configuration compiled for this GPU into Triton's cache, {checkout.cpu_count} "
            "processes")
    if checkout.cannot_run("compile"):
        return Stage("compile", 0, what, skip=checkout.cannot_run("compile"))
    command = (checkout.python, "-m", "sbd_kernels.aot", "--warm", "--jobs", str(checkout.cpu_count))
    return Stage("compile", checkout.stage_budget("compile"), what, commands=(command,))


def test_files(checkout: Checkout) -> list[str]:
    """tests/test_*.py, GPU_TEST_FILES first; tests/test_hf.py only with transformers installed."""
    names = sorted(p.name for p in (checkout.repo / "tests").glob("test_*.py"))
    ordered = [n for n in GPU_TEST_FILES if n in names] + [n for n in names if n not in GPU_TEST_FILES]
    if "transformers" in checkout.missing:
        ordered.remove("test_hf.py")
    return [f"tests/{name}" for name in ordered]


def test_stage(checkout: Checkout) -> Stage:
    shards = test_shards(checkout.cpu_count)
    what = ("the whole test suite on CUDA tensors, Triton kernels compiled, in "
            + (f"{shards} pytest processes side by side" if shards > 1 else "one pytest process"))
    if checkout.cannot_run("tests"):
        return Stage("tests", 0, what, skip=checkout.cannot_run("tests"))
    deselect = [arg for test in DESELECTED_TESTS for arg in ("--deselect", test)]
    command = (checkout.python, "-m", "pytest", *test_files(checkout), *deselect, "-q", "-rfEs", "-p",
               "no:cacheprovider")
    threads = str(max(1, checkout.cpu_count // shards))
    junit = tuple(checkout.out / "logs" / f"tests-{i}.xml" for i in range(shards))
    plans = tuple(checkout.out / "logs" / f"tests-{i}.plan" for i in range(shards))
    # --junitxml on the command line, not in PYTEST_ADDOPTS: the pytest runs that tests start must not write there.
    return Stage("tests", checkout.stage_budget("tests"), what,
                 commands=tuple((*command, f"--junitxml={path}") for path in junit),
                 env=(("SBD_TEST_DEVICE", "cuda"), ("OMP_NUM_THREADS", threads), *OFFLINE_ENV),
                 shard_env=tuple((("SBD_TEST_SHARD", f"{i}/{shards}"), (PLAN_VARIABLE, str(plans[i])))
                                 for i in range(shards)), junit=junit, plans=plans)


BENCH_WHAT = {
    "attention": "block_attention_with_kvcache: sbd (Triton) vs SDPA + cache append, FlexAttention, the oracle",
    "sampling": "entropy_sample: sbd (Triton) vs eager torch, torch.compile, the oracle",
    "scatter": "mask_scatter_: sbd (Triton) vs eager torch, torch.compile, the oracle",
    "decode": "end-to-end decode forwards with 1, k and 2k query rows (small and 1B-shaped model)",
    "hf": "Hugging Face decode: SBD and NTP through the ops, eager and from CUDA graphs, vs HF greedy generate",
}


def bench_stage(checkout: Checkout, family: str) -> Stage:
    name = f"bench-{family}"
    what = f"{BENCH_WHAT[family]}; quick grid, on CUDA"
    if checkout.cannot_run(name):
        return Stage(name, 0, what, skip=checkout.cannot_run(name))
    raw = checkout.out / "raw" / f"{family}.json"
    command = tuple(bench_report.benchmark_command(checkout.python, [f"bench/bench_{family}.py"], raw, ("-rs",)))
    return Stage(name, checkout.stage_budget(name), what, commands=(command,),
                 env=(("SBD_BENCH_QUICK", "1"), ("SBD_BENCH_DEVICE", "cuda"), *OFFLINE_ENV,
                      (bench_report.PARTIAL_VARIABLE, str(bench_report.partial_path(raw)))), raw_json=raw)


def plan_text(stages: list[Stage], budget_s: int = TOTAL_BUDGET_S, spent_s: int = 0) -> str:
    """The stages with their budgets, and the commands each runs (or why it does not); spent_s, the seconds
    the check took before its first stage, counts against budget_s."""
    lines = []
    for s in stages:
        lines.append(f"{s.name:<16} {s.budget_s:>4} s  {s.what}")
        if s.skip is not None or s.nothing_to_do is not None:
            lines.append(f"    skipped: {s.skip}" if s.skip is not None else f"    nothing to run: {s.nothing_to_do}")
        lines += [f"    {line}" for line in s.command_lines()]
    total = spent_s + sum(s.budget_s for s in stages) + fixed_cost_s(sum(s.budget_s > 0 for s in stages))
    before = f"before the stages, {spent_s} s; " if spent_s else ""
    lines.append(f"budget: {total} s at most of {budget_s} s ({before}stages, {GRACE_S} s grace each, report)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# Running a stage
# ----------------------------------------------------------------------------------------------------
def run_stage(stage: Stage, checkout: Checkout) -> StageResult:
    """Run the stage's commands side by side, each in its own process group with its log under out/logs;
    SIGINT at its budget and the seconds carried over to it (stage.carried_s), SIGKILL GRACE_S later. Returns
    the judged result."""
    logs_dir = checkout.out / "logs"
    logs_dir.mkdir(parents=True, exist_ok=True)
    logs = [logs_dir / (f"{stage.name}-{i}.log" if len(stage.commands) > 1 else f"{stage.name}.log")
            for i in range(len(stage.commands))]
    if stage.raw_json is not None:
        stage.raw_json.parent.mkdir(parents=True, exist_ok=True)
        stage.raw_json.unlink(missing_ok=True)
        bench_report.partial_path(stage.raw_json).unlink(missing_ok=True)
    for path in (*stage.junit, *stage.plans):
        path.unlink(missing_ok=True)
    start = time.monotonic()
    processes = []
    with GpuMonitor() as monitor:
        for i, (command, log) in enumerate(zip(stage.commands, logs)):
            with open(log, "w") as handle:
                processes.append(subprocess.Popen(command, cwd=checkout.repo, env=stage.environment(i, checkout.repo),
                                                  stdout=handle, stderr=subprocess.STDOUT, start_new_session=True))
        overran = wait_or_stop(processes, start + stage.budget_s + stage.carried_s)
    seconds = time.monotonic() - start
    texts = [log.read_text(errors="replace") for log in logs]
    result = judge(stage, [p.returncode for p in processes], texts, overran, seconds)
    result.by_file = outcomes_by_file(stage.junit, stage.plans)
    result.gpu_load = monitor.summary()
    return result


def outcomes_by_file(junit: tuple[Path, ...], plans: tuple[Path, ...] = ()) -> dict[str, dict[str, int]]:
    """{test file: {"planned" / "passed" / "failed" / "skipped": count}}: the node ids the processes collected
    to run (their SBD_TEST_PLAN files) and the outcomes of pytest's JUnit XML files, by file, sorted. A file
    missing or cut short (a process killed while writing it) counts nothing; pytest writes its JUnit XML also
    when stopped by SIGINT at the budget. Planned minus the three outcomes is what the budget did not reach."""
    counts: dict[str, collections.Counter] = {}
    for path in plans:
        try:
            node_ids = path.read_text().splitlines()
        except OSError:
            continue
        for node_id in node_ids:
            counts.setdefault(node_id.split("::")[0], collections.Counter())["planned"] += 1
    for path in junit:
        try:
            root = ElementTree.parse(path).getroot()
        except (OSError, ElementTree.ParseError):
            continue
        for case in root.iter("testcase"):
            test_file = case.get("classname", "").split("::")[0].replace(".", "/") + ".py"
            kinds = {child.tag for child in case}
            outcome = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
            counts.setdefault(test_file, collections.Counter())[outcome] += 1
    return {name: dict(counts[name]) for name in sorted(counts)}


def wait_or_stop(processes: list[subprocess.Popen], deadline: float) -> bool:
    """Wait for every process until `deadline` (time.monotonic()); then SIGINT the process groups still
    running, and GRACE_S later SIGKILL what is left of them (leaders and their children: compile workers,
    torchrun ranks). Returns whether any was still running at the deadline."""
    for p in processes:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            break
    late = [p for p in processes if p.poll() is None]
    _signal_groups(late, signal.SIGINT)
    grace_end = time.monotonic() + GRACE_S
    for p in late:
        try:
            p.wait(timeout=max(0.0, grace_end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    _signal_groups(late, signal.SIGKILL)
    for p in late:
        p.wait()
    return bool(late)


def _signal_groups(processes: list[subprocess.Popen], sig: int) -> None:
    """Send `sig` to the process group of each process (each started its own session: group id = pid)."""
    for p in processes:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:  # the whole group has exited
            pass


# pytest's outcome words in its summary line ("12 passed, 1 skipped, 2 deselected in 3.21s").
OUTCOMES = ("failed", "passed", "skipped", "error", "errors", "xfailed", "xpassed")


def pytest_counts(text: str) -> collections.Counter:
    """Outcome counts of pytest's last summary line in `text` (errors counted as "error")."""
    counts: collections.Counter = collections.Counter()
    for line in reversed(text.splitlines()):
        words = line.strip(" =").replace(",", " ").split()
        pairs = [(words[i - 1], w) for i, w in enumerate(words) if i and w in OUTCOMES and words[i - 1].isdigit()]
        if pairs and " in " in line:
            for number, outcome in pairs:
                counts["error" if outcome == "errors" else outcome] += int(number)
            return counts
    return counts


def short_summary(text: str, kind: str) -> list[str]:
    """The lines of pytest's short test summary of `kind` ("FAILED", "ERROR", "SKIPPED")."""
    return [line.strip() for line in text.splitlines() if line.startswith(kind + " ")]


def last_line(texts: list[str]) -> str:
    lines = [line.strip() for text in texts for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def judge(stage: Stage, returncodes: list[int | None], texts: list[str], overran: bool,
          seconds: float) -> StageResult:
    """A stage's status and one-line detail from its exit statuses and logs."""
    failures = [line for text in texts for kind in ("FAILED", "ERROR") for line in short_summary(text, kind)]
    skipped = [line for text in texts for line in short_summary(text, "SKIPPED")]
    result = StageResult(stage.name, "passed", seconds, stage.budget_s, "", failures, skipped,
                         carried_s=stage.carried_s)
    if stage.name in AUTOMATIC_STAGES and not overran:  # no pytest: the exit status, the last line
        ok = returncodes == [0]
        result.status = "passed" if ok else "failed"
        result.detail = "built" if ok and stage.name == "build" else last_line(texts)
        return result
    counts = sum((pytest_counts(t) for t in texts), collections.Counter())
    parts = [f"{counts[k]} {k}" for k in ("passed", "failed", "error", "skipped", "xfailed", "xpassed") if counts[k]]
    if stage.raw_json is not None:
        timings, bad = raw_outcome(stage.raw_json)
        parts.append(f"{timings} timings kept" if overran else f"{timings} timings")
        if bad:
            result.failures += [f"oracle check FAILED: {b}" for b in bad]
    if overran:
        result.status = "overran"
        result.detail = f"stopped at {stop_text(stage)}; " + (", ".join(parts) or last_line(texts))
    elif all(rc == 0 for rc in returncodes) and not (result.failures or counts["failed"] or counts["error"]):
        result.detail = ", ".join(parts)
    else:
        result.status = "failed"
        statuses = sorted({rc for rc in returncodes if rc != 0})
        result.detail = ", ".join(parts + ([f"pytest exit status {statuses}"] if statuses else []))
        if not counts:
            result.detail += f"; {last_line(texts)}"
    return result


def stop_text(stage: Stage) -> str:
    """When a stage past its time was stopped: "the 55 s budget", or with seconds carried over to it "its 55 s
    budget + 38 s the stages before left"."""
    carried = round(stage.carried_s)
    if not carried:
        return f"the {stage.budget_s} s budget"
    return f"its {stage.budget_s} s budget + {carried} s the stages before left"


def raw_outcome(raw_json: Path) -> tuple[int, list[str]]:
    """(timings in a pytest-benchmark JSON, "family case provider" of those whose oracle check failed)."""
    benches = bench_report.read_raw(raw_json)
    bad = [f"{b['extra_info'].get('family')} {b['extra_info'].get('case')} {b['extra_info'].get('provider')}"
           for b in benches if b.get("extra_info", {}).get("correct") is False]
    return len(benches), bad


def not_run(stage: Stage, why: str) -> StageResult:
    return StageResult(stage.name, "not run", 0.0, stage.budget_s, why)


# ----------------------------------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------------------------------
def merged_raw(stages: list[Stage], results: list[StageResult]) -> dict:
    """The timings of the bench stages that ran in this check (a status in RAN), as one pytest-benchmark JSON:
    a stage not selected, skipped or not run reads none, whatever JSON an earlier check left at its path."""
    ran = {r.name for r in results if r.status in RAN}
    return {"benchmarks": [b for s in stages if s.raw_json is not None and s.name in ran
                           for b in bench_report.read_raw(s.raw_json)]}


def earlier_outputs(out: Path) -> list[Path]:
    """What an earlier check left in `out` that this one writes only for the stages it runs: the bench stages'
    raw JSON and partial timings, the stages' logs, JUnit XML and plans, the plots of the benchmark rows
    (PLOT_FILES). Anything else there (an earlier run kept in a subfolder, a README) is not touched."""
    raw = [path for family in BENCH_FAMILIES
           for path in (out / "raw" / f"{family}.json", bench_report.partial_path(out / "raw" / f"{family}.json"))]
    logs = out / "logs"
    stage_logs = [path for name in BUDGETS_S for pattern in (f"{name}.log", f"{name}-*.log")
                  for path in logs.glob(pattern)]
    test_files_ = [*logs.glob("tests-*.xml"), *logs.glob("tests-*.plan")]
    return [path for path in (*raw, *stage_logs, *test_files_, *(out / name for name in PLOT_FILES)) if path.exists()]


def remove_earlier_outputs(out: Path) -> None:
    """Removes `earlier_outputs(out)`: the report of this check never shows an earlier check's timings or plots."""
    for path in earlier_outputs(out):
        path.unlink(missing_ok=True)


def gpu_line(header: dict) -> str:
    gpu = header.get("gpu")
    if not gpu:
        return "not queried (no GPU, or a dry run): NVML fields missing"
    return ", ".join(f"{k} {v}" for k, v in gpu.items())


def tests_by_file(results: list[StageResult]) -> dict[str, collections.Counter]:
    """The `by_file` counts of every stage, merged by test file."""
    merged: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in results:
        for test_file, counts in r.by_file.items():
            merged[test_file].update(counts)
    return merged


def not_reached(counts: collections.Counter) -> int:
    """Tests planned but neither passed, failed nor skipped: those the budget stopped the run before."""
    return max(0, counts["planned"] - counts["passed"] - counts["failed"] - counts["skipped"])


def check_section(header: dict, results: list[StageResult], stages: list[Stage], checkout: Checkout,
                  seconds: float, dry_run: bool, finished: bool = True) -> str:
    """The gpu-check part of report.md: the GPU, the stages against their budgets, what was skipped and why,
    the failures, the commands. Before the check has `finished`, the title says so (stages "pending")."""
    name = (header.get("gpu") or {}).get("name", "unknown GPU")
    state = " (dry run: no stage ran)" if dry_run else "" if finished else f" (in progress: {PENDING_DETAIL})"
    lines = [f"# sbd gpu-check: {name}{state}", "",
             f"- GPU (NVML, read before the stages: idle clocks): {gpu_line(header)}",
             ("- GPU while each stage ran (NVML): clocks are medians (and the lowest SM clock) of the samples "
              "with the GPU busy, temperature and power the highest"),
             (f"- torch {header['torch']} (CUDA {torch.version.cuda or 'none'}), triton {header['triton']}, python "
              f"{header['python']}, commit {header['commit']}, {header['date']}"),
             (f"- the check took {seconds:.0f} s"
              f"{f' ({checkout.spent_s} s before the first stage included: build, start-up)' if checkout.spent_s else ''}; "
              f"budget {checkout.budget_s} s (default {TOTAL_BUDGET_S} s: `make gpu-check` on an H100)"), "",
             "## Stages", "",
             ("Budget s: the stage's budget, + the seconds the stages before it left unused (its time to run, "
              "within the check's one budget)."), "",
             "| stage | status | time s | budget s | result | GPU while it ran |", "|---|---|---|---|---|---|"]
    lines += [f"| {r.name} | {r.status} | {r.seconds:.0f} | {r.budget_text()} | {r.detail} "
              f"| {gpu_load_text(r.gpu_load)} |" for r in results]
    by_file = tests_by_file(results)
    if by_file:
        lines += ["", "## Tests by file", "",
                  "Planned: collected to run; not reached: planned, but the budget stopped the run first.", "",
                  "| file | planned | passed | failed | skipped | not reached |", "|---|---|---|---|---|---|"]
        rows = [*sorted(by_file.items()), ("all", sum(by_file.values(), collections.Counter()))]
        lines += [f"| {name} | {c['planned']} | {c['passed']} | {c['failed']} | {c['skipped']} | {not_reached(c)} |"
                  for name, c in rows]
    lines += ["", "## Skipped, and why", ""]
    skips = [f"- {r.name}: {r.detail}" for r in results if r.status in ("skipped", "not run")]
    if "transformers" in checkout.missing:
        skips.append("- tests/test_hf.py: transformers is not installed")
    if any(s.name == "tests" and s.commands and s.skip is None for s in stages):
        skips += [f"- {test}: {why}" for test, why in DESELECTED_TESTS.items()]
    if "pynvml" in checkout.missing:
        skips.append("- NVML fields: nvidia-ml-py is not installed")
    if "matplotlib" in checkout.missing:
        skips.append("- plots: matplotlib is not installed")
    skips += [f"- {r.name}: {line}" for r in results for line in r.skipped]
    lines += skips or ["- nothing"]
    failures = [f"- {r.name}: {line}" for r in results for line in r.failures]
    if failures:
        lines += ["", "## Failures", "", *failures]
    lines += ["", "## Commands", "", "```"]
    for s in stages:
        why = f": skipped, {s.skip}" if s.skip else f": nothing to run, {s.nothing_to_do}" if s.nothing_to_do else ""
        lines += [f"# {s.name} ({s.budget_s} s){why}", *s.command_lines()]
    lines += ["```", ""]
    return "\n".join(lines)


PENDING_DETAIL = "not reached when this report was written (a later report replaces it)"


def pending(stages: list[Stage], results: list[StageResult]) -> list[StageResult]:
    """`results`, then a "pending" result for each stage of `stages` after them."""
    return [*results, *(StageResult(s.name, "pending", 0.0, s.budget_s, PENDING_DETAIL) for s in stages[len(results):])]


def write_report(checkout: Checkout, header: dict, stages: list[Stage], results: list[StageResult],
                 seconds: float, dry_run: bool, finished: bool = True) -> tuple[Path, dict[str, list[dict]]]:
    """report.md, report.json, report.csv, gpu-check.json (and when `finished` the plots, with matplotlib)
    under out; returns (report.md, the benchmark rows by family, each set against its ceilings). `run`
    writes it after every stage as well (`finished` False, the stages not reached yet "pending", gpu-check.json
    "finished": false), so that a check killed at the time limit leaves the report of what it finished."""
    results = pending(stages, results)
    raw = merged_raw(stages, results)
    ceilings = bench_report.report_ceilings(header, raw)
    families = bench_report.rows_from_raw(raw, ceilings)
    report = bench_report.write_outputs(checkout.out, header, families, bench_report.roofline_section(raw), ceilings)
    tables = report.read_text() if families else "## Benchmarks\n\nNo benchmark ran.\n"
    report.write_text(check_section(header, results, stages, checkout, seconds, dry_run, finished) + "\n" + tables)
    (checkout.out / "gpu-check.json").write_text(json.dumps(
        {"gpu": header.get("gpu"), "seconds": seconds, "dry_run": dry_run, "budget_s": checkout.budget_s,
         "spent_s": checkout.spent_s, "finished": finished, "stages": [asdict(r) for r in results], "missing": sorted(checkout.missing)},
        indent=1))
    if finished and families and "matplotlib" not in checkout.missing:
        from sbd_kernels.bench_plots import write_plots

        write_plots(checkout.out, families)
    return report, families


def is_ours(provider: str) -> bool:
    """Whether a provider is this package's code: the ops ("sbd", "sbd plain", "sbd t=16") or a decode
    through them ("ntp ops", "sbd ops", "ntp ops graphed")."""
    return provider.startswith("sbd") or " ops" in provider


def compared_rows(rows: list[dict]) -> list[dict]:
    """Our rows (sbd..., ... ops) that a family's summary line compares: those against a foreign baseline (the
    same work done by torch), or in a family with none, those against our own (decode: "sbd t=1"). A row timed
    against one of our own providers beside foreign ones (sampling's "sbd plain", the filtered case's call
    without the filter, against "sbd": what the filter costs) does other work than the foreign baseline and
    stays out of the line."""
    ours = [r for r in rows if r["provider"] != r["baseline"] and is_ours(r["provider"])]
    foreign = [r for r in ours if not is_ours(r["baseline"])]
    return foreign or ours


def kernel_lines(families: dict[str, list[dict]]) -> list[str]:
    """Per family, one line on how our rows (`compared_rows`) did against the baseline of their cases. A
    family whose baseline is one of our own providers (decode: "sbd t=1") compares our code with itself:
    its line gives time(t)/time(1), the cost of a wider pass, and no speedup. The best TB/s and TFLOP/s are
    those of rows timed from a CUDA graph, each with its fraction of the ceiling that row was set against
    (`row_ceiling`: not always the report's, the decode rows store their own)."""
    lines = []
    for family, rows in families.items():
        ours = compared_rows(rows)
        if not ours:
            continue
        parts = [f"{family}: {len(ours)} rows"]
        if is_ours(ours[0]["baseline"]):
            parts += _width_ratios(ours)
        else:
            parts += _speedups(ours)
        text = ", ".join(parts)
        graphed = [r for r in ours if r.get("rate_from") == "graph ms"]
        best = max((r for r in graphed if r["gbs"]), key=lambda r: r["gbs"], default=None)
        if best is not None:
            share = (f" = {best['pct_copy']:.0f}% of the {row_ceiling(best, 'gbs', 'pct_copy') / 1e3:.2f} TB/s "
                     "datasheet" if best["pct_copy"] else "")
            text += f"; best {best['gbs'] / 1e3:.2f} TB/s{share} ({best['case']})"
        top = max((r for r in graphed if r["gflops"]), key=lambda r: r["gflops"], default=None)
        if top is not None:
            share = f" = {top['pct_peak']:.0f}% of the datasheet peak" if top["pct_peak"] else ""
            text += f"; best {top['gflops'] / 1e3:.1f} TFLOP/s{share} ({top['case']})"
        failed = sum(r["oracle"] == "FAIL" for r in ours)
        lines.append("  " + text + (f"; {failed} oracle check FAILURES" if failed else ""))
    return lines


def row_ceiling(row: dict, rate: str, fraction: str) -> float:
    """The ceiling a row's `rate` ("gbs", "gflops") was set against, from the rate and its percentage
    `fraction` ("pct_copy", "pct_peak"): that of the row's own ceilings (`bench_report.row_ceilings`)."""
    return 100 * row[rate] / row[fraction]


def _speedups(rows: list[dict]) -> list[str]:
    """Speedups against the (foreign) baseline, per call and on CUDA-graph time. A family with several of our
    providers (hf: "sbd ops", "sbd ops graphed", ...) gets one span per provider, since one span over an eager
    and a graph-replayed decode would say nothing of either."""
    parts = []
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    for provider in providers:
        speedups = [r["speedup"] for r in rows if r["speedup"] and r["provider"] == provider]
        if speedups:
            named = f"{provider} " if len(providers) > 1 else ""
            parts.append(f"{named}{_span(speedups)} vs {rows[0]['baseline']} per call")
    graph = [r["graph_speedup"] for r in rows if r["graph_speedup"]]
    if graph:
        parts.append(f"{_span(graph)} on CUDA-graph time")
    return parts


def _width_ratios(rows: list[dict]) -> list[str]:
    """Time over our own baseline's = 1 / speedup (decode: time(t)/time(1)), per call and on CUDA-graph
    time: not a kernel speedup."""
    parts = []
    ratios = [1 / r["speedup"] for r in rows if r["speedup"]]
    if ratios:
        parts.append(f"time over our own {rows[0]['baseline']} (not a speedup): {_span(ratios)} per call")
    graph = [1 / r["graph_speedup"] for r in rows if r["graph_speedup"]]
    if graph:
        parts.append(f"{_span(graph)} on CUDA-graph time")
    return parts


def _span(values: list[float]) -> str:
    low, high = min(values), max(values)
    return f"{low:.2f}x" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}x"


def summary(header: dict, results: list[StageResult], families: dict[str, list[dict]],
            report: Path, seconds: float, budget_s: int = TOTAL_BUDGET_S) -> str:
    """What gets printed at the end: the GPU, each stage against its budget, the kernels, the skips, where the
    report is."""
    lines = [f"sbd gpu-check: {gpu_line(header)}",
             f"{'stage':<16} {'status':<8} {'time / budget':>14}  result"]
    lines += [f"{r.name:<16} {r.status:<8} {r.seconds:>5.0f} / {r.budget_text():>3} s  {r.detail}" for r in results]
    loads = [f"  {r.name}: {gpu_load_text(r.gpu_load)}" for r in results if r.gpu_load]
    if loads:
        lines += ["GPU while the stages ran (NVML):", *loads]
    total = sum(tests_by_file(results).values(), collections.Counter())
    if total["planned"]:
        ran = total["passed"] + total["failed"] + total["skipped"]
        lines.append(f"tests: {ran} of {total['planned']} run ({total['failed']} failed), {not_reached(total)} "
                     "not reached in the budget; by file in the report")
    kernels = kernel_lines(families)
    if kernels:
        lines += ["kernels (our rows against the baseline of each case; TB/s and TFLOP/s from CUDA-graph times):",
                  *kernels]
    skipped = [f"{r.name} ({r.detail})" for r in results if r.status in ("skipped", "not run")]
    if skipped:
        lines.append("skipped: " + "; ".join(skipped))
    lines.append(f"total {seconds:.0f} s of {budget_s} s; report: {report}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------------------
def preflight(missing: frozenset[str]) -> None:
    """Raises GpuCheckError, in one line, when the check cannot run here."""
    if not cuda_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise GpuCheckError(f"no NVIDIA GPU visible to torch {torch.__version__} ({build}); nothing was run "
                            "(`sbd gpu-check --dry-run` shows what would run)")
    if "triton" in missing:
        raise GpuCheckError("triton is not installed: the GPU kernels need it (CUDA builds of torch ship it)")


def seconds_since(started_at: float | None) -> int:
    """Whole seconds from Unix time `started_at` (`--started-at`) to now, rounded up; 0 without one, or for one
    in the future (a clock set back in between)."""
    return 0 if started_at is None else max(0, math.ceil(time.time() - started_at))


def run(args: argparse.Namespace) -> int:
    """The whole check (or its dry run); returns the exit status."""
    started = time.monotonic()
    spent_s = seconds_since(args.started_at)
    missing = missing_modules()
    if not args.dry_run:
        preflight(missing)
    repo = find_repo()
    header = machine_header(repo, gpu=not args.dry_run)
    default_out = (repo / "bench" / "results" / "gpu-check-dry-run" if args.dry_run
                   else repo / "bench" / "reference" / gpu_slug((header.get("gpu") or {}).get("name", "")))
    checkout = Checkout(repo, (args.out or default_out).resolve(), sys.executable, os.cpu_count() or 1, missing,
                        extension_is_current(repo), args.budget, tuple(args.only.split(",")) if args.only else (),
                        spent_s)
    checkout.out.mkdir(parents=True, exist_ok=True)
    remove_earlier_outputs(checkout.out)
    stages = plan(checkout)
    print(f"sbd gpu-check{' --dry-run' if args.dry_run else ''}: {len(stages)} stages\n"
          f"{plan_text(stages, checkout.budget_s, checkout.spent_s)}", flush=True)
    results = []
    # One deadline for the stages so far: each stage that runs is stopped at the end of its budget counted from
    # it, so that a stage that ends early passes its unused seconds on to the next ones, and one stopped past
    # it (GRACE_S at most) takes nothing from them (the plan's worst case, plan_text, holds).
    stages_end = time.monotonic()
    for stage in stages:
        now = time.monotonic()
        result = stage_result(stage, results, checkout, args.dry_run, max(0.0, stages_end - now))
        if result.status in RAN:
            stages_end = max(stages_end, now) + stage.budget_s
        results.append(result)
        write_report(checkout, header, stages, results, time.monotonic() - started + checkout.spent_s, args.dry_run,
                     finished=False)
    seconds = time.monotonic() - started + checkout.spent_s
    report, families = write_report(checkout, header, stages, results, seconds, args.dry_run)
    print(summary(header, results, families, report, seconds, checkout.budget_s))
    return 1 if any(r.status in ("failed", "overran") for r in results) else 0


def stage_result(stage: Stage, results: list[StageResult], checkout: Checkout, dry_run: bool,
                 carried_s: float) -> StageResult:
    """Runs `stage` with `carried_s` seconds on top of its budget, or says why it does not run: skipped,
    nothing to do, a dry run, or a build before it that failed or was stopped (the stages would test an
    earlier extension, or none)."""
    if stage.skip is not None:
        return StageResult(stage.name, "skipped", 0.0, stage.budget_s, stage.skip)
    if stage.nothing_to_do is not None:
        before = checkout.spent_s if stage.name == "build" else 0.0  # make gpu-check's build and the start-up
        return StageResult(stage.name, "passed", before, stage.budget_s, stage.nothing_to_do)
    if dry_run:
        return not_run(stage, "dry run")
    build = next((r for r in results if r.name == "build" and r.status in ("failed", "overran")), None)
    if build is not None:
        return not_run(stage, "the build failed" if build.status == "failed" else "the build was stopped at its budget")
    print(f"[{stage.name}] running, {stage.budget_s} s budget"
          + (f" + {carried_s:.0f} s the stages before left" if round(carried_s) else ""), flush=True)
    return run_stage(dataclasses.replace(stage, carried_s=carried_s), checkout)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--out", type=lambda text: Path(argtypes.output_dir(text)),
                        help="report folder (default: bench/reference/<gpu-name>; with --dry-run "
                             "bench/results/gpu-check-dry-run)")
    add_option(parser, "--budget", type=budget_seconds, default=TOTAL_BUDGET_S, metavar="SECONDS",
               help=f"the whole check's time at most (default {TOTAL_BUDGET_S}: 10 minutes on an H100); the stages' "
                    "budgets are scaled to it, keeping their proportions")
    add_option(parser, "--only", type=argtypes.choice_list(name for name in BUDGETS_S if name not in AUTOMATIC_STAGES),
               metavar="STAGES", help="comma-separated stages to run (the build when needed and the compile stage "
                                      "always run too), e.g. bench-attention,bench-sampling; the budget is shared "
                                      "among them")
    add_option(parser, "--started-at", type=argtypes.positive_float, metavar="UNIX_TIME",
               help="when the check began, in seconds since 1970 (`make gpu-check` passes the time before its build): "
                    "the time since, the build and this command's start-up included, counts against --budget, "
                    "the stages share the rest")
    add_option(parser, "--dry-run", action="store_true",
               help="no GPU needed: print the plan and its commands, write the report of stages not run")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sbd gpu-check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    return run(add_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
