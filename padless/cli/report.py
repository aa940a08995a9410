"""What ``padless inspect`` reports: the size distribution, and each batching strategy's padding.

The batches are formed by padless' own samplers (:class:`~padless.loaders.RandomBatchSampler`,
:class:`~padless.loaders.BucketBatchSampler`, :class:`~padless.loaders.BudgetBatchSampler`), epoch 0
of ``seed``, so the numbers are what the library would do. For each strategy and each cost model:

* real: the work on the samples themselves, ``sum f(size_i)`` (what padless computes);
* padded: the work on the padded envelope, ``sum over batches of B_b * f(max size in the batch)``;
* occupancy = real / padded; padless saves padded / real (its ideal speed-up over that padded batch).

The cost models ``f``, per sample extents (``L``; ``H, W``; ``N`` for pairs):

* ``features``: the elements, ``L``, ``H*W`` or ``N^2`` (linears, norms, activations, convolutions);
* ``attention``: ``L^2`` (images: ``(H*W)^2``, every pixel or patch a token; pairs: ``N^3``, row
  attention over the pair state);
* ``triangle`` (pairs): ``N^3``, triangle multiplication and triangle attention.

>>> import numpy as np
>>> r = build_report(np.array([[2], [4], [6], [8]]), kind="tokens", batch_size=2, num_buckets=2)
>>> sorted(sorted(b) for b in r.strategies["bucket"].batches), r.strategies["bucket"].real, r.strategies["bucket"].padded
([[0, 1], [2, 3]], {'features': 20.0}, {'features': 24.0})
>>> round(r.strategies["bucket"].occupancy, 3), round(r.strategies["bucket"].saving(), 2)
(0.833, 1.2)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from padless.loaders import (
    BatchSamplerBase,
    BucketBatchSampler,
    BudgetBatchSampler,
    Constraint,
    PairBudget,
    PixelBudget,
    RandomBatchSampler,
    TokenBudget,
)

KINDS = {
    "tokens": (("L",), "tokens", TokenBudget),
    "images": (("H", "W"), "pixels", PixelBudget),
    "pairs": (("N",), "cells (N^2)", PairBudget),
}
STRATEGIES = ("random", "bucket", "budget")
DEFAULT_BATCH_SIZE = 32


def model_costs(extents: np.ndarray, kind: str, model: str) -> np.ndarray:
    """``f(extents)`` per row of ``extents`` (float64), for the cost ``model`` (see the module docstring)."""
    e = extents.astype(np.float64)
    elements = e.prod(axis=1)
    if kind == "pairs":
        n = e[:, 0]
        return n * n if model == "features" else n**3
    if model == "features":
        return elements
    if model == "attention":
        return elements**2
    raise ValueError(f"padless inspect: the {model!r} cost model applies to pair data (--pairs) only")


@dataclasses.dataclass
class StrategyReport:
    """One batching strategy over one epoch."""

    name: str
    batches: list[list[int]]
    real: dict[str, float]  # per cost model: the work on the samples
    padded: dict[str, float]  # per cost model: the work on the padded batches
    occupancy_per_batch: np.ndarray  # features: real / padded per batch, in epoch order
    peak_real: int  # the largest batch's real elements
    peak_padded: int  # the largest padded batch's elements

    @property
    def occupancy(self) -> float:
        return self.real["features"] / self.padded["features"] if self.padded["features"] else 1.0

    def saving(self, model: str = "features") -> float:
        """padded / real: how many times less work padless does than this padded batching."""
        return self.padded[model] / self.real[model] if self.real[model] else 1.0


@dataclasses.dataclass
class Report:
    sizes: np.ndarray  # (N, k) extents used for padding: L, (H, W) (in patches with patch_size), N
    kind: str
    batch_size: int
    budget: float
    rule: str  # how the batch size and the budget were chosen
    seed: int
    num_buckets: int
    models: tuple[str, ...]
    strategies: dict[str, StrategyReport]
    patch_size: int | None = None  # images: sizes are in patches of this side
    source: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def dims(self) -> tuple[str, ...]:
        return KINDS[self.kind][0]

    @property
    def unit(self) -> str:
        return unit_of(self.kind, self.patch_size)


def unit_of(kind: str, patch_size: int | None = None) -> str:
    """What one element is: tokens, pixels (patches with ``patch_size``), N^2 cells."""
    return f"{patch_size}x{patch_size} patches" if kind == "images" and patch_size else KINDS[kind][1]


def samplers(
    sizes: np.ndarray, kind: str, batch_size: int | None, budget: float | None, seed: int, num_buckets: int,
    unit: str = "",
) -> tuple[dict[str, BatchSamplerBase], int, float, str]:
    """The three samplers, the batch size and budget they use, and how those were chosen.

    A batch size alone gives random and bucketed batches of that size and a budget of that
    many mean samples; a budget alone gives the budget and, for random and bucketed batches,
    the batch size holding that budget on average; both are used as given."""
    budget_cls: type[Constraint] = KINDS[kind][2]
    unit = unit or KINDS[kind][1]
    mean_cost = float(budget_cls(1).costs(sizes).mean()) if len(sizes) else 1.0
    if batch_size is None and budget is None:
        batch_size = DEFAULT_BATCH_SIZE
    if budget is None:
        budget = max(1.0, float(np.ceil(batch_size * mean_cost)))
        rule = f"batch size {batch_size}; budget {budget:,.0f} {unit} = {batch_size} x the mean sample"
    elif batch_size is None:
        batch_size = max(1, int(round(budget / max(mean_cost, 1e-12))))
        rule = f"budget {budget:,.0f} {unit}; batch size {batch_size} = the budget / the mean sample"
    else:
        rule = f"batch size {batch_size}; budget {budget:,.0f} {unit}"
    constraint = budget_cls(budget)
    out: dict[str, BatchSamplerBase] = {
        "random": RandomBatchSampler(len(sizes), batch_size, seed=seed),
        "bucket": BucketBatchSampler(sizes, batch_size, num_buckets=num_buckets, seed=seed),
        "budget": BudgetBatchSampler(sizes, constraint, seed=seed),
    }
    return out, batch_size, budget, rule


def build_report(
    sizes: np.ndarray,
    *,
    kind: str,
    batch_size: int | None = None,
    budget: float | None = None,
    seed: int = 0,
    num_buckets: int = 8,
    attention: bool = False,
    triangle: bool = False,
    patch_size: int | None = None,
) -> Report:
    """Batch ``sizes`` three ways and price each (see the module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"padless inspect: kind must be one of {tuple(KINDS)}, got {kind!r}")
    if triangle and kind != "pairs":
        raise ValueError("padless inspect: --triangle prices N^3 triangle ops of pair data; add --pairs")
    models = ("features",) + (("attention",) if attention else ()) + (("triangle",) if triangle else ())
    found, batch_size, budget, rule = samplers(
        sizes, kind, batch_size, budget, seed, num_buckets, unit_of(kind, patch_size)
    )
    per_sample = {m: model_costs(sizes, kind, m) for m in models}
    elements = per_sample["features"]
    strategies = {}
    for name, sampler in found.items():
        batches = sampler.batches(0)
        padded = {m: 0.0 for m in models}
        occ = np.empty(len(batches))
        peak_real = peak_padded = 0.0
        for j, b in enumerate(batches):
            env = sizes[b].max(axis=0, keepdims=True)
            for m in models:
                padded[m] += len(b) * float(model_costs(env, kind, m)[0])
            real_b = float(elements[b].sum())
            pad_b = len(b) * float(model_costs(env, kind, "features")[0])
            occ[j] = real_b / pad_b if pad_b else 1.0
            peak_real, peak_padded = max(peak_real, real_b), max(peak_padded, pad_b)
        real = {m: float(per_sample[m][[i for b in batches for i in b]].sum()) for m in models}
        strategies[name] = StrategyReport(name, batches, real, padded, occ, int(peak_real), int(peak_padded))
    return Report(sizes, kind, batch_size, float(budget), rule, seed, num_buckets, models, strategies, patch_size)


def distribution(values: np.ndarray) -> dict[str, float]:
    """min, quantiles, max, mean of ``values`` (zeros for no values)."""
    if len(values) == 0:
        return {k: 0.0 for k in ("min", "p10", "p50", "p90", "p99", "max", "mean")}
    q = np.quantile(values, [0.1, 0.5, 0.9, 0.99])
    return {
        "min": float(values.min()), "p10": float(q[0]), "p50": float(q[1]), "p90": float(q[2]), "p99": float(q[3]),
        "max": float(values.max()), "mean": float(values.mean()),
    }


def size_rows(report: Report) -> dict[str, dict[str, float]]:
    """The distribution of each size dim and of the elements per sample."""
    rows = {d: distribution(report.sizes[:, i]) for i, d in enumerate(report.dims)}
    label = {"tokens": "tokens", "images": "patches (H*W)" if report.patch_size else "pixels (H*W)", "pairs": "cells (N^2)"}[
        report.kind
    ]
    if report.kind != "tokens":
        rows[label] = distribution(model_costs(report.sizes, report.kind, "features"))
    return rows


def to_dict(report: Report) -> dict[str, Any]:
    """The machine-readable report (``padless inspect --json``)."""
    n = len(report.sizes)
    out: dict[str, Any] = {
        "source": report.source,
        "samples": n,
        "kind": report.kind,
        "dims": list(report.dims),
        "sizes": size_rows(report),
        "batching": {
            "batch_size": report.batch_size, "budget": report.budget, "unit": report.unit, "rule": report.rule,
            "seed": report.seed, "epoch": 0, "num_buckets": report.num_buckets,
        },
        "models": list(report.models),
        "strategies": {},
    }
    for name, s in report.strategies.items():
        out["strategies"][name] = {
            "steps": len(s.batches),
            "samples_per_batch": n / len(s.batches) if s.batches else 0.0,
            "occupancy": s.occupancy,
            "real": s.real,
            "padded": s.padded,
            "saving": {m: s.saving(m) for m in report.models},
            "peak_batch_real": s.peak_real,
            "peak_batch_padded": s.peak_padded,
        }
    return out


def to_text(report: Report) -> str:
    """The human-readable report: the sizes, then one markdown table row per strategy."""
    src = report.source
    n = len(report.sizes)
    lines = [f"padless inspect: {src.get('path', '?')} ({src.get('format', '?')}: {src.get('detail', '')})"]
    what = {"tokens": "token sequences (L)", "images": "images (H x W)", "pairs": "pair states (N x N cells)"}[report.kind]
    patch = f", sizes in {report.unit}" if report.patch_size else ""
    lines.append(f"  {n:,} samples: {what}{patch}")
    skipped = src.get("skipped", [])
    if skipped:
        lines.append(f"  {len(skipped)} left out (unreadable): " + "; ".join(skipped[:3]) + (" ..." if len(skipped) > 3 else ""))
    lines.append("")
    lines.append(f"  {'size':<14}" + "".join(f"{k:>10}" for k in ("min", "p10", "p50", "p90", "p99", "max", "mean")))
    for name, d in size_rows(report).items():
        lines.append(f"  {name:<14}" + "".join(f"{v:>10,.0f}" if k != "mean" else f"{v:>10,.1f}" for k, v in d.items()))
    lines.append("")
    lines.append(f"batching (epoch 0, seed {report.seed}): {report.rule}; bucket: {report.num_buckets} buckets")
    lines.append("")
    head = "| strategy | steps / epoch | samples / batch | real / padded elements | occupancy | padless saves (features)"
    sep = "|---|---:|---:|---:|---:|---:"
    for m in report.models[1:]:
        head += f" | padless saves ({m})"
        sep += "|---:"
    lines += [head + " |", sep + "|"]
    for name, s in report.strategies.items():
        steps = len(s.batches)
        row = (
            f"| {name} | {steps:,} | {n / steps if steps else 0:.1f} | {s.real['features']:,.0f} / {s.padded['features']:,.0f} "
            f"| {s.occupancy:.2f} | {s.saving():.2f}x"
        )
        for m in report.models[1:]:
            row += f" | {s.saving(m):.2f}x"
        lines.append(row + " |")
    lines.append("")
    lines.append(
        "padless computes the real elements whichever strategy forms the batches; a padded batch computes its "
        "envelope. 'padless saves' is padded / real work: padless' ideal speed-up over padding under that strategy "
        "(1 / occupancy for feature-wise work)."
    )
    return "\n".join(lines)
