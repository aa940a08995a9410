"""Row attention over pair states with a pair bias (triangle attention), forward + backward.

    python benchmarks/row_attention.py [--batch 8] [--lo 24] [--hi 128] [--rounds 5] [--threads N]

Pair samples ``(N_i, N_i, H, E)`` (H=4, E=32), N_i ~ U[lo, hi], a learnable pair bias
``(N_i, N_i, H)``; every row of a sample attends over that sample's N_i keys. Side by side
in one run (interleaved rounds, medians of per-round ratios, see ``padless.testing.bench``):

* padless: ``padless.ops.row_attention(q, k, v, bias=b)`` on NestedTensors (one SDPA
  call per sample on views of its rows, gradients into q, k, v and the bias; forward
  only under ``no_grad``, where torch's fused CPU kernel takes the 4-D bias);
* per-sample loop: the same SDPA calls on separately stored dense samples (hand written,
  no packing: the floor padless' bookkeeping is measured against);
* padded + mask: the padded batch ``(B, N, H, N, E)`` with the bias set to -inf at padded
  keys, one SDPA over all B*N rows (the usual baseline: computes B*N^3 scores where the
  samples hold sum N_i^3).

torch.nested (jagged) holds one ragged dim, so it cannot represent an N_i x N_i pair state.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

import padless
from padless.testing import bench


def _leaves(samples: list[torch.Tensor]) -> list[torch.Tensor]:
    return [s.clone().requires_grad_() for s in samples]


def cases(b: int, lo: int, hi: int, h: int, e: int, rounds: int) -> list[bench.Row]:
    n = torch.randint(lo, hi + 1, (b,)).tolist()
    qs, ks, vs = ([torch.randn(m, m, h, e) for m in n] for _ in range(3))
    bs = [torch.randn(m, m, h) for m in n]

    # padless
    q, k, v = (padless.from_list(s, ragged_dims=(0, 1), requires_grad=True) for s in (qs, ks, vs))
    bias = padless.from_list(bs, ragged_dims=(0, 1), requires_grad=True)

    def run_padless() -> None:
        padless.ops.row_attention(q, k, v, bias=bias).values().sum().backward()

    # per-sample loop over dense samples
    lq, lk, lv, lb = _leaves(qs), _leaves(ks), _leaves(vs), _leaves(bs)

    def run_loop() -> None:
        total = 0.0
        for qi, ki, vi, bi in zip(lq, lk, lv, lb):
            o = F.scaled_dot_product_attention(
                qi.transpose(1, 2), ki.transpose(1, 2), vi.transpose(1, 2), attn_mask=bi.permute(2, 0, 1)[None]
            )
            total = total + o.sum()
        total.backward()

    # padded + mask
    nmax = max(n)
    pq, pk, pv = (q_.to_padded().detach().requires_grad_() for q_ in (q, k, v))  # (B, N, N, H, E)
    pb = bias.to_padded().detach().requires_grad_()  # (B, N, N, H)
    valid = torch.arange(nmax)[None, :] < torch.tensor(n)[:, None]  # (B, N)
    key_pad = torch.zeros(b, 1, 1, 1, nmax).masked_fill(~valid[:, None, None, None, :], float("-inf"))
    out_mask = (valid[:, :, None] & valid[:, None, :])[..., None, None].float()  # real (a, b) positions

    def run_padded() -> None:
        m = pb.permute(0, 3, 1, 2)[:, None] + key_pad  # (B, 1, H, N, N): bias + padded keys
        o = F.scaled_dot_product_attention(pq.transpose(2, 3), pk.transpose(2, 3), pv.transpose(2, 3), attn_mask=m)
        (o.transpose(2, 3) * out_mask).sum().backward()

    def forward_only(fn):
        def run() -> None:
            with torch.no_grad():
                fn()

        return run

    def fwd_padless() -> None:
        padless.ops.row_attention(q, k, v, bias=bias)

    def fwd_loop() -> None:
        for qi, ki, vi, bi in zip(qs, ks, vs, bs):
            F.scaled_dot_product_attention(
                qi.transpose(1, 2), ki.transpose(1, 2), vi.transpose(1, 2), attn_mask=bi.permute(2, 0, 1)[None]
            )

    def fwd_padded() -> None:
        m = pb.permute(0, 3, 1, 2)[:, None] + key_pad
        F.scaled_dot_product_attention(pq.transpose(2, 3), pk.transpose(2, 3), pv.transpose(2, 3), attn_mask=m)

    cube = sum(m ** 3 for m in n) / (b * nmax ** 3)
    case = f"B={b}, N U[{lo}, {hi}] (sum N^2={sum(m * m for m in n)}, score occupancy {cube:.2f})"
    rows = []
    for what, impls in (
        ("fwd+bwd", {"padded + mask": run_padded, "padless row_attention": run_padless, "per-sample loop (dense)": run_loop}),
        ("forward, no_grad", {
            "padded + mask": forward_only(fwd_padded),
            "padless row_attention": forward_only(fwd_padless),
            "per-sample loop (dense)": forward_only(fwd_loop),
        }),
    ):
        res = bench.interleaved(impls, baseline="padded + mask", rounds=rounds, warmup=1)
        rows += bench.rows_from(f"{what}, {case}", res, {"padless row_attention": "grads into q, k, v, bias" if what == "fwd+bwd" else ""})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lo", type=int, default=24)
    ap.add_argument("--hi", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load0 = os.getloadavg()[0]
    rows = cases(args.batch, args.lo, args.hi, 4, 32, args.rounds)
    print(
        f"H=4, E=32, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"load average {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end"
    )
    bench.print_table(rows, "Row attention over pair states (pair bias)", "padded + mask")
    print("\ntorch.nested (jagged): not runnable (one ragged dim; a pair state has two)")


if __name__ == "__main__":
    main()
