"""`make test`: the test suite in one pytest process per core, side by side, on the CPU.

    python tools/run_tests.py [--shards N] [--record-durations] [PYTEST ARGS...]     # from the repository root

Each process runs one of N shards of the tests (SBD_TEST_SHARD=i/N, tests/conftest.py), dealt by the seconds
each test took when they were last recorded (tests/durations.json, `--record-durations`; the CMake tests, which
share one build, in one shard), so that the shards end close together, with TRITON_INTERPRET=1 so that the
Triton kernels run on CPU tensors. Most of the suite is single-threaded Python (the Triton interpreter,
the oracles, subprocesses that import torch): on the 2-core reference machine (AMD EPYC Zen 4) two processes ran it
in 8.5-11 minutes (8.7-11.6 with later tests, on a busy machine; 8.1-12.7 with 39 Hugging Face families, 8.4-10.5
with 59, 8.3-10.5 with 67), where one process had taken 17.3 minutes (with 71 more real-process CLI cases, ~2.5
min). A 2-core Xeon at 2.1 GHz took 16.4-18.7 minutes, and 10.1-12.1 once the interpreter patched
triton.language once per launch (`sbd_kernels.testing.patch_the_interpreter_once_per_launch`) and the CMake
build ran in one shard; a 2-core Xeon at 2.6 GHz, 7.7-10.6 minutes.
Shard 0 prints as it runs; the others' output follows when they end. Exit status: 0 when every shard passed,
else the first non-zero status among them. SIGTERM (a CI job's time limit) stops every shard and prints the
others' output so far before this process ends with status 143, so that a run cut short shows where each
shard was.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAX_SHARDS = 4


def default_shards() -> int:
    """One process per core this process may use, at most MAX_SHARDS (each holds a copy of torch, ~1 GB)."""
    return max(1, min(MAX_SHARDS, len(os.sched_getaffinity(0))))


def add_shards_option(parser: argparse.ArgumentParser) -> None:
    """--shards N (N >= 1, default: default_shards()), shared by the scripts that run the tests in shards."""
    def shard_count(text: str) -> int:
        count = int(text)
        if count < 1:
            raise argparse.ArgumentTypeError(f"must be >= 1, got {count}")
        return count

    parser.add_argument("--shards", type=shard_count, default=default_shards(),
                        help=f"pytest processes side by side (default: the usable cores, at most {MAX_SHARDS})")


def shard_command(pytest_args: list[str], paths: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", *paths, "-q", "-p", "no:cacheprovider", *pytest_args]


class Terminated(Exception):
    """SIGTERM reached this process while its shards ran."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


def _print_shard_logs(logs: list[Path], statuses: list[str]) -> None:
    """The output of shards 1.. (shard 0 printed as it ran), each under a line with its exit status."""
    for i in range(1, len(logs)):
        print(f"\n---- shard {i}/{len(logs)} ({statuses[i]}) ----", flush=True)
        sys.stdout.write(logs[i].read_text())


def run(shards: int, pytest_args: list[str], paths: list[str] | None = None, cwd: Path = REPO,
        extra_env: dict[str, str] | None = None) -> int:
    """Runs pytest on `paths` (default: tests) in `shards` processes from `cwd`, with TRITON_INTERPRET=1 and
    extra_env added to this process's environment; returns the first non-zero exit status, else 0."""
    env = {**os.environ, "TRITON_INTERPRET": "1", **(extra_env or {})}
    command = shard_command(pytest_args, ["tests"] if paths is None else paths)
    if shards == 1:
        return subprocess.call(command, cwd=cwd, env=env)
    previous_handler = signal.signal(signal.SIGTERM, _raise_terminated)
    others: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="sbd-tests-") as tmp:
        logs = [Path(tmp) / f"shard-{i}.log" for i in range(shards)]
        try:
            for i in range(1, shards):
                with open(logs[i], "w") as log:
                    others.append(subprocess.Popen(command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                                   env={**env, "SBD_TEST_SHARD": f"{i}/{shards}"}))
            print(f"run_tests: {shards} pytest processes side by side; shard 0/{shards} below, the others after "
                  "it", flush=True)
            # subprocess.call kills shard 0 when Terminated interrupts its wait.
            statuses = [subprocess.call(command, cwd=cwd, env={**env, "SBD_TEST_SHARD": f"0/{shards}"})]
            statuses += [process.wait() for process in others]
        except Terminated:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            for process in others:
                process.terminate()
                process.wait()
            _print_shard_logs(logs, ["stopped by SIGTERM"] * shards)
            print("\nrun_tests: stopped by SIGTERM", flush=True)
            return 128 + signal.SIGTERM
        finally:
            signal.signal(signal.SIGTERM, previous_handler)
        _print_shard_logs(logs, [f"exit status {status}" for status in statuses])
    print(f"\nrun_tests: exit statuses of the {shards} shards: {statuses}")
    return next((status for status in statuses if status != 0), 0)


DURATIONS_FILE = REPO / "tests" / "durations.json"
# Tests below this many seconds are left out of the durations file and weigh the mean of their recorded times:
# with them all the file would hold ~6900 entries; the ~380 above it held 838 of the 1127 recorded seconds.
LISTED_FROM_S = 0.5


def durations_document(recorded: dict[str, float], cpu: str) -> dict:
    """tests/durations.json from {node id: seconds}: the tests of LISTED_FROM_S or more, sorted by node id, and
    `default_s`, the mean of the others (what a test not listed weighs when the tests are dealt to shards)."""
    listed = {node: round(seconds, 2) for node, seconds in sorted(recorded.items()) if seconds >= LISTED_FROM_S}
    others = [seconds for seconds in recorded.values() if seconds < LISTED_FROM_S]
    return {"about": f"seconds per test (setup + call + teardown) on {cpu}, recorded by `python tools/run_tests.py "
                     f"--record-durations`; tests under {LISTED_FROM_S} s weigh default_s, their mean. The shards of "
                     "`make test` are dealt by these (sbd_kernels.testing.select_shard).",
            "default_s": round(sum(others) / max(1, len(others)), 4), "tests": listed}


def record_durations(shards: int, pytest_args: list[str]) -> int:
    """Runs the suite, and where every shard passed writes the seconds of its tests to DURATIONS_FILE."""
    import json

    from sbd_kernels.machine import cpu_model
    from sbd_kernels.testing import DURATIONS_VARIABLE

    with tempfile.TemporaryDirectory(prefix="sbd-durations-") as folder:
        status = run(shards, pytest_args, extra_env={DURATIONS_VARIABLE: folder})
        if status != 0:
            print("run_tests: a shard failed; the durations file is left as it was")
            return status
        recorded = {}
        for path in Path(folder).glob("*.json"):
            recorded.update(json.loads(path.read_text()))
    DURATIONS_FILE.write_text(json.dumps(durations_document(recorded, cpu_model()), indent=1) + "\n")
    print(f"run_tests: the durations of {len(recorded)} tests written to {DURATIONS_FILE.relative_to(REPO)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shards_option(parser)
    parser.add_argument("--record-durations", action="store_true",
                        help=f"write each test's seconds to {DURATIONS_FILE.relative_to(REPO)} (where every shard "
                             "passed), by which the shards are dealt")
    args, pytest_args = parser.parse_known_args(argv)
    if args.record_durations:
        return record_durations(args.shards, pytest_args)
    return run(args.shards, pytest_args)


if __name__ == "__main__":
    sys.exit(main())
