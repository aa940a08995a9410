"""Bucketing vs random batching: the same data under three batch samplers, padded and padless.

    python examples/bucketing_vs_random.py [--samples 2048] [--dim 64] [--out FILE.png]

The data is made here: token-feature sequences with long-tailed (lognormal)
lengths. One epoch is batched three ways:

* ``random``: :class:`padless.loaders.RandomBatchSampler`, 32 samples per batch;
* ``bucket``: :class:`padless.loaders.BucketBatchSampler`, 32 per batch, 8 length buckets;
* ``budget``: :class:`padless.loaders.BudgetBatchSampler`, a token budget of 32 x the mean length.

For each policy it reports the number of batches, the occupancy of the padded
envelope (real tokens / ``B x max length``), the spread of lengths inside
batches, and the time of one epoch of a small model step (LayerNorm -> MLP
residual block, forward + backward) on padded batches with a mask and on padless
batches (``padless.from_list``), interleaved batch by batch, the median of
several rounds per batch, summed over the epoch. It prints a
markdown table and writes a PNG of occupancy per batch for each policy, to ``--out``
(default: ``bucketing_vs_random.png`` in the system's temporary folder; the figure of
docs/benchmarks.md is written with ``--out docs/bucketing_vs_random.png``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import torch
import torch.nn as nn

import padless
from padless.testing.models import TokenMLP
from padless.loaders import BatchSamplerBase, BucketBatchSampler, BudgetBatchSampler, RandomBatchSampler, TokenBudget
from padless.loaders.synthetic import token_lengths


def padded_step(model: nn.Module, padded: torch.Tensor, mask: torch.Tensor) -> float:
    model.zero_grad(set_to_none=True)
    y = model(padded)
    loss = ((y**2).sum(-1) * mask).sum() / (mask.sum() * y.shape[-1])
    loss.backward()
    return loss.item()


def padless_step(model: nn.Module, x: padless.NestedTensor) -> float:
    model.zero_grad(set_to_none=True)
    loss = (model(x) ** 2).mean()  # over real elements only
    loss.backward()
    return loss.item()


def policies(lengths: np.ndarray, batch: int, seed: int) -> dict[str, BatchSamplerBase]:
    budget = int(batch * lengths.mean())
    return {
        "random": RandomBatchSampler(len(lengths), batch, seed=seed),
        "bucket": BucketBatchSampler(lengths, batch, num_buckets=8, seed=seed),
        "budget": BudgetBatchSampler(lengths, TokenBudget(budget), seed=seed),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds over every batch (median per batch)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "bucketing_vs_random.png"),
                    help="where the PNG goes (default: %(default)s)")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)

    lengths = token_lengths(args.samples, seed=args.seed, mean=4.0, sigma=0.8, low=4, high=512)
    data = [torch.randn(int(n), args.dim) for n in lengths]
    model = TokenMLP(args.dim, 4 * args.dim)
    samplers = policies(lengths, args.batch, args.seed)

    warm = padless.from_list(data[:8])  # first calls pay one-time costs; keep them out of every policy
    for _ in range(3):
        padless_step(model, warm)
        padded_step(model, warm.to_padded(), warm.mask()[..., 0])

    # Batches are built before timing, as DataLoader workers would build them.
    prepared: dict[str, list[tuple[list[int], padless.NestedTensor, torch.Tensor, torch.Tensor]]] = {}
    for name, sampler in samplers.items():
        prepared[name] = []
        for b in sampler:
            samples = [data[i] for i in b]
            padded = torch.nn.utils.rnn.pad_sequence(samples, batch_first=True)
            mask = torch.arange(padded.shape[1])[None, :] < torch.as_tensor(lengths[b])[:, None]
            prepared[name].append((b, padless.from_list(samples), padded, mask))

    # Rounds over all policies, padded and padless interleaved batch by batch: machine drift hits all alike.
    times = {name: {"pad": [[] for _ in p], "nt": [[] for _ in p]} for name, p in prepared.items()}
    for _ in range(args.rounds):
        for name, batches in prepared.items():
            for j, (b, x, padded, mask) in enumerate(batches):
                t0 = time.perf_counter()
                l_pad = padded_step(model, padded, mask)
                t1 = time.perf_counter()
                l_nt = padless_step(model, x)
                t2 = time.perf_counter()
                times[name]["pad"][j].append(t1 - t0)
                times[name]["nt"][j].append(t2 - t1)
                if abs(l_pad - l_nt) > 1e-4 * abs(l_pad):
                    raise SystemExit(f"bucketing_vs_random: padded and padless losses differ on a {name} batch: {l_pad} vs {l_nt}")

    rows, occ_per_batch = [], {}
    for name, batches in prepared.items():
        idx = [b for b, *_ in batches]
        occ = [lengths[b].sum() / (len(b) * lengths[b].max()) for b in idx]
        tokens = [int(lengths[b].sum()) for b in idx]
        occ_per_batch[name] = occ
        rows.append(
            dict(
                policy=name,
                batches=len(idx),
                samples=statistics.mean(len(b) for b in idx),
                tokens=statistics.mean(tokens),
                tokens_cv=statistics.pstdev(tokens) / statistics.mean(tokens),
                occupancy=lengths.sum() / sum(len(b) * lengths[b].max() for b in idx),
                spread=statistics.median(lengths[b].max() / lengths[b].min() for b in idx),
                t_pad=sum(statistics.median(t) for t in times[name]["pad"]),
                t_nt=sum(statistics.median(t) for t in times[name]["nt"]),
            )
        )

    print(
        f"bucketing vs random: {args.samples} sequences, lengths {lengths.min()}..{lengths.max()} "
        f"(mean {lengths.mean():.0f}, lognormal), d={args.dim}, LayerNorm->MLP(4x) residual, "
        f"forward + backward, {args.threads} thread(s), median of {args.rounds} rounds per batch\n"
    )
    print(
        "| policy | batches | samples / batch | tokens / batch (cv) | occupancy | max/min length in batch (median) "
        "| padded epoch (s) | padless epoch (s) | padless vs padded |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['policy']} | {r['batches']} | {r['samples']:.1f} | {r['tokens']:,.0f} ({r['tokens_cv']:.2f}) "
            f"| {r['occupancy']:.2f} | {r['spread']:.1f} | {r['t_pad']:.2f} | {r['t_nt']:.2f} "
            f"| {r['t_pad'] / r['t_nt']:.2f}x |"
        )
    write_plot(occ_per_batch, rows, os.path.normpath(args.out))


def write_plot(occ: dict[str, list[float]], rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    for name, o in occ.items():
        ax.plot(range(len(o)), o, marker=".", linewidth=0.8, label=f"{name} (mean {np.mean(o):.2f})")
    ax.set_xlabel("batch (epoch order)")
    ax.set_ylabel("occupancy of the padded envelope")
    ax.set_ylim(0, 1.2)
    ax.set_title("Occupancy per batch")
    ax.legend(loc="upper center", ncol=3, fontsize="small")
    names = [r["policy"] for r in rows]
    xs = np.arange(len(names))
    bx.bar(xs - 0.2, [r["t_pad"] for r in rows], 0.4, label="padded + mask")
    bx.bar(xs + 0.2, [r["t_nt"] for r in rows], 0.4, label="padless")
    bx.set_xticks(xs, names)
    bx.set_ylabel("epoch step time (s)")
    bx.set_title("Same model, same data")
    bx.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"\nplot: {path}")


if __name__ == "__main__":
    main()
