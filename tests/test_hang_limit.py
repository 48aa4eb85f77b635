"""A hung or cut-short test run says where it was: the suite's limit on one test's time (pyproject.toml) ends a
hung test's pytest process with every thread's stack on stderr, so that a deadlock fails the run and names its
place instead of running into CI's limit; `tools/run_tests.py` stopped by SIGTERM prints every shard's output."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SLEEPING_TEST = """
import time


def test_sleeps_past_the_limit():
    time.sleep(120)
"""


def test_a_test_past_the_limit_ends_its_process_with_the_stacks(tmp_path):
    """Guards against a hang that holds a shard until CI's own limit (a gloo deadlock did, printing nothing):
    with the project's settings and the limit lowered to 2 s, a sleeping test must end pytest within seconds,
    status non-zero, with the sleeping line in the stack dump."""
    test_file = tmp_path / "test_sleeping.py"
    test_file.write_text(SLEEPING_TEST)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", str(test_file), "-q", "-p", "no:cacheprovider",
                           "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path),
                           "-o", "faulthandler_timeout=2"],
                          capture_output=True, text=True, check=False, timeout=100)
    assert proc.returncode != 0 and time.monotonic() - start < 60
    assert "Timeout (0:00:02)!" in proc.stderr, proc.stderr[-2000:]
    assert f'File "{test_file}", line 6 in test_sleeps_past_the_limit' in proc.stderr, proc.stderr[-2000:]


def test_the_limit_is_set_and_ends_the_process(pytestconfig):
    """Guards against the settings above being dropped: without faulthandler_exit_on_timeout, pytest dumps the
    stacks and the hung test goes on waiting."""
    assert pytestconfig.getini("faulthandler_exit_on_timeout") is True
    assert 300 <= float(pytestconfig.getini("faulthandler_timeout")) <= 900


QUICK_THEN_SLOW = """
import time


def test_quick():
    pass


def test_slow():
    time.sleep(120)
"""
RUN_TWO_SHARDS = """
import sys
from pathlib import Path

sys.path.insert(0, sys.argv[1])
import run_tests

sys.exit(run_tests.run(2, [], ["test_pair.py"], cwd=Path.cwd()))
"""


def test_a_run_stopped_by_sigterm_prints_the_other_shards(tmp_path):
    """Guards against a run cut short by CI's time limit that shows shard 0 alone (the others' output, kept in
    files until they end, was lost): after SIGTERM, shard 1's output so far follows, the shards are stopped and
    the run ends with status 143."""
    (tmp_path / "test_pair.py").write_text(QUICK_THEN_SLOW)
    output = tmp_path / "output.txt"
    with open(output, "w") as out:
        runner = subprocess.Popen([sys.executable, "-c", RUN_TWO_SHARDS, str(REPO / "tools")], cwd=tmp_path,
                                  stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while "." not in output.read_text().partition("\n")[2] and time.monotonic() < deadline:
        time.sleep(0.1)                     # until shard 0 has passed test_quick
    time.sleep(3)                           # and shard 1, started beside it, too
    os.kill(runner.pid, signal.SIGTERM)
    assert runner.wait(timeout=30) == 128 + signal.SIGTERM
    text = output.read_text()
    _, header, shard_one = text.partition("---- shard 1/2 (stopped by SIGTERM) ----")
    assert header and shard_one.lstrip().startswith("."), text
    assert text.rstrip().endswith("run_tests: stopped by SIGTERM"), text
