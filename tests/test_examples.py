"""Smoke tests of the runnable examples, with their smallest settings."""

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
