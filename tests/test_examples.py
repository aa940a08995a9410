"""Smoke tests of the runnable examples (and of the batching benchmark), with their smallest settings."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"padless_example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def test_native_cnn_example_runs(capsys):
    pytest.importorskip("PIL", reason="the example writes PNG/JPEG shards (pip install 'padless[loaders]')")
    out = _load("native_cnn").main(steps=2, per_shard=4, low=12, high=40, pixels=3000, num_workers=1)
    for task in ("classification", "segmentation"):
        s = out[task]
        assert len(s["losses"]) == 2 and all(math.isfinite(v) for v in s["losses"])
        assert s["max_err"] < 1e-4  # packed batch == each image alone
        assert 0 < s["real"] <= s["padded"]
        assert 0 < len(s["distinct"]) <= min(s["images"], 8)  # an epoch of `steps` batches need not cover the data
    out = capsys.readouterr().out
    assert "a padded batch would have held" in out and "of the 8 distinct ones" in out


def test_batching_benchmark_runs_small(capsys, monkeypatch, tmp_path):
    """benchmarks/batching.py (the figure of docs/when-faster.md) at its smallest: it checks padded
    and padless logits agree and prints one row per batching."""
    import runpy
    import sys

    pytest.importorskip("matplotlib")
    png = tmp_path / "batching.png"
    argv = ["batching.py", "--samples", "40", "--batch", "8", "--dim", "16", "--layers", "1", "--epochs", "1", "--plot", str(png)]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(EXAMPLES.parent / "benchmarks" / "batching.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert all(f"| {name} |" in out for name in ("random", "bucket", "budget")) and "padless epoch:" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
