"""What a new batch's step spends building plans: ``benchmarks/pairformer.py --plans``.

Per piece and batch source, one step on a new batch (the median of three): its CPU time, the part
spent building plans for the new structures (bucket plans ``bucketed._build``, index maps
``padding_maps`` built outside them: a plan's result maps, broadcast terms' maps), how many it
built, and the aten ops of a step on another new batch (all, top-level). Every row starts from
empty caches and draws the same lengths, so rows compare.
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable

import torch


def split_table(pieces: list[str], sources: list[tuple[str, Any]],
                new_step: Callable[[str, random.Random, int, Any], Callable[[], None]]) -> None:
    """``new_step(piece, rng, seed, source)``: a step of ``piece`` on a new batch (lengths from
    ``rng``) from ``source``, built before it returns (a collate call is not part of the step)."""
    from padless.ops.kernels import layout as kl
    from padless.ops.pairs import bucketed, spread
    from padless.tensor import lru

    spent = {"s": 0.0, "build": 0, "maps": 0}
    depth = [0]

    def timed(fn, what):
        def run(*a, **k):
            depth[0] += 1
            t0 = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    spent["s"] += time.process_time() - t0
                spent[what] += 1
        return run

    saved = (bucketed._build, bucketed.padding_maps, spread.padding_maps)
    bucketed._build = timed(saved[0], "build")
    bucketed.padding_maps = spread.padding_maps = timed(kl.padding_maps, "maps")
    print("\n| piece | batch from | step CPU (ms) | building plans (ms) | plans built | maps built | aten ops (top-level) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    try:
        for name in pieces:
            for label, source in sources:
                for cache in lru.caches():  # the same lengths for every row, none met before
                    cache.clear()
                rng = random.Random(name)
                runs = []
                for r in range(3):  # the median of three new batches, each step timed, then another profiled
                    step = new_step(name, rng, 300 + r, source)
                    spent.update(s=0.0, build=0, maps=0)
                    t0 = time.process_time()
                    step()
                    took = time.process_time() - t0
                    built = (spent["s"], spent["build"], spent["maps"])
                    step = new_step(name, rng, 400 + r, source)
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                        step()
                    ev = [e for e in prof.events() if e.name.startswith("aten::")]
                    top = sum(1 for e in ev if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
                    runs.append((took, *built, len(ev), top))
                took, plans_s, nb, nm, _, _ = sorted(runs)[1]
                n_ev, n_top = sorted(r[4:] for r in runs)[1]
                print(f"| {name} | {label} | {took * 1e3:.1f} | {plans_s * 1e3:.1f} | {nb} | {nm} | {n_ev} ({n_top}) |", flush=True)
    finally:
        bucketed._build, bucketed.padding_maps, spread.padding_maps = saved
