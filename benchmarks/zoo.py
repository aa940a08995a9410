"""The model zoo: real model packages, unchanged, on padless input, against the padded batch.

    make zoo                                   # builds zoo/.venv, runs this, writes docs/zoo.md + docs/zoo.png
    zoo/.venv/bin/python benchmarks/zoo.py [--rounds 7] [--only resnet18,bert] [--no-docs]

For every model (timm, segmentation-models-pytorch, boltz, transformers, TorchRec; random
init, no download) one row says:

* **runs unchanged**: the model's forward on padless input, as the package ships it. When it
  raises, the row gives the error (class and first line) and, if the zoo knows a named edit
  for it, applies that edit (a monkeypatch of the package, listed in ``EDITS`` with why) and
  measures the rest of the row with it; the row then names the edits it needed.
* **max diff**: eval mode, float32: the padless output unbound per sample against the model
  run on each sample alone (a batch of one), the largest absolute difference over samples.
* **grad diff** (one model per family): the parameter gradients of ``sum_i loss_i`` on the
  padless batch against the sum of the per-sample gradients, in eval mode (BatchNorm then
  uses running statistics, so samples stay independent), largest absolute difference.
* **train step**: forward + backward in training mode, padless vs the padded batch of the
  same samples (zeros / masks up to the envelope), interleaved repeats, medians
  (``padless.testing.bench.interleaved``); speed-up = padded time / padless time, the median
  of per-round ratios.
* **occupancy**: real elements / elements of the padded envelope (the ideal speed-up of
  work that scales with elements is 1 / occupancy).

A row that fails keeps its error and the script goes on with the next row. The models,
batches, padded baselines, edits and checks are in ``zoo_models.py`` (reused by
``tests/zoo/test_zoo_models.py``), the table, picture and page in ``zoo_report.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time
import traceback
import types
import warnings
from typing import Callable, Iterator

import torch

from padless.testing import bench
from padless.testing.bench import interleaved
import zoo_families
from zoo_models import Case, all_cases, default_loss, edits_applied, grad_diff, occupancy, per_sample_diff
from zoo_report import ROOT, Result, plot, table, write_docs


# ----------------------------------------------------------------------------- measuring

def first_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    text = msg[0] if msg else ""
    return f"{type(e).__name__}: {text[:160]}"


def where(e: BaseException) -> str:
    """Where it raised: the innermost line of the model package, then padless' (file:line).

    torch's own frames (``nn.Module.__call__`` and the like) are skipped.
    """
    frames = traceback.extract_tb(e.__traceback__)
    model = next((f for f in reversed(frames) if "site-packages/" in f.filename
                  and not f.filename.split("site-packages/")[-1].startswith("torch/")), None)
    ours = next((f for f in reversed(frames) if f"{os.sep}padless{os.sep}" in f.filename), None)
    parts = []
    if model is not None:
        parts.append(f"{model.filename.split('site-packages/')[-1]}:{model.lineno}")
    if ours is not None:
        parts.append(f"{os.path.relpath(ours.filename, ROOT)}:{ours.lineno}")
    return " → ".join(parts)


_FALLBACK = re.compile(r"padless: (\S+) has no NestedTensor handler")


def measure(case: Case, rounds: int, seed: int = 0, clock: str = "cpu") -> Result:
    """One row; the ops padless ran sample by sample (its one-time fallback warnings) are recorded."""
    from padless.tensor import core

    core._WARNED.clear()  # padless warns once per op and process: every row sees its own fallbacks
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with runner_clock(clock):
            res = _measure(case, rounds, seed)
    ops = {m.group(1) for w in caught if (m := _FALLBACK.search(str(w.message)))}
    res.fallbacks = sorted(ops)
    return res


def _measure(case: Case, rounds: int, seed: int) -> Result:
    res = Result(case.name, case.what)
    samples = case.samples(seed)
    res.occupancy = occupancy(case.shapes(samples))
    try:
        model = case.build().eval()
    except Exception as e:  # noqa: BLE001  (a row that cannot build reports why)
        res.unchanged = f"build failed: {first_line(e)}"
        return res
    # 1. unchanged, eval, per sample
    edits: tuple[str, ...] = ()
    scale: list[float] = []
    try:
        res.max_diff = per_sample_diff(case, model, samples, scale)
        res.unchanged = "yes"
    except Exception as e:  # noqa: BLE001
        if os.environ.get("ZOO_TRACE"):
            traceback.print_exc()
        loc = where(e)
        res.unchanged = f"no: {first_line(e)}" + (f" [{loc}]" if loc else "")
        if case.edits:
            edits = case.edits
            try:
                with edits_applied(edits, model):
                    res.max_diff = per_sample_diff(case, model, samples, scale)
                res.edits = edits
            except Exception as e2:  # noqa: BLE001
                res.notes.append(f"with edits {', '.join(edits)}: {first_line(e2)}")
                return res
        else:
            return res
    res.out_scale = scale[-1] if scale else None
    # 2. gradients, eval
    if case.grad:
        try:
            with edits_applied(edits, model):
                gscale: list[float] = []
                res.grad_diff = grad_diff(case, model, samples, gscale)
                res.grad_scale = gscale[0]
        except Exception as e:  # noqa: BLE001
            res.notes.append(f"grad check: {first_line(e)} [{where(e)}]")
    # 3. train step timing
    model.train()
    train_edits = edits if case.train_edits else ()
    if edits and not train_edits:
        res.notes.append(f"the train step runs unchanged (edits {', '.join(edits)} for eval only)")
    pl = case.padless_loss or default_loss(case)
    runs = {
        "padded": lambda: case.padded_loss(model, samples).backward(),
        "padless": lambda: pl(model, samples).backward(),
    }
    try:
        with edits_applied(train_edits, model):
            t = interleaved(runs, baseline="padded", rounds=rounds, warmup=1, inner=inner_repeats(runs))
        res.padded_ms = t["padded"][0] / 1e3
        res.padless_ms = t["padless"][0] / 1e3
        res.speedup = t["padless"][1]
    except Exception as e:  # noqa: BLE001
        res.notes.append(f"train step: {first_line(e)} [{where(e)}]")
    model.zero_grad(set_to_none=True)
    return res


@contextlib.contextmanager
def runner_clock(clock: str) -> Iterator[None]:
    """``cpu``: the shared runner reads ``time.process_time`` (CPU seconds of this process).

    With one torch thread that is the step's own work, steady while other processes share
    the machine; ``wall`` keeps the runner's ``time.perf_counter``.
    """
    if clock == "wall":
        yield
        return
    old = bench.time
    bench.time = types.SimpleNamespace(perf_counter=time.process_time)
    try:
        yield
    finally:
        bench.time = old


def inner_repeats(runs: dict[str, Callable[[], None]], target_s: float = 0.05) -> int:
    """Calls per timed sample so that one sample lasts about ``target_s`` (sub-millisecond steps)."""
    t0 = time.process_time()
    for f in runs.values():
        f()
    per_call = max((time.process_time() - t0) / len(runs), 1e-6)
    return max(1, min(50, round(target_s / per_call)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds per row")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: with --clock cpu, a step's own work)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="cpu: process CPU time, steady on a shared machine (default); wall: perf_counter")
    ap.add_argument("--only", default="", help="comma-separated substrings of row names (case-insensitive)")
    ap.add_argument("--no-docs", action="store_true", help="print only; do not write docs/zoo.md and docs/zoo.png")
    ap.add_argument("--no-families", action="store_true", help="skip the family sweep (benchmarks/zoo_families.py)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")  # the packages' deprecation chatter; errors still end up in the table
    torch.set_num_threads(args.threads)
    cases = all_cases()
    if args.only:
        keys = [k.strip().lower() for k in args.only.split(",") if k.strip()]
        cases = [c for c in cases if any(k in c.name.lower() for k in keys)]
    t0 = time.perf_counter()
    results = []
    for c in cases:
        t = time.perf_counter()
        try:
            r = measure(c, args.rounds, clock=args.clock)
        except Exception as e:  # noqa: BLE001  (the zoo goes on with the next row)
            r = Result(c.name, c.what, unchanged=f"zoo error: {first_line(e)}")
        results.append(r)
        print(f"  {c.name}: {r.unchanged[:100]} ({time.perf_counter() - t:.1f} s)", file=sys.stderr, flush=True)
    families = "" if args.no_families or args.only else zoo_families.table(zoo_families.rows())
    elapsed = time.perf_counter() - t0
    printed = table(results)
    print(printed)
    if families:
        print("\n" + families)
    if not args.no_docs:
        plot(results, ROOT / "docs" / "zoo.png")
        write_docs(results, printed, elapsed, args, families)
        print(f"\nwrote docs/zoo.md and docs/zoo.png ({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
