"""Which CPU attention strategy to use for packed rows: measured side by side.

    python benchmarks/attention_cpu.py [--rounds 5]

B=16 samples, 4 heads, head dim 64, lengths U[16, 256], forward + backward of SDPA:

* per-sample: torch SDPA on each sample's rows (padless' CPU default);
* block-diagonal: one SDPA over all T rows with a (T, T) mask that blocks
  cross-sample pairs (no padding, but every cross-sample score is computed);
* padded: SDPA on the padded batch with a key-padding mask (the usual baseline);
* FlexAttention (eager) with a document mask: forward only (no CPU backward in
  torch 2.13), on a smaller batch, because eager flex materialises all scores.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import padless
from padless.ops import attention as attn
from padless.testing import bench


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--flex-compiled", action="store_true", help="also time compiled FlexAttention (forward; ~10 s compile)")
    args = ap.parse_args()
    torch.manual_seed(0)
    lengths = torch.randint(16, 257, (16,)).tolist()
    h, e = 4, 64
    q = padless.from_list([torch.randn(h, n, e) for n in lengths], ragged_dims=(1,)).requires_grad_()
    qv = q.values().detach().requires_grad_()
    t = qv.shape[0]
    sid = q.row_sample_ids()
    block = sid[:, None] == sid[None, :]
    pad = q.to_padded().detach().requires_grad_()
    keep = q.mask()[:, 0, :, 0]  # (B, L)
    kpm = keep[:, None, None, :]

    def per_sample():
        F.scaled_dot_product_attention(q, q, q).sum().backward()

    def block_diagonal():
        x = qv.permute(1, 0, 2)
        F.scaled_dot_product_attention(x, x, x, attn_mask=block).sum().backward()

    def padded():
        F.scaled_dot_product_attention(pad, pad, pad, attn_mask=kpm).sum().backward()

    res = bench.interleaved(
        {"per-sample (default)": per_sample, "block-diagonal": block_diagonal, "padded + mask": padded},
        baseline="padded + mask",
        rounds=args.rounds,
        warmup=1,
    )
    small = padless.from_list([torch.randn(h, n, e) for n in lengths[:4]], ragged_dims=(1,))
    with torch.no_grad():
        attn._flex(small, small, small, False, None, False, None, None)
        t0 = time.perf_counter()
        attn._flex(small, small, small, False, None, False, None, None)
        flex_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        F.scaled_dot_product_attention(small, small, small)
        ps_ms = (time.perf_counter() - t0) * 1e3
    print(f"B=16, H={h}, E={e}, lengths U[16, 256] (T={t}), occupancy {q.occupancy():.2f}, forward + backward, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    bench.print_table(bench.rows_from("SDPA fwd+bwd", res), "CPU attention strategies", "padded + mask")
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
