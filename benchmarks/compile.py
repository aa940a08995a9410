"""torch.compile on variable-size batches: eager padless vs compiled padless vs compiled padded.

    python benchmarks/compile.py [--models pair,triangle,encoder] [--backend inductor] [--batches 8]
                                 [--repeats 3] [--threads 2] [--clock wall|cpu] [--fallback-random]

Three models, forward + backward, on batches whose size and lengths change every step:

* the pair block ``p = u(x)[:, :, None] + v(x)[:, None]; p = p + mlp(ln(p));
  x + g(p.mean(dim=2))`` (C=32, pair channels 16, MLP 4x), batches of B in 2..16 with
  lengths U[8, 48]; padless inputs are plain ``padless.from_list`` batches (no preparation
  step: the pair row count is carried into the graph automatically); the padded twin masks
  the pair mean;
* a triangle-multiplication block on the same batches: ``z`` as above, gated projections
  ``a, b``, ``einsum("bikc,bjkc->bijc", a, b) + einsum("bkic,bkjc->bijc", a, b)``, a layer
  norm, and ``x + o(z.mean(dim=2))``; the padded twin zeroes padded pair rows before the
  products and masks the mean;
* ``nn.TransformerEncoderLayer(64, 4, 256, dropout=0, batch_first=True)``, B in 2..16,
  lengths U[16, 128]; the padded twin passes ``src_key_padding_mask``;
* (``--models decoder``) ``nn.TransformerDecoderLayer(64, 4, 256, batch_first=True)`` in
  training (dropout 0.1: attention dropout runs in padless' saving dropout op), causal
  self-attention and cross-attention to the batch itself, same batches as the encoder; the
  padded twin passes both key padding masks.

Compiled runs use ``fullgraph=True`` (padless) and ``dynamic=True`` (padded, so it does not
recompile per shape). The first pass over the batches is the warm-up and gives the compile
time (all graphs compiled while warming up); then every batch runs every implementation back
to back ``--repeats`` times, and the table gives the median per-batch time, the median of
per-batch ratios against eager padless, graphs compiled over the whole run (warm-up
included) and recompiles after warm-up. Timings on a shared machine are noisy: the load
average is printed with the table; ``--clock cpu`` times this process's CPU time
(``time.process_time``) instead of wall time, which other processes' load disturbs less
(use it with ``--threads 1``, where CPU time is the work done).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn as nn
from torch._dynamo.testing import CompileCounterWithBackend

import padless


class TriangleBlock(nn.Module):
    def __init__(self, c: int = 32, p: int = 16) -> None:
        super().__init__()
        self.u, self.v, self.o = nn.Linear(c, p), nn.Linear(c, p), nn.Linear(p, c)
        self.a, self.b, self.ga = nn.Linear(p, p), nn.Linear(p, p), nn.Linear(p, p)
        self.ln = nn.LayerNorm(p)

    def forward(self, x):
        z = self.u(x).unsqueeze(2) + self.v(x).unsqueeze(1)
        a, b = self.a(z) * torch.sigmoid(self.ga(z)), self.b(z)
        t = torch.einsum("bikc,bjkc->bijc", a, b) + torch.einsum("bkic,bkjc->bijc", a, b)
        z = z + self.ln(t)
        return x + self.o(z.mean(dim=2))


def triangle_padded(block: TriangleBlock, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The triangle block on a padded ``(B, L, C)`` batch; padded pair rows are zeroed before
    the products (so they add nothing) and left out of the mean."""
    m = mask.to(x.dtype)
    pm = (m[:, :, None] * m[:, None, :])[..., None]
    z = block.u(x).unsqueeze(2) + block.v(x).unsqueeze(1)
    a, b = block.a(z) * torch.sigmoid(block.ga(z)) * pm, block.b(z) * pm
    t = torch.einsum("bikc,bjkc->bijc", a, b) + torch.einsum("bkic,bkjc->bijc", a, b)
    z = z + block.ln(t)
    mean = (z * m[:, None, :, None]).sum(2) / m.sum(1).clamp_min(1)[:, None, None]
    return (x + block.o(mean)) * m[..., None]


class PairBlock(nn.Module):
    def __init__(self, c: int = 32, p: int = 16) -> None:
        super().__init__()
        self.u, self.v, self.g = nn.Linear(c, p), nn.Linear(c, p), nn.Linear(p, c)
        self.ln = nn.LayerNorm(p)
        self.mlp = nn.Sequential(nn.Linear(p, 4 * p), nn.ReLU(), nn.Linear(4 * p, p))

    def forward(self, x):
        p = self.u(x).unsqueeze(2) + self.v(x).unsqueeze(1)
        p = p + self.mlp(self.ln(p))
        return x + self.g(p.mean(dim=2))


def pair_padded(block: PairBlock, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The same block on a padded ``(B, L, C)`` batch; ``mask`` ``(B, L)`` marks real rows."""
    p = block.u(x).unsqueeze(2) + block.v(x).unsqueeze(1)
    p = p + block.mlp(block.ln(p))
    m = mask.to(x.dtype)
    mean = (p * m[:, None, :, None]).sum(2) / m.sum(1).clamp_min(1)[:, None, None]
    return (x + block.g(mean)) * m[..., None]


class DecoderBlock(nn.Module):
    """``nn.TransformerDecoderLayer(64, 4, 256, batch_first=True)`` in training (dropout 0.1):
    causal self-attention, and cross-attention to the batch itself as the memory."""

    def __init__(self) -> None:
        super().__init__()
        self.dec = nn.TransformerDecoderLayer(64, 4, 256, batch_first=True)

    def forward(self, x):
        causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.dec(x, x, tgt_mask=causal, tgt_is_causal=True)


def decoder_padded(block: DecoderBlock, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
    pad = ~mask
    out = block.dec(x, x, tgt_mask=causal, tgt_is_causal=True, tgt_key_padding_mask=pad, memory_key_padding_mask=pad)
    return out * mask[..., None]


def batches(model: str, n: int, seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    sizes = [4, 2, 7, 16, 3, 9, 12, 5, 8, 6][:n]
    lo, hi, c = (8, 48, 32) if model in ("pair", "triangle") else (16, 128, 64)
    return [[torch.randn(int(l), c, generator=g) for l in torch.randint(lo, hi + 1, (b,), generator=g)] for b in sizes]


def make(model: str, backend: str):
    """(implementation name -> step(samples) callable, counters) for one model."""
    torch.manual_seed(0)
    if model == "pair":
        net = PairBlock()
        padded_fn = lambda x, m: pair_padded(net, x, m)  # noqa: E731
    elif model == "triangle":
        net = TriangleBlock()
        padded_fn = lambda x, m: triangle_padded(net, x, m)  # noqa: E731
    elif model == "decoder":
        net = DecoderBlock()
        padded_fn = lambda x, m: decoder_padded(net, x, m)  # noqa: E731
    else:
        net = nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)
        padded_fn = lambda x, m: net(x, src_key_padding_mask=~m) * m[..., None]  # noqa: E731
    c_nt, c_pad = CompileCounterWithBackend(backend), CompileCounterWithBackend(backend)
    compiled_nt = torch.compile(net, backend=c_nt, fullgraph=True)
    compiled_pad = torch.compile(padded_fn, backend=c_pad, dynamic=True)

    def nt_input(samples):
        return padless.from_list(samples, requires_grad=True)

    def run_nt(fn):
        def step(samples):
            x = nt_input(samples)
            (fn(x).values() ** 2).sum().backward()
        return step

    def run_pad(samples):
        x = padless.from_list(samples)
        xp, m = x.to_padded(), x.mask()[..., 0]
        xp.requires_grad_()
        (compiled_pad(xp, m) ** 2).sum().backward()

    impls = {"eager padless": run_nt(net), "compiled padless": run_nt(compiled_nt), "compiled padded": run_pad}
    return net, impls, {"compiled padless": c_nt, "compiled padded": c_pad}


CLOCK = time.perf_counter


def timed(fn, *args) -> float:
    t = CLOCK()
    fn(*args)
    return CLOCK() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="pair,triangle,encoder")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="wall time, or this process's CPU time")
    ap.add_argument(
        "--fallback-random", action="store_true",
        help="torch._inductor.config.fallback_random: inductor calls aten's RNG (eager's bernoulli_) for dropout "
        "instead of drawing one Philox number per element in its generated CPU code",
    )
    args = ap.parse_args()
    if args.fallback_random:
        import torch._inductor.config as inductor_config

        inductor_config.fallback_random = True
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    print(
        f"threads={args.threads} backend={args.backend} clock={args.clock} "
        f"fallback_random={args.fallback_random} torch {torch.__version__}"
    )
    for model in args.models.split(","):
        net, impls, counters = make(model, args.backend)
        data = batches(model, args.batches)
        occ = statistics.mean(padless.from_list(s).occupancy() for s in data)
        warm: dict[str, float] = {}
        for name, fn in impls.items():
            warm[name] = sum(timed(fn, s) for s in data)
            net.zero_grad()
        graphs_after_warmup = {k: c.frame_count for k, c in counters.items()}
        times: dict[str, list[float]] = {k: [] for k in impls}
        ratios: dict[str, list[float]] = {k: [] for k in impls}
        for _ in range(args.repeats):
            for s in data:
                t = {name: timed(fn, s) for name, fn in impls.items()}
                net.zero_grad()
                for name in impls:
                    times[name].append(t[name])
                    ratios[name].append(t["eager padless"] / t[name])
        load = os.getloadavg()[0]
        print(f"\n{model}: {len(data)} batches, B 2..16, mean occupancy {occ:.2f}, load {load:.2f} (uptime 1-min)")
        print(f"{'implementation':<18}{'median ms':>10}{'speedup vs eager':>18}{'warm-up s':>11}{'graphs':>8}{'recompiles':>11}")
        for name in impls:
            c = counters.get(name)
            graphs = "-" if c is None else str(c.frame_count)
            recompiles = "-" if c is None else str(c.frame_count - graphs_after_warmup[name])
            print(
                f"{name:<18}{1e3 * statistics.median(times[name]):>10.2f}{statistics.median(ratios[name]):>17.2f}x"
                f"{warm[name]:>11.1f}{graphs:>8}{recompiles:>11}"
            )


if __name__ == "__main__":
    main()
