"""Memory stays flat over batches that never repeat (issue 39).

A training run meets a new batch every step: new sizes of tokens, pairs and images, collated
through ``padless.collate``. Every op that fills a cache runs each step (a padded-coordinate
read, a pair broadcast, reductions, a contraction against a long-lived query, a convolution),
so the caches fill to their bounds during the warm-up; after it, the resident set may not grow
by more than 20 MiB, and no structure may be kept alive from one step to the next, also when
the caller keeps every step's shapes (three ``torch.Size`` and their extents a step).

``PADLESS_MEMORY_STEPS`` sets the measured steps (the default is small enough for ``make
test``; the long run is ``PADLESS_MEMORY_STEPS=10000``, which prints its figures with ``-s``).
The long run warms up for 1,000 steps (``PADLESS_MEMORY_WARMUP``): the 256-entry caches fill
within the first few hundred steps of never-repeating batches (about +8 MiB, bounded), after
which the plain run grows about 0.4 MiB per 1,000 steps.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

import padless
from padless.tensor import lru
from padless.tensor.structure import StructureMeta

STEPS = int(os.environ.get("PADLESS_MEMORY_STEPS", "60"))
WARMUP = int(os.environ.get("PADLESS_MEMORY_WARMUP", "20" if STEPS < 1000 else "1000"))
GROWTH_MIB = 20  # over the measured steps, shapes kept or not (issue 39: <= +20 MiB over 10,000 steps)
B, C = 4, 8
PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2**20


def _live_structures() -> int:
    return sum(type(o) is StructureMeta for o in gc.get_objects())


class _Model:
    """What a step runs: the long-lived parts (a query, a position table, a convolution)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.q = padless.from_list([torch.randn(n, C, generator=g) for n in (5, 1, 7, 3)], requires_grad=True)
        self.pos = torch.randn(1, 64, C, generator=g)  # sliced to each batch's envelope: padded coordinates
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def step(self, g: torch.Generator) -> tuple[list, dict]:
        def sizes(lo, hi):
            out = torch.randint(lo, hi, (B,), generator=g).tolist()
            if len(set(out)) == 1:  # collate makes a dim ragged where the samples differ
                out[0] = out[0] + 1
            return out

        n_tok, n_pair, hs, ws = sizes(1, 48), sizes(0, 12), sizes(3, 20), sizes(3, 20)  # a sample may be empty
        batch = padless.collate([
            {"tokens": torch.randn(n_tok[i], C), "pair": torch.randn(n_pair[i], n_pair[i], 2),
             "single": torch.randn(n_pair[i], 2), "image": torch.randn(3, hs[i], ws[i])}
            for i in range(B)
        ])
        x, pair, single, image = batch["tokens"], batch["pair"], batch["single"], batch["image"]
        y = x + self.pos[:, : x.shape[1]]  # a padded-coordinate read
        out = [y.sum(1), torch.softmax(y, dim=1).amax(1)]  # reductions over the ragged dim
        p = pair + single.unsqueeze(2) + single.unsqueeze(1)  # a pair broadcast
        out.append(p.sum((1, 2)))
        k = padless.from_list([torch.randn(n, C) for n in n_tok])
        scores = self.q @ k.transpose(-1, -2)  # a contraction with the long-lived query
        scores.values().sum().backward()
        with torch.no_grad():
            out.append(self.conv(image).mean((2, 3)))
        self.q.grad = None
        return out, batch


def _run(steps: int, keep_shapes: bool) -> dict:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = _Model()
    kept = []
    for _ in range(WARMUP):
        model.step(g)
    gc.collect()
    rss0, live0 = _rss_mib(), _live_structures()
    for i in range(steps):
        _, batch = model.step(g)
        if steps >= 1000 and (i + 1) % (steps // 10) == 0:  # the long run reports its way
            gc.collect()
            print(f"\n  step {i + 1}: RSS +{_rss_mib() - rss0:.1f} MiB, structures alive +{_live_structures() - live0}", end="")
        if keep_shapes:  # what a logging hook or a shape check keeps of each step
            kept.append([(batch[k].shape, batch[k].size(1)) for k in ("tokens", "pair", "image")])
    gc.collect()
    return {
        "steps": steps,
        "rss_growth_mib": _rss_mib() - rss0,
        "structures_grown": _live_structures() - live0,
        "query_cache_entries": sum(len(v) if isinstance(v, dict) else 1 for v in model.q._meta.derived.values()),
        "caches": [repr(c) for c in lru.caches()],
    }


def _check(r: dict) -> None:
    print(f"\n{r['steps']} steps: RSS +{r['rss_growth_mib']:.1f} MiB, structures alive +{r['structures_grown']}, "
          f"long-lived query's cache entries {r['query_cache_entries']}")
    for c in r["caches"]:
        print("   ", c)
    assert r["structures_grown"] <= 16, f"structures kept alive from step to step: {r}"
    assert r["query_cache_entries"] <= 16, r
    assert r["rss_growth_mib"] <= GROWTH_MIB, r


def test_never_repeating_batches_keep_memory_flat(one_thread):
    _check(_run(STEPS, keep_shapes=False))
    for c in lru.caches():
        assert len(c) <= c.max_entries and c.held_bytes <= c.max_bytes, c


def test_never_repeating_batches_keep_memory_flat_with_shapes_kept(one_thread):
    x = padless.from_list([torch.ones(2, 3), torch.ones(4, 3)])
    assert isinstance(x.shape[1], int)
    _check(_run(STEPS, keep_shapes=True))  # three batches' shapes a step, kept by the caller


def test_every_cache_states_its_bounds():
    """Every cache of padless is a bounded LRU whose docstring line says what it holds."""
    import padless.ops.common.islands  # noqa: F401  (caches of the compiled paths, imported lazily elsewhere)
    import padless.ops.pairs.traced_maps  # noqa: F401

    names = {c.name for c in lru.caches()}
    assert {"row_coords", "content_maps", "traced_broadcast_rows", "island_structures", "reshape_targets",
            "permute_plans", "grid_rows", "conv_checked_arguments"} <= names
    for c in lru.caches():
        assert 0 < c.max_entries <= 4096 and 0 < c.max_bytes <= 128 * lru.MiB and c.what, c


def test_an_lru_is_bounded_by_entries_and_by_bytes():
    c = lru.LRU("test-only", max_entries=3, max_bytes=10_000, what="a test", register=False)
    for i in range(5):
        c.put(i, torch.zeros(10))
    assert list(c) == [2, 3, 4]
    assert c.get(2) is not None  # 2 is now the most recent
    c.put(5, torch.zeros(10))
    assert list(c) == [4, 2, 5]
    assert not c.put("huge", torch.zeros(1000))  # more than a quarter of the bytes: not kept
    big = [torch.zeros(300) for _ in range(3)]  # 1,200 bytes of storage each
    for i, t in enumerate(big):
        c.put(("big", i), t)
    assert c.held_bytes <= 10_000 and len(c) <= 3
    c.max_bytes = 3_000
    c.put("x", 1)
    assert c.held_bytes <= 3_000
    c.clear()
    assert len(c) == 0 and c.held_bytes == 0
