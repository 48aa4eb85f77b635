"""Tests of the GPU static report's bookkeeping (`sbd_kernels.aot`), without compiling any kernel."""
from __future__ import annotations

import importlib

import pytest

from sbd_kernels.aot import FAMILIES, CompileResult, collect_picks, format_picks, theoretical_occupancy


@pytest.mark.parametrize("family", FAMILIES)
def test_benchmark_picks_name_listed_specs(family):
    """Guards against a launcher picking, at a shape of the benchmark grid, a configuration that
    `aot_specs()` does not list (it would never be compiled nor checked for spills), or a spec renamed on
    one side only."""
    module = importlib.import_module(f"sbd_kernels.ops.{family}.triton")
    names = {spec.name for spec in module.aot_specs()}
    picks = collect_picks((family,))
    assert picks, f"{family}: no benchmark picks"
    missing = [(shape, spec) for shape, spec in picks if spec not in names]
    assert not missing, f"{family}: picks not in aot_specs(): {missing}"


def test_spec_names_are_unique():
    """Guards against two configurations sharing a name, which would make a pick ambiguous."""
    names = [spec.name for family in FAMILIES
             for spec in importlib.import_module(f"sbd_kernels.ops.{family}.triton").aot_specs()]
    assert len(names) == len(set(names))


def test_theoretical_occupancy_hand_computed():
    """Guards against a wrong register rounding or limit order in the occupancy formula.

    sm_90, 8 warps, 62 registers, 4096 B shared: 62 * 32 = 1984 registers per warp, rounded up to 2048;
    a block needs 8 * 2048 = 16384 of 65536 -> 4 blocks; shared (4096 + 1024 reserved) allows 44; warps 64 / 8
    allow 8: 4 blocks * 8 warps / 64 = 50%. With 230 registers: 7360 -> 7424 per warp, 59392 per block,
    1 block: 8 / 64 = 12.5%.
    """
    assert theoretical_occupancy(90, regs=62, shared=4096, num_warps=8) == 0.5
    assert theoretical_occupancy(90, regs=230, shared=4096, num_warps=8) == 0.125
    # Shared memory bound on sm_80: 164 KiB / (48 KiB + 1 KiB) = 3 blocks of 4 warps -> 12 / 64.
    assert theoretical_occupancy(80, regs=32, shared=48 * 1024, num_warps=4) == 12 / 64


def test_format_picks_flags_spills_and_unlisted():
    """Guards against the picks table passing a benchmark configuration that spills or was never listed."""
    results = [CompileResult("good", arch, 4, True, 40, 0, 0, 0.5) for arch in (80, 90)]
    results += [CompileResult("spilling", 80, 4, True, 255, 16, 0, 0.125),
                CompileResult("spilling", 90, 4, True, 200, 0, 0, 0.125)]
    picks = [("shape a", "good"), ("shape b", "spilling"), ("shape c", "unknown")]
    table, bad = format_picks(picks, results, (80, 90))
    assert len(table.splitlines()) == 1 + len(picks)
    assert bad == ["shape b: spilling SPILLS", "shape c: unknown NOT LISTED"]
