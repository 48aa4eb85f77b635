"""The benchmark grid is the one home of the benchmark shapes: the bench files time its records, the GPU
compile check reports the configurations picked at its records, and labels are generated from them."""
import ast
import importlib
from pathlib import Path

import pytest

from sbd_kernels import benchmark_grid as grid
from sbd_kernels.aot import FAMILIES, OP_NAMES, collect_picks

REPO = Path(__file__).resolve().parent.parent
BENCH_FAMILIES = sorted(grid.GRIDS)


@pytest.mark.parametrize("family", BENCH_FAMILIES)
@pytest.mark.parametrize("quick", [False, True])
def test_labels_are_unique_and_records_round_trip(family, quick):
    """Guards against two benchmark cases sharing a label (the report would merge their providers) and a
    record that does not survive the benchmark JSON (the report and plots read it back)."""
    shapes = grid.GRIDS[family](quick)
    assert shapes
    keys = [(s.label, getattr(s, "provider", "")) for s in shapes]
    assert len(keys) == len(set(keys))
    assert len({s.test_id for s in shapes}) == len(shapes)
    assert all(grid.shape_from_dict(family, grid.shape_to_dict(s)) == s for s in shapes)
    assert set(grid.GRIDS[family](True)) <= set(grid.GRIDS[family](False))


def test_label_is_generated_from_the_fields():
    """Guards against a label that drifts from its record (the report's case names a shape not timed)."""
    shape = grid.AttentionShape(batch=4, length=4096, dtype="fp16")
    assert shape.label == "B=4 Hq=32 Hkv=8 D=128 C=16 K=16 L=4096 fp16"
    assert shape.label_without("length") == "B=4 Hq=32 Hkv=8 D=128 C=16 K=16 fp16"
    assert grid.SamplingShape(8, 16, 151936, "bf16").label == "B=8 K=16 V=151936 bf16"
    assert grid.DecodeShape("1b", 4, 512, 32).label == "1b bf16 B=4 L=512 k=16"
    with pytest.raises(ValueError, match="unknown fields"):
        grid.shape_from_dict("scatter", {"batch": 1, "block": 16, "vocab": 3})


def test_aot_picks_are_taken_at_every_shape_of_the_grid():
    """Guards against the GPU compile check reporting "picked at benchmark shapes" for a private copy of
    the shapes that drifted from what the benchmarks time (it once lacked fp16 and batch 4 for attention)."""
    picked = {label for label, _ in collect_picks()}
    expected = {f"{OP_NAMES[family]} {shape.label}" for family in FAMILIES for shape in grid.GRIDS[family]()}
    assert picked == expected


def test_picks_follow_the_shape():
    """Guards against picks that ignore the record: the tile follows the vocabulary, BLOCK_K the block, the
    attention configuration the dtype."""
    from sbd_kernels.aot import picked_at

    small, large = (picked_at("sampling", grid.SamplingShape(1, 1, vocab, "fp32"))[0] for vocab in (1000, 128256))
    assert "BLOCK=128" in small and "BLOCK=1024" in large
    assert "BLOCK_K=32" in picked_at("scatter", grid.ScatterShape(1, 32))[0]
    assert picked_at("attention", grid.AttentionShape(1, 512, "fp16"))[0].startswith("attention/split fp16")


@pytest.mark.parametrize("family", BENCH_FAMILIES)
def test_bench_files_time_the_grid(family, monkeypatch):
    """Guards against a bench file declaring its own shapes again: its test is parametrised over exactly
    the grid's records, full and quick."""
    for quick in ("0", "1"):
        monkeypatch.setenv("SBD_BENCH_QUICK", quick)
        module = importlib.reload(importlib.import_module(f"bench.bench_{family}"))
        test = next(getattr(module, name) for name in dir(module) if name.startswith("test_"))
        shapes = next(mark.args[1] for mark in test.pytestmark if mark.name == "parametrize" and mark.args[0] == "shape")
        assert list(shapes) == grid.GRIDS[family](quick == "1")


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


@pytest.mark.parametrize("family", FAMILIES)
def test_kernel_modules_hold_no_benchmark_shapes(family):
    """Guards against benchmark shapes creeping back into a kernel module (a second copy that drifts)."""
    path = REPO / "sbd_kernels" / "ops" / family / "triton.py"
    names = {n.id for n in ast.walk(_tree(path)) if isinstance(n, ast.Name)}
    names |= {n.name for n in ast.walk(_tree(path)) if isinstance(n, ast.FunctionDef)}
    assert not [n for n in names if n.startswith("_BENCH") or n == "benchmark_picks"]


LABEL_READERS = [REPO / "sbd_kernels" / "bench_report.py", REPO / "sbd_kernels" / "bench_plots.py",
                 *sorted((REPO / "bench").glob("*.py"))]


@pytest.mark.parametrize("path", LABEL_READERS, ids=lambda p: p.name)
def test_labels_are_never_parsed(path):
    """Guards against reading shapes back out of label strings with regular expressions: the report, the
    plots and the bench files read the records' fields."""
    imported = {alias.name for n in ast.walk(_tree(path)) if isinstance(n, ast.Import) for alias in n.names}
    imported |= {n.module for n in ast.walk(_tree(path)) if isinstance(n, ast.ImportFrom)}
    assert "re" not in imported
