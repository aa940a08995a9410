"""Running a case on both sides and judging the outcome.

The chain runs on the NestedTensor and on every dense sample alone (each run with fresh
operands, :class:`padless.testing.fuzz.core.Side`), under the case's mode. The outcome is one
:class:`Verdict`:

* ``pass``: every step's result matches sample by sample (values, structure, dtype), and in
  grad mode so do the gradients of the inputs, of the dense operands that need one (the sum
  of the samples' gradients) and of the intermediate ``Case.wrt``;
* ``refused``: padless refused (``StructureError``/``NotImplementedError``, or the error that
  sample raises) at the step where some sample alone raises too (that sample has no value to
  compare with): a correct outcome;
* ``lenient``: padless gave an empty sample an empty result where torch refuses that empty
  sample alone (``interpolate`` to a size of 0), or answered a ``view`` that torch refuses
  only for a sample's strides (a window of a ragged dim is a contiguous copy in padless) with
  what the sample made contiguous gives: counted, not a failure;
* ``gap``: padless refused (``StructureError``/``NotImplementedError``) a step every sample
  runs: code with one clear meaning that padless does not take;
* ``wrong``: a value, structure or gradient differs, or padless answered where a sample
  alone raises;
* ``error``: padless raised something other than a refusal where every sample runs.

A verdict names the step it is attributed to (the first step whose result differs; for a
gradient, the shortest failing prefix of the chain) and that step's tags, plus the
case-level tags when the failure goes away with the mode off (inference mode, the gradient
of an intermediate). :func:`padless.testing.fuzz.known.known_reason` says whether a known
entry excuses it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any, Sequence

import torch
from torch import Tensor

from padless.ops.common.seq_first import SeqFirstView
from padless.tensor.construct import from_list
from padless.tensor.core import NestedTensor
from padless.tensor.errors import StructureError
from padless.testing.fuzz.core import TOLERANCES, Case, Side, Step, inputs
from padless.testing.fuzz.known import GRAD_INTERMEDIATE, INFERENCE_MODE, known_reason
from padless.testing.reference import assert_close_samples

REFUSALS = (StructureError, NotImplementedError)
OK = ("pass", "refused", "lenient")


class BothRaise(Exception):
    """Both sides' backward raised (a sample's own backward fails too)."""


@dataclasses.dataclass
class Verdict:
    """The outcome of one case (module docstring)."""

    status: str
    step: int | None = None
    tags: frozenset = frozenset()
    detail: str = ""
    known: str | None = None

    @property
    def ok(self) -> bool:
        """A pass, an agreed refusal, or a failure a known entry excuses."""
        return self.status in OK or self.known is not None


# ---------------------------------------------------------------------------- torch's own disagreements


_VECTOR_PAD = 128  # elements: a buffer of whole multiples of this runs entirely in torch's vectorised loop


def torch_disagrees(step: Step, x: Tensor, y: Tensor) -> bool:
    """True when the pointwise ``step`` maps some element of the dense sample ``x`` to a value
    (``y = step.fn(x, 0)``) whose NaN/inf pattern differs from what torch's vectorised loop
    gives the same element (the sample padded into a long buffer): the result depends on
    where the element sits, so a per-sample reference cannot judge padless's packed one."""
    with torch.no_grad():
        flat = x.detach().reshape(-1)
        n = flat.numel()
        if n == 0:
            return False
        buf = torch.zeros(-(-n // _VECTOR_PAD) * _VECTOR_PAD, dtype=flat.dtype)
        buf[:n] = flat
        v = step.fn(buf, 0)[:n]
        w = y.detach().reshape(-1)
        return not (torch.equal(v.isnan(), w.isnan()) and torch.equal(v.isinf(), w.isinf()) and torch.equal(v[v.isinf()], w[w.isinf()]))


# ---------------------------------------------------------------------------- one side


def mode_context(mode: str) -> contextlib.AbstractContextManager:
    if mode == "no_grad":
        return torch.no_grad()
    if mode == "inference":
        return torch.inference_mode()
    return torch.enable_grad()


@dataclasses.dataclass
class Trace:
    """One side's run: every step's result, and where it raised (if it did)."""

    side: Side
    outs: list[Any]
    error_step: int | None = None
    error: BaseException | None = None
    disagrees: int | None = None  # first pointwise step torch answers by position (dense only)


def run_side(steps: Sequence[Step], x: Tensor, side: Side, mode: str, probe: bool = False) -> Trace:
    tr = Trace(side, [])
    with mode_context(mode):
        for k, s in enumerate(steps):
            try:
                y = s.fn(x, side)
            except Exception as e:  # noqa: BLE001 - every exception is an outcome here
                tr.error_step, tr.error = k, e
                return tr
            if probe and tr.disagrees is None and s.pointwise and torch_disagrees(s, x, y):
                tr.disagrees = k
            if side and _lost_lineage(x, y):  # sizes read from y's shape would not be checked
                tr.error_step, tr.error = k, AssertionError("the result lost its input's batch lineage")
                return tr
            tr.outs.append(y)
            x = y
    return tr


def _lost_lineage(x: Any, y: Any) -> bool:
    if not isinstance(x, NestedTensor) or x._lineage is None:
        return False
    return any(isinstance(t, NestedTensor) and t._lineage is None for t in (y if isinstance(y, (tuple, list)) else (y,)))


def _magnitude(t: Any) -> float:
    if not isinstance(t, Tensor) or not t.numel() or not (t.is_floating_point() or t.is_complex()):
        return 0.0
    v = t.detach().double().abs()
    v = v[torch.isfinite(v)]
    return float(v.max()) if v.numel() else 0.0


def _close(what: str, got: Any, refs: list[Any], rtol: float, atol: float) -> str | None:
    """None when ``got`` holds ``refs`` sample by sample, else the difference."""
    if not isinstance(got, Tensor) or any(not isinstance(r, Tensor) for r in refs):
        return f"{what}: padless gave {type(got).__name__}, the samples {type(refs[0]).__name__ if refs else '-'}"
    try:
        assert_close_samples(got, refs, what=what, rtol=rtol, atol=atol)
    except AssertionError as e:
        return str(e)
    return None


# ---------------------------------------------------------------------------- judging


def judge(case: Case) -> Verdict:
    """Run ``case`` on both sides and judge it (module docstring)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. torch's "degrees of freedom <= 0" on an empty sample
        v = _judge(case)
        if v.status in OK:
            return v
        tags = set(v.tags)
        if case.mode == "inference" and not _same_failure(v, _judge(dataclasses.replace(case, mode="no_grad"))):
            tags.add(INFERENCE_MODE)
        if case.wrt is not None and not _same_failure(v, _judge(dataclasses.replace(case, wrt=None))):
            tags.add(GRAD_INTERMEDIATE)
        v.tags = frozenset(tags)
        v.known = known_reason(v.status, v.tags)
        return v


def _same_failure(v: Verdict, off: Verdict) -> bool:
    """Whether the case with a mode switched off fails as ``v`` does (else the mode is to blame)."""
    return off.status == v.status and off.step == v.step


def _verdict(case: Case, status: str, k: int | None, detail: str) -> Verdict:
    tags = case.steps[k].tags if k is not None and k < len(case.steps) else frozenset()
    where = f"step {k} ({case.steps[k].name})" if k is not None and k < len(case.steps) else "the case"
    return Verdict(status, k, tags, f"{where}: {detail}")


#: a result (bfloat16, float16 or float32) that differs from the dense one in that dtype is still
#: right when it is as close to the float64 computation as the dense one is (within this factor): an
#: ill-conditioned chain (a layer norm of values that cancel, a gradient that is rounding residue
#: where float64 gives 0) amplifies rounding in either order of summation
ACCURACY_FACTOR = 4.0
_ROUNDED = (torch.bfloat16, torch.float16, torch.float32)  # float64 is the reference itself

_LOW = (torch.bfloat16, torch.float16, torch.float32)


class _Float64(torch.overrides.TorchFunctionMode):
    """The float64 chain of a sample: every floating operand a step made in the case's dtype (a
    weight drawn with it, a table) is read in float64 too, so the chain runs end to end."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        up = lambda t: t.double() if isinstance(t, Tensor) and t.dtype in _LOW else t  # noqa: E731
        args, kwargs = torch.utils._pytree.tree_map(up, (args, kwargs or {}))
        return func(*args, **kwargs)


def _as_accurate(case: Case, dense: list[Tensor], got: Any, outs: list[Any], k: int, atol: float) -> bool:
    if case.dtype not in _ROUNDED or not isinstance(got, NestedTensor):
        return False
    try:
        with _Float64():
            hi = [run_side(case.steps[: k + 1], d.detach().double(), Side(False, i), "no_grad") for i, d in enumerate(dense)]
    except Exception:  # noqa: BLE001 - a step that cannot run in float64: no verdict from it
        return False
    if any(h.error is not None for h in hi):
        return False
    for g, r, h in zip(got.unbind(), outs, hi):
        ref64 = h.outs[k]
        if not isinstance(r, Tensor) or g.shape != r.shape or ref64.shape != r.shape:
            return False
        if not g.numel():
            continue
        err_nt = (g.detach().double() - ref64).abs().max().item()
        err_dense = (r.detach().double() - ref64).abs().max().item()
        if err_nt > ACCURACY_FACTOR * err_dense + atol:
            return False
    return True


def _judge(case: Case) -> Verdict:
    rtol, atol = TOLERANCES[case.dtype]
    grad = case.mode == "grad"
    nt, dense = inputs(case.shapes, case.ragged, case.dtype, case.seed, grad=grad)
    refs = [run_side(case.steps, s, Side(False, i), case.mode, probe=True) for i, s in enumerate(dense)]
    got = run_side(case.steps, nt, Side(True), case.mode)
    n = len(case.steps)
    k_dense = min((r.error_step for r in refs if r.error_step is not None), default=None)
    k_dis = min((r.disagrees for r in refs if r.disagrees is not None), default=None)
    k_nt = got.error_step
    end = min(k for k in (k_nt, k_dense, n) if k is not None)
    if k_dis is not None and k_dis < end:
        return _judge_packed(case, nt, got, refs, k_dis, rtol, atol)
    scale = 1.0
    for k in range(end):  # every step both sides ran
        outs = [r.outs[k] for r in refs]
        scale = max([scale] + [_magnitude(o) for o in outs])
        diff = _close("output", got.outs[k], outs, rtol, atol * scale)
        if diff is not None and not _as_accurate(case, dense, got.outs[k], outs, k, atol * scale):
            return _verdict(case, "wrong", k, diff)
    if k_nt is not None:
        e = got.error
        if k_dense is not None and k_dense == k_nt:
            i = _first_failing(refs)
            if isinstance(e, REFUSALS) or isinstance(e, type(refs[i].error)):
                return _verdict(case, "refused", k_nt, f"raised {type(e).__name__} as sample {i} does")
            return _verdict(case, "error", k_nt, f"raised {type(e).__name__}: {e} (sample {i} alone raises "
                            f"{type(refs[i].error).__name__}: a refusal should be clear)")
        if k_dense is not None and k_dense < k_nt:
            return _answered(case, nt, got, refs, k_dense, dense)
        status = "gap" if isinstance(e, REFUSALS) else "error"
        return _verdict(case, status, k_nt, f"raised {type(e).__name__}: {e}")
    if k_dense is not None:
        return _answered(case, nt, got, refs, k_dense, dense)
    if not grad:
        return Verdict("pass")
    try:
        diff = _compare_grads(case, nt, dense, got, refs, rtol, atol * scale)
    except BothRaise as e:
        return Verdict("refused", len(case.steps) - 1, case.steps[-1].tags, str(e))
    except Exception as e:  # noqa: BLE001
        return _localize(case, "error", f"gradient: raised {type(e).__name__}: {e}")
    if diff is not None:
        return _localize(case, "wrong", diff)
    return Verdict("pass")


def _first_failing(refs: list[Trace]) -> int:
    k = min(r.error_step for r in refs if r.error_step is not None)
    return next(i for i, r in enumerate(refs) if r.error_step == k)


_VIEW_STRIDES = "view size is not compatible with input tensor's size and stride"


def _answered(case: Case, nt, got: Trace, refs: list[Trace], k: int, dense: list[Tensor]) -> Verdict:
    """padless ran step ``k`` where some samples alone raise: lenient when each of them is
    empty and padless's result for it is empty too, or when each of them raises only torch's
    ``view`` stride error on a strided sample while padless's input is contiguous (a window of
    a ragged dim is a contiguous copy, docs/limits.md) and padless's result is what the step
    gives that sample made contiguous; else wrong."""
    x = got.outs[k - 1] if k else nt
    y = got.outs[k]
    failing = [i for i, r in enumerate(refs) if r.error_step == k]
    empty_in = isinstance(x, NestedTensor) and all(int(x.host_sizes()[i].prod()) == 0 for i in failing)
    empty_out = isinstance(y, NestedTensor) and all(int(y.host_sizes()[i].prod()) == 0 for i in failing)
    e = refs[failing[0]].error
    what = f"sample {failing[0]} alone raises {type(e).__name__}: {str(e)[:300]}"
    if empty_in and empty_out:
        return _verdict(case, "lenient", k, f"padless gave an empty result where {what}")
    strided = all(isinstance(refs[i].error, RuntimeError) and _VIEW_STRIDES in str(refs[i].error) for i in failing)
    if strided and isinstance(x, NestedTensor) and x.is_contiguous():
        outs = []
        for i, r in enumerate(refs):
            if r.error_step != k:
                outs.append(r.outs[k])
                continue
            s = r.outs[k - 1] if k else dense[i]
            with mode_context(case.mode):
                try:
                    outs.append(case.steps[k].fn(s.contiguous(), r.side))
                except Exception:  # noqa: BLE001 - not only the strides: padless should have refused
                    return _verdict(case, "wrong", k, f"padless answered where {what}")
        rtol, atol = TOLERANCES[case.dtype]
        scale = max([1.0] + [_magnitude(o) for o in outs])
        diff = _close("output", y, outs, rtol, atol * scale)
        if diff is None:
            return _verdict(case, "lenient", k, f"padless's contiguous input answered where {what}")
        return _verdict(case, "wrong", k, diff)
    return _verdict(case, "wrong", k, f"padless answered where {what}")


def _localize(case: Case, status: str, detail: str) -> Verdict:
    """A gradient failure, attributed to the last step of the shortest failing prefix."""
    for k in range(len(case.steps) - 1):
        wrt = case.wrt if case.wrt is not None and case.wrt < k else None
        sub = dataclasses.replace(case, steps=case.steps[: k + 1], wrt=wrt)
        if _judge(sub).status not in OK:
            return _verdict(case, status, k, detail)
    return _verdict(case, status, len(case.steps) - 1, detail)


def _cotangents(case: Case, refs: list[Tensor]) -> list[Tensor]:
    g = torch.Generator().manual_seed(case.seed + 1)
    return [torch.randn(r.shape, generator=g, dtype=torch.float64).to(r.dtype) for r in refs]


def _grads(out: Tensor, wrt: list[Tensor], cot: Tensor, accumulate: bool = False,
           seq_first: bool = False) -> list[Tensor | None]:
    """The gradients of ``wrt``: asked for (``torch.autograd.grad``) or, with ``accumulate``,
    accumulated by ``out.backward(cot, inputs=wrt)`` and read from ``.grad`` (a leaf
    NestedTensor's gradient is then gathered on its rows and folded when read,
    ``padless.tensor.leaf_rows``). With ``seq_first``, a NestedTensor ``out`` is asked through
    its sequence-first view (``out.transpose(0, 1)`` with ``cot.transpose(0, 1)``, where the
    transpose is that view: ``padless.tensor.engine_calls``)."""
    if not out.requires_grad:
        return [None] * len(wrt)
    if seq_first and isinstance(out, NestedTensor) and out.dim() >= 2:
        u = out.transpose(0, 1)
        if type(u) is SeqFirstView:
            out, cot = u, cot.transpose(0, 1)
    if not accumulate:
        return list(torch.autograd.grad(out, wrt, cot, allow_unused=True))
    for t in wrt:
        t.grad = None
    out.backward(cot, inputs=wrt)
    return [t.grad for t in wrt]


def _compare_grads(case, nt, dense, got: Trace, refs: list[Trace], rtol: float, atol: float) -> str | None:
    outs = [r.outs[-1] for r in refs]
    cot = _cotangents(case, outs)
    out = got.outs[-1]
    keys = sorted(k for k, p in got.side.params.items() if p.requires_grad)
    wrt = [nt] + ([got.outs[case.wrt]] if case.wrt is not None else []) + [got.side.params[k] for k in keys]
    if isinstance(out, NestedTensor):
        g_out = from_list(cot, ragged_dims=out.ragged_dims, dtype=out.dtype)
    else:
        g_out = torch.stack(cot).to(out.dtype)
    per_sample = []
    for i, (r, s) in enumerate(zip(refs, dense)):
        w = [s] + ([r.outs[case.wrt]] if case.wrt is not None else []) + [r.side.params[k] for k in keys]
        try:
            g = _grads(r.outs[-1], w, cot[i])
        except Exception as e:  # noqa: BLE001 - the sample's own backward fails: padless must too
            try:
                _grads(out, wrt, g_out)
            except Exception:  # noqa: BLE001
                raise BothRaise(f"the backward raises, as sample {i}'s does ({type(e).__name__})") from None
            return f"gradient: padless's backward ran where sample {i}'s raises {type(e).__name__}: {str(e)[:200]}"
        per_sample.append([gi if gi is not None else torch.zeros_like(wi) for gi, wi in zip(g, w)])
    g_nt = _grads(out, wrt, g_out, accumulate=case.seed % 2 == 1, seq_first=case.seed % 3 == 0)
    scale = max([1.0] + [_magnitude(g) for gs in per_sample for g in gs])
    names = ["input"] + (["intermediate"] if case.wrt is not None else []) + [f"operand {k}" for k in keys]
    for j, name in enumerate(names):
        want = [gs[j] for gs in per_sample]
        have = g_nt[j]
        if j >= len(names) - len(keys):  # a dense operand: the samples' gradients add up
            total = torch.stack(want).sum(0)
            have = torch.zeros_like(total) if have is None else have
            try:
                torch.testing.assert_close(have, total, rtol=rtol, atol=atol * scale, equal_nan=True)
            except AssertionError as e:
                if not _operand_grad_as_accurate(case, dense, cot, keys[j - len(names) + len(keys)], have, total,
                                                 atol * scale):
                    return f"gradient of the {name}: {e}"
            continue
        if have is None:
            if any(bool(w.abs().sum() > 0) for w in want):
                return f"gradient of the {name}: padless gives none, the samples do"
            continue
        diff = _close(f"gradient of the {name}", have, want, rtol, atol * scale)
        if diff is not None and not (j == 0 and _input_grad_as_accurate(case, dense, cot, have, want, atol * scale)):
            return diff
    return None


def _input_grad_as_accurate(case: Case, dense: list[Tensor], cot: list[Tensor], have: Any, want: list[Tensor],
                            atol: float) -> bool:
    """:func:`_as_accurate` for the input gradient: the float64 chain's gradient as the reference."""
    if case.dtype not in _ROUNDED or not isinstance(have, NestedTensor):
        return False
    for i, (d, g, w) in enumerate(zip(dense, have.unbind(), want)):
        if not g.numel():
            continue
        x64 = d.detach().double().requires_grad_()
        try:
            with _Float64():
                tr = run_side(case.steps, x64, Side(False, i), "grad")
            if tr.error is not None:
                return False
            (g64,) = torch.autograd.grad(tr.outs[-1], [x64], cot[i].double(), allow_unused=True)
        except Exception:  # noqa: BLE001 - a chain that cannot run in float64: no verdict from it
            return False
        g64 = torch.zeros_like(x64) if g64 is None else g64
        if g.shape != g64.shape:
            return False
        err_nt = (g.detach().double() - g64).abs().max().item()
        err_dense = (w.detach().double() - g64).abs().max().item()
        if err_nt > ACCURACY_FACTOR * err_dense + atol:
            return False
    return True


def _operand_grad_as_accurate(case: Case, dense: list[Tensor], cot: list[Tensor], key: str, have: Tensor,
                              total: Tensor, atol: float) -> bool:
    """:func:`_as_accurate` for a dense operand's gradient (the samples' gradients summed): the
    float64 chains' gradients, summed in float64, as the reference."""
    if case.dtype not in _ROUNDED:
        return False
    ref = torch.zeros(have.shape, dtype=torch.float64)
    for i, d in enumerate(dense):
        try:
            with _Float64():
                tr = run_side(case.steps, d.detach().double(), Side(False, i), "grad")
            if tr.error is not None:
                return False
            p = tr.side.params.get(key)
            if p is None or not p.requires_grad or p.shape != have.shape:
                return False
            if tr.outs[-1].requires_grad:
                (g,) = torch.autograd.grad(tr.outs[-1], [p], cot[i].double(), allow_unused=True)
                if g is not None:
                    ref += g.double()
        except Exception:  # noqa: BLE001 - a chain that cannot run in float64: no verdict from it
            return False
    err_nt = (have.detach().double() - ref).abs().max().item() if have.numel() else 0.0
    err_dense = (total.detach().double() - ref).abs().max().item() if total.numel() else 0.0
    return err_nt <= ACCURACY_FACTOR * err_dense + atol


def _judge_packed(case: Case, nt, got: Trace, refs: list[Trace], k: int, rtol: float, atol: float) -> Verdict:
    """Forward only, for a chain whose step ``k`` is pointwise and position-dependent in torch:
    steps before it against the per-sample reference, step ``k`` against torch's dense op on
    the same packed values padless ran it on (the rest of the chain has no per-sample reference)."""
    scale = 1.0
    for j in range(k):
        outs = [r.outs[j] for r in refs]
        scale = max([scale] + [_magnitude(o) for o in outs])
        diff = _close("output", got.outs[j], outs, rtol, atol * scale)
        if diff is not None:
            return _verdict(case, "wrong", j, diff)
    step = case.steps[k]
    with torch.no_grad():
        x = got.outs[k - 1] if k else nt.detach()
        y = step.fn(x, Side(True))
        packed = isinstance(x, NestedTensor) and isinstance(y, NestedTensor)
        have, want = (y.values(), step.fn(x.values(), Side(False, 0))) if packed else (y, step.fn(x, Side(False, 0)))
        try:
            torch.testing.assert_close(have, want, rtol=rtol, atol=atol * scale, equal_nan=True)
        except AssertionError as e:
            detail = f"step {k} ({step.name}) differs from torch's dense op on the same packed values\n{e}"
            return Verdict("wrong", k, step.tags, detail)
    return Verdict("pass")


def run_case(case: Case) -> Verdict:
    """Judge ``case``; raise ``AssertionError`` naming the case unless it passed, padless
    refused where a sample alone refuses too, or was lenient. Returns the verdict."""
    v = judge(case)
    if v.status not in OK:
        raise AssertionError(f"{case!r}\n{v.status}: {v.detail}")
    return v
