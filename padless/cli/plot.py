"""``padless inspect --plot FILE``: the size distribution and each strategy's occupancy per batch.

matplotlib is imported here, when a plot is asked for (``pip install 'padless[plot]'``).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import numpy as np

from padless.cli.report import Report, model_costs
from padless.cli.sources import InspectError


def _pyplot() -> Any:
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError as e:
        raise InspectError(
            f"padless inspect --plot needs matplotlib ({e}); install it with: pip install 'padless[plot]'"
        ) from e
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def write_plot(report: Report, path: str) -> str:
    """Draw the report into ``path`` (any format matplotlib writes, by its suffix); returns the path."""
    plt = _pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1, 1.6]})
    elements = model_costs(report.sizes, report.kind, "features")
    label = {"tokens": "tokens per sample (L)", "images": "pixels per image (H*W)", "pairs": "cells per sample (N^2)"}
    ax.hist(elements, bins=min(60, max(5, len(np.unique(elements)))), color="#4c72b0")
    ax.set_xlabel(label[report.kind] + (f", in {report.unit}" if report.patch_size else ""))
    ax.set_ylabel("samples")
    ax.set_title(f"Size distribution ({len(elements):,} samples)")
    for name, s in report.strategies.items():
        occ = s.occupancy_per_batch
        bx.plot(np.arange(len(occ)), occ, marker=".", markersize=3, linewidth=0.6, label=f"{name}: {s.occupancy:.2f} ({len(occ)} steps)")
    bx.set_xlabel("batch (epoch order)")
    bx.set_ylabel("occupancy (real / padded elements)")
    bx.set_ylim(0, 1.15)
    bx.set_title(f"Occupancy per batch: {report.rule}", fontsize="small")
    bx.legend(loc="upper center", ncol=3, fontsize="small")
    fig.tight_layout()
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise InspectError(f"padless inspect --plot: the folder of {path!r} does not exist")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
