"""The suite's limit on one test's time (pyproject.toml): a hung test ends its pytest process with every thread's
stack on stderr, so that a deadlock fails the run and names its place instead of running into CI's limit."""
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
