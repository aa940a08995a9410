"""ResNet-style classifier, forward + backward in training mode: padless vs padded vs per-image loop.

Batches of 12 images whose sides are uniform in [48, 216] (occupancy about 0.4). Every
round draws a new batch and runs the three implementations on it in rotating order; the
table reports median times and the median of per-batch ratios against the padded batch:

* ``padless``: the images packed (``padless.from_list``), the model unchanged;
* ``padded``: zeros up to the largest H and W of the batch, one dense batch;
* ``per-image``: the model on each image alone (a batch of one), gradients accumulated.

Peak activation memory is the total size of the tensors autograd saves for backward
during the forward pass (``torch.autograd.graph.saved_tensors_hooks``, unique storages),
i.e. what is alive at the end of the forward pass besides parameters; on CUDA the table
also gives ``torch.cuda.max_memory_allocated`` above the parameters.

``--designs`` also times the spatial-plan layouts on one 3x3 convolution and on the model:
one shared canvas vs equal tiles with halo vs the per-image loop, and the persistent canvas
(activations kept on the canvas between layers, :mod:`padless.ops.vision.canvas`), plane shapes
made for each batch instead of reused (:func:`padless.ops.vision.pack.reuse_plane`) and plane sides
rounded to a ladder (:func:`padless.ops.vision.pack.plane_side`) against the default (rows between
layers, plane shapes reused). The designs share one process, so oneDNN's per-shape kernel cache: a design that makes the
same plane shapes as another can find its kernels built by it (compare designs by separate runs
when a difference is small).

``--compile`` times the train step compiled (``torch.compile(fullgraph=True)``, inductor by
default): eager padless vs compiled padless (``padless.vision.prepare_for_compile`` per batch)
vs the padded batch eager and compiled with dynamic shapes, each batch a new size and new
image sizes; it reports the first call (compile) time and the graphs compiled over the run.

``--ops 6 48`` counts the aten ops of one train step (forward + backward) at each batch size.

``--steady`` adds the row ``padless (plans built)``: the same batch stepped again after the timed rows
(an untimed step first), so it pays neither the batch's spatial plans and index maps nor oneDNN's
kernels for its new canvas shapes: the steady state of a run whose batches repeat their image sizes,
and, against ``padless``, what a new batch's first step costs. It runs after the others in every
round (its plans and kernels would otherwise be found by a row after it).

``--collated`` adds rows whose batches come ready from a DataLoader worker, as in training: the
collation runs outside the timed step (here, in this process, then pickled as a worker sends it)
and the timed step starts by unpickling it. ``padless collated`` uses
``Collator({"x": Field(ragged=(1, 2), spatial_plan=recipe)})`` with ``recipe =
padless.vision.plan_recipe(model, example)`` recorded once before the rounds, so every layer's
spatial plan is built in the worker; ``padless collated (no recipe)`` the same Collator without it;
``padded collated`` the padded batch, built in the worker too. The note gives the worker's time per
batch (collate + plans + pickling). Every run of this table then starts with no spatial cache kept, so
no run finds the plans of another run on the same sizes (plans are found by content).

    python benchmarks/vision.py [--rounds 7] [--threads 2] [--device cpu] [--designs] [--compile] [--ops 6 48] [--collated] [--steady]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import time
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import padless
from padless.ops.vision import canvas, pack, spatial
from padless.testing.bench import Row, print_table
from padless.testing.vision import ResNetish, random_image_sizes

BATCH, LO, HI = 12, 48, 216
CLOCK = time.perf_counter  # --clock cpu: time.process_time (CPU seconds of this process; steadier on a busy machine)


def _sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def make_runs(model: nn.Module, imgs: list[torch.Tensor], labels: torch.Tensor, dev: str) -> dict[str, Callable[[], None]]:
    hmax = max(i.shape[1] for i in imgs)
    wmax = max(i.shape[2] for i in imgs)

    def run_padless() -> None:
        x = padless.from_list(imgs, ragged_dims=(1, 2))
        F.cross_entropy(model(x), labels).backward()

    def run_padded() -> None:
        x = imgs[0].new_zeros(len(imgs), imgs[0].shape[0], hmax, wmax)
        for k, im in enumerate(imgs):
            x[k, :, : im.shape[1], : im.shape[2]] = im
        F.cross_entropy(model(x), labels).backward()

    def run_loop() -> None:
        for k, im in enumerate(imgs):
            (F.cross_entropy(model(im[None]), labels[k : k + 1]) / len(imgs)).backward()

    return {"padless": run_padless, "padded": run_padded, "per-image": run_loop}


def collated_runs(model: nn.Module, imgs: list[torch.Tensor], labels: torch.Tensor, dev: str, collators: dict, worker: dict[str, list[float]]) -> dict[str, Callable[[], None]]:
    """Rows whose batch a DataLoader worker made: collated (and pickled, as a worker sends it) here,
    untimed; the timed step unpickles it (the main process's share) and runs the train step."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's shared-memory reductions)

    samples = [{"x": im.cpu()} for im in imgs]
    hmax, wmax = max(i.shape[1] for i in imgs), max(i.shape[2] for i in imgs)

    def padded_batch() -> torch.Tensor:
        x = torch.zeros(len(imgs), imgs[0].shape[0], hmax, wmax)
        for k, s in enumerate(samples):
            x[k, :, : s["x"].shape[1], : s["x"].shape[2]] = s["x"]
        return x

    makers = {name: (lambda c=c: c(samples)) for name, c in collators.items()}
    makers["padded collated"] = padded_batch
    runs = {}
    for name, make in makers.items():
        t0 = CLOCK()
        payload = ForkingPickler.dumps(make())
        worker.setdefault(name, []).append(CLOCK() - t0)

        def run(payload=payload, padded=name.startswith("padded")) -> None:
            b = ForkingPickler.loads(payload)
            x = (b if padded else b["x"]).to(dev, non_blocking=True)
            F.cross_entropy(model(x), labels).backward()
        runs[name] = run
    return runs


def saved_bytes(fn: Callable[[], torch.Tensor]) -> int:
    """Bytes of the unique storages autograd saves for backward while ``fn`` runs its forward."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        if isinstance(t, padless.NestedTensor):
            t = t._values
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def forward_only(model: nn.Module, imgs: list[torch.Tensor], labels: torch.Tensor) -> dict[str, Callable[[], object]]:
    hmax = max(i.shape[1] for i in imgs)
    wmax = max(i.shape[2] for i in imgs)

    def padded():
        x = imgs[0].new_zeros(len(imgs), imgs[0].shape[0], hmax, wmax)
        for k, im in enumerate(imgs):
            x[k, :, : im.shape[1], : im.shape[2]] = im
        return F.cross_entropy(model(x), labels)

    return {
        "padless": lambda: F.cross_entropy(model(padless.from_list(imgs, ragged_dims=(1, 2))), labels),
        "padded": padded,
        "per-image": lambda: [F.cross_entropy(model(im[None]), labels[k : k + 1]) for k, im in enumerate(imgs)],
    }


def cuda_peak(fn: Callable[[], None], dev: str) -> int:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


DESIGNS = {  # --designs: padless with another choice of the spatial / canvas modules (attribute -> value)
    "persistent canvas": {"CANVAS_PERSIST": True},
    "fresh plane shapes": {"REUSE_PLANES": False},
    "quantized plane sides": {"QUANTIZE": True},
    "tiles": {"DEFAULT_LAYOUT": "tiles", "CANVAS_PERSIST": False},
    "NCHW canvas": {"CANVAS_FORMAT": "contiguous", "CANVAS_PERSIST": False},
}


def _module_of(attr: str):
    return next(m for m in (spatial, canvas, pack) if hasattr(m, attr))


def model_table(args: argparse.Namespace, layouts: tuple[str, ...] = ()) -> None:
    dev = args.device
    torch.manual_seed(0)
    model = ResNetish(widths=tuple(args.widths), classes=10).to(dev).train()
    rng = random.Random(0)
    times: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    vs_loop: dict[str, list[float]] = {}
    mem: dict[str, list[int]] = {}
    pixels = []
    worker: dict[str, list[float]] = {}
    of_ideal: dict[str, list[float]] = {}
    collators = {}
    if args.collated:  # the recipe: recorded once, on an example batch of other sizes
        import padless.vision

        ex = [torch.randn(3, h, w, device=dev) for h, w in random_image_sizes(random.Random(99), 4, LO, HI)]
        recipe = padless.vision.plan_recipe(model, padless.from_list(ex, ragged_dims=(1, 2)))
        collators = {"padless collated": padless.Collator({"x": padless.Field(ragged=(1, 2), spatial_plan=recipe)}),
                     "padless collated (no recipe)": padless.Collator({"x": padless.Field(ragged=(1, 2))})}
    for r in range(args.rounds + 1):
        sizes = random_image_sizes(rng, BATCH, LO, HI)
        pixels.append(sum(h * w for h, w in sizes) / (BATCH * max(h for h, _ in sizes) * max(w for _, w in sizes)))
        imgs = [torch.randn(3, h, w, device=dev) for h, w in sizes]
        labels = torch.randint(0, 10, (BATCH,), device=dev)
        runs = make_runs(model, imgs, labels, dev)
        for lay in layouts:  # extra rows: padless with another design choice
            def run_layout(lay=lay):
                old = {k: getattr(_module_of(k), k) for k in DESIGNS[lay]}
                for k, val in DESIGNS[lay].items():
                    setattr(_module_of(k), k, val)
                try:
                    runs["padless"]()
                finally:
                    for k, val in old.items():
                        setattr(_module_of(k), k, val)
            runs[f"padless ({lay})"] = run_layout
        if args.collated:
            runs.update(collated_runs(model, imgs, labels, dev, collators, worker))
        names = list(runs)
        names = names[r % len(names):] + names[: r % len(names)]  # rotate the order every round
        t: dict[str, float] = {}
        for n in names:
            model.zero_grad(set_to_none=True)
            if args.collated or layouts:  # untimed: drop the plans of the other runs on these sizes (the
                spatial._RECENT.clear()  # latest batches' caches are kept, and their plans by reference cycles)
                gc.collect()
            _sync(dev)
            t0 = CLOCK()
            runs[n]()
            _sync(dev)
            t[n] = CLOCK() - t0
        if args.steady:  # last in the round: its untimed step builds what no later row may find
            model.zero_grad(set_to_none=True)
            runs["padless"]()
            model.zero_grad(set_to_none=True)
            gc.collect()  # untimed: the other rows' garbage (plans hold reference cycles)
            _sync(dev)
            t0 = CLOCK()
            runs["padless"]()
            _sync(dev)
            t["padless (plans built)"] = CLOCK() - t0
        if r == 0:
            fwd = forward_only(model, imgs, labels)
            for n, f in fwd.items():
                mem.setdefault(n, []).append(saved_bytes(f))
                if dev.startswith("cuda"):
                    mem.setdefault(n + " cuda", []).append(cuda_peak(runs[n], dev))
            continue  # warm-up round: memory only
        for n in t:
            times.setdefault(n, []).append(t[n])
            ratios.setdefault(n, []).append(t["padded"] / t[n])
            of_ideal.setdefault(n, []).append(t["padded"] / t[n] * pixels[-1])  # speedup / (1 / occupancy)
            vs_loop.setdefault(n, []).append(t["per-image"] / t[n])
    rows = [Row("resnet fwd+bwd b=12", n, statistics.median(times[n]) * 1e6, statistics.median(ratios[n])) for n in times]
    for row in rows:
        row.note = f"{statistics.median(vs_loop[row.impl]):.2f}x the per-image loop; {statistics.median(of_ideal[row.impl]):.2f} of 1/occupancy"
        if row.impl in worker:
            row.note += f"; worker {statistics.median(worker[row.impl][1:]) * 1e3:.1f} ms per batch"
        m = mem.get(row.impl)
        if m:
            row.note += f"; saved activations {m[0] / 2**20:.1f} MiB ({mem['padded'][0] / m[0]:.2f}x less than padded)"
            if row.impl + " cuda" in mem:
                row.note += f"; cuda peak {mem[row.impl + ' cuda'][0] / 2**20:.1f} MiB"
    load = os.getloadavg()
    title = (f"vision: ResNet-style (widths {tuple(args.widths)}) train step, {BATCH} images, sides U[{LO}, {HI}], "
             f"occupancy {statistics.mean(pixels):.2f}, {args.rounds} batches, {dev}, threads {torch.get_num_threads()}, "
             f"{CLOCK.__name__}, load {load[0]:.1f}")
    print_table(rows, title, "padded")


def design_table(args: argparse.Namespace) -> None:
    """One 3x3 conv (64 -> 64, padding 1) forward + backward on a batch: canvas vs tiles vs loop."""
    dev = args.device
    rng = random.Random(1)
    conv = nn.Conv2d(64, 64, 3, padding=1).to(dev)
    times: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    for r in range(args.rounds):
        sizes = [(max(1, h // 4), max(1, w // 4)) for h, w in random_image_sizes(rng, BATCH, LO, HI)]
        imgs = [torch.randn(64, h, w, device=dev) for h, w in sizes]
        x = padless.from_list(imgs, ragged_dims=(1, 2))

        def with_layout(lay: str) -> Callable[[], None]:
            def run() -> None:
                old, persist = spatial.DEFAULT_LAYOUT, canvas.CANVAS_PERSIST
                spatial.DEFAULT_LAYOUT = "canvas" if lay == "persistent canvas" else lay
                canvas.CANVAS_PERSIST = lay == "persistent canvas"
                try:
                    xx = x.detach().requires_grad_()
                    conv(xx).values().sum().backward()
                finally:
                    spatial.DEFAULT_LAYOUT, canvas.CANVAS_PERSIST = old, persist
            return run

        def loop() -> None:
            for im in imgs:
                conv(im[None].requires_grad_()).sum().backward()

        runs = {"persistent canvas": with_layout("persistent canvas"), "canvas": with_layout("canvas"), "tiles": with_layout("tiles"), "per-image loop": loop}
        for lay in ("persistent canvas", "canvas", "tiles"):  # plans are built once per structure (cached): build them first
            with_layout(lay)()
        t = {}
        for n in list(runs)[r % len(runs):] + list(runs)[: r % len(runs)]:
            _sync(dev)
            t0 = CLOCK()
            runs[n]()
            _sync(dev)
            t[n] = CLOCK() - t0
        for n in t:
            times.setdefault(n, []).append(t[n])
            ratios.setdefault(n, []).append(t["per-image loop"] / t[n])
    rows = [Row("conv3x3 64ch fwd+bwd, sides U[12, 54]", n, statistics.median(times[n]) * 1e6, statistics.median(ratios[n])) for n in times]
    print_table(rows, f"spatial plan layouts, {args.rounds} batches, {dev}, threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}", "per-image loop")


def compile_table(args: argparse.Namespace) -> None:
    """Train step (forward, cross-entropy, backward) eager vs compiled, padless vs padded."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from padless.vision import prepare_for_compile

    dev = args.device
    torch.manual_seed(0)
    model = ResNetish(widths=tuple(args.widths), classes=10).to(dev).train()
    counters = {n: CompileCounterWithBackend(args.backend) for n in ("padless", "padded")}
    compiled = {
        "padless": torch.compile(model, backend=counters["padless"], fullgraph=True),
        "padded": torch.compile(model, backend=counters["padded"], fullgraph=True, dynamic=True),
    }

    def step(m: Callable, x, labels: torch.Tensor) -> None:
        F.cross_entropy(m(x), labels).backward()

    def padded(imgs: list[torch.Tensor]) -> torch.Tensor:
        x = imgs[0].new_zeros(len(imgs), imgs[0].shape[0], max(i.shape[1] for i in imgs), max(i.shape[2] for i in imgs))
        for k, im in enumerate(imgs):
            x[k, :, : im.shape[1], : im.shape[2]] = im
        return x

    runs = {
        "padded eager": lambda imgs, y: step(model, padded(imgs), y),
        "padded compiled": lambda imgs, y: step(compiled["padded"], padded(imgs), y),
        "padless eager": lambda imgs, y: step(model, padless.from_list(imgs, ragged_dims=(1, 2)), y),
        "padless compiled": lambda imgs, y: step(compiled["padless"], prepare_for_compile(padless.from_list(imgs, ragged_dims=(1, 2))), y),
    }
    rng = random.Random(0)
    first: dict[str, float] = {}
    times: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    sizes_seen = []
    for r in range(args.rounds + 2):  # two warm-up batches: compile, then the one dynamic recompile
        b = rng.randint(max(2, BATCH // 2), BATCH * 3 // 2)
        sizes = random_image_sizes(rng, b, LO, HI)
        sizes_seen.append(sum(h * w for h, w in sizes) / (b * max(h for h, _ in sizes) * max(w for _, w in sizes)))
        imgs = [torch.randn(3, h, w, device=dev) for h, w in sizes]
        labels = torch.randint(0, 10, (b,), device=dev)
        names = list(runs)[r % len(runs):] + list(runs)[: r % len(runs)]
        t: dict[str, float] = {}
        for n in names:
            model.zero_grad(set_to_none=True)
            _sync(dev)
            t0 = CLOCK()
            runs[n](imgs, labels)
            _sync(dev)
            t[n] = CLOCK() - t0
        if r < 2:
            for n, v in t.items():
                first[n] = first.get(n, 0.0) + v
            continue
        for n in t:
            times.setdefault(n, []).append(t[n])
            ratios.setdefault(n, []).append(t["padless eager"] / t[n])
    rows = []
    for n in times:
        row = Row(f"resnet train step b={BATCH // 2}..{BATCH * 3 // 2}", n, statistics.median(times[n]) * 1e6, statistics.median(ratios[n]))
        if n.endswith("compiled"):
            c = counters[n.split()[0]]
            row.note = f"first two calls {first[n]:.1f} s (compile); {c.frame_count} graphs over {args.rounds + 2} batches"
        rows.append(row)
    load = os.getloadavg()
    title = (f"vision compile: ResNet-style (widths {tuple(args.widths)}) train step, sides U[{LO}, {HI}], occupancy "
             f"{statistics.mean(sizes_seen):.2f}, {args.rounds} timed batches, {args.backend}, {dev}, threads "
             f"{torch.get_num_threads()}, {CLOCK.__name__}, load {load[0]:.1f}")
    print_table(rows, title, "padless eager")


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops a region runs (every op that reaches dispatch, forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def ops_table(args: argparse.Namespace) -> None:
    """Aten ops per train step (forward + backward) at two batch sizes: does the work per layer
    grow with the number of images? Plans are built by a first step, then one step is counted."""
    dev = args.device
    torch.manual_seed(0)
    model = ResNetish(widths=tuple(args.widths), classes=10).to(dev).train()
    rng = random.Random(0)
    counts: dict[str, dict[int, int]] = {}
    for b in args.ops:
        sizes = random_image_sizes(rng, b, LO, HI)
        imgs = [torch.randn(3, h, w, device=dev) for h, w in sizes]
        labels = torch.randint(0, 10, (b,), device=dev)
        for n, run in make_runs(model, imgs, labels, dev).items():
            run()  # warm-up: plans and structures cached
            model.zero_grad(set_to_none=True)
            with _OpCounter() as c:
                run()
            counts.setdefault(n, {})[b] = c.n
    bs = list(args.ops)
    print(f"aten ops per train step (ResNet-style, widths {tuple(args.widths)}, forward + backward)")
    print("| implementation | " + " | ".join(f"B={b}" for b in bs) + f" | B={bs[-1]} / B={bs[0]} |")
    print("|---|" + "---:|" * (len(bs) + 1))
    for n, c in counts.items():
        print(f"| {n} | " + " | ".join(f"{c[b]:,}" for b in bs) + f" | {c[bs[-1]] / c[bs[0]]:.2f}x |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256, 512], help="stage widths (ResNet-18 widths by default)")
    p.add_argument("--designs", action="store_true", help="also compare the spatial-plan layouts")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="wall time, or CPU time of this process")
    p.add_argument("--compile", action="store_true", help="only the compiled train step table (eager vs compiled)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend of --compile")
    p.add_argument("--ops", type=int, nargs="*", help="only count aten ops per train step at these batch sizes (e.g. --ops 6 48)")
    p.add_argument("--collated", action="store_true", help="also rows whose batches a DataLoader worker made (Collator with a network plan recipe; padded)")
    p.add_argument("--steady", action="store_true", help="also padless on each batch stepped again (plans and oneDNN kernels already built)")
    args = p.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    if args.compile:
        compile_table(args)
        return
    if args.ops:
        ops_table(args)
        return
    if args.designs:
        design_table(args)
    model_table(args, tuple(DESIGNS) if args.designs else ())


if __name__ == "__main__":
    main()
