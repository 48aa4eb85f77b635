"""The benchmark pipeline end to end on a tiny selection: `sbd bench` runs pytest-benchmark, checks the
op against its oracle, and writes the report with ratios against the baseline of the same run."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_sbd_bench_writes_a_report_with_ratios(tmp_path):
    """Guards against a broken link between the bench files, the harness and the report (an empty table,
    a missing baseline ratio, an oracle flag that is never set)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "sbd_kernels.cli", "bench", "--only", "scatter", "-k", "1-16 and (sbd or eager)",
           "--rounds", "2", "--no-gpu-static", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "report.json").read_text())["results"]["scatter"]
    by_provider = {r["provider"]: r for r in rows}
    assert set(by_provider) == {"sbd", "eager"}
    assert by_provider["sbd"]["oracle"] == "pass"
    assert by_provider["eager"]["speedup"] == pytest.approx(1.0)
    assert by_provider["sbd"]["speedup"] > 0
    report = (tmp_path / "report.md").read_text()
    assert "measured ceilings: copy bandwidth" in report and "| sbd |" in report
