"""Triangle attention written with its rows folded into the batch vs the same block unfolded.

    python benchmarks/fold_attention.py [--batch 8] [--lo 16] [--hi 64] [--rounds 7] [--threads 1]
                                        [--cz 64] [--heads 4] [--width 32] [--profile]

One triangle attention around the starting node (AlphaFold/boltz's, no mask), forward +
backward, the same weights written two ways, both on padless NestedTensors ``(N_i, N_i, Cz)``:

* **unfolded**: ``q, k, v`` as ``(B, I, H, J, c)`` pair states, ``softmax(q @ k^T + bias) @ v``
  with the bias ``(B, 1, H, I, J)`` (boltz's and OpenFold's form; padless runs the scores as one
  bucketed node, ``padless.ops.pairs.pending``);
* **folded**: rows folded into the batch as einops' ``rearrange(z, 'b i j d -> (b i) j d')``
  writes it (``z.reshape(B * N, N, d)``), ``F.scaled_dot_product_attention`` with the bias
  repeated per row (``bias.repeat_interleave(N, dim=0)``), unfolded with ``reshape(B, N, N, d)``
  (padless: one attention call per parent sample on views of the rows,
  ``padless.ops.attention.runs``);
* **folded, per-sample path**: the folded form with the runs path turned off
  (``runs.ENABLED = False``: the attention of the previous release).

Interleaved rounds (``padless.testing.bench``); the ratio column is unfolded time / this time,
the median of per-round ratios (above 1: faster than the unfolded block). The outputs of the
two forms are checked against each other first.
"""

from __future__ import annotations

import argparse
import math
import os
import random

import torch
import torch.nn as nn
import torch.nn.functional as F

import padless
from padless.testing import bench

try:
    from padless.ops.attention import runs
except ImportError:  # a padless before the runs path (the "before" of a before/after)
    runs = None


class TriangleAttention(nn.Module):
    """Triangle attention around the starting node; ``unfolded`` and ``folded`` compute the same."""

    def __init__(self, cz: int, heads: int, width: int) -> None:
        super().__init__()
        self.h, self.c = heads, width
        self.norm = nn.LayerNorm(cz)
        self.bias = nn.Linear(cz, heads, bias=False)
        self.q, self.k, self.v = (nn.Linear(cz, heads * width, bias=False) for _ in range(3))
        self.g, self.o = nn.Linear(cz, heads * width), nn.Linear(heads * width, cz)

    def unfolded(self, z):
        x = self.norm(z)
        tri = self.bias(x).permute(0, 3, 1, 2).unsqueeze(1)  # (B, 1, H, I, J)
        q = self.q(x).unflatten(-1, (self.h, self.c)).transpose(-2, -3) / math.sqrt(self.c)
        k = self.k(x).unflatten(-1, (self.h, self.c)).transpose(-2, -3)
        v = self.v(x).unflatten(-1, (self.h, self.c)).transpose(-2, -3)
        o = torch.matmul((torch.matmul(q, k.transpose(-1, -2)) + tri).softmax(-1), v).transpose(-2, -3)
        o = o * self.g(x).sigmoid().unflatten(-1, (self.h, self.c))
        return self.o(o.flatten(-2))

    def folded(self, z):
        x = self.norm(z)
        b, n, d = x.shape[0], x.shape[1], x.shape[-1]
        bias = self.bias(x).permute(0, 3, 1, 2)  # (B, H, I, J)
        xf = x.reshape(b * n, n, d)  # rearrange(x, 'b i j d -> (b i) j d')
        q, k, v = (lin(xf).view(b * n, n, self.h, self.c).transpose(1, 2) for lin in (self.q, self.k, self.v))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.repeat_interleave(n, dim=0))
        o = o.transpose(1, 2).reshape(b * n, n, self.h * self.c) * self.g(xf).sigmoid()
        return self.o(o).reshape(b, n, n, d)  # rearrange(o, '(b i) j d -> b i j d', b=b)


def _step(fn, z, per_sample: bool = False):
    def run() -> None:
        if runs is not None:
            runs.ENABLED = not per_sample
        try:
            fn(z).values().square().sum().backward()
        finally:
            if runs is not None:
                runs.ENABLED = True
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lo", type=int, default=16)
    ap.add_argument("--hi", type=int, default=64)
    ap.add_argument("--cz", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batches", type=int, default=2, help="batches (new lengths each); rounds per batch")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="top aten ops of one step of each form")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    block = TriangleAttention(args.cz, args.heads, args.width)
    rng = random.Random(0)
    rows = []
    for _ in range(args.batches):
        ns = [rng.randint(args.lo, args.hi) for _ in range(args.batch)]
        z = padless.from_list([torch.randn(n, n, args.cz) for n in ns], ragged_dims=(0, 1), requires_grad=True)
        torch.testing.assert_close(block.folded(z).values(), block.unfolded(z).values(), atol=1e-4, rtol=1e-4)
        impls = {"unfolded": _step(block.unfolded, z), "folded": _step(block.folded, z)}
        if runs is not None:
            impls["folded, per-sample path"] = _step(block.folded, z, per_sample=True)
        res = bench.interleaved(impls, baseline="unfolded", rounds=args.rounds, warmup=2)
        rows += bench.rows_from(f"B={args.batch} N={min(ns)}..{max(ns)}", res)
        if args.profile:
            from torch.profiler import profile

            for name, f in impls.items():
                with profile() as p:
                    f()
                print(f"\n{name}\n" + p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    bench.print_table(rows, f"Triangle attention fwd+bwd, folded vs unfolded, Cz={args.cz} H={args.heads} c={args.width}, "
                            f"{args.threads} thread(s), load {load:.1f}", baseline="unfolded")


if __name__ == "__main__":
    main()
