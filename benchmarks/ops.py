"""Per-op eager cost on NestedTensors vs the same work hand-packed on values and padded.

    python benchmarks/ops.py [--rounds N]

Small batches (B=8, 8..64 tokens, C=64, one thread) so per-call overhead shows.
"hand-packed" is the best plain-torch code on the packed buffer with its index
tensors prebuilt (what a user would write by hand); "padded" is the dense op on the
padded batch (plus the mask work a correct result needs). Medians of interleaved
rounds from one run; "overhead" is padless minus hand-packed.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import padless
from padless.testing import bench


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--inner", type=int, default=100)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    lengths = [17, 33, 8, 64, 40, 25, 51, 12]
    c = 64
    x = padless.from_list([torch.randn(n, c) for n in lengths])
    v = x.values()
    pad = x.to_padded()
    mask = x.mask()[..., :1]  # (B, L, 1)
    n = x.lengths().to(v.dtype)[:, None]
    sid = x.row_sample_ids()
    b = len(lengths)
    lin, ln = torch.nn.Linear(c, c), torch.nn.LayerNorm(c)
    short = [5, 9, 3, 7]
    s = padless.from_list([torch.randn(k, 16) for k in short])
    sv = s.values()
    ii = torch.cat([torch.arange(k).repeat_interleave(k) + o for k, o in zip(short, s.offsets()[:-1].tolist())])
    jj = torch.cat([torch.arange(k).repeat(k) + o for k, o in zip(short, s.offsets()[:-1].tolist())])
    spad = s.to_padded()

    def seg_softmax(values):
        m = torch.zeros(b, c).scatter_reduce(0, sid[:, None].expand_as(values), values, "amax", include_self=False)
        e = (values - m[sid]).exp()
        return e / torch.zeros(b, c).index_add(0, sid, e)[sid]

    cases = {
        "linear (feature)": (lambda: lin(x), lambda: lin(v), lambda: lin(pad)),
        "layer_norm (feature)": (lambda: ln(x), lambda: ln(v), lambda: ln(pad)),
        "gelu (pointwise)": (lambda: F.gelu(x), lambda: F.gelu(v), lambda: F.gelu(pad)),
        "sum over ragged dim": (lambda: x.sum(dim=1), lambda: torch.zeros(b, c).index_add(0, sid, v), lambda: (pad * mask).sum(1)),
        "mean over ragged dim": (lambda: x.mean(dim=1), lambda: torch.zeros(b, c).index_add(0, sid, v) / n, lambda: (pad * mask).sum(1) / n),
        "amax over ragged dim": (
            lambda: x.amax(dim=1),
            lambda: torch.zeros(b, c).scatter_reduce(0, sid[:, None].expand_as(v), v, "amax", include_self=False),
            lambda: pad.masked_fill(~mask, float("-inf")).amax(1),
        ),
        "softmax over ragged dim": (lambda: torch.softmax(x, dim=1), lambda: seg_softmax(v), lambda: pad.masked_fill(~mask, float("-inf")).softmax(1)),
        "softmax over static dim": (lambda: torch.softmax(x, dim=-1), lambda: torch.softmax(v, -1), lambda: torch.softmax(pad, -1)),
        "pair from singles (N,1)+(1,N)": (
            lambda: s.unsqueeze(2) + s.unsqueeze(1),
            lambda: sv.index_select(0, ii) + sv.index_select(0, jj),
            lambda: spad.unsqueeze(2) + spad.unsqueeze(1),
        ),
    }
    rows = []
    with torch.no_grad():
        for name, (f_nt, f_hand, f_pad) in cases.items():
            res = bench.interleaved(
                {"hand-packed": f_hand, "padless": f_nt, "padded": f_pad},
                baseline="hand-packed",
                rounds=args.rounds,
                inner=args.inner,
            )
            over = res["padless"][0] - res["hand-packed"][0]
            rows += bench.rows_from(name, res, {"padless": f"overhead {over:.1f} us"})
    print(f"B={b}, C={c}, lengths {lengths}; pairs from lengths {short}, C=16; torch {torch.__version__}, 1 thread, no grad")
    bench.print_table(rows, "Per-op eager cost", "hand-packed")


if __name__ == "__main__":
    main()
