"""Which CPU attention strategy to use for packed rows: measured side by side.

    python benchmarks/attention_cpu.py [--rounds 5] [--threads N] [--flex-compiled]

4 heads, head dim 64, forward + backward of SDPA, two batches with the same ~2,200
tokens: B=16 with lengths U[16, 256] and B=256 with lengths U[1, 16] (occupancy ~0.55):

* padless: ``F.scaled_dot_product_attention`` on NestedTensors (the CPU default:
  samples from one split of the rows, equal-length samples batched in one call);
* per-sample slices: the same loop over samples taking each sample as a slice of the
  rows (what padless did before: its backward fills a buffer of all rows per sample);
* block-diagonal: one SDPA over all T rows with a (T, T) mask that blocks
  cross-sample pairs (no padding, but every cross-sample score is computed; B=16 only);
* padded: SDPA on the padded batch with a key-padding mask (the usual baseline);
* FlexAttention (eager) with a document mask: forward only (no CPU backward in
  torch 2.13), on a smaller batch, because eager flex materialises all scores.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

import padless
from padless.ops.attention import sdpa as attn
from padless.testing import bench


def _slices(q: padless.NestedTensor) -> torch.Tensor:
    """The per-sample loop over slices of the rows (the O(B x T) backward, for comparison)."""
    v = q.values()
    o = q.host_offsets().tolist()
    outs = []
    for i in range(q.batch_size):
        x = v[o[i] : o[i + 1]].movedim(0, 1).unsqueeze(0)
        outs.append(F.scaled_dot_product_attention(x, x, x)[0].movedim(1, 0))
    return torch.cat(outs)


def strategies(b: int, lo: int, hi: int, h: int, e: int, rounds: int) -> tuple[list, padless.NestedTensor]:
    lengths = torch.randint(lo, hi + 1, (b,)).tolist()
    q = padless.from_list([torch.randn(h, n, e) for n in lengths], ragged_dims=(1,)).requires_grad_()
    qv = q.values().detach().requires_grad_()
    sid = q.row_sample_ids()
    block = sid[:, None] == sid[None, :]
    pad = q.to_padded().detach().requires_grad_()
    keep = q.mask()[:, 0, :, 0]  # (B, L)
    kpm = keep[:, None, None, :]
    impls = {
        "padless (default)": lambda: F.scaled_dot_product_attention(q, q, q).sum().backward(),
        "per-sample slices": lambda: _slices(q).sum().backward(),
        "padded + mask": lambda: F.scaled_dot_product_attention(pad, pad, pad, attn_mask=kpm).sum().backward(),
    }
    if b <= 16:
        impls["block-diagonal"] = lambda: F.scaled_dot_product_attention(
            qv.permute(1, 0, 2), qv.permute(1, 0, 2), qv.permute(1, 0, 2), attn_mask=block
        ).sum().backward()
    res = bench.interleaved(impls, baseline="padded + mask", rounds=rounds, warmup=1)
    case = f"B={b}, U[{lo}, {hi}] (T={qv.shape[0]}, occ {q.occupancy():.2f})"
    return bench.rows_from(case, res), q


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--flex-compiled", action="store_true", help="also time compiled FlexAttention (forward; ~10 s compile)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    h, e = 4, 64
    load0 = os.getloadavg()[0]
    rows, q = strategies(16, 16, 256, h, e, args.rounds)
    rows256, _ = strategies(256, 1, 16, h, e, args.rounds)
    lengths = q.host_sizes()[:, 1].tolist()
    qv = q.values().detach()
    t = qv.shape[0]
    sid = q.row_sample_ids()
    print(f"H={h}, E={e}, forward + backward, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"load average {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    bench.print_table(rows + rows256, "CPU attention strategies", "padded + mask")
    small = padless.from_list([torch.randn(h, n, e) for n in lengths[:4]], ragged_dims=(1,))
    with torch.no_grad():
        attn._flex(small, small, small, False, None, False, None, None)
        t0 = time.perf_counter()
        attn._flex(small, small, small, False, None, False, None, None)
        flex_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        F.scaled_dot_product_attention(small, small, small)
        ps_ms = (time.perf_counter() - t0) * 1e3
    print(f"\nFlexAttention eager, forward only, first 4 samples: {flex_ms:.1f} ms (per-sample: {ps_ms:.1f} ms)")
    if args.flex_compiled:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def doc(b, hh, qi, ki):
            return sid[qi] == sid[ki]

        bm = create_block_mask(doc, None, None, t, t, device="cpu")
        x = qv.detach().permute(1, 0, 2).unsqueeze(0)
        cf = torch.compile(flex_attention)
        t0 = time.perf_counter()
        cf(x, x, x, block_mask=bm)
        compile_s = time.perf_counter() - t0
        with torch.no_grad():
            res2 = bench.interleaved(
                {"per-sample": lambda: F.scaled_dot_product_attention(q, q, q), "flex compiled": lambda: cf(x, x, x, block_mask=bm)},
                baseline="per-sample", rounds=args.rounds, warmup=1,
            )
        print(f"compiled FlexAttention (compile {compile_s:.1f} s), forward only:")
        bench.print_table(bench.rows_from("SDPA forward", res2), "Forward only", "per-sample")


if __name__ == "__main__":
    main()
