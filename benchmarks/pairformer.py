"""A Pairformer layer (boltz 2.2.1's ``PairformerLayer``), train mode, forward + backward:
padded batch with its masks vs padless, interleaved, per piece and for the whole layer.

    python benchmarks/pairformer.py [--batch 8] [--lo 16] [--hi 64] [--rounds 10]
                                    [--pieces all] [--threads 1] [--clock cpu] [--profile] [--counts] [--fresh [--collator]]
                                    [--plans]
                                    [--compile [--backend inductor]] [--style boltz|mini|openfold]

The model code is boltz's, unchanged (``zoo/.venv`` has boltz installed:
``PYTHONPATH=. zoo/.venv/bin/python benchmarks/pairformer.py``). Without boltz, a small
AlphaFold-style layer written here (:class:`MiniPairformer`, the same pieces written with
plain torch calls) stands in; ``--style mini`` times it even with boltz installed, and
``--style openfold`` with its triangle multiplications written as OpenFold writes them
(``a.permute(0, 3, 1, 2) @ b.permute(0, 3, 2, 1)``, channel-first matmuls). Both sides get
the same weights and inputs:

- padded: ``s (B, N, Cs)``, ``z (B, N, N, Cz)`` zero-padded to the largest N, with
  ``mask (B, N)`` and ``pair_mask (B, N, N)``; the loss sums squares over valid positions;
- padless: ``s (N_i, Cs)``, ``z (N_i, N_i, Cz)`` NestedTensors, masks NestedTensors of ones
  (``--dense-masks``: the padded batch's dense masks, read in padded coordinates); the loss
  sums squares over the packed values.

``--plans`` splits one step of each piece on a new batch into building plans (bucket plans and
index maps for the new structures) and the rest, with the plans built and the step's aten ops
(with ``--collator`` also on a Collator's batch with the layer's recipe). ``--profile`` prints the top aten ops (self CPU time) of one padless step of the whole
layer (of the piece, when ``--pieces`` names one); ``--counts`` prints the aten ops per
padless layer step at B=4 and B=16 (a step whose op count grows with B runs per-sample loops). The ratio column is padded time / padless
time, the median of per-round ratios (above 1: padless is faster). Each batch is reused for
its rounds (index maps cached after its first step); ``--fresh`` makes a new batch of new
lengths every round instead, as training does, so every padless step pays its batch's maps;
with ``--collator`` the padless inputs come from a ``padless.Collator`` whose token field carries a
pair plan recipe (``Field(pair_plans=padless.pair_plan_recipe(layer, ...))``, recorded once on a
small example), so the collate call (a DataLoader worker's work in training, not timed in the
steps) builds the bucket plans and the step builds none; it prints the collate time with and
without the recipe.
Before any piece is timed, one untimed step of the whole layer (padded and padless, every
batch) leaves the allocator as a training loop would (:func:`warm_allocator`).

``--compile`` times the whole layer under ``torch.compile`` instead (``--backend``, inductor
by default): padless compiled with ``fullgraph=True``, padded compiled with ``dynamic=True``,
each warmed up (compiled) on every batch first. It prints the compile time of each batch,
the graphs each made (padless: one over the changing batches), and per batch the step times
of both compiled and both eager layers, interleaved, with the ratio compiled padded /
compiled padless (median of per-round ratios) and, for reference, eager padded / eager
padless (ratio of the median times); above 1: padless is faster. With ``--profile`` it then
prints the top aten and padless ops (self CPU time; the generated kernels are not among
them) of one compiled padless step. Compiling takes minutes at the default channel sizes
(padded recompiles when its padded length changes); smaller ones (``--cs 64 --cz 32 --heads
4 --pair-width 8``) compile faster.
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import padless
from padless.testing.bench import interleaved, without_syncs

# ----------------------------------------------------------------------------- a stand-in layer


class _TriMul(nn.Module):
    def __init__(self, c: int, outgoing: bool, as_matmul: bool = False) -> None:
        super().__init__()
        self.outgoing, self.as_matmul = outgoing, as_matmul
        self.norm_in, self.norm_out = nn.LayerNorm(c), nn.LayerNorm(c)
        self.p_in, self.g_in = nn.Linear(c, 2 * c, bias=False), nn.Linear(c, 2 * c, bias=False)
        self.p_out, self.g_out = nn.Linear(c, c, bias=False), nn.Linear(c, c, bias=False)

    def forward(self, x, mask):
        x = self.norm_in(x)
        xi = x
        x = self.p_in(x) * self.g_in(x).sigmoid() * mask.unsqueeze(-1)
        a, b = torch.chunk(x, 2, dim=-1)
        if self.as_matmul:  # OpenFold's form: channel-first matmuls of permuted pair states
            pa, pb = ((0, 3, 1, 2), (0, 3, 2, 1)) if self.outgoing else ((0, 3, 2, 1), (0, 3, 1, 2))
            p = torch.matmul(a.permute(*pa), b.permute(*pb)).permute(0, 2, 3, 1)
        else:
            p = torch.einsum("bikd,bjkd->bijd" if self.outgoing else "bkid,bkjd->bijd", a, b)
        return self.p_out(self.norm_out(p)) * self.g_out(xi).sigmoid()


class _TriAtt(nn.Module):
    def __init__(self, c: int, ch: int, h: int, starting: bool) -> None:
        super().__init__()
        self.starting, self.h, self.ch = starting, h, ch
        self.norm = nn.LayerNorm(c)
        self.bias = nn.Linear(c, h, bias=False)
        self.q, self.k, self.v = (nn.Linear(c, h * ch, bias=False) for _ in range(3))
        self.g, self.o = nn.Linear(c, h * ch), nn.Linear(h * ch, c)

    def forward(self, x, mask):
        if not self.starting:
            x, mask = x.transpose(-2, -3), mask.transpose(-1, -2)
        x = self.norm(x)
        tri = self.bias(x).permute(0, 3, 1, 2).unsqueeze(1)          # (B, 1, H, I, J)
        mb = (1e9 * (mask - 1))[:, :, None, None, :]                 # (B, I, 1, 1, J)
        q = self.q(x).unflatten(-1, (self.h, self.ch)).transpose(-2, -3) / math.sqrt(self.ch)
        k = self.k(x).unflatten(-1, (self.h, self.ch)).transpose(-2, -3)
        v = self.v(x).unflatten(-1, (self.h, self.ch)).transpose(-2, -3)
        a = torch.matmul(q, k.transpose(-1, -2)) + mb + tri
        o = torch.matmul(a.softmax(-1), v).transpose(-2, -3)
        o = o * self.g(x).sigmoid().unflatten(-1, (self.h, self.ch))
        o = self.o(o.flatten(-2))
        return o.transpose(-2, -3) if not self.starting else o


class _Transition(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2, self.fc3 = nn.LayerNorm(c), nn.Linear(c, 4 * c), nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x):
        x = self.norm(x)
        return self.fc3(F.silu(self.fc1(x)) * self.fc2(x))


class _PairBiasAttention(nn.Module):
    def __init__(self, cs: int, cz: int, h: int) -> None:
        super().__init__()
        self.h, self.d = h, cs // h
        self.q, self.k, self.v, self.g, self.o = (nn.Linear(cs, cs) for _ in range(5))
        self.zn, self.zb = nn.LayerNorm(cz), nn.Linear(cz, h, bias=False)

    def forward(self, s, z, mask, k_in):
        b = s.shape[0]
        q = self.q(s).view(b, -1, self.h, self.d)
        k = self.k(k_in).view(b, -1, self.h, self.d)
        v = self.v(k_in).view(b, -1, self.h, self.d)
        bias = self.zb(self.zn(z)).permute(0, 3, 1, 2)
        a = torch.einsum("bihd,bjhd->bhij", q, k) / self.d ** 0.5 + bias
        a = (a + (1 - mask[:, None, None]) * -1e6).softmax(-1)
        o = torch.einsum("bhij,bjhd->bihd", a, v).reshape(b, -1, self.h * self.d)
        return self.o(self.g(s).sigmoid() * o)


class MiniPairformer(nn.Module):
    """The pieces of an AlphaFold/boltz Pairformer layer with plain torch calls (used when
    boltz is not installed); same call signature as boltz's ``PairformerLayer``."""

    def __init__(self, cs, cz, num_heads, dropout, pairwise_head_width, pairwise_num_heads, tri_mul_matmul=False) -> None:
        super().__init__()
        self.dropout = dropout
        self.tri_mul_out, self.tri_mul_in = _TriMul(cz, True, tri_mul_matmul), _TriMul(cz, False, tri_mul_matmul)
        self.tri_att_start = _TriAtt(cz, pairwise_head_width, pairwise_num_heads, True)
        self.tri_att_end = _TriAtt(cz, pairwise_head_width, pairwise_num_heads, False)
        self.transition_z, self.transition_s = _Transition(cz), _Transition(cs)
        self.pre_norm_s = nn.LayerNorm(cs)
        self.attention = _PairBiasAttention(cs, cz, num_heads)

    def _drop(self, z, columnwise=False):
        v = z[:, 0:1, :, 0:1] if columnwise else z[:, :, 0:1, 0:1]
        p = self.dropout * self.training
        return (torch.rand(v.shape) >= p) * 1.0 / (1.0 - p)

    def forward(self, s, z, mask, pair_mask):
        z = z + self._drop(z) * self.tri_mul_out(z, mask=pair_mask)
        z = z + self._drop(z) * self.tri_mul_in(z, mask=pair_mask)
        z = z + self._drop(z) * self.tri_att_start(z, mask=pair_mask)
        z = z + self._drop(z, True) * self.tri_att_end(z, mask=pair_mask)
        z = z + self.transition_z(z)
        sn = self.pre_norm_s(s)
        s = s + self.attention(s=sn, z=z, mask=mask, k_in=sn)
        return s + self.transition_s(s), z


def build_layer(args) -> tuple[nn.Module, str]:
    torch.manual_seed(0)
    kw = dict(num_heads=args.heads, dropout=args.dropout, pairwise_head_width=args.pair_width,
              pairwise_num_heads=args.pair_heads)
    style = getattr(args, "style", "boltz")
    if style != "boltz":
        mini = MiniPairformer(args.cs, args.cz, **kw, tri_mul_matmul=style == "openfold")
        return mini, f"MiniPairformer, triangle multiplications as {'matmuls (OpenFold)' if style == 'openfold' else 'einsums'}"
    try:
        from boltz.model.layers.pairformer import PairformerLayer
    except ImportError:
        return MiniPairformer(args.cs, args.cz, **kw), "MiniPairformer (boltz not installed)"
    layer = PairformerLayer(args.cs, args.cz, v2=True, **kw)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # boltz zero-initialises the last projection of each branch
        for p in layer.parameters():
            if p.numel() and not p.any():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return layer, "boltz 2.2.1 PairformerLayer(v2=True)"


# ----------------------------------------------------------------------------- inputs


class Batch:
    """One batch, padded with masks and packed, built before timing (a collate_fn's work); with
    ``collator`` the packed side is that ``padless.Collator``'s batch of the same samples."""

    def __init__(self, ns: list[int], cs: int, cz: int, seed: int, dense_masks: bool = False, collator=None) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ns = ns
        ss = [torch.randn(n, cs, generator=g) for n in ns]
        zs = [torch.randn(n, n, cz, generator=g) for n in ns]
        n = max(ns)
        self.s = torch.stack([F.pad(a, (0, 0, 0, n - a.shape[0])) for a in ss]).requires_grad_()
        self.z = torch.stack([F.pad(b, (0, 0, 0, n - b.shape[1], 0, n - b.shape[0])) for b in zs]).requires_grad_()
        self.mask = torch.stack([F.pad(torch.ones(k), (0, n - k)) for k in ns])
        self.pair_mask = self.mask[:, :, None] * self.mask[:, None, :]
        # ragged dims declared: a batch whose lengths happen to be equal is still ragged there
        self.ps = padless.from_list(ss, ragged_dims=(0,), requires_grad=True)
        self.pz = padless.from_list(zs, ragged_dims=(0, 1), requires_grad=True)
        self.pmask = padless.from_list([torch.ones(k) for k in ns], ragged_dims=(0,))
        self.ppair_mask = padless.from_list([torch.ones(k, k) for k in ns], ragged_dims=(0, 1))
        if collator is not None:
            t0 = time.perf_counter()
            b = collator([{"s": a, "z": c, "mask": torch.ones(k), "pair_mask": torch.ones(k, k)} for a, c, k in zip(ss, zs, ns)])
            self.collate_s = time.perf_counter() - t0
            self.ps, self.pz = b.s.requires_grad_(), b.z.requires_grad_()
            self.pmask, self.ppair_mask = b.mask, b.pair_mask
        if dense_masks:  # the padded batch's masks, read by padless in padded coordinates
            self.pmask, self.ppair_mask = self.mask, self.pair_mask

    def to(self, device: str) -> "Batch":
        """Every tensor on ``device``, leaves again where they were."""
        for k, t in vars(self).items():
            if isinstance(t, torch.Tensor):
                moved = t.detach().to(device)
                setattr(self, k, moved.requires_grad_() if t.requires_grad else moved)
        return self

    @property
    def occupancy(self) -> float:
        return sum(k * k for k in self.ns) / (len(self.ns) * max(self.ns) ** 2)


def _padded_sq(t: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return (t.pow(2) * m[..., None]).sum()


def _packed_sq(t) -> torch.Tensor:
    return t.values().pow(2).sum()


def _s_norm(layer, s):
    return layer.pre_norm_s(s)


# piece name -> (padded loss, padless loss)
PIECES = {
    "tri_mul_out": (lambda L, b: _padded_sq(L.tri_mul_out(b.z, mask=b.pair_mask), b.pair_mask),
                    lambda L, b: _packed_sq(L.tri_mul_out(b.pz, mask=b.ppair_mask))),
    "tri_mul_in": (lambda L, b: _padded_sq(L.tri_mul_in(b.z, mask=b.pair_mask), b.pair_mask),
                   lambda L, b: _packed_sq(L.tri_mul_in(b.pz, mask=b.ppair_mask))),
    "tri_att_start": (lambda L, b: _padded_sq(L.tri_att_start(b.z, mask=b.pair_mask), b.pair_mask),
                      lambda L, b: _packed_sq(L.tri_att_start(b.pz, mask=b.ppair_mask))),
    "tri_att_end": (lambda L, b: _padded_sq(L.tri_att_end(b.z, mask=b.pair_mask), b.pair_mask),
                    lambda L, b: _packed_sq(L.tri_att_end(b.pz, mask=b.ppair_mask))),
    "transition_z": (lambda L, b: _padded_sq(L.transition_z(b.z), b.pair_mask),
                     lambda L, b: _packed_sq(L.transition_z(b.pz))),
    "attention": (lambda L, b: _padded_sq(L.attention(s=_s_norm(L, b.s), z=b.z, mask=b.mask, k_in=_s_norm(L, b.s)), b.mask),
                  lambda L, b: _packed_sq(L.attention(s=_s_norm(L, b.ps), z=b.pz, mask=b.pmask, k_in=_s_norm(L, b.ps)))),
    "layer": (lambda L, b: sum(_padded_sq(t, m) for t, m in zip(L(b.s, b.z, b.mask, b.pair_mask), (b.mask, b.pair_mask))),
              lambda L, b: sum(_packed_sq(t) for t in L(b.ps, b.pz, b.pmask, b.ppair_mask))),
}


_AUTOCAST: list[str] = []  # the device type to run steps under bf16 autocast (--dtype bfloat16)


def _step(layer, fn, batch):
    def run():
        layer.zero_grad(set_to_none=True)
        if _AUTOCAST:
            with torch.autocast(_AUTOCAST[0], dtype=torch.bfloat16):
                loss = fn(layer, batch)
        else:
            loss = fn(layer, batch)
        loss.backward()
    return run


def lengths(rng: random.Random, b: int, lo: int, hi: int) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(b)]


def warm_allocator(layer: nn.Module, batches: list[Batch]) -> None:
    """One untimed step of the whole layer, padded and padless, on every batch. A piece timed in
    a fresh process would otherwise see the allocator cold: the padded pair-biased attention's
    allocations of a few MB each come from ``mmap`` (page faults every step) until a larger step
    has freed blocks that size, after which they come from the heap. Measured (two threads,
    wall): padded 12.1 ms alone against 8.5 ms after ``transition_z``, padless 9.2 and 9.5 ms.
    A training loop runs the whole layer, so every piece is timed from that state."""
    pad_fn, nt_fn = PIECES["layer"]
    for b in batches:
        _step(layer, pad_fn, b)()
        _step(layer, nt_fn, b)()


def collators(layer: nn.Module, args) -> tuple:
    """A ``padless.Collator`` of the layer's inputs without and with a pair plan recipe of the
    whole layer (recorded on a small example batch), and the recipe."""
    fields = {"s": padless.Field(ragged=0), "z": padless.Field(ragged=(0, 1)), "mask": padless.Field(ragged=0),
              "pair_mask": padless.Field(ragged=(0, 1))}
    plain = padless.Collator(fields)
    ex = Batch([args.lo, (args.lo + args.hi) // 2, args.hi], args.cs, args.cz, 7, collator=plain).to(args.device)
    recipe = padless.pair_plan_recipe(layer, ex.ps, ex.pz, ex.pmask, ex.ppair_mask)
    return plain, padless.Collator({**fields, "s": padless.Field(ragged=0, pair_plans=recipe)}), recipe


def fresh(layer: nn.Module, pieces: list[str], args, clock) -> None:
    """Per piece, ``args.rounds`` rounds; each round a new batch of new lengths (one warm-up
    round first), padded and padless stepping on it in alternating order. Prints medians of
    the step times and of the per-round ratios (and, with ``--collator``, of the collate time)."""
    plain = coll = None
    if args.collator:
        plain, coll, recipe = collators(layer, args)
        print(f"\npadless inputs from padless.Collator with Field(pair_plans=...): {recipe}")
    print(f"\nnew batch every round ({args.rounds} rounds, lengths U[{args.lo}, {args.hi}])")
    print("\n| piece | padded (ms) | padless (ms) | padded / padless |")
    print("|---|---:|---:|---:|")
    for name in pieces:
        pad_fn, nt_fn = PIECES[name]
        rng = random.Random(1)
        times: dict[str, list[float]] = {"padded": [], "padless": []}
        ratios = []
        collate_s: dict[str, list[float]] = {"plain": [], "recipe": []}
        for r in range(args.rounds + 1):
            ns = lengths(rng, args.batch, args.lo, args.hi)
            if coll is not None:  # the collate time without the recipe, for comparison
                collate_s["plain"].append(Batch(ns, args.cs, args.cz, 100 + r, collator=plain).collate_s)
            b = Batch(ns, args.cs, args.cz, 100 + r, args.dense_masks, collator=coll).to(args.device)
            if coll is not None:
                collate_s["recipe"].append(b.collate_s)
            steps = {"padded": _step(layer, pad_fn, b), "padless": _step(layer, nt_fn, b)}
            order = list(steps) if r % 2 else list(reversed(steps))
            t = {}
            for k in order:
                t0 = clock()
                steps[k]()
                t[k] = clock() - t0
            if r == 0:
                continue  # warm-up
            for k in t:
                times[k].append(t[k])
            ratios.append(t["padded"] / t["padless"])
        print(f"| {name} | {statistics.median(times['padded']) * 1e3:.1f} | "
              f"{statistics.median(times['padless']) * 1e3:.1f} | {statistics.median(ratios):.2f}x |", flush=True)
        if coll is not None:
            print(f"  collate (wall, median): {statistics.median(collate_s['plain']) * 1e3:.1f} ms without the recipe, "
                  f"{statistics.median(collate_s['recipe']) * 1e3:.1f} ms with it")


def plan_split(layer: nn.Module, pieces: list[str], args) -> None:
    """Per piece, steps on new batches split into building plans and the rest
    (:func:`plan_builds.split_table`), from ``from_list`` and, with ``--collator``, from a
    Collator with the layer's pair plan recipe."""
    from plan_builds import split_table

    sources = [("from_list", None)]
    if args.collator:
        sources.append(("Collator + recipe", collators(layer, args)[1]))

    def new_step(name: str, rng: random.Random, seed: int, coll):
        b = Batch(lengths(rng, args.batch, args.lo, args.hi), args.cs, args.cz, seed, collator=coll).to(args.device)
        return _step(layer, PIECES[name][1], b)

    split_table(pieces, sources, new_step)


# ----------------------------------------------------------------------------- checks


def check(layer: nn.Module, batch: Batch) -> float:
    """Max relative difference of the layer's loss and gradients (padded vs padless, eval
    mode so no dropout)."""
    layer = copy.deepcopy(layer).eval()
    out = []
    for fn, (s, z) in ((PIECES["layer"][0], (batch.s, batch.z)), (PIECES["layer"][1], (batch.ps, batch.pz))):
        layer.zero_grad(set_to_none=True)
        s.grad = z.grad = None
        loss = fn(layer, batch)
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in layer.parameters()], s.grad, z.grad))
    (l0, g0, s0, z0), (l1, g1, s1, z1) = out
    # a gradient that is exactly zero in exact arithmetic (a LayerNorm bias feeding only a softmax
    # bias) is float noise on both sides: compare each gradient against the largest one
    scale = max(float(a.abs().max()) for a in g0)
    err = [abs(float(l0 - l1)) / abs(float(l0))]
    err += [float((a - b).abs().max()) / max(float(a.abs().max()), 1e-4 * scale) for a, b in zip(g0, g1)]
    for pad, nt in ((s0, s1), (z0, z1)):
        for i, part in enumerate(nt.unbind()):
            ref = pad[i][tuple(slice(0, k) for k in part.shape[:-1])]
            err.append(float((ref - part).abs().max() / ref.abs().max().clamp_min(1e-12)))
    return max(err)


def op_count(layer: nn.Module, batch: Batch) -> tuple[int, int]:
    """aten ops in one padless layer step: all profiler events named ``aten::*``, and the
    top-level ones (not called by another aten op: what Python and autograd dispatch)."""
    run = _step(layer, PIECES["layer"][1], batch)
    run()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    ev = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in ev if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    return len(ev), len(top)


def profile(layer: nn.Module, batch: Batch, top: int, piece: str = "layer") -> None:
    run = _step(layer, PIECES[piece][1], batch)
    run()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    ev = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total = sum(e.self_cpu_time_total for e in ev)
    print(f"\n### padless {piece} step: top aten ops by self CPU time ({sum(e.count for e in ev)} aten calls)\n")
    print("| op | calls | self CPU (ms) | share |")
    print("|---|---:|---:|---:|")
    for e in sorted(ev, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"| {e.key} | {e.count} | {e.self_cpu_time_total / 1e3:.1f} | {e.self_cpu_time_total / total:.0%} |")


def compiled(layer: nn.Module, batches: list[Batch], rounds: int, clock, backend: str, top: int) -> None:
    """Compiled padless (``fullgraph=True``) vs compiled padded (``dynamic=True``), whole layer."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    cnt = {"padded": CompileCounterWithBackend(backend), "padless": CompileCounterWithBackend(backend)}
    pad_fn, nt_fn = PIECES["layer"]
    steps = {"padded": (layer, pad_fn), "padless": (layer, nt_fn),
             "compiled padded": (torch.compile(layer, backend=cnt["padded"], dynamic=True), pad_fn),
             "compiled padless": (torch.compile(layer, backend=cnt["padless"], fullgraph=True), nt_fn)}
    for b in batches:
        took = []
        for name in ("compiled padded", "compiled padless"):
            t0 = time.perf_counter()
            _step(*steps[name], b)()
            took.append(f"{name} {time.perf_counter() - t0:.1f} s")
        print(f"first step (compiles) on N={b.ns}: " + ", ".join(took), flush=True)
    graphs = {k: c.frame_count for k, c in cnt.items()}
    print(f"graphs after warm-up: compiled padless {graphs['padless']}, compiled padded {graphs['padded']}")
    print("\n| batch N | occupancy | compiled padded (ms) | compiled padless (ms) | compiled padded / padless "
          "| eager padded (ms) | eager padless (ms) | eager padded / padless |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for b in batches:
        res = interleaved({k: _step(m, fn, b) for k, (m, fn) in steps.items()}, baseline="compiled padded",
                          rounds=rounds, warmup=1, clock=clock)
        ratio_eager = res["padded"][0] / res["padless"][0]
        print(f"| {b.ns} | {b.occupancy:.2f} | {res['compiled padded'][0] / 1e3:.1f} | {res['compiled padless'][0] / 1e3:.1f} | "
              f"{res['compiled padless'][1]:.2f}x | {res['padded'][0] / 1e3:.1f} | {res['padless'][0] / 1e3:.1f} | "
              f"{ratio_eager:.2f}x |", flush=True)
    after = {k: c.frame_count for k, c in cnt.items()}
    print(f"\ngraphs after timing: compiled padless {after['padless']}, compiled padded {after['padded']}"
          + (" (recompiled while timing)" if after != graphs else " (no recompiles)"))
    if top:
        run = _step(*steps["compiled padless"], batches[0])
        run()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run()
        ev = [e for e in prof.key_averages() if e.key.startswith(("aten::", "padless::"))]
        total = sum(e.self_cpu_time_total for e in ev)
        print("\n### compiled padless layer step: top aten and padless ops by self CPU time "
              "(the generated kernels not counted)\n")
        print("| op | calls | self CPU (ms) | share of these |")
        print("|---|---:|---:|---:|")
        for e in sorted(ev, key=lambda e: -e.self_cpu_time_total)[:top]:
            print(f"| {e.key} | {e.count} | {e.self_cpu_time_total / 1e3:.1f} | {e.self_cpu_time_total / total:.0%} |")


# ----------------------------------------------------------------------------- main


def _device_clock(device: str):
    """Wall clock that waits for the device's queued work first."""

    def clock() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return clock


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--style", choices=("boltz", "mini", "openfold"), default="boltz",
                    help="boltz's layer (MiniPairformer when boltz is missing), or the stand-in with its "
                         "triangle multiplications as einsums (mini) or as OpenFold's matmuls (openfold)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lo", type=int, default=16)
    ap.add_argument("--hi", type=int, default=64)
    ap.add_argument("--cs", type=int, default=128)
    ap.add_argument("--cz", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--pair-heads", type=int, default=4)
    ap.add_argument("--pair-width", type=int, default=16)
    ap.add_argument("--dropout", type=float, default=0.25)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--batches", type=int, default=2, help="batches (new lengths each); rounds per batch")
    ap.add_argument("--pieces", default="all", help="comma list of " + ",".join(PIECES))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="cpu: this process' CPU time (steadier on a loaded machine)")
    ap.add_argument("--fresh", action="store_true",
                    help="a new batch (new lengths, new NestedTensors) every round, as in training: "
                         "per-batch index maps are paid in every padless step")
    ap.add_argument("--collator", action="store_true",
                    help="with --fresh: padless inputs from padless.Collator with a pair plan recipe (the plans built at collate)")
    ap.add_argument("--plans", action="store_true",
                    help="per piece, one step on a new batch: the CPU time spent building plans, the plans built, aten ops")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--counts", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--settle", type=int, default=0,
                    help="untimed steps of each implementation right before its timed one (its steady state, "
                         "as in a training loop that runs only it); 0: each step right after the other's")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--syncs", action="store_true",
                    help="(CUDA) run one padless layer step with torch.cuda.set_sync_debug_mode('error')")
    ap.add_argument("--dense-masks", action="store_true",
                    help="give padless the padded batch's dense masks (read in padded coordinates)")
    ap.add_argument("--compile", action="store_true",
                    help="the whole layer compiled: padless fullgraph=True vs padded dynamic=True (and eager for reference)")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend for --compile")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.dtype == "bfloat16":  # boltz is written for autocast (it upcasts its attention itself)
        _AUTOCAST[:] = [torch.device(args.device).type]
    layer, what = build_layer(args)
    layer.to(args.device).train()
    pieces = list(PIECES) if args.pieces == "all" else args.pieces.split(",")
    rng = random.Random(0)
    batches = [Batch(lengths(rng, args.batch, args.lo, args.hi), args.cs, args.cz, seed, args.dense_masks).to(args.device)
               for seed in range(args.batches)]
    if args.device != "cpu":
        clock = _device_clock(args.device)
    if args.syncs:  # a step that synchronises raises here, naming the op
        without_syncs(_step(layer, PIECES["layer"][1], batches[0]))
        print("padless layer step: zero device syncs (set_sync_debug_mode('error') raised nothing)")
    print(f"{what}; Cs={args.cs} Cz={args.cz} heads={args.heads} pair heads={args.pair_heads}x{args.pair_width} "
          f"dropout={args.dropout}; {args.clock} clock; B={args.batch}, N~U[{args.lo},{args.hi}]; pair occupancy "
          + ", ".join(f"{b.occupancy:.2f}" for b in batches) + f"; threads {torch.get_num_threads()}")
    if not args.no_check:
        # on a twin of the first batch: the timed batches start with no gradients and no caches
        twin = Batch(batches[0].ns, args.cs, args.cz, 0, args.dense_masks).to(args.device)
        print(f"layer loss + gradients, padded vs padless (eval mode): max relative difference {check(layer, twin):.1e}")
    if args.compile:
        compiled(layer, batches, args.rounds, clock, args.backend, 15 if args.profile else 0)
        return
    if args.rounds:  # the allocator as a training loop leaves it (see warm_allocator)
        warm_allocator(layer, batches)
    if args.plans:
        warm_allocator(layer, batches)
        plan_split(layer, pieces, args)
    if args.rounds and args.fresh:
        fresh(layer, pieces, args, clock)
    elif args.rounds:
        print("\n| piece | padded (ms) | padless (ms) | padded / padless |")
        print("|---|---:|---:|---:|")
        for name in pieces:
            pad_fn, nt_fn = PIECES[name]
            times = {"padded": [], "padless": []}
            ratios = []
            for b in batches:
                res = interleaved({"padded": _step(layer, pad_fn, b), "padless": _step(layer, nt_fn, b)},
                                  baseline="padded", rounds=args.rounds, warmup=1, clock=clock, settle=args.settle)
                for k in times:
                    times[k].append(res[k][0])
                ratios.append(res["padless"][1])
            print(f"| {name} | {statistics.median(times['padded']) / 1e3:.1f} | "
                  f"{statistics.median(times['padless']) / 1e3:.1f} | {statistics.median(ratios):.2f}x |", flush=True)
    if args.counts:
        from padless.ops.common import sample_views
        from padless.ops.kernels import softmax as ks
        from padless.ops.pairs import bucketed

        cpu_price, cpu_limit, cpu_views = bucketed.SAMPLE_CALL_COST, ks.BUCKET_LIMIT, sample_views.MAX_SAMPLES
        for label, price, limit, views in (
                ("CPU prices", cpu_price, cpu_limit, cpu_views),
                # on an accelerator: buckets everywhere, and no per-sample views (a launch per sample)
                ("accelerator prices (a call per sample = launches)", bucketed.SAMPLE_CALL_COST_DEVICE, 1 << 40, 0)):
            bucketed.SAMPLE_CALL_COST, ks.BUCKET_LIMIT, sample_views.MAX_SAMPLES = price, limit, views
            c4 = op_count(layer, Batch(lengths(random.Random(4), 4, args.lo, args.hi), args.cs, args.cz, 4))
            c16 = op_count(layer, Batch(lengths(random.Random(16), 16, args.lo, args.hi), args.cs, args.cz, 16))
            print(f"\naten ops per padless layer step, {label}: B=4 {c4[0]}, B=16 {c16[0]} (ratio {c16[0] / c4[0]:.2f}); "
                  f"top-level: B=4 {c4[1]}, B=16 {c16[1]} (ratio {c16[1] / c4[1]:.2f})")
        bucketed.SAMPLE_CALL_COST, ks.BUCKET_LIMIT, sample_views.MAX_SAMPLES = cpu_price, cpu_limit, cpu_views
    if args.profile:  # the whole layer, or the one piece asked for
        profile(layer, batches[0], 15, pieces[0] if len(pieces) == 1 else "layer")


if __name__ == "__main__":
    main()
