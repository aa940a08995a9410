"""padless demo: pack variable-length sequences, train a small model step, see what padding cost.

    make demo            (or: python examples/demo.py [--batch 32] [--dim 256])

The data is made here: token-feature sequences whose lengths follow a long-tailed
distribution (most short, a few long), as in real text. The same model step
(LayerNorm -> MLP with residual, mean-squared loss over real tokens, forward and
backward) runs on a padded batch with a mask and on a padless NestedTensor; the
demo checks that both give the same loss and gradients, then prints what padless
saved: elements, activation bytes and step time, measured side by side.
"""

from __future__ import annotations

import argparse

import torch

import padless
from padless.testing.models import TokenMLP
from padless.testing import bench


def make_lengths(batch: int, lo: int, hi: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    raw = torch.empty(batch).log_normal_(mean=4.0, std=0.8, generator=g)
    return raw.clamp(lo, hi).long().tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)

    lengths = make_lengths(args.batch, 4, 512, args.seed)
    samples = [torch.randn(n, args.dim) for n in lengths]
    x = padless.from_list(samples)  # one packed buffer + structure
    padded = x.to_padded()  # what a padding collate_fn would have produced
    mask = x.mask()[..., 0]  # (B, L) True on real tokens

    model = TokenMLP(args.dim, 4 * args.dim)

    def padless_step():
        model.zero_grad(set_to_none=True)
        y = model(x)
        loss = (y ** 2).mean()  # mean over real elements only
        loss.backward()
        return loss

    def padded_step():
        model.zero_grad(set_to_none=True)
        y = model(padded)
        per_tok = (y ** 2).sum(-1) * mask
        loss = per_tok.sum() / (mask.sum() * args.dim)
        loss.backward()
        return loss

    # 1. Same numbers.
    l_pad = padded_step().item()
    g_pad = [p.grad.clone() for p in model.parameters()]
    l_nt = padless_step().item()
    g_nt = [p.grad.clone() for p in model.parameters()]
    grad_err = max((a - b).abs().max().item() / (b.abs().max().item() + 1e-12) for a, b in zip(g_nt, g_pad))
    same = abs(l_pad - l_nt) <= 1e-4 * abs(l_pad) and grad_err < 1e-3

    # 2. What padding costs.
    real, env = x.numel(), x.padded_numel()
    hidden_bytes_real = sum(lengths) * 4 * args.dim * 4
    hidden_bytes_pad = args.batch * max(lengths) * 4 * args.dim * 4
    res = bench.interleaved(
        {"padded + mask": padded_step, "padless": padless_step}, baseline="padded + mask", rounds=args.rounds, warmup=2
    )

    print("padless demo: a LayerNorm->MLP residual block, forward + backward, on variable-length sequences")
    print(f"  batch {args.batch}, feature dim {args.dim}, lengths {min(lengths)}..{max(lengths)} (mean {sum(lengths) / len(lengths):.0f})")
    print(f"  storage: values {tuple(x.values().shape)}, offsets {x.offsets().tolist()[:6]}..., envelope {tuple(x.shape)}")
    print(f"  occupancy of the padded envelope: {x.occupancy():.2f}")
    print(f"  same loss and gradients as padded+mask: {'yes' if same else 'NO'} (loss {l_nt:.6f} vs {l_pad:.6f}, max rel grad diff {grad_err:.1e})")
    print()
    print(f"  {'':26}{'padded':>14}{'padless':>14}{'saved':>10}")
    print(f"  {'input elements':26}{env:>14,}{real:>14,}{1 - real / env:>10.0%}")
    print(f"  {'MLP hidden activation MB':26}{hidden_bytes_pad / 2**20:>14.1f}{hidden_bytes_real / 2**20:>14.1f}{1 - hidden_bytes_real / hidden_bytes_pad:>10.0%}")
    tp, tn = res["padded + mask"][0], res["padless"][0]
    print(f"  {'step time (ms, median)':26}{tp / 1e3:>14.1f}{tn / 1e3:>14.1f}{res['padless'][1]:>9.2f}x")
    print(f"  (ideal speed-up for feature-wise work is 1/occupancy = {1 / x.occupancy():.2f}x)")
    if not same:
        raise SystemExit("demo: padless and padded results disagree")


if __name__ == "__main__":
    main()
