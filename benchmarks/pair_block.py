"""The single-pair-single block of pair models, forward + backward, four ways in one run.

    python benchmarks/pair_block.py [--batches 8] [--batch 8] [--lo 24] [--hi 128]

Unchanged model code on padless::

    p = u(x).unsqueeze(2) + v(x).unsqueeze(1)   # (N_i, C) -> (N_i, N_i, Cp)
    p = p + h(ln(p))                             # LayerNorm + Linear(Cp,4Cp)-ReLU-Linear(4Cp,Cp)
    y = x + g(p.mean(dim=2))                     # back to (N_i, C)
    loss = (y ** 2).mean() + (p ** 2).mean()

against padded dense with masks, and hand packing (explicit gather indices and
``index_add``). torch.nested (jagged) cannot hold an N x N pair state (one ragged
dim only), so it is reported as not runnable. Every batch runs all implementations
back to back (interleaved); the table reports medians of per-batch times and of
per-batch ratios. Per-batch metadata (padless' pair maps, hand packing's gather
indices, padded masks) is built before timing, as a collate_fn in a DataLoader
worker would; its one-off cost is printed separately.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn

import padless


class Block(nn.Module):
    def __init__(self, c: int, cp: int) -> None:
        super().__init__()
        self.u, self.v = nn.Linear(c, cp), nn.Linear(c, cp)
        self.ln = nn.LayerNorm(cp)
        self.h = nn.Sequential(nn.Linear(cp, 4 * cp), nn.ReLU(), nn.Linear(4 * cp, cp))
        self.g = nn.Linear(cp, c)

    def padless_loss(self, x):
        p = self.u(x).unsqueeze(2) + self.v(x).unsqueeze(1)
        p = p + self.h(self.ln(p))
        y = x + self.g(p.mean(dim=2))
        return (y ** 2).mean() + (p ** 2).mean()

    def padded_loss(self, x, mask, pmask, n):
        p = self.u(x).unsqueeze(2) + self.v(x).unsqueeze(1)
        p = p + self.h(self.ln(p))
        pm = (p * pmask[..., None]).sum(2) / n.clamp_min(1)[:, None, None]
        y = x + self.g(pm)
        ly = ((y ** 2) * mask[..., None]).sum() / (mask.sum() * y.shape[-1])
        lp = ((p ** 2) * pmask[..., None]).sum() / (pmask.sum() * p.shape[-1])
        return ly + lp

    def packed_loss(self, x, ii, jj, counts):
        p = self.u(x).index_select(0, ii) + self.v(x).index_select(0, jj)
        p = p + self.h(self.ln(p))
        pm = torch.zeros(x.shape[0], p.shape[1], dtype=p.dtype).index_add(0, ii, p) / counts[:, None]
        y = x + self.g(pm)
        return (y ** 2).mean() + (p ** 2).mean()


def hand_indices(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ii, jj, start = [], [], 0
    for n in lengths:
        r = torch.arange(n) + start
        ii.append(r.repeat_interleave(n))
        jj.append(r.repeat(n))
        start += n
    counts = torch.cat([torch.full((n,), float(n)) for n in lengths])
    return torch.cat(ii), torch.cat(jj), counts


def step(model: Block, fn) -> tuple[float, float]:
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    loss = fn()
    loss.backward()
    return time.perf_counter() - t0, float(loss.detach())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--c", type=int, default=384)
    ap.add_argument("--cp", type=int, default=128)
    ap.add_argument("--lo", type=int, default=24)
    ap.add_argument("--hi", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    model = Block(args.c, args.cp)
    rng = torch.Generator().manual_seed(args.seed)
    times: dict[str, list[float]] = {"padded + masks": [], "hand-packed": [], "padless": []}
    ratios: dict[str, list[float]] = {"padded + masks": [], "hand-packed": []}
    occ, meta_cost, max_dev = [], [], 0.0
    for b in range(args.batches + 1):
        lengths = torch.randint(args.lo, args.hi + 1, (args.batch,), generator=rng).tolist()
        samples = [torch.randn(n, args.c, generator=rng) for n in lengths]
        t0 = time.perf_counter()
        x = padless.from_list(samples)
        with torch.no_grad():
            model.padless_loss(x)  # builds and caches the pair maps (a collate worker's job)
        meta_cost.append(time.perf_counter() - t0)
        xp = x.to_padded()
        n = x.lengths()
        mask = x.mask()[..., 0]
        pmask = mask[:, :, None] & mask[:, None, :]
        xv = x.values()
        ii, jj, counts = hand_indices(lengths)
        occ.append(sum(n_ * n_ for n_ in lengths) / (len(lengths) * max(lengths) ** 2))
        runs = {
            "padded + masks": lambda: model.padded_loss(xp, mask, pmask, n),
            "hand-packed": lambda: model.packed_loss(xv, ii, jj, counts),
            "padless": lambda: model.padless_loss(x),
        }
        res = {k: step(model, f) for k, f in runs.items()}
        losses = [v[1] for v in res.values()]
        max_dev = max(max_dev, max(abs(a - losses[-1]) / abs(losses[-1]) for a in losses))
        if b == 0:
            continue  # warm-up batch
        for k, (t, _) in res.items():
            times[k].append(t)
        for k in ratios:
            ratios[k].append(res[k][0] / res["padless"][0])
    if max_dev > 1e-4:
        raise SystemExit(f"implementations disagree: max relative loss difference {max_dev:.2e}")
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(
        f"pair block, B={args.batch}, C={args.c}, Cp={args.cp}, lengths U[{args.lo}, {args.hi}], "
        f"pair occupancy {statistics.mean(occ):.2f}, {args.batches} batches, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; all agree (max rel. loss diff {max_dev:.1e})\n"
    )
    print("| implementation | median step (ms) | padless speed-up vs it (median of per-batch ratios) |")
    print("|---|---:|---:|")
    for k in ("padded + masks", "hand-packed"):
        print(f"| {k} | {med[k]:,.1f} | {statistics.median(ratios[k]):.2f}x |")
    print(f"| padless | {med['padless']:,.1f} | 1.00x |")
    print("| torch.nested (jagged) | - | cannot run: one ragged dim, no N x N pair state |")
    print(f"\npadless pair-map build per batch (first call, done in a worker in practice): "
          f"{statistics.median(meta_cost) * 1e3:.1f} ms including one no-grad forward")


if __name__ == "__main__":
    main()
