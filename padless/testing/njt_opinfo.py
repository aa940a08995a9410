"""torch's own NJT OpInfo samples, run against padless (forward and backward).

``torch.testing._internal.opinfo.definitions.nested.njt_op_db`` (shipped with the torch
wheel; its ``common_utils`` needs the ``expecttest`` package) translates torch's OpInfo
database to jagged-layout nested tensors (NJT): every op marked ``supports_njt`` has a
``sample_inputs_func`` that yields NJT samples (2-4 dims; contiguous with and without the
seqlen cache, transposed, with holes) and a ``ref`` that computes the expected output from the
samples' components (the unbind reference, or a reduction over ``values()``).

For every op and sample, :func:`check_sample` runs:

* **NJT**: the op on the NJT sample against its reference (values; in backward, the
  gradients of the sample's inputs too);
* **padless**: the same values as padless NestedTensors (each NJT converted by
  ``padless.from_njt``: holes dropped, transposed ones kept transposed), the op on them, compared sample by
  sample with the same reference. In backward the inputs are padless leaves and their
  gradients are compared with the reference's; then once more with the inputs converted from
  the NJTs with their autograd history (gradients taken with respect to those padless
  tensors, intermediates of the graph: issue 39 #7).

The rule: every sample NJT passes, padless passes, or refuses by a documented rule listed in
:data:`BY_DESIGN` (op, predicate on the sample, reason), or hits an entry of :data:`KNOWN`
(a bug being fixed elsewhere; expected to flip after its fix). ``python -m
padless.testing.njt_opinfo [--full]`` prints the counts.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
import zlib
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

from padless.tensor.construct import from_njt
from padless.tensor.core import NestedTensor

@dataclasses.dataclass(frozen=True)
class Rule:
    """A by-design difference or a known bug: ``op`` (a full OpInfo name, or a regex with
    ``re:``), ``when`` (a predicate on the sample's name and phase), ``reason``."""

    op: str
    reason: str
    when: Callable[[str, str], bool] = lambda name, phase: True

    def matches(self, op: str, name: str, phase: str) -> bool:
        hit = re.fullmatch(self.op[3:], op) if self.op.startswith("re:") else self.op == op
        return bool(hit) and self.when(name, phase)


#: Samples NJT passes and padless refuses or answers differently on purpose (docs/nested.md,
#: docs/limits.md). One place, as data.
BY_DESIGN: list[Rule] = [
    Rule("re:.*", "a full reduction (dim=None) of an NJT with holes: NJT's reference reduces values(), the "
         "elements in the holes included; padless drops the holes (they are not data: docs/nested.md, "
         "nested_tensor_from_jagged with lengths) and reduces every sample's real elements",
         lambda name, phase: "holes" in name and "full reduction" in name),
]

#: Samples on which NJT itself crashes the interpreter (a segmentation fault): NJT is not
#: run on them (counted as an NJT failure); padless is.
NJT_CRASHES: list[Rule] = [
    Rule("split_with_sizes", "NJT's backward of a split with a size-0 part segfaults (torch 2.13)",
         lambda name, phase: phase == "backward" and re.search(r"split_sizes=\[0,|, 0\]", name) is not None),
]

#: Bugs being fixed on other branches: these samples fail today and should pass after the fix.
KNOWN: list[Rule] = []

#: A reason the gradients with respect to padless tensors converted from the NJTs with their
#: history (intermediates of the graph) may fail; None: they must pass (issue 39 #7 is fixed).
KNOWN_INTERMEDIATE: str | None = None


@dataclasses.dataclass
class Result:
    """One sample in one phase: NJT's outcome (``pass``/``fail``), padless's (``pass``,
    ``refused`` (by a :data:`BY_DESIGN` rule), ``known`` (a :data:`KNOWN` entry), ``fail``),
    and, in backward, whether the gradients with respect to converted intermediates match
    (``inter``: ``pass``, ``unused`` (off the graph: issue 39 #7), ``fail``, or ``-``)."""

    op: str
    idx: int
    name: str
    phase: str
    njt: str
    padless: str
    detail: str = ""
    inter: str = "-"
    reason: str = ""
    njt_detail: str = ""
    inter_detail: str = ""

    @property
    def ok(self) -> bool:
        """The rule: a sample NJT passes must pass on padless or be explained (by a rule, a
        known bug, or, for the gradients of intermediates, :data:`KNOWN_INTERMEDIATE`)."""
        if self.njt != "pass":
            return True
        inter_ok = self.inter != "fail" and (self.inter != "unused" or KNOWN_INTERMEDIATE is not None)
        return self.padless in ("pass", "refused", "known") and inter_ok


# ---------------------------------------------------------------------------- the op database


def njt_ops() -> list[Any]:
    """Every OpInfo of ``njt_op_db`` that supports NJT (imports torch's test internals)."""
    from torch.testing._internal.opinfo.definitions.nested import njt_op_db

    return [op for op in njt_op_db if op.supports_njt]


def samples(op: Any, requires_grad: bool, pick: Callable[[int], bool] | None = None,
            stop: int | None = None) -> Iterator[tuple[int, Any]]:
    """``(index, sample)`` of ``op``'s float32 CPU samples (those ``pick`` keeps, up to index ``stop``)."""
    torch.manual_seed(zlib.crc32(op.full_name.encode()))  # the generators draw random sizes
    it = op.sample_inputs(device="cpu", dtype=torch.float32, requires_grad=requires_grad)
    for i, s in enumerate(it):
        if stop is not None and i >= stop:
            return
        if pick is None or pick(i):
            yield i, s


# ---------------------------------------------------------------------------- comparing


def _components(t: Any) -> Any:
    """A nested output as its list of components; anything else as it is."""
    if isinstance(t, NestedTensor):
        return list(t.unbind())
    if isinstance(t, Tensor) and t.is_nested:
        return list(t.unbind())
    return t


def compare(got: Any, want: Any) -> str | None:
    """None when ``got`` (padless or NJT output) equals ``want`` (the reference) component by
    component (values, shapes, dtypes; NaN equal), else the difference."""
    g_leaves, g_spec = tree_flatten(tree_map(_components, got, is_leaf=lambda x: isinstance(x, Tensor)))
    w_leaves, w_spec = tree_flatten(tree_map(_components, want, is_leaf=lambda x: isinstance(x, Tensor)))
    if len(g_leaves) != len(w_leaves):
        return f"{len(g_leaves)} outputs (components), the reference has {len(w_leaves)}"
    for k, (g, w) in enumerate(zip(g_leaves, w_leaves)):
        if isinstance(w, Tensor) != isinstance(g, Tensor):
            return f"output {k}: {type(g).__name__}, the reference {type(w).__name__}"
        if not isinstance(w, Tensor):
            if g != w:
                return f"output {k}: {g!r}, the reference {w!r}"
            continue
        if tuple(g.shape) != tuple(w.shape):
            return f"output {k}: shape {tuple(g.shape)}, the reference {tuple(w.shape)}"
        try:
            torch.testing.assert_close(g.detach(), w.detach(), equal_nan=True)
        except AssertionError as e:
            return f"output {k}: {e}"
    return None


def _loss(out: Any, seed: int) -> Tensor | None:
    """A scalar with a fixed random weight per output element (components in order), so the
    gradients of ``out`` and of the reference are taken with the same cotangent."""
    g = torch.Generator().manual_seed(seed)
    total = None
    for leaf in tree_flatten(tree_map(_components, out, is_leaf=lambda x: isinstance(x, Tensor)))[0]:
        if isinstance(leaf, Tensor) and leaf.requires_grad and leaf.is_floating_point():
            w = torch.randn(leaf.shape, generator=g, dtype=torch.float64).to(leaf.dtype)
            term = (leaf * w).sum()
            total = term if total is None else total + term
    return total


def _grads(out: Any, wrt: list[Tensor], seed: int) -> list[Tensor | None] | None:
    loss = _loss(out, seed)
    if loss is None:
        return None
    return list(torch.autograd.grad(loss, wrt, allow_unused=True))


def _grad_components(g: Tensor | None, like: Tensor) -> Any:
    if g is None:
        return [torch.zeros_like(c) for c in like.unbind()] if (like.is_nested or isinstance(like, NestedTensor)) \
            else torch.zeros_like(like)
    return _components(g)


# ---------------------------------------------------------------------------- one sample


def _convert(sample: Any, how: str) -> tuple[Any, Any, Any, list[Tensor]]:
    """The sample's input, args and kwargs with every NJT as a padless NestedTensor: ``leaf``
    (detached, a leaf needing grad as the NJT did), ``history`` (converted with its autograd
    history) or ``plain`` (detached); dense tensors needing grad are detached leaves too.
    Returns them and the tensors to differentiate with respect to."""
    wrt: list[Tensor] = []

    def conv(t: Any) -> Any:
        if not isinstance(t, Tensor):
            return t
        if t.is_nested:
            if how == "history":
                out = from_njt(t)
            else:
                out = from_njt(t.detach()).detach()
                if how == "leaf" and t.requires_grad:
                    out.requires_grad_()
        elif how != "history" and t.requires_grad:
            out = t.detach().clone().requires_grad_()
        else:
            out = t
        if t.requires_grad and how != "plain":
            wrt.append(out)
        return out

    return conv(sample.input), tree_map(conv, sample.args), tree_map(conv, sample.kwargs), wrt


def _sample_wrt(sample: Any) -> list[Tensor]:
    leaves = tree_flatten((sample.input, sample.args, sample.kwargs))[0]
    return [t for t in leaves if isinstance(t, Tensor) and t.requires_grad]


def _rule(rules: Iterable[Rule], op: str, name: str, phase: str) -> Rule | None:
    return next((r for r in rules if r.matches(op, name, phase)), None)


def check_sample(op: Any, idx: int, sample: Any, phase: str) -> Result:
    """NJT and padless on one sample (module docstring)."""
    name = sample.name or ""
    res = Result(op.full_name, idx, name, phase, "fail", "fail")
    seed = 1234 + idx
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # NJT against its reference
        try:
            ref = op.ref(op, sample)
        except Exception as e:  # noqa: BLE001 - a reference that cannot run: nothing to compare with
            res.njt = res.padless = "skip"
            res.detail = f"reference raised {type(e).__name__}: {e}"
            return res
        ref_wrt = _sample_wrt(sample)
        g_ref = None
        if phase == "backward":
            try:
                g_ref = _grads(ref, ref_wrt, seed)
            except Exception as e:  # noqa: BLE001
                res.njt = res.padless = "skip"
                res.detail = f"the reference's backward raised {type(e).__name__}: {e}"
                return res
        try:
            crash = _rule(NJT_CRASHES, op.full_name, name, phase)
            if crash is not None:
                raise RuntimeError(crash.reason)
            out = op.op(sample.input, *sample.args, **sample.kwargs)
            diff = compare(out, ref)
            if diff is None and phase == "backward":
                g = _grads(out, ref_wrt, seed)
                if g is not None and g_ref is not None:
                    diff = compare([_grad_components(a, w) for a, w in zip(g, ref_wrt)],
                                   [_grad_components(b, w) for b, w in zip(g_ref, ref_wrt)])
            res.njt = "pass" if diff is None else "fail"
            res.njt_detail = diff or ""
        except Exception as e:  # noqa: BLE001
            res.njt, res.njt_detail = "fail", f"raised {type(e).__name__}: {str(e)[:300]}"
        # padless against the same reference
        try:
            inp, args, kwargs, wrt = _convert(sample, "leaf" if phase == "backward" else "plain")
            pl = op.op(inp, *args, **kwargs)
            diff = compare(pl, ref)
            if diff is None and phase == "backward":
                g = _grads(pl, wrt, seed) if g_ref is not None else None
                if g_ref is not None and g is None:
                    diff = "gradient: padless's output needs no gradient, the reference's does"
                elif g_ref is not None:
                    diff = compare([_grad_components(a, w) for a, w in zip(g, wrt)],
                                   [_grad_components(b, w) for b, w in zip(g_ref, ref_wrt)])
                    diff = None if diff is None else f"gradient: {diff}"
                    if diff is None:
                        res.inter, res.inter_detail = _intermediates(op, sample, g_ref, ref_wrt, seed)
        except Exception as e:  # noqa: BLE001
            diff = f"raised {type(e).__name__}: {str(e)[:300]}"
        if diff is None:
            res.padless = "pass"
        res.detail = diff or ""
    if res.padless != "pass":
        known = _rule(KNOWN, op.full_name, name, phase)
        by_design = _rule(BY_DESIGN, op.full_name, name, phase)
        if known is not None:
            res.padless, res.reason = "known", known.reason
        elif by_design is not None:
            res.padless, res.reason = "refused", by_design.reason
        else:
            res.padless = "fail"  # a wrong value, a crash, or a refusal no rule documents
    return res


def _nonzero(g: Tensor | None) -> bool:
    """A gradient with some entry that is not 0 (NaN counts)."""
    if g is None:
        return False
    parts = _components(g)
    return any(bool((p != 0).any()) for p in (parts if isinstance(parts, list) else [parts]))


def _intermediates(op: Any, sample: Any, g_ref: list, ref_wrt: list[Tensor], seed: int) -> tuple[str, str]:
    """Gradients with respect to padless tensors converted from the NJTs with their history:
    ``("pass", "")``, ``("unused", ...)`` when autograd finds such a tensor off the graph
    (no gradient where the reference has one: issue 39 #7's signature), or ``("fail", ...)``."""
    try:
        inp, args, kwargs, wrt = _convert(sample, "history")
        g = _grads(op.op(inp, *args, **kwargs), wrt, seed)
    except Exception as e:  # noqa: BLE001
        return "fail", f"raised {type(e).__name__}: {str(e)[:200]}"
    if g is None:
        return "unused", "the output needs no gradient (off the graph), the reference's does"
    unused = [k for k, (a, b) in enumerate(zip(g, g_ref)) if a is None and _nonzero(b) and isinstance(wrt[k], NestedTensor)]
    if unused:
        return "unused", f"inputs {unused}: no gradient (not on the graph), the reference has one"
    diff = compare([_grad_components(a, w) for a, w in zip(g, wrt)],
                   [_grad_components(b, w) for b, w in zip(g_ref, ref_wrt)])
    return ("pass", "") if diff is None else ("fail", diff[:300])


# ---------------------------------------------------------------------------- runs


def run_op(op: Any, full: bool, phases: tuple[str, ...] = ("forward", "backward")) -> list[Result]:
    """Every sample of ``op`` (``full``) or a fixed subsample (:func:`fast_pick`), in each phase
    (backward only for ops that support autograd)."""
    out = []
    for phase in phases:
        if phase == "backward" and not op.supports_autograd:
            continue
        pick, stop = (None, None) if full else fast_pick(op.full_name, phase)
        for i, s in samples(op, phase == "backward", pick, stop):
            out.append(check_sample(op, i, s, phase))
    return out


FAST_WINDOW = 12  # the first samples cover 2-D and 3-D inputs: contiguous, without the seqlen cache, transposed, with holes
FAST_EVERY = 4


def fast_pick(op: str, phase: str) -> tuple[Callable[[int], bool], int]:
    """The subsample ``make test`` runs: every ``FAST_EVERY``-th of the first ``FAST_WINDOW``
    samples, at an offset that depends on the op and the phase (so the variants rotate)."""
    k = zlib.crc32(f"{op}|{phase}".encode()) % FAST_EVERY
    return (lambda i: i % FAST_EVERY == k), FAST_WINDOW


def summarize(results: list[Result]) -> str:
    """Counts per phase: samples NJT passes, and of those padless passes / refuses by a rule /
    known bugs / fails; padless on the samples NJT fails; gradients wrt intermediates."""
    lines = [f"{'phase':<9}{'samples':>8}{'NJT pass':>9}{'padless:':>9}{'pass':>6}{'by rule':>8}{'known':>6}"
             f"{'fails':>6}   {'NJT fails, padless passes':>26}   {'grad wrt intermediates pass/unused/fail':>40}"]
    for phase in ("forward", "backward"):
        rs = [r for r in results if r.phase == phase and r.njt != "skip"]
        njt_ok = [r for r in rs if r.njt == "pass"]
        c = {k: sum(1 for r in njt_ok if r.padless == k) for k in ("pass", "refused", "known", "fail")}
        extra = sum(1 for r in rs if r.njt != "pass" and r.padless == "pass")
        inter = "/".join(str(sum(1 for r in rs if r.inter == k)) for k in ("pass", "unused", "fail"))
        lines.append(f"{phase:<9}{len(rs):>8}{len(njt_ok):>9}{'':>9}{c['pass']:>6}{c['refused']:>8}{c['known']:>6}"
                     f"{c['fail']:>6}   {extra:>26}   {inter:>40}")
    skipped = sum(1 for r in results if r.njt == "skip")
    if skipped:
        lines.append(f"({skipped} samples whose reference cannot run are left out)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m padless.testing.njt_opinfo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="every sample (default: the make-test subsample)")
    ap.add_argument("-k", default=None, help="a regex on the op's full name")
    ap.add_argument("--show", type=int, default=20)
    ap.add_argument("-v", action="store_true", help="print each op as it starts")
    ap.add_argument("--part", default=None, help="i/n: only every n-th op from the i-th (runs split in parts)")
    ap.add_argument("--json", default=None, help="write every result to this file (--merge sums such files)")
    ap.add_argument("--merge", nargs="*", default=None, help="summarise result files written by --json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    results: list[Result] = []
    if args.merge is not None:
        import json

        for f in args.merge:
            with open(f) as fh:
                results += [Result(**r) for r in json.load(fh)]
        print(summarize(results))
        bad = [r for r in results if not r.ok]
        for r in bad[: args.show]:
            print(f"FAIL {r.op} [{r.phase} #{r.idx} {r.name}] {r.detail[:300]}")
        return 1 if bad else 0
    part, parts = (int(v) for v in args.part.split("/")) if args.part else (0, 1)
    for j, op in enumerate(njt_ops()):
        if j % parts != part or (args.k and not re.search(args.k, op.full_name)):
            continue
        if args.v:
            print(op.full_name, flush=True)
        results += run_op(op, args.full)
    if args.json:
        import json

        with open(args.json, "w") as fh:
            json.dump([dataclasses.asdict(r) for r in results], fh)
    print(summarize(results))
    bad = [r for r in results if not r.ok]
    for r in bad[: args.show]:
        print(f"FAIL {r.op} [{r.phase} #{r.idx} {r.name}] {r.detail[:300]}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
