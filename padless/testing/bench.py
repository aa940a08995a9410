"""The one benchmark runner: interleaved timing, medians, ratios, one output schema.

This machine (and most shared CI machines) is noisy, so implementations are run
round-robin, one call each per round, and the reported ratio is the median of
per-round ratios against the baseline measured in the same round.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Mapping

import torch


@dataclasses.dataclass
class Row:
    """One line of a benchmark table (the shared output schema)."""

    case: str
    impl: str
    median_us: float
    ratio: float  # baseline time / this time (>1: faster than the baseline)
    note: str = ""


def _sync(device: str | None) -> None:
    if device and device.startswith("cuda"):
        torch.cuda.synchronize()


def interleaved(
    impls: Mapping[str, Callable[[], object]],
    *,
    baseline: str,
    rounds: int = 50,
    inner: int = 1,
    warmup: int = 3,
    device: str | None = None,
    clock: Callable[[], float] = time.perf_counter,
    settle: int = 0,
) -> dict[str, tuple[float, float]]:
    """Time each callable round-robin; return ``{name: (median_us, median ratio vs baseline)}``.

    ``inner`` calls per sample amortise the timer for microsecond-scale ops. ``clock``:
    ``time.process_time`` (CPU time of this process) is steadier on a loaded machine.
    ``settle`` untimed calls of a callable run right before its timed ones, so each is timed
    in its own steady state (caches and allocator warm from its own last step, as in a
    training loop that runs only it) rather than right after another implementation's step.
    """
    names = list(impls)
    for _ in range(warmup):
        for n in names:
            impls[n]()
    _sync(device)
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(rounds):
        for n in names:
            f = impls[n]
            for _ in range(settle):
                f()
            _sync(device)
            t0 = clock()
            for _ in range(inner):
                f()
            _sync(device)
            times[n].append((clock() - t0) / inner * 1e6)
    base = times[baseline]
    out = {}
    for n in names:
        ratios = [b / t for b, t in zip(base, times[n]) if t > 0]
        out[n] = (statistics.median(times[n]), statistics.median(ratios) if ratios else float("nan"))
    return out


def without_syncs(step: Callable[[], object]) -> None:
    """Run ``step`` once to warm up (plans, backend probes), then once more with CUDA device
    syncs turned into errors (``torch.cuda.set_sync_debug_mode("error")``): a step that
    synchronises raises, naming the op."""
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def rows_from(case: str, result: Mapping[str, tuple[float, float]], notes: Mapping[str, str] | None = None) -> list[Row]:
    notes = notes or {}
    return [Row(case, n, t, r, notes.get(n, "")) for n, (t, r) in result.items()]


def print_table(rows: list[Row], title: str, baseline: str) -> None:
    """Markdown table: the README pastes it as printed."""
    print(f"\n### {title}\n")
    print(f"| case | impl | median (us) | speed vs {baseline} | note |")
    print("|---|---|---:|---:|---|")
    for r in rows:
        t = f"{r.median_us:,.1f}"
        print(f"| {r.case} | {r.impl} | {t} | {r.ratio:.2f}x | {r.note} |")
