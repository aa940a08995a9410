"""Transformer encoder layers on variable-length batches: padded vs padless vs torch.nested.

    python benchmarks/encoder.py [--batch-sizes 16,64,256] [--threads 1,2] [--batches 6]
                                 [--config uniform|lognormal|both] [--models pre-ln,encoder-layer]
                                 [--profile] [--device cpu|cuda] [--d 256] [--rounds 1]
                                 [--clock wall|cpu] [--stat median|min] [--per-call] [--no-nested]

Two models, forward + backward, d=256 (``--d``), 4 heads, FFN 4x, GELU:

* a pre-LN encoder layer written with plain torch calls (qkv Linear, chunk,
  unflatten, transpose, ``F.scaled_dot_product_attention``);
* ``nn.TransformerEncoderLayer(norm_first=True, batch_first=True)``.

Each runs as padded dense (key-padding mask), as padless (the same module code on a
NestedTensor), as ``torch.nested`` jagged where it runs, and (pre-LN layer) as explicit
hand packing: the same weights on one ``(T, d)`` buffer with one SDPA call per sample on
``torch.split`` views, what a user writes without a library. The note column of the
padded row gives the FLOP ideal: padded FLOPs over packed FLOPs for that batch (linears,
layer norms and activations scale with the tokens, ``72 d^2`` per token forward + backward;
attention with ``L^2``, ``14 L^2 d`` with the fused backward's recompute), i.e. the
speed-up a packed path reaches if every FLOP costs the same on both sides. Lengths are uniform in
``[16, 256] * 16 / B`` (occupancy ~0.55 at every B, the same ~2,200 tokens per batch:
U[16, 256] at B=16, U[4, 64] at B=64, U[1, 16] at B=256) or lognormal (~0.3, scaled the
same way). Each row runs at every thread count given (``--threads``, default 1 and all
cores). Every batch runs every implementation back to back; the table gives medians of
per-batch times and of per-batch ratios, and the machine's load average, since
timings on a shared machine are noisy. ``--profile`` adds the CPU profile of the padless
pre-LN step (share of ``slice_backward``, ``fill_``, ``add_``, ``copy_``, ``cat``, SDPA).
``--device cuda`` runs the same in bfloat16 on a GPU. ``--d 128`` runs the small layer where
per-sample attention calls weigh most; ``--per-call`` adds padless with the length buckets of
``padless/ops/attention/buckets.py`` switched off (one SDPA call per sample or equal length);
``--rounds`` repeats each batch round-robin (median per batch, or the fastest round with
``--stat min``: on a shared machine another job's burst only ever slows a round down);
``--clock cpu`` times CPU seconds of the process (steadier on a loaded machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import padless
from padless.ops.attention import sdpa
from padless.testing import bench


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
    """Lengths for a batch of ``b``: the B=16 distribution scaled by 16 / b (same tokens per batch)."""
    scale = 16 / b
    if kind == "uniform":
        lo, hi = max(1, round(16 * scale)), max(1, round(256 * scale))
        return torch.randint(lo, hi + 1, (b,), generator=g).tolist()
    raw = torch.empty(b).log_normal_(mean=4.0, std=0.9, generator=g)
    return (raw.clamp(8, 512) * scale).round().clamp(min=1).long().tolist()


CLOCK = time.perf_counter  # --clock cpu: time.process_time (CPU seconds of this process; steadier on a busy machine)


def timed(fn) -> float:
    t0 = CLOCK()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return CLOCK() - t0


def make_models(d: int, heads: int, device: str, dtype: torch.dtype) -> dict[str, nn.Module]:
    torch.manual_seed(0)
    models = {
        "pre-ln": PreLNLayer(d, heads),
        "encoder-layer": nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        ),
    }
    return {k: m.to(device=device, dtype=dtype) for k, m in models.items()}


NAMES = {"pre-ln": "pre-LN layer", "encoder-layer": "nn.TransformerEncoderLayer"}
IMPLS = ("padded + mask", "padless", "padless, call per sample", "hand-packed", "torch.nested")


def hand_packed(m: PreLNLayer, x, lengths: list[int]):
    """The pre-LN layer on packed ``(T, d)`` rows written by hand: one SDPA per sample on
    ``torch.split`` views (4-D, so torch's fused CPU kernel runs), one concatenation."""
    q, k, v = m.qkv(m.ln1(x)).chunk(3, dim=-1)
    q, k, v = (t.contiguous().unflatten(-1, (m.heads, -1)) for t in (q, k, v))  # (T, H, E) rows
    outs = [
        F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in qkv))[0].transpose(0, 1)
        for qkv in zip(q.split(lengths), k.split(lengths), v.split(lengths))
    ]
    x = x + m.proj(torch.cat(outs).flatten(-2))
    return x + m.ff(m.ln2(x))


def flop_ideal(lengths: list[int], d: int) -> float:
    """Padded FLOPs over packed FLOPs of one forward + backward step (see the module docstring)."""
    b, lmax = len(lengths), max(lengths)
    per_token, per_score = 72 * d * d, 14 * d
    padded = b * lmax * per_token + b * lmax * lmax * per_score
    packed = sum(lengths) * per_token + sum(n * n for n in lengths) * per_score
    return padded / packed
SKIPPED: dict[str, str] = {}  # "model / implementation" -> why it could not run


def run_config(kind: str, b: int, threads: int, args, models, device: str, dtype: torch.dtype) -> list[bench.Row]:
    torch.set_num_threads(threads)
    d = args.d
    g = torch.Generator().manual_seed(1)
    times: dict[tuple[str, str], list[float]] = {}
    ratios: dict[tuple[str, str], list[float]] = {}
    notes: dict[tuple[str, str], str] = {}
    occ, ideal = [], []
    for batch_i in range(args.batches + 1):
        lengths = lengths_for(kind, b, g)
        samples = [torch.randn(n, d, generator=g).to(device=device, dtype=dtype) for n in lengths]
        x = padless.from_list(samples).requires_grad_()
        pad = x.to_padded().detach().requires_grad_()
        keep = x.mask()[..., 0]
        occ.append(x.occupancy())
        xs = torch.cat(samples).requires_grad_()
        if batch_i:  # batch 0 warms up
            ideal.append(flop_ideal(lengths, d))
        for name, m in models.items():
            def padded_step(m=m, name=name):
                if name == "pre-ln":
                    y = m(pad, attn_mask=keep[:, None, None, :])
                else:
                    y = m(pad, src_key_padding_mask=~keep)
                ((y ** 2) * keep[..., None]).sum().div(keep.sum() * d).backward()

            def padless_step(m=m):
                (m(x) ** 2).mean().backward()

            def hand_step(m=m):
                (hand_packed(m, xs, lengths) ** 2).mean().backward()

            def nested_step(m=m):
                njt = torch.nested.nested_tensor([s.detach() for s in samples], layout=torch.jagged, requires_grad=True)
                y = m(njt)
                (y.values() ** 2).mean().backward()

            def per_call_step(m=m):
                sdpa.BUCKETS = False  # one SDPA call per sample (and per group of equal lengths)
                try:
                    (m(x) ** 2).mean().backward()
                finally:
                    sdpa.BUCKETS = True

            steps = {"padded + mask": padded_step, "padless": padless_step, "torch.nested": nested_step}
            if args.no_nested:
                del steps["torch.nested"]
            if args.per_call:
                steps["padless, call per sample"] = per_call_step
            if name == "pre-ln":
                steps["hand-packed"] = hand_step
            runs: dict[str, list[float]] = {}
            for _ in range(args.rounds):  # round-robin: every implementation once per round
                for impl, fn in steps.items():
                    key = (name, impl)
                    if notes.get(key, "").startswith("cannot run"):
                        continue
                    m.zero_grad(set_to_none=True)
                    try:
                        runs.setdefault(impl, []).append(timed(fn))
                    except Exception as e:  # torch.nested's coverage differs per torch version
                        notes[key] = f"cannot run: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
            per_batch = min if args.stat == "min" else statistics.median
            res = {impl: per_batch(ts) for impl, ts in runs.items() if not notes.get((name, impl), "").startswith("cannot")}
            if batch_i == 0:
                continue
            for impl, t in res.items():
                times.setdefault((name, impl), []).append(t)
                ratios.setdefault((name, impl), []).append(res["padded + mask"] / t)
    case_tail = f"{kind} B={b} (occ {statistics.mean(occ):.2f}), {threads} thr"
    rows = []
    for name in models:
        for impl in IMPLS:
            key = (name, impl)
            case = f"{NAMES[name]}, {case_tail}"
            if key in times:
                note = f"FLOP ideal {statistics.median(ideal):.2f}x" if impl == "padded + mask" and ideal else ""
                rows.append(bench.Row(case, impl, statistics.median(times[key]) * 1e6, statistics.median(ratios[key]), note))
            elif key in notes:
                SKIPPED[f"{NAMES[name]} / {impl}"] = notes[key]
    return rows


def profile_padless(models, device: str, dtype: torch.dtype, b: int, threads: int, d: int) -> None:
    """Where the padless pre-LN step spends its CPU time (two steps, after one warm-up)."""
    from torch.profiler import profile

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(1)
    m = models["pre-ln"]
    x = padless.from_list([torch.randn(n, d, generator=g).to(device=device, dtype=dtype) for n in lengths_for("uniform", b, g)])
    x.requires_grad_()
    (m(x) ** 2).mean().backward()
    with profile() as prof:
        for _ in range(2):
            (m(x) ** 2).mean().backward()
    ev = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ev) or 1.0
    watch = ("aten::slice_backward", "aten::fill_", "aten::add_", "aten::copy_", "aten::cat", "aten::index_add_", "aten::index_select")
    print(f"\n### padless pre-LN step profile, d={d}, uniform B={b}, {threads} thread(s): share of self CPU time\n")
    print("| op | calls | share |")
    print("|---|---:|---:|")
    for e in sorted(ev, key=lambda e: -e.self_cpu_time_total):
        if e.key in watch or "scaled_dot_product" in e.key or e.key in ("aten::mm", "aten::addmm"):
            print(f"| {e.key} | {e.count} | {100 * e.self_cpu_time_total / total:.1f}% |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--batch-sizes", default="16,64,256")
    ap.add_argument("--threads", default=f"1,{os.cpu_count() or 1}")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--config", choices=["uniform", "lognormal", "both"], default="uniform")
    ap.add_argument("--models", default="pre-ln,encoder-layer")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--d", type=int, default=256, help="model width (4 heads)")
    ap.add_argument("--per-call", action="store_true", help="add padless with one SDPA call per sample (no length buckets)")
    ap.add_argument("--no-nested", action="store_true", help="skip torch.nested")
    ap.add_argument("--rounds", type=int, default=1, help="round-robin repeats per batch (median per batch)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="wall time, or CPU time of this process")
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="per batch, the median or the fastest of its rounds (min: steadier on a shared machine)")
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    models = make_models(args.d, 4, args.device, dtype)
    models = {k: models[k] for k in args.models.split(",")}
    threads = [int(t) for t in dict.fromkeys(args.threads.split(","))]
    load0 = os.getloadavg()
    rows: list[bench.Row] = []
    for kind in (["uniform", "lognormal"] if args.config == "both" else [args.config]):
        for b in (int(x) for x in args.batch_sizes.split(",")):
            for t in threads:
                rows += run_config(kind, b, t, args, models, args.device, dtype)
    load1 = os.getloadavg()
    bench.print_table(
        rows,
        f"Encoder layer, forward + backward, d={args.d}, 4 heads, FFN 4x, {args.batches} batches per row, {args.device} "
        f"{str(dtype).replace('torch.', '')}, {args.clock} clock, {args.stat} of {args.rounds} rounds, torch {torch.__version__}, {os.cpu_count()} cores, load average "
        f"{load0[0]:.1f} at start, {load1[0]:.1f} at end",
        "padded + mask",
    )
    for what, why in SKIPPED.items():
        print(f"\n{what}: {why}")
    if args.profile and "pre-ln" in models:
        for b in (int(x) for x in args.batch_sizes.split(",")):
            for t in threads:
                profile_padless(models, args.device, dtype, b, t, args.d)


if __name__ == "__main__":
    main()
