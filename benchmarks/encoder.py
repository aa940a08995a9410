"""Transformer encoder layers on variable-length batches: padded vs padless vs torch.nested.

    python benchmarks/encoder.py [--batches 6] [--device cpu|cuda]

Two models, forward + backward, d=256, 4 heads, FFN 4x, GELU:

* a pre-LN encoder layer written with plain torch calls (qkv Linear, chunk,
  unflatten, transpose, ``F.scaled_dot_product_attention``);
* ``nn.TransformerEncoderLayer(norm_first=True, batch_first=True)``.

Each runs as padded dense (key-padding mask), as padless (the same module code on a
NestedTensor) and as ``torch.nested`` jagged where it runs. Two length
distributions: uniform in [16, 256] (occupancy ~0.67) and lognormal (~0.3). Every
batch runs every implementation back to back; the table gives medians of per-batch
times and of per-batch ratios. ``--device cuda`` runs the same in bfloat16 on a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import padless


class PreLNLayer(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, attn_mask=None):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (t.contiguous().unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        x = x + self.proj(a.transpose(1, 2).flatten(-2))
        return x + self.ff(self.ln2(x))


def lengths_for(kind: str, b: int, g: torch.Generator) -> list[int]:
    if kind == "uniform":
        return torch.randint(16, 257, (b,), generator=g).tolist()
    raw = torch.empty(b).log_normal_(mean=4.0, std=0.9, generator=g)
    return raw.clamp(8, 512).long().tolist()


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def run_config(kind: str, args, device: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    d, heads, b = 256, 4, args.batch
    models = {
        "pre-LN layer": PreLNLayer(d, heads),
        "nn.TransformerEncoderLayer": nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        ),
    }
    for m in models.values():
        m.to(device=device, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    times: dict[tuple[str, str], list[float]] = {}
    ratios: dict[tuple[str, str], list[float]] = {}
    notes: dict[tuple[str, str], str] = {}
    occ = []
    for batch_i in range(args.batches + 1):
        lengths = lengths_for(kind, b, g)
        samples = [torch.randn(n, d, generator=g).to(device=device, dtype=dtype) for n in lengths]
        x = padless.from_list(samples).requires_grad_()
        pad = x.to_padded().detach().requires_grad_()
        keep = x.mask()[..., 0]
        occ.append(x.occupancy())
        for name, m in models.items():
            def padded_step(m=m, name=name):
                if name == "pre-LN layer":
                    y = m(pad, attn_mask=keep[:, None, None, :])
                else:
                    y = m(pad, src_key_padding_mask=~keep)
                ((y ** 2) * keep[..., None]).sum().div(keep.sum() * d).backward()

            def padless_step(m=m):
                (m(x) ** 2).mean().backward()

            def nested_step(m=m):
                njt = torch.nested.nested_tensor([s.detach() for s in samples], layout=torch.jagged, requires_grad=True)
                y = m(njt)
                (y.values() ** 2).mean().backward()

            impls = {"padded + mask": padded_step, "padless": padless_step, "torch.nested": nested_step}
            res = {}
            for impl, fn in impls.items():
                key = (name, impl)
                if notes.get(key, "").startswith("cannot run"):
                    continue
                m.zero_grad(set_to_none=True)
                try:
                    res[impl] = timed(fn)
                except Exception as e:  # torch.nested's coverage differs per torch version
                    notes[key] = f"cannot run: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
            if batch_i == 0:
                continue
            for impl, t in res.items():
                times.setdefault((name, impl), []).append(t)
                ratios.setdefault((name, impl), []).append(res["padded + mask"] / t)
    print(f"\n### {kind} lengths (occupancy {statistics.mean(occ):.2f}), B={b}, d={d}, {heads} heads, FFN 4x, "
          f"{args.batches} batches, {device} {str(dtype).replace('torch.', '')}, torch {torch.__version__}\n")
    print("| model | implementation | median step (ms) | speed vs padded (median of per-batch ratios) |")
    print("|---|---|---:|---:|")
    for name in models:
        for impl in ("padded + mask", "padless", "torch.nested"):
            key = (name, impl)
            if key in times:
                print(f"| {name} | {impl} | {statistics.median(times[key]) * 1e3:,.1f} | {statistics.median(ratios[key]):.2f}x |")
            else:
                print(f"| {name} | {impl} | - | {notes.get(key, 'not run')} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--config", choices=["uniform", "lognormal", "both"], default="both")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    for kind in (["uniform", "lognormal"] if args.config == "both" else [args.config]):
        run_config(kind, args, args.device, dtype)


if __name__ == "__main__":
    main()
