"""`sbd gpu-check` without a GPU: the switch that runs the test suite on CUDA (SBD_TEST_DEVICE, SBD_TEST_SHARD,
`on_device`), the plan and its budgets, the dry run, the stage runner (stubbed, or on tiny real commands), the
report against the GPU's datasheet and the one-line failure without a GPU."""
import ast
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from sbd_kernels import bench_report, cli, gpucheck, machine
from sbd_kernels import benchmark_grid as grid
from sbd_kernels.testing import (
    OP_FAMILIES,
    backend_op,
    call_on_copies,
    configure_triton_environment,
    gpu_run_order,
    load_test_durations,
    on_device,
    op_on_given_tensors,
    select_shard,
    triton_test_device,
)

REPO = Path(__file__).resolve().parent.parent


def run_python(code: str, **env: str | None) -> subprocess.CompletedProcess:
    """`python -c code` at the repository root, with `env` set (None: removed) over this environment."""
    environ = {k: v for k, v in os.environ.items() if k not in env}
    environ.update({k: v for k, v in env.items() if v is not None})
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=environ, capture_output=True, text=True,
                          check=False, timeout=300)


# ----------------------------------------------------------------------------------------------------
# SBD_TEST_DEVICE: where the Triton tests run
# ----------------------------------------------------------------------------------------------------
def test_test_device_follows_the_variable(monkeypatch):
    """Guards against a switch that never picks CUDA (the GPU check would test the interpreter again) or that
    silently ignores a misspelt value."""
    monkeypatch.delenv("SBD_TEST_DEVICE", raising=False)
    assert triton_test_device() == "cpu"
    for value, device in (("", "cpu"), ("cpu", "cpu"), ("cuda", "cuda")):
        monkeypatch.setenv("SBD_TEST_DEVICE", value)
        assert triton_test_device() == device
    monkeypatch.setenv("SBD_TEST_DEVICE", "gpu")
    with pytest.raises(ValueError, match="SBD_TEST_DEVICE must be one of cpu, cuda, got 'gpu'"):
        triton_test_device()


def test_backend_ops_are_the_implementations_of_their_op(monkeypatch):
    """Guards against a backend helper that hands a test the wrong op or the wrong backend (a test of the oracle
    against itself cannot fail), or that runs the Triton launcher on CPU tensors in a CUDA run."""
    from sbd_kernels.ops.sampling import naive, triton

    for name in OP_FAMILIES:
        assert op_on_given_tensors(name, "cpu") is getattr(torch.ops.sbd, name)
    assert op_on_given_tensors("entropy_sample", "triton") is triton.entropy_sample
    assert op_on_given_tensors("entropy_sample", "naive") is naive.entropy_sample
    monkeypatch.setenv("SBD_TEST_DEVICE", "cpu")
    assert backend_op("entropy_sample", "triton") is triton.entropy_sample
    monkeypatch.setenv("SBD_TEST_DEVICE", "cuda")
    assert backend_op("entropy_sample", "triton").__wrapped__ is triton.entropy_sample
    assert backend_op("entropy_sample", "cpu") is torch.ops.sbd.entropy_sample
    for name, backend in (("entropy", "cpu"), ("entropy_sample", "cuda")):
        with pytest.raises(ValueError, match=f"no {backend!r} implementation of {name!r}"):
            op_on_given_tensors(name, backend)


def test_interpreter_is_set_for_cpu_only():
    """Guards against CUDA runs that still interpret the kernels (TRITON_INTERPRET=1 set by conftest, or left
    set by the caller), and against the CPU default losing it."""
    assert configure_triton_environment(env := {}) == "cpu" and env["TRITON_INTERPRET"] == "1"
    assert configure_triton_environment(env := {"TRITON_INTERPRET": "1"}) == "cpu" and env["TRITON_INTERPRET"] == "1"
    assert configure_triton_environment(env := {"SBD_TEST_DEVICE": "cuda"}) == "cuda" and "TRITON_INTERPRET" not in env
    assert configure_triton_environment({"SBD_TEST_DEVICE": "cuda", "TRITON_INTERPRET": "0"}) == "cuda"
    with pytest.raises(ValueError, match="unset TRITON_INTERPRET"):
        configure_triton_environment({"SBD_TEST_DEVICE": "cuda", "TRITON_INTERPRET": "1"})


CONFTEST_STATE = ("import sys, os; sys.path.insert(0, 'tests'); import conftest; "
                  "print(conftest.TRITON_DEVICE, os.environ.get('TRITON_INTERPRET'))")


def test_conftest_sets_the_interpreter_only_without_cuda():
    """Guards against tests/conftest.py turning the interpreter on under SBD_TEST_DEVICE=cuda (it runs before
    any Triton kernel is imported, so it decides for the whole run)."""
    cuda = run_python(CONFTEST_STATE, SBD_TEST_DEVICE="cuda", TRITON_INTERPRET=None)
    assert cuda.returncode == 0 and cuda.stdout.split() == ["cuda", "None"], cuda.stderr[-2000:]
    default = run_python(CONFTEST_STATE, SBD_TEST_DEVICE=None, TRITON_INTERPRET=None)
    assert default.returncode == 0 and default.stdout.split() == ["cpu", "1"], default.stderr[-2000:]


def collected(*pytest_args: str, **env: str | None) -> list[str]:
    """The node ids of the whole suite (selected by `pytest_args`) under `env`, sorted (also when this test runs
    in a shard: the CUDA setting orders the tests before the shard takes its share)."""
    code = ("import sys, pytest; sys.exit(pytest.main(['tests', '--collect-only', '-q', '-p', 'no:cacheprovider', "
            f"*{list(pytest_args)!r}]))")
    proc = run_python(code, **{"SBD_TEST_SHARD": None, **env})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return sorted(line for line in proc.stdout.splitlines() if "::" in line)


@pytest.mark.slow
def test_cuda_setting_collects_the_same_tests():
    """Guards against a test module that builds CUDA tensors at import, or a CUDA-only test that exists under one
    setting only: SBD_TEST_DEVICE=cuda collects exactly the tests of the default run (here, without a GPU)."""
    cuda = collected(SBD_TEST_DEVICE="cuda", TRITON_INTERPRET=None)
    assert len(cuda) > 1000 and cuda == collected(SBD_TEST_DEVICE=None, TRITON_INTERPRET="1")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the stop on a machine without a GPU")
def test_cuda_run_without_a_gpu_stops_in_one_line():
    """Guards against SBD_TEST_DEVICE=cuda on a machine without a GPU failing test by test (or passing on CPU
    tensors): the run stops at its first test, saying why."""
    code = "import sys, pytest; sys.exit(pytest.main(['tests/test_tasks.py', '-q', '-p', 'no:cacheprovider']))"
    proc = run_python(code, SBD_TEST_DEVICE="cuda", TRITON_INTERPRET=None)
    assert proc.returncode == 4
    assert "SBD_TEST_DEVICE=cuda, but torch" in proc.stdout and "sees no CUDA device" in proc.stdout


def test_gpu_run_order_puts_cuda_only_first_then_takes_the_gpu_files_in_turns():
    """Guards against a GPU run stopped at its budget having checked one kernel family only (files in sequence),
    or spent its time on CPU-only files before the kernels, or run the CUDA-only tests late, or lost or
    repeated a test."""
    items = [("test_attention_triton.py", 1), ("test_attention_triton.py", 2), ("test_cmake.py", 1),
             ("test_attention_triton.py", 3), ("test_sampling.py", 1), ("test_generate.py", "graph"),
             ("test_scatter.py", 1), ("test_scatter.py", 2), ("test_demo.py", 1), ("test_sampling.py", "cuda")]
    order = gpu_run_order(items, lambda item: item[0], lambda item: item[1] in ("cuda", "graph"))
    assert order == [("test_generate.py", "graph"), ("test_sampling.py", "cuda"),
                     ("test_attention_triton.py", 1), ("test_sampling.py", 1), ("test_scatter.py", 1),
                     ("test_attention_triton.py", 2), ("test_scatter.py", 2), ("test_attention_triton.py", 3),
                     ("test_cmake.py", 1), ("test_demo.py", 1)]
    assert gpu_run_order([], str, bool) == []


def test_the_cuda_only_tests_carry_their_marker():
    """Guards against a CUDA-only test losing its `cuda_only` marker: it would come late in a budgeted GPU run
    (gpu_run_order), maybe after the stop."""
    marked = {node.split("::")[0] + "::" + node.split("::")[1].split("[")[0]
              for node in collected("-m", "cuda_only", SBD_TEST_DEVICE="cpu")}
    assert marked == {
        "tests/test_attention_triton.py::test_opcheck_cuda",
        "tests/test_attention_triton.py::test_decode_step_compiles_fullgraph_cuda",
        "tests/test_attention_triton.py::test_runs_on_the_device_of_its_tensors_not_the_current_one",
        "tests/test_compile.py::test_cuda_graph_replay_of_filtered_sampling_equals_eager",
        "tests/test_generate.py::test_cuda_graph_decode_gives_the_eager_tokens",
        "tests/test_hf.py::test_cuda_graph_decode_through_hf_gives_the_eager_tokens",
        "tests/test_hf.py::test_flex_attention_training_mask_with_sinks_gives_the_eager_logits",
    }


def test_shards_split_the_run_once():
    """Guards against shards that skip or repeat tests: n shards keep every item exactly once."""
    items = list(range(23))
    kept = [select_shard(items, f"{i}/4")[0] for i in range(4)]
    assert sorted(i for shard in kept for i in shard) == items and kept[1] == [1, 5, 9, 13, 17, 21]
    assert select_shard(items, "2/4")[1] == [i for i in items if i % 4 != 2]
    for bad in ("4/4", "1", "a/b", "-1/2"):
        with pytest.raises(ValueError, match="SBD_TEST_SHARD"):
            select_shard(items, bad)


def test_a_shard_group_runs_in_one_shard():
    """Guards against tests that share an expensive module fixture (the CMake build) split over shards, each
    building it: a group is one unit, weighing its items, and the other items are dealt in turns."""
    items = ["a", "cmake1", "b", "cmake2", "c", "d", "cmake3", "e"]
    group = {"cmake1": "cmake", "cmake2": "cmake", "cmake3": "cmake"}.get
    kept = [select_shard(items, f"{i}/2", group)[0] for i in range(2)]
    assert kept == [["cmake1", "cmake2", "d", "cmake3"], ["a", "b", "c", "e"]]
    assert select_shard(items, "0/2", group)[1] == kept[1]


def test_shards_are_dealt_by_weight_and_end_together():
    """Guards against shards that end minutes apart: dealt in turns by count, two runs of this suite on 2 cores
    ended 103 s apart where the heavy tests fell on one side. Units go heaviest first to the least-loaded shard,
    so the loads differ by at most the lightest unit; each shard keeps its items in their order, and every item
    runs once."""
    seconds = {"a": 1, "b": 9, "c": 2, "d": 7, "e": 3, "f": 3, "g": 1, "cmake1": 4, "cmake2": 2}
    items = list(seconds)
    group = {"cmake1": "cmake", "cmake2": "cmake"}.get
    kept = [select_shard(items, f"{i}/2", group, seconds.get)[0] for i in range(2)]
    assert kept == [["a", "b", "e", "f"], ["c", "d", "g", "cmake1", "cmake2"]]
    assert [sum(seconds[item] for item in shard) for shard in kept] == [16, 16]
    three = [select_shard(items, f"{i}/3", group, seconds.get)[0] for i in range(3)]
    assert sorted(item for shard in three for item in shard) == sorted(items)
    assert [sum(seconds[item] for item in shard) for shard in three] == [11, 11, 10]


def test_a_test_without_a_recorded_duration_weighs_the_default(tmp_path):
    """Guards against a new test (not in tests/durations.json) weighing nothing, or a missing file stopping the
    run: the file's default weighs the tests it does not list, and without a file every test weighs 1."""
    path = tmp_path / "durations.json"
    path.write_text(json.dumps({"about": "", "default_s": 0.04, "tests": {"tests/test_x.py::test_slow": 12.5}}))
    durations = load_test_durations(path)
    assert durations.of("tests/test_x.py::test_slow") == 12.5 and durations.of("tests/test_x.py::test_new") == 0.04
    assert load_test_durations(tmp_path / "absent.json").of("tests/test_x.py::test_slow") == 1.0


def test_shards_weigh_recorded_durations_on_the_cpu_setting_alone(monkeypatch):
    """Guards against dealing a CUDA run by CPU durations (interpreted Triton tests, the CMake build that skips
    there): on CUDA every test weighs the same; on the CPU the slowest recorded test weighs its seconds."""
    import conftest

    listed = json.loads((REPO / "tests" / "durations.json").read_text())["tests"]
    slowest = types.SimpleNamespace(nodeid=max(listed, key=listed.get))
    assert conftest.shard_weight()(slowest) == listed[slowest.nodeid] > 10
    monkeypatch.setattr(conftest, "TRITON_DEVICE", "cuda")
    assert conftest.shard_weight()(slowest) == 1.0


def test_the_durations_file_lists_the_slow_tests_and_weighs_the_others_by_their_mean(monkeypatch):
    """Guards against a durations file that lists thousands of fast tests, or weighs the unlisted ones as 0."""
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import run_tests

    document = run_tests.durations_document({"t::slow": 12.345, "t::mid": 0.5, "t::a": 0.1, "t::b": 0.3}, "CPU X")
    assert document["tests"] == {"t::mid": 0.5, "t::slow": 12.35} and document["default_s"] == 0.2
    assert "on CPU X" in document["about"]


def test_the_suite_has_a_durations_file_that_names_its_tests():
    """Guards against dealing the shards by a stale file: the tests it lists are still collected (a renamed
    test weighs the default; rerun `python tools/run_tests.py --record-durations`)."""
    listed = json.loads((REPO / "tests" / "durations.json").read_text())["tests"]
    stale = sorted(set(listed) - set(collected(SBD_TEST_DEVICE="cpu")))
    assert len(listed) > 100 and not stale, f"{len(stale)} tests no longer collected, e.g. {stale[:3]}"


def same_shard_item(*args, **kwargs):
    """A stand-in for a test item marked `@pytest.mark.same_shard(*args, **kwargs)`."""
    marker = pytest.mark.same_shard(*args, **kwargs).mark
    return types.SimpleNamespace(nodeid="tests/test_x.py::test_y",
                                 get_closest_marker=lambda name: marker if name == "same_shard" else None)


def test_a_same_shard_marker_without_its_name_stops_the_run():
    """Guards against a bare `@pytest.mark.same_shard` (no group name) failing with an IndexError in the
    collection hook, a marker's name not reaching select_shard, or a weight given to the marker silently
    ignored (a group weighs its tests' recorded durations)."""
    import conftest

    assert conftest.shard_group(same_shard_item("cmake_build")) == "cmake_build"
    for args, kwargs in (((), {}), (("a", "b"), {}), ((3,), {}), (("cmake_build",), {"weight": 60})):
        with pytest.raises(pytest.UsageError, match=r"test_x.py::test_y: same_shard takes one name"):
            conftest.shard_group(same_shard_item(*args, **kwargs))


def test_the_cmake_tests_share_a_shard():
    """Guards against a CMake test left out of its group (a second CMake build in another shard)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "tests/test_cmake.py"], cwd=REPO, capture_output=True, text=True, check=False,
                          env={**os.environ, "SBD_TEST_SHARD": "1/2"})
    collected = [line for line in proc.stdout.splitlines() if "::" in line]
    source = (REPO / "tests" / "test_cmake.py").read_text()
    names = {node.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)
             and node.name.startswith("test_")
             and any(arg.arg in ("cmake_build", "cmake_configured") for arg in node.args.args)}
    in_shard = {line.split("::")[1] for line in collected}
    assert names and (names <= in_shard or not names & in_shard), (names, in_shard)


# ----------------------------------------------------------------------------------------------------
# on_device: a launcher on device copies of CPU arguments
# ----------------------------------------------------------------------------------------------------
def test_on_device_keeps_layouts_and_aliases_and_writes_back():
    """Guards against device copies that lose what the tests check: a strided, offset or expanded argument
    arriving contiguous, two views of one buffer arriving in two buffers (the aliasing checks would not see
    them), an in-place result or a stray write not reaching the CPU tensors, results left on the device."""
    buffer = torch.arange(24.0)
    strided, shifted = buffer[1::3], buffer[2:8]
    expanded = torch.tensor([7]).expand(4)
    seen = {}

    def fn(a, b, c, scale, meta):
        seen.update(strides=(a.stride(), b.storage_offset(), c.stride()), meta=meta.device.type,
                    shared=a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())
        a.mul_(scale)  # in place, through the strided view
        a.as_strided((1,), (1,), 0).fill_(-1.0)  # a stray write, outside every argument
        return a + 1, [c.sum()]

    out, (total,) = call_on_copies(fn, "cpu", strided, shifted, expanded, 2.0, torch.empty(2, device="meta"))
    assert seen == {"strides": ((3,), 2, (0,)), "shared": True, "meta": "meta"}
    assert torch.equal(buffer[1::3], torch.arange(1.0, 24.0, 3) * 2) and buffer[0] == -1 and buffer[3] == 3
    assert torch.equal(out, buffer[1::3] + 1) and int(total) == 28
    assert out.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
    assert on_device(fn, "cpu") is fn


# ----------------------------------------------------------------------------------------------------
# The plan
# ----------------------------------------------------------------------------------------------------
def checkout(tmp_path, missing=(), current=True, cpu_count=16) -> gpucheck.Checkout:
    return gpucheck.Checkout(REPO, tmp_path, sys.executable, cpu_count, frozenset(missing), current)


def test_budgets_fit_in_ten_minutes(tmp_path):
    """Guards against a plan that cannot finish in 10 minutes on an H100 even if every stage ran to its budget
    and its grace period."""
    stages = gpucheck.plan(checkout(tmp_path, current=False))
    assert [s.name for s in stages] == list(gpucheck.BUDGETS_S)
    worst = sum(s.budget_s + gpucheck.GRACE_S for s in stages) + gpucheck.REPORT_BUDGET_S
    assert worst <= gpucheck.TOTAL_BUDGET_S == 600


@pytest.mark.parametrize("total", [gpucheck.least_budget_s(), gpucheck.least_budget_s() + 1, 300, 480, 530, 600, 1200])
def test_a_budget_scales_every_stage_and_the_worst_case_fits_in_it(tmp_path, total):
    """Guards against `--budget` that leaves the worst case (every stage to its budget and grace, then the
    report) longer than asked, changes the default plan, or starves a stage of all its time."""
    stages = gpucheck.plan(dataclasses.replace(checkout(tmp_path, current=False), budget_s=total))
    budgets = {s.name: s.budget_s for s in stages}
    worst = sum(b + gpucheck.GRACE_S for b in budgets.values()) + gpucheck.REPORT_BUDGET_S
    assert worst <= total and min(budgets.values()) >= 1
    if total == gpucheck.TOTAL_BUDGET_S:
        assert budgets == gpucheck.BUDGETS_S
    else:  # proportions kept (to the whole second), more or less time than the default as asked
        scale = budgets["tests"] / gpucheck.BUDGETS_S["tests"]
        assert (scale < 1) == (total < gpucheck.TOTAL_BUDGET_S)
        assert all(abs(b - gpucheck.BUDGETS_S[n] * scale) <= 1 + scale for n, b in budgets.items())


@pytest.mark.parametrize("only", [(), ("bench-sampling",), ("tests", "bench-attention")])
@pytest.mark.parametrize("current", [True, False])
def test_only_the_selected_stages_share_the_budget(tmp_path, only, current):
    """Guards against `--only` running stages it does not name, giving a stage not run a budget (the build with
    nothing to do included), leaving out the compile stage that every other one relies on, or a worst case past
    the total."""
    plan = gpucheck.plan(dataclasses.replace(checkout(tmp_path, current=current), budget_s=300, only=only))
    budgeted = {s.name: s.budget_s for s in plan if s.budget_s}
    expected = set(only or gpucheck.BUDGETS_S) - {"build"} | {"compile"} | (set() if current else {"build"})
    assert set(budgeted) == expected
    assert all(s.skip == "not selected (--only)" for s in plan if s.name not in expected and s.name != "build")
    assert sum(budgeted.values()) + gpucheck.fixed_cost_s(len(budgeted)) <= 300
    if only:  # the named stages get the time of the others, in proportion
        ratio = {n: b / gpucheck.BUDGETS_S[n] for n, b in budgeted.items()}
        assert max(ratio.values()) - min(ratio.values()) < 0.05
        assert min(ratio.values()) > gpucheck.stage_budgets(300)["tests"] / gpucheck.BUDGETS_S["tests"]


def test_only_names_stages_or_is_refused(capsys):
    """Guards against a misspelt stage in `--only` being ignored (a check that silently runs less)."""
    with pytest.raises(SystemExit) as info:
        cli.main(["gpu-check", "--dry-run", "--only", "bench-attention,benchmarks"])
    assert info.value.code == 2 and "argument --only" in capsys.readouterr().err


@pytest.mark.parametrize("text", [str(gpucheck.least_budget_s() - 1), "0", "-5", "5.5", "ten"])
def test_a_budget_too_short_for_the_stages_is_refused_by_name(text, capsys):
    """Guards against a `--budget` whose stages would get no time (or a negative one) being accepted."""
    with pytest.raises(SystemExit) as info:
        cli.main(["gpu-check", "--dry-run", "--budget", text])
    assert info.value.code == 2
    assert "argument --budget" in capsys.readouterr().err


def test_plan_runs_the_suite_on_cuda_without_installing_anything(tmp_path, monkeypatch):
    """Guards against a test stage that interprets the kernels (TRITON_INTERPRET inherited), runs the suite once
    per shard instead of once in all, leaves GPU test files to the end, any stage that installs or downloads
    (pip, venv) instead of using this interpreter, or one whose subprocesses (torchrun's ranks) cannot import
    the package built in place, not installed."""
    monkeypatch.setenv("PYTHONPATH", "/wheels/carried")
    stages = {s.name: s for s in gpucheck.plan(checkout(tmp_path, current=False))}
    tests = stages["tests"]
    assert len(tests.commands) == 8 and len({c[:-1] for c in tests.commands}) == 1
    assert [c[-1] for c in tests.commands] == [f"--junitxml={tmp_path}/logs/tests-{i}.xml" for i in range(8)]
    env = [tests.environment(i, REPO) for i in range(8)]
    assert all(e["PYTHONPATH"] == f"{REPO}{os.pathsep}/wheels/carried" for e in env)
    assert all(e["SBD_TEST_DEVICE"] == "cuda" and "TRITON_INTERPRET" not in e for e in env)
    assert sorted(e["SBD_TEST_SHARD"] for e in env) == [f"{i}/8" for i in range(8)]
    assert all(e["HF_HUB_OFFLINE"] == "1" for e in env)
    assert "tests/test_package.py::test_plain_pip_install_keeps_the_installed_torch" in tests.commands[0]
    files = [a for a in tests.commands[0] if a.startswith("tests/") and "::" not in a]
    assert files[0] == "tests/test_attention_triton.py" and "tests/test_hf.py" in files
    assert set(files) == {f"tests/{p.name}" for p in (REPO / "tests").glob("test_*.py")}
    assert stages["build"].commands == ((sys.executable, "setup.py", "build_ext", "--inplace", "--force"),)
    for family in gpucheck.BENCH_FAMILIES:
        stage = stages[f"bench-{family}"]
        env = stage.environment(0, REPO)
        assert env["SBD_BENCH_DEVICE"] == "cuda" and env["SBD_BENCH_QUICK"] == "1" and env["PYTHONPATH"].startswith(str(REPO))
        assert f"bench/bench_{family}.py" in stage.commands[0] and stage.raw_json == tmp_path / "raw" / f"{family}.json"
    words = [word for s in stages.values() for command in s.commands for word in command]
    assert all(c[0] == sys.executable for s in stages.values() for c in s.commands)
    assert not {"pip", "install", "venv", "download"} & set(words)


def test_plan_skips_what_cannot_run_and_says_why(tmp_path):
    """Guards against a stage that fails for a missing optional package instead of being skipped with the
    reason, and against a build run although the extension is current."""
    stages = {s.name: s for s in gpucheck.plan(checkout(tmp_path, missing={"transformers", "pytest_benchmark"}))}
    assert stages["build"].commands == () and "up to date" in stages["build"].nothing_to_do
    assert "tests/test_hf.py" not in stages["tests"].commands[0] and stages["tests"].skip is None
    assert stages["bench-hf"].skip == "pytest_benchmark, transformers not installed"
    assert stages["bench-attention"].skip == "pytest_benchmark not installed"
    without_pytest = {s.name: s for s in gpucheck.plan(checkout(tmp_path, missing={"pytest"}))}
    assert without_pytest.pop("compile").skip is None  # no pytest in it
    assert {s.skip for name, s in without_pytest.items() if name != "build"} == {"pytest not installed"}
    assert stages["compile"].commands == ((sys.executable, "-m", "sbd_kernels.aot", "--warm", "--jobs", "16"),)
    assert gpucheck.plan(checkout(tmp_path, missing={"triton"}))[1].skip == "triton not installed"
    assert [gpucheck.test_shards(n) for n in (1, 2, 8, 16, 64)] == [1, 1, 4, 8, 8]


@pytest.mark.parametrize("missing", [{"transformers"}, {"pytest_benchmark"}, {"pytest"}])
def test_a_stage_that_cannot_run_leaves_its_budget_to_the_others(tmp_path, missing):
    """Guards against a stage known to be skipped (a module missing) keeping a share of the budget that no
    stage then uses: the stages that run share all of it, in their proportions, and the skipped ones have none."""
    stages = gpucheck.plan(checkout(tmp_path, missing=missing))
    skipped = {s.name for s in stages if s.skip is not None}
    running = tuple(s.name for s in stages if s.skip is None and s.nothing_to_do is None)
    assert skipped and all(s.budget_s == 0 for s in stages if s.name in skipped)
    room = checkout(tmp_path).stage_room_s()
    assert {s.name: s.budget_s for s in stages if s.name in running} == gpucheck.stage_budgets(room, running)
    everything = {s.name: s.budget_s for s in gpucheck.plan(checkout(tmp_path))}
    assert all(s.budget_s > everything[s.name] for s in stages if s.name in running)


# ----------------------------------------------------------------------------------------------------
# Running a stage
# ----------------------------------------------------------------------------------------------------
def test_a_bench_run_interrupted_in_a_timing_keeps_the_timings_it_finished(tmp_path):
    """Guards against losing a whole bench stage's JSON when its budget stops it in the middle of a timing:
    pytest-benchmark's writer failed on the unfinished entry (seen on an H200: bench-hf wrote 0 bytes)."""
    (tmp_path / "test_interrupted.py").write_text(
        "def test_finished(benchmark):\n"
        "    benchmark.pedantic(lambda: None, rounds=2)\n\n"
        "def test_stopped(benchmark):\n"
        "    def stop():\n"
        "        raise KeyboardInterrupt\n"
        "    benchmark.pedantic(stop, rounds=2)\n")
    raw = tmp_path / "raw.json"
    proc = subprocess.run([sys.executable, "-m", "pytest", str(tmp_path / "test_interrupted.py"), "-p",
                           "bench.conftest", "-q", "-p", "no:cacheprovider", f"--benchmark-json={raw}"],
                          check=False, cwd=REPO, capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert proc.returncode == 2, proc.stdout + proc.stderr  # interrupted
    assert [b["name"] for b in json.loads(raw.read_text())["benchmarks"]] == ["test_finished"]
    assert gpucheck.raw_outcome(raw) == (1, [])


def test_test_outcomes_are_counted_by_file_from_the_junit_files(tmp_path):
    """Guards against a report that cannot say which test files a budget-stopped GPU run checked, or how many it
    did not reach: the planned node ids and the outcomes of every shard's JUnit XML, by file; a missing or
    cut-short file counts nothing."""
    folder = tmp_path / "tests"
    folder.mkdir()
    (folder / "test_a.py").write_text("import pytest\n\ndef test_ok():\n    pass\n\ndef test_bad():\n    assert 0\n\n"
                                      "@pytest.mark.skip(reason='no')\ndef test_skip():\n    pass\n")
    (folder / "test_b.py").write_text("def test_ok():\n    pass\n")
    junit = (tmp_path / "0.xml", tmp_path / "1.xml", tmp_path / "missing.xml", tmp_path / "cut.xml")
    for path, name in zip(junit[:2], ("test_a.py", "test_b.py")):
        subprocess.run([sys.executable, "-m", "pytest", f"tests/{name}", "-q", "-p", "no:cacheprovider",
                        f"--junitxml={path}", "--rootdir", str(tmp_path)], check=False, cwd=tmp_path,
                       capture_output=True)
    junit[3].write_text(junit[0].read_text()[:100])
    assert gpucheck.outcomes_by_file(junit) == {"tests/test_a.py": {"passed": 1, "failed": 1, "skipped": 1},
                                                "tests/test_b.py": {"passed": 1}}
    (tmp_path / "0.plan").write_text("tests/test_a.py::test_ok\ntests/test_a.py::test_bad\ntests/test_a.py::test_skip\n"
                                     "tests/test_a.py::test_not_reached\n")
    counts = gpucheck.outcomes_by_file(junit, (tmp_path / "0.plan", tmp_path / "missing.plan"))
    assert counts["tests/test_a.py"] == {"planned": 4, "passed": 1, "failed": 1, "skipped": 1}


def test_a_shard_writes_the_tests_it_is_about_to_run(tmp_path):
    """Guards against a plan file that differs from what the shard runs (other tests, another order): it is
    what gpu-check counts the tests not reached against."""
    env = {**{k: v for k, v in os.environ.items() if k not in ("SBD_TEST_SHARD", "SBD_TEST_PLAN")},
           "SBD_TEST_SHARD": "1/3", "SBD_TEST_PLAN": str(tmp_path / "plan")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests/test_overlap.py", "--collect-only", "-q", "-p",
                           "no:cacheprovider"], check=True, cwd=REPO, capture_output=True, text=True, env=env)
    collected = [line for line in proc.stdout.splitlines() if "::" in line]
    assert collected and (tmp_path / "plan").read_text().splitlines() == collected
    subprocess.run([sys.executable, "-m", "pytest", "tests/test_overlap.py", "--collect-only", "-q", "-p",
                    "no:cacheprovider"], check=True, cwd=REPO, capture_output=True, env={**env, "SBD_TEST_SHARD": "0/3"})
    assert (tmp_path / "plan").read_text().splitlines() == collected  # a later run (a test's own) leaves it


def test_a_deselected_test_is_not_planned(tmp_path):
    """Guards against the test gpu-check leaves out (DESELECTED_TESTS, pytest's --deselect) counted as one the
    budget did not reach in every finished run: the plan lists what runs after every selection."""
    env = {**{k: v for k, v in os.environ.items() if k not in ("SBD_TEST_SHARD", "SBD_TEST_PLAN")},
           "SBD_TEST_PLAN": str(tmp_path / "plan")}
    left_out = "tests/test_overlap.py::test_internal_overlap_of_sliced_views_is_no[0]"
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests/test_overlap.py", "--collect-only", "-q", "-p",
                           "no:cacheprovider", "--deselect", left_out], check=True, cwd=REPO, capture_output=True,
                          text=True, env=env)
    collected = [line for line in proc.stdout.splitlines() if "::" in line]
    assert "1 deselected" in proc.stdout and left_out not in collected
    assert (tmp_path / "plan").read_text().splitlines() == collected


def test_bench_rows_that_compile_per_case_come_last_in_each_file():
    """Guards against a budget-stopped bench stage without complete comparisons: every case's kernel and plain
    baseline (sbd, SDPA, eager) are timed before any FlexAttention, torch.compile or oracle row of the file."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "bench/bench_attention.py", "bench/bench_sampling.py",
                           "--collect-only", "-q", "-p", "no:cacheprovider"], check=True, cwd=REPO,
                          capture_output=True, text=True,
                          env={**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "SBD_BENCH_QUICK": "1"})
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    files = [i.split("::")[0] for i in ids]
    assert files == sorted(files, key=files.index) and len(set(files)) == 2  # each file's rows together
    late = ("flex", "compile", "naive")
    for name in set(files):
        providers = [i.rsplit("-", 1)[1].rstrip("]") for i in ids if i.startswith(name)]
        ranks = [late.index(p) + 1 if p in late else 0 for p in providers]
        assert ranks == sorted(ranks) and ranks[0] == 0 and ranks[-1] > 0, name


def test_a_bench_run_killed_keeps_the_timings_it_finished(tmp_path):
    """Guards against losing every timing of a bench stage killed after its grace period (a compile that ignores
    SIGINT; seen on an H200: bench-attention kept none of the timing it had finished): each finished timing is
    appended at once, with the extra_info the test adds after timing, and read back when no JSON was written."""
    (tmp_path / "test_killed.py").write_text(
        "import os, signal\n\n"
        "def test_finished(benchmark):\n"
        "    benchmark.pedantic(lambda: None, rounds=2)\n"
        "    benchmark.extra_info['graph_ms'] = 1.5\n\n"
        "def test_killed(benchmark):\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n")
    raw = tmp_path / "raw.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "pytest", str(tmp_path / "test_killed.py"), "-p", "bench.conftest",
                           "-q", "-p", "no:cacheprovider", f"--benchmark-json={raw}"], check=False, cwd=REPO,
                          capture_output=True, env={**env, bench_report.PARTIAL_VARIABLE: str(bench_report.partial_path(raw))})
    assert proc.returncode == -signal.SIGKILL and not raw.exists()
    (timing,) = bench_report.read_raw(raw)
    assert timing["name"] == "test_finished" and timing["extra_info"]["graph_ms"] == 1.5
    assert len(timing["stats"]["data"]) == 2 and timing["stats"]["median"] >= 0
    with open(bench_report.partial_path(raw), "a") as handle:
        handle.write('{"name": "cut sh')  # a line cut short by the kill
    assert len(bench_report.read_raw(raw)) == 1 and gpucheck.raw_outcome(raw) == (1, [])


def test_an_unreadable_bench_json_counts_no_timings(tmp_path):
    """Guards against the report crashing on a bench stage's JSON left empty or cut short (a stage killed while
    writing it): its timings are lost, the rest of the report is written."""
    for text in ("", '{"benchmarks": [{"name": "x"'):
        (tmp_path / "raw.json").write_text(text)
        assert gpucheck.raw_outcome(tmp_path / "raw.json") == (0, [])
        stage = gpucheck.Stage("bench-hf", 30, "", raw_json=tmp_path / "raw.json")
        ran = gpucheck.StageResult("bench-hf", "overran", 31.0, 30, "stopped")
        assert gpucheck.merged_raw([stage], [ran]) == {"benchmarks": []}


def test_a_stage_past_its_budget_is_stopped_and_says_so(tmp_path, monkeypatch):
    """Guards against a stage that overruns its budget holding up the whole check (the 10 minutes): it is
    interrupted at the budget, a process that ignores the interrupt is killed after the grace period, and
    the result says so with what had been done."""
    monkeypatch.setattr(gpucheck, "GRACE_S", 1)
    report = "print('3 passed in 0.4s', flush=True); time.sleep(120)"
    slow = (sys.executable, "-c", f"import time; {report}")
    stubborn = (sys.executable, "-c", f"import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); {report}")
    stage = gpucheck.Stage("tests", 1, "a test run that hangs", commands=(slow, stubborn))
    result = gpucheck.run_stage(stage, checkout(tmp_path))
    assert result.status == "overran" and result.seconds < 5
    assert result.detail == "stopped at the 1 s budget; 6 passed"
    assert (tmp_path / "logs" / "tests-1.log").read_text().startswith("3 passed")


def test_a_stage_runs_on_the_seconds_carried_over_to_it(tmp_path, monkeypatch):
    """Guards against a stage stopped at its own budget while the stages before it left time unused: it is
    stopped at its budget plus the seconds carried over (stage.carried_s), and says so when stopped."""
    monkeypatch.setattr(gpucheck, "GRACE_S", 1)
    command = (sys.executable, "-c", "import time; time.sleep(1.5); print('1 passed in 1.5s')")
    stage = gpucheck.Stage("tests", 1, "a test run longer than its budget", commands=(command,), carried_s=3.0)
    result = gpucheck.run_stage(stage, checkout(tmp_path))
    assert result.status == "passed" and result.carried_s == 3.0 and result.budget_text() == "1+3"
    hang = (sys.executable, "-c", "import time; time.sleep(120)")
    stopped = gpucheck.run_stage(dataclasses.replace(stage, commands=(hang,), carried_s=1.0), checkout(tmp_path))
    assert stopped.status == "overran" and 2 <= stopped.seconds < 5
    assert stopped.detail.startswith("stopped at its 1 s budget + 1 s the stages before left")


# One tiny case of each benchmark family (a `-k` expression on the bench file's test ids): our provider only.
TINY_BENCH_CASES = {
    "attention": "test_block_attention[1-512-fp32-sbd]",
    "sampling": "test_entropy_sample[1-1-32000-fp32-sbd]",
    "scatter": "test_mask_scatter[1-16-sbd]",
    "decode": "test_decode_pass[small-1-512-1]",
    "hf": "ntp and small-1 and not small-16 and not graphed",
}


def test_every_family_has_a_tiny_case():
    assert set(TINY_BENCH_CASES) == set(gpucheck.BENCH_FAMILIES)


@pytest.mark.slow
@pytest.mark.parametrize("family", gpucheck.BENCH_FAMILIES)
def test_bench_stage_command_runs_on_cpu(tmp_path, family):
    """Guards against a benchmark command line of the check that only fails on the GPU machine (a wrong flag,
    path, plugin option or environment variable): the bench stage's own command and runner, with the
    benchmarks moved to the CPU (SBD_BENCH_DEVICE=cpu), one round, and one tiny case (-k), time that case
    and write its pytest-benchmark JSON. The command is `sbd bench`'s (bench_report.benchmark_command)."""
    stage = gpucheck.bench_stage(checkout(tmp_path, missing=gpucheck.missing_modules()), family)
    if stage.skip is not None:
        assert family == "hf" and stage.skip == "transformers not installed", stage.skip
        pytest.skip(f"bench-hf: {stage.skip}")
    raw = tmp_path / "raw" / f"{family}.json"
    assert stage.commands == (tuple(bench_report.benchmark_command(sys.executable, [f"bench/bench_{family}.py"],
                                                                   raw, ("-rs",))),)
    on_cpu = dataclasses.replace(stage, commands=tuple((*c, "-k", TINY_BENCH_CASES[family]) for c in stage.commands),
                                 env=(*stage.env, ("SBD_BENCH_DEVICE", "cpu"), ("SBD_BENCH_ROUNDS", "1")),
                                 budget_s=300)  # the GPU budgets do not apply to this shared CPU
    result = gpucheck.run_stage(on_cpu, checkout(tmp_path))
    log = (tmp_path / "logs" / f"{stage.name}.log").read_text()
    assert result.status == "passed" and result.detail == "1 passed, 1 timings", (result.detail, log[-3000:])
    assert json.loads(raw.read_text())["benchmarks"][0]["extra_info"]["device"] == "cpu"


@pytest.mark.slow
def test_test_stage_command_runs_on_cpu(tmp_path, monkeypatch):
    """Guards against the test stage's pytest command line only failing on the GPU machine (a wrong flag,
    deselected id or plugin option): its own command and runner, on one small test file and on the CPU
    (SBD_TEST_DEVICE=cpu instead of cuda), pass."""
    monkeypatch.setattr(gpucheck, "test_files", lambda checkout_: ["tests/test_tasks.py"])
    stage = gpucheck.test_stage(checkout(tmp_path, missing=gpucheck.missing_modules(), cpu_count=1))
    assert len(stage.commands) == 1 and "tests/test_tasks.py" in stage.commands[0]
    on_cpu = dataclasses.replace(stage, env=(*stage.env, ("SBD_TEST_DEVICE", "cpu")), budget_s=300)
    result = gpucheck.run_stage(on_cpu, checkout(tmp_path))
    log = (tmp_path / "logs" / "tests.log").read_text()
    assert result.status == "passed" and "passed" in result.detail and not result.failures, log[-3000:]


def test_judge_reads_pytest_summaries():
    """Guards against a failed or erroring test run reported as passed, or counts lost between shards."""
    stage = gpucheck.Stage("tests", 100, "", commands=(("x",), ("x",)))
    logs = ["FAILED tests/test_a.py::test_x - AssertionError: 1 != 2\n==== 1 failed, 10 passed, 2 skipped in 3.1s ====",
            "SKIPPED [1] tests/test_b.py:4: cmake is not installed\n12 passed, 3 deselected in 2.0s"]
    result = gpucheck.judge(stage, [1, 0], logs, False, 5.0)
    assert result.status == "failed" and result.detail.startswith("22 passed, 1 failed, 2 skipped")
    assert result.failures == ["FAILED tests/test_a.py::test_x - AssertionError: 1 != 2"]
    assert result.skipped == ["SKIPPED [1] tests/test_b.py:4: cmake is not installed"]
    assert gpucheck.judge(stage, [0, 0], ["4 passed in 1s", "5 passed, 1 error in 1s"], False, 1.0).status == "failed"
    stopped = gpucheck.judge(stage, [4, 4], ["SBD_TEST_DEVICE=cuda, but torch x sees no CUDA device"] * 2, False, 1.0)
    assert stopped.status == "failed" and stopped.detail.endswith("sees no CUDA device")
    build = gpucheck.Stage("build", 90, "", commands=(("x",),))
    assert gpucheck.judge(build, [1], ["error: command 'g++' failed"], False, 1.0).detail == "error: command 'g++' failed"


def test_judge_reads_the_compile_stage_by_its_exit_status():
    """Guards against a configuration that failed to compile for the GPU passing unseen (its summary line
    holds a "1 failed" that is no pytest count), or a clean compile stage reported as failed."""
    stage = gpucheck.Stage("compile", 40, "", commands=(("x",),))
    log = ("FAILED attention/split bf16 M64 N64 D128 contig aligned: CompilationError: out of resources\n"
           "302 configurations compiled for this GPU in 21 s (16 processes, slowest 3.1 s: x); 1 failed")
    failed = gpucheck.judge(stage, [1], [log], False, 21.0)
    assert failed.status == "failed" and failed.detail.endswith("; 1 failed")
    assert failed.failures == [log.splitlines()[0]]
    passed = gpucheck.judge(stage, [0], [log.splitlines()[1].replace("1 failed", "0 failed")], False, 21.0)
    assert passed.status == "passed" and passed.detail.startswith("302 configurations compiled")


# ----------------------------------------------------------------------------------------------------
# The GPU while a stage runs (machine.GpuMonitor on a fake NVML)
# ----------------------------------------------------------------------------------------------------
class FakeNvml:
    """The calls of nvidia-ml-py that GpuMonitor makes, answering from `readings` in turn (the last one
    repeats); a field missing from a reading raises NVMLError as an unsupported query does."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0

    class NVMLError(Exception):
        pass

    def __init__(self, readings: list[dict], fail_init: bool = False):
        self.readings, self.fail_init, self.calls, self.shut = readings, fail_init, 0, False

    def _field(self, key: str):
        reading = self.readings[min(self.calls, len(self.readings) - 1)]
        if key not in reading:
            raise self.NVMLError("Not Supported")
        return reading[key]

    def nvmlInit(self):
        if self.fail_init:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetHandleByIndex(self, index):
        return "gpu0"

    def nvmlDeviceGetUtilizationRates(self, handle):
        return types.SimpleNamespace(gpu=self._field("util"), memory=0)

    def nvmlDeviceGetPowerUsage(self, handle):
        return self._field("mw")

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return self._field("reasons")

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return self._field("temp")

    def nvmlDeviceGetClockInfo(self, handle, clock):
        value = self._field("sm" if clock == self.NVML_CLOCK_SM else "mem")
        if clock == self.NVML_CLOCK_MEM:
            self.calls += 1  # the last field of a sample: the next sample reads the next reading
        return value


class FakeNvmlBeforeTheRename(FakeNvml):
    """nvidia-ml-py before driver 535's names: the clock event reasons are only ...ThrottleReasons."""

    @property
    def nvmlDeviceGetCurrentClocksEventReasons(self):
        raise AttributeError("module 'pynvml' has no attribute 'nvmlDeviceGetCurrentClocksEventReasons'")

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
        return self._field("reasons")


IDLE = {"util": 0, "mw": 70_000, "reasons": 0x1, "temp": 30, "sm": 345, "mem": 3201}
BUSY = {"util": 90, "mw": 650_000, "reasons": 0, "temp": 61, "sm": 1980, "mem": 3201}
CAPPED = {**BUSY, "util": 100, "mw": 700_000, "reasons": 0x4, "temp": 66, "sm": 1755}


def sampled(readings: list[dict], nvml=FakeNvml) -> machine.GpuMonitor:
    """A GpuMonitor whose samples are one per reading, in order (its thread's own are replaced)."""
    fake = nvml(readings)
    with machine.GpuMonitor(nvml=fake) as monitor:
        pass
    fake.calls = 0
    monitor.samples = [monitor.sample() for _ in readings]
    return monitor


def test_gpu_load_is_summarised_over_the_busy_samples():
    """Guards against a report whose clocks mix idle samples in (the header's 345 MHz idle SM clock read as the
    benchmarks' clock), that hides a power cap, or that counts the idle reason as a slowdown."""
    load = sampled([IDLE, BUSY, BUSY, CAPPED, IDLE]).summary()
    assert load == {"samples": 5, "busy": 3, "interval_s": 0.5, "sm_clock_mhz": 1980, "min_sm_clock_mhz": 1755,
                    "mem_clock_mhz": 3201, "temperature_c": 66, "power_w": 700.0, "utilization_pct": 93,
                    "reasons": {"software power cap": 1}}
    assert machine.gpu_load_text(load) == ("SM 1980 MHz (lowest 1755), memory 3201 MHz, 66 C, 700 W, 93% busy in 3 of "
                                           "5 samples 0.5 s apart; clock events: software power cap in 1")


def test_gpu_load_leaves_out_what_the_gpu_does_not_report():
    """Guards against a GPU or driver without power or utilisation readings (some virtual GPUs) failing the
    stage or giving "idle in all samples" for a GPU that was busy; and against an nvidia-ml-py from before
    the clock event reasons' rename losing them."""
    bare = [{k: v for k, v in CAPPED.items() if k not in ("mw", "util")}] * 2
    load = sampled(bare, FakeNvmlBeforeTheRename).summary()
    assert load["busy"] == 2 and "power_w" not in load and load["reasons"] == {"software power cap": 2}
    assert machine.gpu_load_text(load) == ("SM 1755 MHz (lowest 1755), memory 3201 MHz, 66 C, 2 samples 0.5 s apart "
                                           "(no utilisation reported); clock events: software power cap in 2")
    assert machine.gpu_load_text(sampled([IDLE, IDLE]).summary()) == "idle in all 2 samples"


def test_gpu_load_without_nvml_says_why_and_never_raises(monkeypatch):
    """Guards against a machine without NVML (no driver, or nvidia-ml-py missing) failing the stage it watches."""
    with machine.GpuMonitor(nvml=FakeNvml([IDLE], fail_init=True)) as monitor:
        pass
    assert machine.gpu_load_text(monitor.summary()) == "not sampled (NVML failed: Driver Not Loaded)"
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    with machine.GpuMonitor() as monitor:
        pass
    assert monitor.summary() == {"error": "nvidia-ml-py not installed"}
    assert machine.gpu_load_text({}) == "-"


def test_a_stage_records_the_gpu_while_its_commands_run(tmp_path, monkeypatch):
    """Guards against a stage result without the GPU's state during it, or a monitor left sampling (NVML not
    shut down) after the stage's commands ended."""
    fake = FakeNvml([BUSY])
    monkeypatch.setattr(gpucheck, "GpuMonitor", lambda: machine.GpuMonitor(interval_s=0.01, nvml=fake))
    stage = gpucheck.Stage("tests", 30, "one short command",
                           commands=((sys.executable, "-c", "import time; time.sleep(0.3); print('1 passed in 0.3s')"),))
    result = gpucheck.run_stage(stage, checkout(tmp_path))
    assert result.status == "passed" and result.gpu_load["busy"] >= 5, result
    assert result.gpu_load["sm_clock_mhz"] == 1980 and fake.shut
    calls = fake.calls
    time.sleep(0.1)
    assert fake.calls == calls, "sampled after the stage ended"


# ----------------------------------------------------------------------------------------------------
# The command: dry run, no GPU, a whole run with stubbed stages
# ----------------------------------------------------------------------------------------------------
def test_dry_run_prints_the_plan_and_writes_the_report(tmp_path, capsys, monkeypatch):
    """Guards against a dry run that needs a GPU, hides the commands it would run, or writes no report."""
    monkeypatch.setattr(gpucheck, "extension_is_current", lambda repo: False)  # the default plan: build budgeted
    with pytest.raises(SystemExit) as info:
        cli.main(["gpu-check", "--dry-run", "--out", str(tmp_path)])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "SBD_TEST_DEVICE=cuda" in out and "bench/bench_attention.py" in out and "145 s" in out
    assert "budget: 600 s at most of 600 s" in out and "dry run" in out
    assert {p.name for p in tmp_path.iterdir()} >= {"report.md", "report.json", "report.csv", "gpu-check.json"}
    report = (tmp_path / "report.md").read_text()
    assert "NVML fields missing" in report and "| tests | not run | 0 | 145 | dry run |" in report
    assert json.loads((tmp_path / "gpu-check.json").read_text())["dry_run"] is True


def test_a_dry_run_with_a_budget_plans_and_reports_against_it(tmp_path, capsys, monkeypatch):
    """Guards against `--budget` reaching the stages but not the plan's total, the report or its JSON."""
    monkeypatch.setattr(gpucheck, "extension_is_current", lambda repo: False)  # every stage budgeted
    with pytest.raises(SystemExit) as info:
        cli.main(["gpu-check", "--dry-run", "--budget", "480", "--out", str(tmp_path)])
    assert info.value.code == 0
    budgets = gpucheck.stage_budgets(480)
    out = capsys.readouterr().out
    assert "of 480 s (stages" in out and f"tests             {budgets['tests']} s" in out
    assert "budget 480 s (default 600 s" in (tmp_path / "report.md").read_text()
    assert json.loads((tmp_path / "gpu-check.json").read_text())["budget_s"] == 480


@pytest.mark.parametrize("spent", [0, 45, 1000])
def test_the_build_before_the_command_counts_against_the_budget(tmp_path, spent):
    """Guards against `make gpu-check` taking its build plus the whole budget (past 10 minutes on an H100):
    the seconds spent before the first stage (--started-at) leave the stages the rest, never less than the least
    budget that gives each a second, and the build's line says how long it took."""
    room = max(gpucheck.least_budget_s(), gpucheck.TOTAL_BUDGET_S - spent)
    given = dataclasses.replace(checkout(tmp_path), spent_s=spent)
    stages = gpucheck.plan(given)
    assert {s.name: s.budget_s for s in stages if s.budget_s} == gpucheck.stage_budgets(room, given.selected())
    worst = spent + sum(s.budget_s + gpucheck.GRACE_S for s in stages if s.budget_s) + gpucheck.REPORT_BUDGET_S
    assert worst <= gpucheck.TOTAL_BUDGET_S or room == gpucheck.least_budget_s()
    build = next(s for s in stages if s.name == "build")
    assert build.nothing_to_do == (f"built before this command (`make gpu-check`; {spent} s before the first stage)"
                                   if spent else "up to date: newer than every source")
    assert f"budget: {worst} s at most of 600 s" in gpucheck.plan_text(stages, given.budget_s, spent)


def test_make_gpu_check_passes_the_time_of_its_build(capsys):
    """Guards against the Makefile's build being left out of the check's time again, and a --started-at that
    takes a negative, infinite or non-numeric time."""
    recipe = (REPO / "Makefile").read_text().split("\ngpu-check:\n", 1)[1].split("\n\n", 1)[0]
    assert recipe.index("start=$$(date +%s)") < recipe.index("torch.cuda.is_available()") < recipe.index("setup.py")
    assert "gpu-check --started-at $$start" in recipe
    for text in ("-1", "inf", "yesterday"):
        with pytest.raises(SystemExit) as info:
            cli.main(["gpu-check", "--dry-run", "--started-at", text])
        assert info.value.code == 2 and "argument --started-at" in capsys.readouterr().err


def test_the_time_before_the_command_starts_counts_against_the_budget(tmp_path, capsys, monkeypatch):
    """Guards against the check's clock starting after its own start-up (importing torch and triton, seconds
    the budget did not hold when `make gpu-check` passed only its build's time) or double-counting the time
    from the command's start to its first stage; a start in the future counts 0."""
    monkeypatch.setattr(gpucheck, "extension_is_current", lambda repo: True)
    started_at = time.time() - 45.5
    with pytest.raises(SystemExit) as info:
        cli.main(["gpu-check", "--dry-run", "--out", str(tmp_path), "--started-at", str(started_at)])
    assert info.value.code == 0
    since_start = time.time() - started_at
    written = json.loads((tmp_path / "gpu-check.json").read_text())
    spent = written["spent_s"]
    assert 46 <= spent <= 50, spent  # 45.5 s rounded up, plus the command's few seconds before its first stage
    assert written["seconds"] <= since_start + 1, (written["seconds"], since_start)  # + 1: spent_s is rounded up
    given = dataclasses.replace(checkout(tmp_path), spent_s=spent)
    out = capsys.readouterr().out
    assert f"before the stages, {spent} s;" in out and f"{spent} s before the first stage included" in (
        tmp_path / "report.md").read_text()
    assert f"tests             {given.stage_budget('tests')} s" in out
    assert gpucheck.seconds_since(time.time() + 60) == 0 and gpucheck.seconds_since(None) == 0


def test_without_a_gpu_one_line_and_status_1(tmp_path, capsys, monkeypatch):
    """Guards against a check that starts (or writes a report) on a machine where torch sees no GPU, or fails
    there with a traceback."""
    monkeypatch.setattr(gpucheck, "cuda_available", lambda: False)
    with pytest.raises(SystemExit) as info:
        cli.main(["gpu-check", "--out", str(tmp_path / "out")])
    assert info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sbd gpu-check: error: no NVIDIA GPU visible to torch")
    assert not (tmp_path / "out").exists()


H100_NVML = {"name": "NVIDIA H100 80GB HBM3", "driver": "550.54.15", "cuda": "12.4", "sm_clock_mhz": 1980,
             "max_sm_clock_mhz": 1980, "mem_clock_mhz": 2619, "max_mem_clock_mhz": 2619, "memory_gib": 79.6}


def fake_header(repo, gpu=True):
    return {"cpu": "test CPU", "cores": 16, "torch_threads": 16, "cpu_isa": "avx512", "gpu": H100_NVML,
            "torch": "2.x", "triton": "3.x", "python": "3.11", "commit": "abc1234", "date": "today",
            "copy_gbs": 100.0, "matmul_gflops": {"fp32": 1000.0, "bf16": 2000.0}}


def bench_entry(shape, provider: str, median_s: float, graph_ms: float | None, **work) -> dict:
    info = {"family": "sampling", "case": shape.label, "shape": grid.shape_to_dict(shape), "provider": provider,
            "baseline": "eager", "device": "cuda", "graph_ms": graph_ms, "bytes_moved": None, "flops": None,
            "correct": True if provider == "sbd" else None, **work}
    return {"stats": {"median": median_s, "data": [median_s]}, "extra_info": info}


def stub_runner(stage: gpucheck.Stage, checkout_: gpucheck.Checkout) -> gpucheck.StageResult:
    """What each stage "did": tests failed, attention overran, sampling wrote timings, the rest passed."""
    if stage.name == "bench-sampling":
        shape = grid.SamplingShape(1, 16, 128256, "bf16")
        logits = 16 * 128256 * 2  # 4.1 MB: 1.64 TB/s in 2.5 us of graph time
        stage.raw_json.parent.mkdir(parents=True, exist_ok=True)
        stage.raw_json.write_text(json.dumps({"benchmarks": [
            bench_entry(shape, "sbd", 40e-6, 0.0025, bytes_moved=logits),
            bench_entry(shape, "eager", 400e-6, 0.1, bytes_moved=logits)]}))
    outcome = {"tests": ("failed", "3 passed, 1 failed"), "bench-attention": ("overran", "stopped at the 65 s budget")}
    status, detail = outcome.get(stage.name, ("passed", "ok"))
    failures = ["FAILED tests/test_x.py::test_y - boom"] if stage.name == "tests" else []
    by_file = {"tests/test_x.py": {"planned": 6, "passed": 3, "failed": 1}} if stage.name == "tests" else {}
    load = sampled([IDLE, BUSY, CAPPED]).summary() if stage.name == "bench-sampling" else {}
    return gpucheck.StageResult(stage.name, status, 1.0, stage.budget_s, detail, failures, [], by_file, load)


def test_a_run_reports_stages_skips_failures_and_kernels(tmp_path, capsys, monkeypatch):
    """Guards against a report or summary that drops what a GPU run found: the NVML answer, a failed and an
    overrun stage (exit status 1), the skip list with reasons, achieved TB/s against the H100 datasheet."""
    monkeypatch.setattr(gpucheck, "cuda_available", lambda: True)
    monkeypatch.setattr(gpucheck, "missing_modules", lambda: frozenset({"transformers"}))
    monkeypatch.setattr(gpucheck, "machine_header", fake_header)
    monkeypatch.setattr(gpucheck, "extension_is_current", lambda repo: False)
    monkeypatch.setattr(gpucheck, "run_stage", stub_runner)
    with pytest.raises(SystemExit) as info:
        cli.main(["gpu-check", "--out", str(tmp_path)])
    assert info.value.code == 1
    out, err = capsys.readouterr()
    assert err == ""
    assert "name NVIDIA H100 80GB HBM3, driver 550.54.15" in out and "bench-hf (transformers not installed)" in out
    assert "tests: 4 of 6 run (1 failed), 2 not reached in the budget" in out
    sampling_load = ("SM 1868 MHz (lowest 1755), memory 3201 MHz, 66 C, 700 W, 95% busy in 2 of 3 samples 0.5 s "
                     "apart; clock events: software power cap in 1")
    assert f"GPU while the stages ran (NVML):\n  bench-sampling: {sampling_load}\n" in out
    assert ("sampling: 1 rows, 10.00x vs eager per call, 40.00x on CUDA-graph time; best 1.64 TB/s = 49% of the "
            "3.35 TB/s datasheet (B=1 K=16 V=128256 bf16)") in out
    report = (tmp_path / "report.md").read_text()
    budgets = {s.name: s.budget_s for s in gpucheck.plan(checkout(tmp_path, missing={"transformers"}, current=False))}
    assert budgets["bench-hf"] == 0 and budgets["tests"] > 145  # bench-hf's share goes to the stages that run
    for expected in ("# sbd gpu-check: NVIDIA H100 80GB HBM3",
                     f"| tests | failed | 1 | {budgets['tests']} | 3 passed, 1 failed | - |",
                     f"| bench-sampling | passed | 1 | {budgets['bench-sampling']} | ok | {sampling_load} |",
                     "- GPU (NVML, read before the stages: idle clocks): name NVIDIA H100 80GB HBM3",
                     "| bench-attention | overran |", "- tests/test_hf.py: transformers is not installed",
                     "- tests: FAILED tests/test_x.py::test_y - boom", "GPU ceilings: 3.35 TB/s, dense TFLOP/s bf16 989",
                     "| graph ms | TB/s | % datasheet BW |", "| 0.0025 | 1.642 | 49 |",
                     "| tests/test_x.py | 6 | 3 | 1 | 0 | 2 |\n| all | 6 | 3 | 1 | 0 | 2 |"):
        assert expected in report, expected
    stages = json.loads((tmp_path / "gpu-check.json").read_text())["stages"]
    assert {s["name"]: s["status"] for s in stages}["bench-hf"] == "skipped"


def test_summary_does_not_present_decode_widths_as_speedups():
    """Guards against the summary listing decode's "sbd t=16" / "sbd t=32" rows, whose baseline is our own
    "sbd t=1", as kernel speedups ("0.50x vs sbd t=1"): such a family's line gives time(t)/time(1) and says
    it is not a speedup; families with a foreign baseline keep their speedups."""
    decode = [bench_entry(grid.DecodeShape("small", 1, 512, t), f"sbd t={t}", median_s, graph_ms)
              for t, median_s, graph_ms in ((1, 4e-3, 0.35), (16, 5e-3, 0.70), (32, 8e-3, 1.05))]
    for entry in decode:
        entry["extra_info"].update(family="decode", baseline="sbd t=1", correct=True)
    shape = grid.SamplingShape(1, 16, 128256, "bf16")
    raw = {"benchmarks": [*decode, bench_entry(shape, "sbd", 40e-6, 0.0025), bench_entry(shape, "eager", 400e-6, 0.1)]}
    ceilings = bench_report.datasheet_ceilings("NVIDIA H100 80GB HBM3")
    lines = gpucheck.kernel_lines(bench_report.rows_from_raw(raw, ceilings))
    assert "  decode: 2 rows, time over our own sbd t=1 (not a speedup): 1.25-2.00x per call, 2.00-3.00x on CUDA-graph time" in lines
    assert "  sampling: 1 rows, 10.00x vs eager per call, 40.00x on CUDA-graph time" in lines
    assert not any("vs sbd t=1" in line for line in lines)


def stubbed_check(monkeypatch, runner, current=True) -> None:
    """`sbd gpu-check` on a GPU machine as the tests see it: a GPU, transformers missing, the header of an H100,
    `runner` in place of run_stage."""
    monkeypatch.setattr(gpucheck, "cuda_available", lambda: True)
    monkeypatch.setattr(gpucheck, "missing_modules", lambda: frozenset({"transformers"}))
    monkeypatch.setattr(gpucheck, "machine_header", fake_header)
    monkeypatch.setattr(gpucheck, "extension_is_current", lambda repo: current)
    monkeypatch.setattr(gpucheck, "run_stage", runner)


def decode_entries(ceilings: dict | None = None) -> list[dict]:
    """Two decode timings of an earlier run on CUDA, with the ceilings the decode bench stores."""
    entries = [bench_entry(grid.DecodeShape("small", 1, 512, t), f"sbd t={t}", 4e-3, 0.35, bytes_moved=int(1e9))
               for t in (1, 16)]
    for entry in entries:
        entry["extra_info"].update(family="decode", baseline="sbd t=1", correct=True, decode={"ceilings": ceilings})
    return entries


def test_a_run_reports_only_the_timings_it_took(tmp_path, capsys, monkeypatch):
    """Guards against an earlier check's files in the report folder (the committed reference's raw/, logs/ and
    plots) reported as this run's: a stage not selected, skipped or not run reads no raw JSON, and the raw
    JSON, logs and plots of the stages are removed before the stages run; other files stay."""
    raw = tmp_path / "raw"
    raw.mkdir()
    scatter = grid.ScatterShape(1, 16)
    earlier = [bench_entry(scatter, provider, 1e-5, 0.01, family="scatter") for provider in ("sbd", "eager")]
    (raw / "scatter.json").write_text(json.dumps({"benchmarks": earlier}))
    (raw / "hf.partial.jsonl").write_text("{}\n")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "bench-decode.log").write_text("earlier")
    (tmp_path / "logs" / "tests-3.xml").write_text("<testsuites/>")
    (tmp_path / "attention_gflops.png").write_bytes(b"earlier")
    (tmp_path / "first-run" / "raw").mkdir(parents=True)
    (tmp_path / "first-run" / "raw" / "decode.json").write_text("kept")
    stubbed_check(monkeypatch, stub_runner)
    with pytest.raises(SystemExit):
        cli.main(["gpu-check", "--out", str(tmp_path), "--only", "bench-sampling"])
    out = capsys.readouterr().out
    report = (tmp_path / "report.md").read_text()
    assert "## sampling\n" in report and "## scatter" not in report and "  scatter:" not in out
    assert [p.name for p in raw.iterdir()] == ["sampling.json"]
    assert not (tmp_path / "logs").exists() or not list((tmp_path / "logs").iterdir())
    assert not (tmp_path / "attention_gflops.png").exists()
    assert (tmp_path / "first-run" / "raw" / "decode.json").read_text() == "kept"
    stages = [gpucheck.Stage("bench-decode", 45, "", raw_json=raw / "decode.json")]
    (raw / "decode.json").write_text(json.dumps({"benchmarks": decode_entries()}))
    for status in ("skipped", "not run"):
        assert gpucheck.merged_raw(stages, [gpucheck.StageResult("bench-decode", status, 0.0, 45, "")]) == {
            "benchmarks": []}
    passed = gpucheck.StageResult("bench-decode", "passed", 1.0, 45, "")
    assert len(gpucheck.merged_raw(stages, [passed])["benchmarks"]) == 2


def test_summary_sets_each_row_against_its_own_ceiling():
    """Guards against the summary dividing a row's fraction, taken against the ceilings stored with it (the
    decode rows'), by the report's (a TypeError where the report's GPU has no datasheet entry, a wrong TB/s
    otherwise): the line names the ceiling the row was set against."""
    h200 = bench_report.datasheet_ceilings("NVIDIA H200")
    raw = {"benchmarks": decode_entries(h200)}
    for name in ("NVIDIA H100 PCIe", "NVIDIA H100 80GB HBM3"):
        ceilings = bench_report.report_ceilings(dict(fake_header(None), gpu={"name": name}), raw)
        (line,) = gpucheck.kernel_lines(bench_report.rows_from_raw(raw, ceilings))
        assert "best 2.86 TB/s = 60% of the 4.80 TB/s datasheet" in line, line


def test_a_build_stopped_at_its_budget_stops_the_check(tmp_path, capsys, monkeypatch):
    """Guards against the tests and benchmarks running after a build that was stopped at its budget, on an
    earlier extension or none, their outcomes then reported as this commit's: as after a failed build, every
    later stage is not run, and says why."""
    ran = []

    def runner(stage, checkout_):
        ran.append(stage.name)
        return gpucheck.StageResult(stage.name, "overran", stage.budget_s, stage.budget_s, "stopped")

    stubbed_check(monkeypatch, runner, current=False)
    with pytest.raises(SystemExit) as info:
        cli.main(["gpu-check", "--out", str(tmp_path)])
    assert info.value.code == 1 and ran == ["build"]
    stages = json.loads((tmp_path / "gpu-check.json").read_text())["stages"]
    assert {(s["status"], s["detail"]) for s in stages if s["name"] not in ("build", "bench-hf")} == {
        ("not run", "the build was stopped at its budget")}


class FakeClock:
    """time.monotonic for gpucheck: it moves only when a stubbed stage says how long it took."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_the_time_a_stage_leaves_goes_to_the_stages_after_it(tmp_path, capsys, monkeypatch):
    """Guards against losing the time a stage leaves unused (each stage held to its own budget from its start),
    and against a stage taking more than it was left: each stage that runs gets its budget plus what the
    stages before left of theirs; one stopped past that (its grace period) leaves nothing and takes nothing
    from the next; the stages end within the plan's worst case."""
    clock = FakeClock()
    monkeypatch.setattr(gpucheck, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    used = {"compile": 10, "tests": None, "bench-attention": 20, "bench-sampling": 5, "bench-scatter": 30}
    given = {}

    def runner(stage, checkout_):
        given[stage.name] = stage.carried_s
        seconds = used.get(stage.name, stage.budget_s)
        if seconds is None:  # stopped at its time, GRACE_S later killed
            seconds = stage.budget_s + stage.carried_s + gpucheck.GRACE_S
        clock.now += seconds
        status = "overran" if seconds > stage.budget_s + stage.carried_s else "passed"
        return gpucheck.StageResult(stage.name, status, seconds, stage.budget_s, "ok", carried_s=stage.carried_s)

    stubbed_check(monkeypatch, runner)
    start = clock.now
    with pytest.raises(SystemExit):
        cli.main(["gpu-check", "--out", str(tmp_path)])
    budgets = {s.name: s.budget_s for s in gpucheck.plan(dataclasses.replace(
        checkout(tmp_path, missing={"transformers"}), out=tmp_path))}
    assert given == {"compile": 0.0, "tests": budgets["compile"] - 10, "bench-attention": 0.0,
                     "bench-sampling": budgets["bench-attention"] - 20,
                     "bench-scatter": budgets["bench-attention"] - 20 + budgets["bench-sampling"] - 5,
                     "bench-decode": budgets["bench-attention"] + budgets["bench-sampling"] + budgets["bench-scatter"]
                     - 20 - 5 - 30}
    worst = sum(b + gpucheck.GRACE_S for b in budgets.values() if b)
    assert clock.now - start <= worst
    stages = {s["name"]: s for s in json.loads((tmp_path / "gpu-check.json").read_text())["stages"]}
    assert stages["tests"]["carried_s"] == budgets["compile"] - 10
    assert f"| bench-sampling | passed | 5 | {budgets['bench-sampling']}+{budgets['bench-attention'] - 20} |" in (
        tmp_path / "report.md").read_text()


def test_a_check_killed_after_a_stage_leaves_the_report_of_what_it_finished(tmp_path, capsys, monkeypatch):
    """Guards against a check killed at the time limit (the machine's 10 minutes) leaving no report, or an
    earlier one: the report and gpu-check.json are written after every stage, the stages not reached yet
    marked pending, and the last one says the check finished."""
    seen = {}

    def runner(stage, checkout_):
        if stage.name == "bench-sampling":
            seen["json"] = json.loads((tmp_path / "gpu-check.json").read_text())
            seen["report"] = (tmp_path / "report.md").read_text()
        return stub_runner(stage, checkout_)

    stubbed_check(monkeypatch, runner, current=False)
    with pytest.raises(SystemExit):
        cli.main(["gpu-check", "--out", str(tmp_path)])
    statuses = {s["name"]: s["status"] for s in seen["json"]["stages"]}
    assert seen["json"]["finished"] is False
    assert statuses == {"build": "passed", "compile": "passed", "tests": "failed", "bench-attention": "overran",
                        "bench-sampling": "pending", "bench-scatter": "pending", "bench-decode": "pending",
                        "bench-hf": "pending"}
    assert "(in progress: not reached when this report was written" in seen["report"]
    assert "| tests/test_x.py | 6 | 3 | 1 | 0 | 2 |" in seen["report"]
    assert json.loads((tmp_path / "gpu-check.json").read_text())["finished"] is True
    assert "pending" not in (tmp_path / "report.md").read_text()


def test_the_plain_sampling_call_is_left_out_of_the_summary_span():
    """Guards against the summary's speedup span and best TB/s taking in sampling's `sbd plain` row (the
    filtered case's call without the filter) against `eager`, which filters: other work. Its ratio is against
    `sbd` (what the filter costs), labelled so in the table, and the family's line compares `sbd` alone."""
    from bench import bench_sampling

    shape = grid.SamplingShape(1, 16, 128256, "fp32", top_k=50)
    nbytes = 16 * (128256 * 4 + 17)
    entries = [bench_entry(shape, "sbd", 3.04e-3, 3.0, bytes_moved=nbytes),
               bench_entry(shape, "sbd plain", 0.029e-3, 0.016, bytes_moved=nbytes,
                           baseline=bench_sampling.provider_baseline("sbd plain"), correct=True),
               bench_entry(shape, "eager", 0.32e-3, 0.30, bytes_moved=nbytes)]
    ceilings = bench_report.datasheet_ceilings("NVIDIA H200")
    families = bench_report.rows_from_raw({"benchmarks": entries}, ceilings)
    rows = {r["provider"]: r for r in families["sampling"]}
    assert rows["sbd plain"]["speedup"] == pytest.approx(3.04 / 0.029) and rows["sbd plain"]["baseline"] == "sbd"
    assert rows["sbd"]["speedup"] == pytest.approx(0.32 / 3.04)
    (line,) = gpucheck.kernel_lines(families)
    assert line.startswith("  sampling: 1 rows, 0.11x vs eager per call, 0.10x on CUDA-graph time; best 0.00 TB/s")
    assert "| sbd plain | 0.029 |" in bench_report.markdown(fake_header(None), families, ceilings)
    assert "104.83x vs sbd" in bench_report.markdown(fake_header(None), families, ceilings)


def test_the_summary_gives_each_hf_decode_its_own_span():
    """Guards against the summary's HF line spanning our eager and graph-replayed decodes in one range
    ("0.50-4.00x"), which says nothing of either: each of our providers gets its own span against HF greedy."""
    entries = []
    for batch, times in ((1, {"hf greedy": 0.48, "sbd ops": 0.96, "sbd ops graphed": 0.12}),
                         (16, {"hf greedy": 1.6, "sbd ops": 1.6, "sbd ops graphed": 0.4})):
        for provider, median_s in times.items():
            entries.append(bench_entry(grid.HfDecodeShape("small", batch), provider, median_s, None))
            entries[-1]["extra_info"].update(family="hf", baseline="hf greedy",
                                             correct=None if provider == "hf greedy" else True)
    ceilings = bench_report.datasheet_ceilings("NVIDIA H100 80GB HBM3")
    (line,) = gpucheck.kernel_lines(bench_report.rows_from_raw({"benchmarks": entries}, ceilings))
    assert line == "  hf: 4 rows, sbd ops 0.50-1.00x vs hf greedy per call, sbd ops graphed 4.00x vs hf greedy per call"


def test_the_summary_takes_the_best_rates_from_cuda_graph_times():
    """Guards against the summary's "best TB/s" (said to come from CUDA-graph times) taken from a row's eager
    median where it has no graph time."""
    shape = grid.SamplingShape(1, 16, 128256, "bf16")
    nbytes = 16 * 128256 * 2
    entries = [bench_entry(shape, "sbd", 40e-6, 0.0025, bytes_moved=nbytes),
               bench_entry(dataclasses.replace(shape, vocab=32000), "sbd", 2e-6, None, bytes_moved=nbytes),
               bench_entry(shape, "eager", 400e-6, 0.1, bytes_moved=nbytes),
               bench_entry(dataclasses.replace(shape, vocab=32000), "eager", 400e-6, 0.1, bytes_moved=nbytes)]
    ceilings = bench_report.datasheet_ceilings("NVIDIA H100 80GB HBM3")
    (line,) = gpucheck.kernel_lines(bench_report.rows_from_raw({"benchmarks": entries}, ceilings))
    assert "best 1.64 TB/s = 49% of the 3.35 TB/s datasheet (B=1 K=16 V=128256 bf16)" in line


# ----------------------------------------------------------------------------------------------------
# GPU results against the datasheet
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,key", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", None),
                                      ("NVIDIA H100 NVL", None), ("NVIDIA H200", "h200"), ("NVIDIA GH200 480GB", None),
                                      ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA A100-SXM4-40GB", None),
                                      ("NVIDIA GeForce RTX 4090", None)])
def test_datasheet_is_that_of_the_exact_gpu(name, key):
    """Guards against fractions of the wrong datasheet: a PCIe or NVL card (other clocks and memory) or a GH200
    (whose name contains H200) set against the SXM numbers."""
    assert bench_report.datasheet_key(name) == key
    if key == "h100":
        ceilings = bench_report.datasheet_ceilings(name)
        assert ceilings["copy_gbs"] == pytest.approx(3350) and ceilings["matmul_gflops"]["fp16"] == pytest.approx(989400)


def test_cpu_results_keep_their_measured_ceilings():
    """Guards against a CPU report switching to datasheet units or losing its measured ceilings."""
    header = fake_header(None)
    cpu_raw = {"benchmarks": [{"extra_info": {"device": "cpu"}}]}
    assert bench_report.report_ceilings(header, cpu_raw) == {"copy_gbs": 100.0, "matmul_gflops": header["matmul_gflops"],
                                                              "source": "measured", "threads": 16, "by_threads": {}}
    gpu = bench_report.report_ceilings(dict(header, gpu={"name": "NVIDIA H100 PCIe"}),
                                       {"benchmarks": [{"extra_info": {"device": "cuda"}}]})
    assert gpu["copy_gbs"] is None and gpu["source"] == "no datasheet entry for NVIDIA H100 PCIe"


def test_gpu_slug():
    assert gpucheck.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert gpucheck.gpu_slug("NVIDIA A100-SXM4-80GB") == "nvidia-a100-sxm4-80gb" and gpucheck.gpu_slug("") == "unknown-gpu"


def test_bench_device_is_the_gpu_where_there_is_one(monkeypatch):
    """Guards against GPU benchmark runs timing CPU baselines (the old behaviour), against a forced CUDA run
    without a GPU, and against a bench run on such a setting failing with pytest's internal-error traceback."""
    from bench.harness import bench_device

    monkeypatch.delenv("SBD_BENCH_DEVICE", raising=False)
    assert bench_device() == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setenv("SBD_BENCH_DEVICE", "cpu")
    assert bench_device() == "cpu"
    monkeypatch.setenv("SBD_BENCH_DEVICE", "tpu")
    with pytest.raises(ValueError, match="SBD_BENCH_DEVICE must be cpu or cuda"):
        bench_device()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"SBD_BENCH_DEVICE": "tpu"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "bench/bench_scatter.py", "-q", "-p", "no:cacheprovider"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR and "INTERNALERROR" not in proc.stderr + proc.stdout
    assert "ERROR: SBD_BENCH_DEVICE must be cpu or cuda, got 'tpu'" in proc.stderr


# Triton's JIT on a machine without a GPU: a driver for device 0, stream 0, sm_90 (compiles work, launches
# cannot).
FAKE_DRIVER_SETUP = """
import sys
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

class FakeCudaDriver:
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_current_target(self): return GPUTarget("cuda", 90, 32)

driver.set_active(FakeCudaDriver())
"""
# Launches of awkward calls (offset and transposed views, sizes off any power of two, bf16 and fp16), one per
# family and the filtered sampling path, built by each launcher from real CPU tensors: `warm` compiles their
# configurations by name as the compile stage does; `launch` asks the JIT for each launch as a test process
# would and prints the cache entries it added.
WARM_THEN_LAUNCH = FAKE_DRIVER_SETUP + """
import os, torch
from pathlib import Path
from sbd_kernels import aot
from sbd_kernels.ops.attention import triton as attention
from sbd_kernels.ops.sampling import triton as sampling
from sbd_kernels.ops.scatter import triton as scatter
from sbd_kernels.ops._aot import compile_options

attention.compiles_for_gpu = lambda device: True  # the CPU tensors stand for CUDA ones (tensor-core dots)
gen = torch.Generator().manual_seed(0)
tokens = torch.full((3, 27), -1, dtype=torch.int64)[:, 1:14]
launches = {scatter: scatter._scatter_launches(tokens, torch.ones(3, 13, dtype=torch.bool),
                                               torch.randint(0, 9, (3, 13), generator=gen),
                                               torch.rand(13, 3, generator=gen).t(), None, 0.5, "threshold")[1]}
logits = torch.randn(2, 3, 1100, generator=gen).to(torch.bfloat16)[:, :, 3:1003]
launches[sampling] = sampling._sampling_launches(logits, torch.tensor([1, 2]), torch.tensor([0, 5]),
                                                 torch.tensor([0.7, 1.0]), top_k=torch.tensor([5, 0]))[1]
q, k, v = (torch.randn(2, 9, h, 64, generator=gen).to(torch.float16).transpose(1, 2).contiguous().transpose(1, 2)
           for h in (4, 2, 2))
cache = torch.zeros(2, 40, 2, 64, dtype=torch.float16)
launches[attention] = attention._attention_launches(q, k, v, cache, cache.clone(), torch.tensor([7, 20], dtype=torch.int32),
                                                    torch.tensor([5, 2], dtype=torch.int32), 4)[2]
names = [spec.name for family, kls in launches.items() for spec in family.specs_of_launches(kls)]
folder = Path(os.environ["TRITON_CACHE_DIR"])
if sys.argv[1] == "warm":
    listed = [spec.name for spec in aot.collect_specs()]
    print([aot._warm_job(listed.index(name))[2] for name in names])
else:  # "launch": all; "launch-first": the scatter launch alone (one compile where nothing is cached)
    before = set(folder.iterdir())
    every = [kl for kls in launches.values() for kl in kls]
    for kl in every if sys.argv[1] == "launch" else every[:1]:
        kl.kernel.warmup(**kl.args, **kl.constexprs, grid=kl.grid, **compile_options(kl.num_warps, kl.num_stages))
    print((len(names), sorted(p.name for p in set(folder.iterdir()) - before)))
"""


def test_a_launch_finds_what_the_compile_stage_compiled(tmp_path):
    """Guards against the compile stage (`python -m sbd_kernels.aot --warm`) failing on Triton's JIT, compiling
    somewhere the later stages do not look (TRITON_CACHE_DIR), or filling the cache under keys no launch asks
    for (arguments typed unlike a launch's, a specialisation it did not foresee): then every test process
    compiles the same kernels again and the test stage is bound by compiling, as on the first GPU runs.
    Launches of awkward calls, typed by the JIT from real tensors in a fresh process, find every binary the
    warm compiled (and in an empty cache one compiles: the check can fail)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(REPO)}

    def run(mode: str, cache: Path) -> list:
        proc = subprocess.run([sys.executable, "-c", WARM_THEN_LAUNCH, mode], env={**env, "TRITON_CACHE_DIR": str(cache)},
                              capture_output=True, text=True, timeout=600, cwd=REPO, check=False)
        assert proc.returncode == 0, proc.stderr
        return ast.literal_eval(proc.stdout.strip().splitlines()[-1])

    errors = run("warm", tmp_path / "warmed")
    assert errors and errors == [None] * len(errors)
    assert [p.name for p in (tmp_path / "warmed").rglob("_scatter_accept_kernel.cubin")]
    count, added = run("launch", tmp_path / "warmed")
    assert count == len(errors) >= 4 and added == [], f"{len(added)} of {count} launches compiled again"
    (tmp_path / "empty").mkdir()
    _, added = run("launch-first", tmp_path / "empty")
    assert len(added) == 1
