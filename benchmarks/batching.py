"""Batching policy and padding: one epoch of a Transformer classifier, padded vs padless, under
random, length-bucketed and token-budget batches.

    python benchmarks/batching.py [--samples 1024] [--batch 32] [--dim 64] [--layers 2] [--heads 4]
                                  [--epochs 3] [--threads 1] [--seed 0] [--plot FILE.png]

The data is made here: ``--samples`` sequences of ``(L_i, dim)`` features with long-tailed
(lognormal) lengths 4..512 and random labels. One epoch is batched three ways by padless'
samplers, exactly as ``padless inspect`` forms them (:func:`padless.cli.report.samplers`):
``random`` and ``bucket`` (8 length buckets) with ``--batch`` samples per batch, ``budget`` with
a token budget of ``--batch`` x the mean length (first-fit decreasing).

The model (:class:`padless.testing.models.SequenceClassifier`): ``--layers``
``nn.TransformerEncoderLayer`` (pre-LN, GELU, FFN 4x) -> LayerNorm -> mean over tokens -> linear
head, cross-entropy, one SGD step per batch. It runs on padded batches with a key padding mask
(mean over real tokens), and on the same batches as padless NestedTensors: the same module,
the same weights. Batches are built before timing, as DataLoader workers would build them. Each
epoch is timed in CPU seconds of this process (``time.process_time``), padded and padless
alternating epoch by epoch through the shared runner (:func:`padless.testing.bench.interleaved`),
``--epochs`` epochs each after one warm-up step; the table gives the median epoch.

Columns: occupancy (real tokens / padded envelope), the epoch times, padless' speed-up over
padded under that batching, and two ideals: 1 / occupancy (feature-wise work) and the FLOP
ideal (padded FLOPs / packed FLOPs with ``72 d^2`` per token and ``14 d L^2`` of attention per
sample and layer, forward + backward). ``--plot`` draws occupancy per batch and the epoch times.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

import padless
from padless.cli.report import build_report
from padless.loaders.synthetic import token_lengths
from padless.testing import bench
from padless.testing.models import SequenceClassifier


def flop_ideal(strategy, d: int) -> float:
    """Padded over packed FLOPs of forward + backward: ``72 d^2`` per token, ``14 d`` per attention score."""
    padded = 72 * d * d * strategy.padded["features"] + 14 * d * strategy.padded["attention"]
    real = 72 * d * d * strategy.real["features"] + 14 * d * strategy.real["attention"]
    return padded / real


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--classes", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=3, help="timed epochs per implementation (median)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", metavar="FILE", help="write the figure (occupancy per batch, epoch times) here")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    d = args.dim

    lengths = token_lengths(args.samples, seed=args.seed, mean=4.0, sigma=0.8, low=4, high=512)
    report = build_report(lengths[:, None], kind="tokens", batch_size=args.batch, seed=args.seed, attention=True)
    g = torch.Generator().manual_seed(args.seed)
    feats = [torch.randn(int(n), d, generator=g) for n in lengths]
    labels = torch.randint(0, args.classes, (args.samples,), generator=g)
    model = SequenceClassifier(d, args.heads, args.layers, args.classes)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    prepared = {}
    for name, s in report.strategies.items():
        batches = []
        for b in s.batches:
            x = padless.from_list([feats[i] for i in b])
            batches.append((x, x.to_padded(), x.mask()[..., 0], labels[b]))
        prepared[name] = batches

    def step(x, keep, y) -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x, keep), y).backward()
        opt.step()

    # The same module on the same batch, padded and packed: the same logits.
    x, padded, keep, y = prepared["random"][0]
    with torch.no_grad():
        err = float((model(x) - model(padded, keep)).abs().max())
    if err > 1e-4:
        raise SystemExit(f"batching: padded and padless logits differ by {err:.2e} on the first random batch")
    step(x, None, y)  # first calls pay one-time costs (plans, allocator)
    step(padded, keep, y)

    results = {}
    for name, batches in prepared.items():
        impls = {
            "padded": lambda batches=batches: [step(p, k, y) for _, p, k, y in batches],
            "padless": lambda batches=batches: [step(x, None, y) for x, _, _, y in batches],
        }
        results[name] = bench.interleaved(impls, baseline="padded", rounds=args.epochs, warmup=0, clock=time.process_time)

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"batching: {args.samples} sequences, lengths {lengths.min()}..{lengths.max()} (mean {lengths.mean():.0f}, "
        f"lognormal), {args.layers} x nn.TransformerEncoderLayer(d={d}, {args.heads} heads, FFN 4x) -> mean -> head, "
        f"cross-entropy + SGD step, {args.threads} thread(s), CPU seconds per epoch, median of {args.epochs} epochs, "
        f"load average {load:.1f}; {report.rule}; max |padded - padless| logits {err:.1e}\n"
    )
    print("| batching | steps | occupancy | padded epoch (s) | padless epoch (s) | padless vs padded | 1 / occupancy | FLOP ideal |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, s in report.strategies.items():
        r = results[name]
        print(
            f"| {name} | {len(s.batches)} | {s.occupancy:.2f} | {r['padded'][0] / 1e6:.2f} | {r['padless'][0] / 1e6:.2f} "
            f"| {r['padless'][1]:.2f}x | {1 / s.occupancy:.2f}x | {flop_ideal(s, d):.2f}x |"
        )
    nt = [results[n]["padless"][0] for n in results]
    best = min(results, key=lambda n: results[n]["padded"][0])
    print(
        f"\npadless epoch: {min(nt) / 1e6:.2f}..{max(nt) / 1e6:.2f} s whichever batching (max/min {max(nt) / min(nt):.2f}); "
        f"the fastest padded epoch: {results[best]['padded'][0] / 1e6:.2f} s ({best})"
    )
    if args.plot:
        write_plot(report, results, args.plot)
        print(f"plot: {args.plot}")


def write_plot(report, results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [1.6, 1]})
    for name, s in report.strategies.items():
        occ = s.occupancy_per_batch
        ax.plot(np.arange(len(occ)), occ, marker=".", markersize=3, linewidth=0.7, label=f"{name} (occupancy {s.occupancy:.2f})")
    ax.set_xlabel("batch (epoch order)")
    ax.set_ylabel("occupancy of the padded batch")
    ax.set_ylim(0, 1.3)
    ax.set_title("Occupancy per batch")
    ax.legend(loc="upper center", ncol=3, fontsize="small")
    names = list(results)
    xs = np.arange(len(names))
    pad = [results[n]["padded"][0] / 1e6 for n in names]
    nt = [results[n]["padless"][0] / 1e6 for n in names]
    bx.bar(xs - 0.2, pad, 0.4, label="padded + mask")
    bx.bar(xs + 0.2, nt, 0.4, label="padless")
    for i, n in enumerate(names):
        bx.text(xs[i], max(pad[i], nt[i]), f"{results[n]['padless'][1]:.2f}x", ha="center", va="bottom", fontsize="small")
    bx.set_xticks(xs, names)
    bx.set_ylabel("CPU seconds per epoch")
    bx.set_title("Same model, same data, same batches")
    bx.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
