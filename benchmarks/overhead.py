"""Eager overhead of ops on a NestedTensor vs the same op on its values and on a padded tensor.

    python benchmarks/overhead.py [--rounds N]

Small tensors on purpose: the numbers are dominated by per-call cost. "overhead"
is NestedTensor time minus hand-packed (values) time, medians from one run.
"""

from __future__ import annotations

import argparse

import torch

import padless
from padless.testing import bench


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--inner", type=int, default=200)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    lengths = [17, 33, 8, 64, 40, 25, 51, 12]
    c = 64
    x = padless.from_list([torch.randn(n, c) for n in lengths])
    x2 = padless.from_list([torch.randn(n, c) for n in lengths])  # equal structure, built separately
    v, v2 = x.values(), x2.values()
    p, p2 = x.to_padded(), x2.to_padded()
    w = torch.randn(c)
    lin = torch.nn.Linear(c, c)
    ln = torch.nn.LayerNorm(c)
    cases = {
        "x * 2": lambda t, u: t * 2,
        "x + y": lambda t, u: t + u,
        "x * w (dense C)": lambda t, u: t * w,
        "sigmoid(x)": lambda t, u: t.sigmoid(),
        "where(x > 0, x, y)": lambda t, u: torch.where(t > 0, t, u),
        "x.add_(1) in-place": lambda t, u: t.add_(1e-9),
        "linear": lambda t, u: lin(t),
        "layer_norm": lambda t, u: ln(t),
        "x.sum()": lambda t, u: t.sum(),
    }
    rows = []
    with torch.no_grad():
        for name, f in cases.items():
            res = bench.interleaved(
                {
                    "hand-packed (values)": lambda f=f: f(v, v2),
                    "padless": lambda f=f: f(x, x2),
                    "padded": lambda f=f: f(p, p2),
                },
                baseline="hand-packed (values)",
                rounds=args.rounds,
                inner=args.inner,
            )
            over = res["padless"][0] - res["hand-packed (values)"][0]
            rows += bench.rows_from(name, res, {"padless": f"overhead {over:.1f} us"})
    # Forward with autograd recording (inputs require grad): the ATen path, below autograd.
    xg, vg, pg = x.detach().requires_grad_(), v.detach().requires_grad_(), p.detach().requires_grad_()
    grad_rows = []
    for name in ("x * 2", "x * w (dense C)", "sigmoid(x)", "linear", "layer_norm"):
        f = cases[name]
        res = bench.interleaved(
            {
                "hand-packed (values)": lambda f=f: f(vg, None),
                "padless": lambda f=f: f(xg, None),
                "padded": lambda f=f: f(pg, None),
            },
            baseline="hand-packed (values)",
            rounds=args.rounds,
            inner=args.inner,
        )
        over = res["padless"][0] - res["hand-packed (values)"][0]
        grad_rows += bench.rows_from(name, res, {"padless": f"overhead {over:.1f} us"})
    print(f"B={len(lengths)}, C={c}, lengths {lengths}, occupancy {x.occupancy():.2f}, torch {torch.__version__}, 1 thread")
    bench.print_table(rows, "Eager per-call cost (no grad)", "hand-packed (values)")
    bench.print_table(grad_rows, "Eager per-call cost, recording autograd (forward only)", "hand-packed (values)")


if __name__ == "__main__":
    main()
