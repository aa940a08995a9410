"""Eager overhead of ops on a NestedTensor vs the same op on its values and on a padded tensor.

    python benchmarks/overhead.py [--rounds N] [--profile]

Small tensors on purpose: the numbers are dominated by per-call cost. "overhead"
is NestedTensor time minus hand-packed (values) time, medians from one run.

The last table is issue 40's floor: a five-op chain (linear, relu, residual add, layer_norm,
softmax) forward and backward on four tiny samples (T=29, C=64), against the same chain on the
packed rows as a plain tensor and on torch.nested (NJT), CPU-time medians, each with the counts
that do not depend on the machine's load (Python and C calls per step, autograd nodes the
backward runs, Python ``autograd.Function`` nodes made). ``--profile`` splits the chain's
padless time into where it goes (dispatch entry, wrapper construction, autograd nodes,
structure checks and caches, handler Python, the aten kernels themselves), per op, from
cProfile's own-time of every function, and times what a new structure costs: the first pair
broadcast and the first convolution on a batch never seen (maps and spatial plans built)
against the same op on a structure seen before, and runs the chain with parts of padless taken
away (the leaf read once; every op on the rows with one wrapper each, no dispatch).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import sys
import time

import torch

import padless
from padless.testing import bench
from padless.testing.reference import graph_nodes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--inner", type=int, default=200)
    ap.add_argument("--profile", action="store_true", help="where the chain's time goes; what a new structure costs")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    lengths = [17, 33, 8, 64, 40, 25, 51, 12]
    c = 64
    x = padless.from_list([torch.randn(n, c) for n in lengths])
    x2 = padless.from_list([torch.randn(n, c) for n in lengths])  # equal structure, built separately
    v, v2 = x.values(), x2.values()
    p, p2 = x.to_padded(), x2.to_padded()
    w = torch.randn(c)
    lin = torch.nn.Linear(c, c)
    ln = torch.nn.LayerNorm(c)
    cases = {
        "x * 2": lambda t, u: t * 2,
        "x + y": lambda t, u: t + u,
        "x * w (dense C)": lambda t, u: t * w,
        "sigmoid(x)": lambda t, u: t.sigmoid(),
        "where(x > 0, x, y)": lambda t, u: torch.where(t > 0, t, u),
        "x.add_(1) in-place": lambda t, u: t.add_(1e-9),
        "linear": lambda t, u: lin(t),
        "layer_norm": lambda t, u: ln(t),
        "x.sum()": lambda t, u: t.sum(),
    }
    rows = []
    with torch.no_grad():
        for name, f in cases.items():
            res = bench.interleaved(
                {
                    "hand-packed (values)": lambda f=f: f(v, v2),
                    "padless": lambda f=f: f(x, x2),
                    "padded": lambda f=f: f(p, p2),
                },
                baseline="hand-packed (values)",
                rounds=args.rounds,
                inner=args.inner,
            )
            over = res["padless"][0] - res["hand-packed (values)"][0]
            rows += bench.rows_from(name, res, {"padless": f"overhead {over:.1f} us"})
    # Forward with autograd recording (inputs require grad): the ATen path, below autograd.
    xg, vg, pg = x.detach().requires_grad_(), v.detach().requires_grad_(), p.detach().requires_grad_()
    grad_rows = []
    for name in ("x * 2", "x * w (dense C)", "sigmoid(x)", "linear", "layer_norm"):
        f = cases[name]
        res = bench.interleaved(
            {
                "hand-packed (values)": lambda f=f: f(vg, None),
                "padless": lambda f=f: f(xg, None),
                "padded": lambda f=f: f(pg, None),
            },
            baseline="hand-packed (values)",
            rounds=args.rounds,
            inner=args.inner,
        )
        over = res["padless"][0] - res["hand-packed (values)"][0]
        grad_rows += bench.rows_from(name, res, {"padless": f"overhead {over:.1f} us"})
    print(f"B={len(lengths)}, C={c}, lengths {lengths}, occupancy {x.occupancy():.2f}, torch {torch.__version__}, 1 thread")
    bench.print_table(rows, "Eager per-call cost (no grad)", "hand-packed (values)")
    bench.print_table(grad_rows, "Eager per-call cost, recording autograd (forward only)", "hand-packed (values)")
    chain_rows(args)
    if args.profile:
        profile_chain()
        floor_parts(args)
        new_structure_cost()


def _chain_inputs():
    torch.manual_seed(0)
    lengths, c = [5, 9, 3, 12], 64
    xs = [torch.randn(n, c) for n in lengths]
    lin, ln = torch.nn.Linear(c, c), torch.nn.LayerNorm(c)

    def chain(t):
        y = torch.relu(lin(t))
        return torch.softmax(ln(y + t), -1)

    def step(t):
        t.grad = None  # NJT cannot accumulate a second gradient into its .grad
        out = chain(t)
        (out.values() if out.is_nested else out).sum().backward()  # NJT: sum() has no backward

    nt = padless.from_list(xs, requires_grad=True)
    rows = nt.values().detach().clone().requires_grad_()
    njt = torch.nested.nested_tensor(xs, layout=torch.jagged, requires_grad=True)
    return step, nt, rows, njt


def chain_rows(args) -> None:
    step, nt, rows, njt = _chain_inputs()
    res = bench.interleaved(
        {"rows (plain tensor)": lambda: step(rows), "padless": lambda: step(nt), "torch.nested": lambda: step(njt)},
        baseline="rows (plain tensor)",
        rounds=args.rounds,
        inner=max(1, args.inner // 10),
        clock=time.process_time,  # CPU time: steadier than wall time on a shared machine
    )
    notes = {name: chain_counts(step, t) for name, t in (("rows (plain tensor)", rows), ("padless", nt), ("torch.nested", njt))}
    bench.print_table(bench.rows_from("5-op chain fwd+bwd, T=29", res, notes),
                      "The floor: a five-op chain, forward and backward", "rows (plain tensor)")
    print("(note: Python function calls / C calls made from Python per step, counted by sys.setprofile; "
          "autograd nodes the step makes, those the backward runs; counts do not depend on the machine's load)")


def chain_counts(step, t, n: int = 5) -> str:
    """Load-independent cost of one chain step on ``t``: Python function calls and C calls made
    from Python (``sys.setprofile``), autograd nodes made by the step (custom Function nodes
    counted by their ``forward``) and nodes the backward runs (reachable from the loss)."""
    for _ in range(3):
        step(t)
    calls = collections.Counter()

    def prof(frame, event, arg):
        if event == "call":
            calls["py"] += 1
            code = frame.f_code
            if code.co_name == "forward" and code.co_varnames[:1] == ("ctx",):
                calls["fn_nodes"] += 1
        elif event == "c_call":
            calls["c"] += 1

    sys.setprofile(prof)
    for _ in range(n):
        step(t)
    sys.setprofile(None)
    ran = _backward_nodes(step, t)
    return (f"{calls['py'] // n} py + {calls['c'] // n} C calls/step; "
            f"{ran} autograd nodes in backward; {calls['fn_nodes'] // n} Python Function nodes made")


def _backward_nodes(step, t) -> int:
    """Autograd nodes the backward of one step runs (reachable from the loss)."""
    todo = []
    real_backward = torch.Tensor.backward

    def grab(loss, *a, **k):
        todo.append(loss.grad_fn)
        return real_backward(loss, *a, **k)

    torch.Tensor.backward = grab
    try:
        step(t)
    finally:
        torch.Tensor.backward = real_backward
    return sum(len(graph_nodes(root)) for root in todo)


CATEGORIES = (  # (category, predicate on (file, function name)); the first match wins
    ("dispatch entry", lambda f, n: f.endswith("tensor/core.py") and n in ("__torch_function__", "__torch_dispatch__")),
    ("wrapper construction", lambda f, n: (f.endswith("tensor/core.py") and n in ("__new__", "_apply", "values_of"))
     or "_make_wrapper_subclass" in n or f.endswith("tensor/dynamo.py")),
    ("autograd nodes", lambda f, n: f.endswith(("tensor/autograd.py", "tensor/fast_grad.py")) or n in (
        "<built-in method apply>", "<method 'run_backward' of 'torch._C._EngineBase' objects>") or "torch/autograd" in f),
    ("structure checks, caches", lambda f, n: "check" in n or "cache" in n or f.endswith((
        "validate.py", "structure.py", "content.py", "host.py", "registry.py"))),
    ("handler Python", lambda f, n: "/padless/" in f),
    ("aten kernels", lambda f, n: f == "~" and ("torch" in n or "TensorBase" in n or "_nn" in n or "_VariableFunctions" in n)),
)


def profile_chain(n: int = 300) -> None:
    step, nt, _, _ = _chain_inputs()
    for _ in range(20):
        step(nt)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step(nt)
    prof.disable()
    total = collections.Counter()
    for (file, _, name), (_, _, tottime, _, _) in pstats.Stats(prof).stats.items():
        cat = next((c for c, pred in CATEGORIES if pred(file, name)), "other Python (torch.nn, the loop)")
        total[cat] += tottime
    ops = 5 * 2  # forward and backward of five ops
    whole = sum(total.values())
    print(f"\nWhere the chain's padless time goes (cProfile own time, {n} steps; per op = per step / {ops}; "
          "profiling inflates Python)")
    for cat, t in total.most_common():
        print(f"  {cat:36s} {t / n * 1e6:8.1f} us/step {t / n / ops * 1e6:7.1f} us/op {100 * t / whole:5.1f}%")


def floor_parts(args) -> None:
    """What the chain costs with parts of padless taken away, to see which part the floor is:
    the leaf's rows read once and the chain run on them (the leaf's rows are the autograd leaf,
    ``padless.tensor.leaf_rows``: its ``.grad`` is folded when read), and every op run on the rows and wrapped as a
    NestedTensor (``rewrap``: the wrapper and its autograd node per op) without any dispatch."""
    import torch.nn.functional as F

    from padless.tensor.autograd import rewrap, values_of

    step, nt, rows, _ = _chain_inputs()
    torch.manual_seed(0)
    lin, ln = torch.nn.Linear(64, 64), torch.nn.LayerNorm(64)

    def on_rows(v):
        return torch.softmax(ln(torch.relu(lin(v)) + v), -1)

    def wrapped(t):
        a = rewrap(F.linear(values_of(t), lin.weight, lin.bias), t)
        b = rewrap(torch.relu(values_of(a)), a)
        c = rewrap(values_of(b) + values_of(t), b)
        d = rewrap(F.layer_norm(values_of(c), (64,), ln.weight, ln.bias), c)
        return values_of(rewrap(torch.softmax(values_of(d), -1), d))

    def run(chain, t):
        t.grad = None
        with torch._C.DisableTorchFunctionSubclass():  # as inside NestedTensor.__torch_function__
            chain(t).sum().backward()

    res = bench.interleaved(
        {
            "rows (plain tensor)": lambda: run(on_rows, rows),
            "leaf read once, ops on rows": lambda: run(lambda t: on_rows(values_of(t)), nt),
            "ops on rows + wrapper per op": lambda: run(wrapped, nt),
            "padless": lambda: step(nt),
        },
        baseline="rows (plain tensor)", rounds=args.rounds, inner=max(1, args.inner // 10), clock=time.process_time,
    )
    bench.print_table(bench.rows_from("5-op chain fwd+bwd, T=29", res), "The floor, part by part (no dispatch)",
                      "rows (plain tensor)")


def new_structure_cost(reps: int = 20) -> None:
    """The first pair broadcast / convolution on a structure never seen against a seen one."""
    conv = torch.nn.Conv2d(16, 16, 3, padding=1)
    rows = []
    for what in ("pair broadcast (B=8, N 16..64, C=32)", "conv2d 3x3 (8 images 16x[24..64]^2)"):
        fresh, seen = [], []
        for i in range(reps):
            g = torch.Generator().manual_seed(1000 + i)
            if what.startswith("pair"):
                ns = torch.randint(16, 65, (8,), generator=g).tolist()
                make = lambda: padless.from_list([torch.randn(k, 32) for k in ns])  # noqa: E731
                op = lambda x: x.unsqueeze(2) + x.unsqueeze(1)  # noqa: E731
            else:
                hw = torch.randint(24, 65, (8, 2), generator=g).tolist()
                make = lambda: padless.from_list([torch.randn(16, h, w) for h, w in hw])  # noqa: E731
                op = conv
            with torch.no_grad():
                x = make()
                t0 = time.perf_counter()
                op(x)
                fresh.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                op(x)
                seen.append(time.perf_counter() - t0)
        fresh.sort(), seen.sort()
        f, s_ = fresh[reps // 2] * 1e3, seen[reps // 2] * 1e3
        rows.append(f"  {what:40s} new structure {f:7.2f} ms, seen {s_:7.2f} ms: plans {f - s_:6.2f} ms")
    print("\nWhat a new batch pays (no grad, medians):")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
