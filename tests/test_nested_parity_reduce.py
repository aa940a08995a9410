"""torch.nested (NJT) reductions found by PyTorch's NJT OpInfo tests (``benchmarks/njt_suite.py``),
each compared with torch's real NJT sample by sample (values, shapes, gradients).

Covered: ``nansum`` / ``nanmean`` / ``count_nonzero`` (no handler before: the per-sample
fallback, refused for batch-level dims); ``std`` / ``var`` over the batch dim together with
the ragged dim (and static dims), and ``keepdim=True`` when every dim is listed;
``argmax`` / ``argmin`` without ``dim`` on a transposed tensor (a flat index into
``values()``); reductions over batch + ragged of a transposed tensor (ragged dim last).
"""

import pytest
import torch

from padless import nested

# Ragged (j, 4) samples: an empty sample in the middle, the one-sample batch, and (j, 2, 4).
BATCHES = {"mixed": [(3, 4), (0, 4), (2, 4)], "one": [(5, 4)], "3d": [(2, 2, 4), (4, 2, 4)]}


def _samples(shapes, seed=0, nans=False):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(s, generator=g) for s in shapes]
    if nans:  # a NaN in every non-empty sample, and a column that is NaN in the first one
        for s in out:
            if s.numel():
                s.view(-1)[1] = float("nan")
        if out[0].numel():
            out[0][..., 0] = float("nan")
    return out


def _pair(samples, requires_grad=False, transposed=False):
    pl = nested.nested_tensor([s.clone() for s in samples], requires_grad=requires_grad)
    njt = torch.nested.nested_tensor([s.clone() for s in samples], layout=torch.jagged, requires_grad=requires_grad)
    if transposed:  # ragged dim last: (B, 4, j)
        return pl.transpose(1, -1), njt.transpose(1, -1), (pl, njt)
    return pl, njt, (pl, njt)


def _same(a, b):
    """``a`` (padless) equals ``b`` (NJT): dense results as they are, nested ones sample by sample."""
    assert (type(a) is torch.Tensor) == (not b.is_nested), (type(a), b.is_nested)
    xs, ys = (list(a.unbind()), list(b.unbind())) if b.is_nested else ([a], [b])
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert x.shape == y.shape
        torch.testing.assert_close(x, y, equal_nan=True)


def _grads(out, leaf):
    (g,) = torch.autograd.grad(out, leaf, torch.ones_like(out))
    return g


# (dim, keepdim) in NJT's outer dims of a (B, j, 4) batch; 3-D batches are (B, j, 2, 4).
DIMS = [(1, False), (1, True), (-1, False), ([0, 1], False), ([0, 1], True), (None, False)]
DIMS_3D = [([0, 1, 2], False), ([0, 1, 3], True), ([0, 1, 2, 3], True)]


def _dims(name):
    return DIMS + (DIMS_3D if name == "3d" else [([0, 1, 2], True)])


def _dense_ref(op, samples, dim, **kw):
    """The dense reference: ``op`` on each sample (stacked when the ragged dim 1 is reduced),
    or on the rows of every sample together when ``dim`` holds the batch dim (then the ragged
    dim too), or on every element when ``dim`` is None."""
    fn = getattr(torch, op)
    keepdim = kw.get("keepdim", False)
    if dim is None:
        return fn(torch.cat([s.flatten() for s in samples]), **kw)
    dims = [d % (samples[0].dim() + 1) for d in ([dim] if isinstance(dim, int) else dim)]
    if 0 in dims:
        out = fn(torch.cat(samples), dim=sorted({max(d - 1, 0) for d in dims}), **kw)
        return out.unsqueeze(0) if keepdim else out
    outs = [fn(s, dim=[d - 1 for d in dims], **kw) for s in samples]
    return torch.stack(outs) if 1 in dims else outs


def _same_ref(a, ref):
    """``a`` (padless) equals the dense reference: a tensor, or a list of samples (a NestedTensor)."""
    if isinstance(ref, list):
        assert type(a) is not torch.Tensor and len(a.unbind()) == len(ref)
        for x, y in zip(a.unbind(), ref):
            assert x.shape == y.shape
            torch.testing.assert_close(x, y, equal_nan=True)
    else:
        assert type(a) is torch.Tensor and a.shape == ref.shape and a.dtype == ref.dtype
        torch.testing.assert_close(a, ref, equal_nan=True)


def _leaf_grads(out, ref, pl, leaves):
    """Gradients of ``out`` (padless) and of the dense reference w.r.t. each sample, both fed ones."""
    (g,) = torch.autograd.grad(out, pl, torch.ones_like(out))
    refs = ref if isinstance(ref, list) else [ref]
    want = torch.autograd.grad(refs, leaves, [torch.ones_like(r) for r in refs], allow_unused=True)
    for x, y, leaf in zip(g.unbind(), want, leaves):
        torch.testing.assert_close(x, torch.zeros_like(leaf) if y is None else y, equal_nan=True)


# NJT has no nansum / nanmean / count_nonzero / std / var (aten.nansum.default, aten.std.correction
# raise NotImplementedError): padless is checked against the dense op on the samples.
@pytest.mark.parametrize("name", BATCHES)
@pytest.mark.parametrize("op", ["nansum", "nanmean", "std", "var"])
def test_reductions_njt_lacks_match_dense(name, op):
    for dim, keepdim in _dims(name):
        if op in ("std", "var") and dim == 1 and name == "mixed":
            continue  # the empty sample: torch warns (degrees of freedom <= 0); the NaN is tested in tests/ops
        samples = _samples(BATCHES[name], nans=op.startswith("nan"))
        leaves = [s.clone().requires_grad_() for s in samples]
        pl = nested.nested_tensor([s.clone() for s in samples], requires_grad=True)
        kw = {} if dim is None else {"keepdim": keepdim}
        a, ref = getattr(torch, op)(pl, dim=dim, **kw), _dense_ref(op, leaves, dim, **kw)
        _same_ref(a, ref)
        _leaf_grads(a, ref, pl, leaves)


@pytest.mark.parametrize("name", BATCHES)
def test_count_nonzero_matches_dense(name):
    samples = [s.masked_fill(s > 0.5, 0.0) for s in _samples(BATCHES[name])]
    pl = nested.nested_tensor(samples)
    for dim, _keepdim in _dims(name):
        _same_ref(torch.count_nonzero(pl, dim=dim), _dense_ref("count_nonzero", samples, dim))


@pytest.mark.parametrize("name", ["mixed", "one"])
@pytest.mark.parametrize("op", ["sum", "mean", "amax", "amin", "all", "any", "linalg.vector_norm"])
def test_batch_and_ragged_reduction_of_transposed_matches_njt(name, op):
    """Ragged dim last (B, 4, j): dim=[0, 2] reduces every row of every sample, per channel.

    (PyTorch's OpInfo reference computes these samples on ``values()`` with NJT's inner dims,
    which for a transposed NJT is ``(4, T)``; padless's ``values()`` is ragged-first ``(T, 4)``,
    so that reference reduces the wrong dim of it. The real NJT, here, agrees with padless.)
    """
    fn = torch.linalg.vector_norm if op == "linalg.vector_norm" else getattr(torch, op)
    grad = op not in ("all", "any")
    for keepdim in (False, True):
        samples = _samples(BATCHES[name])
        pl, njt, (base, _) = _pair(samples, requires_grad=grad, transposed=True)
        a = fn(pl, dim=[0, 2], keepdim=keepdim)
        if op != "linalg.vector_norm":  # (NJT: aten.linalg_vector_norm.default not implemented here)
            with torch.no_grad():  # NJT's backward here raises (aten._nested_sum_backward)
                _same(a.detach() if grad else a, fn(njt.detach(), dim=[0, 2], keepdim=keepdim))
        leaves = [x.clone().requires_grad_(grad) for x in samples]  # the dense op on every row
        ref = fn(torch.cat(leaves), dim=0)
        ref = ref.reshape(1, -1, 1) if keepdim else ref
        _same_ref(a, ref)
        if grad:
            _leaf_grads(a, ref, base, leaves)


@pytest.mark.parametrize("name", BATCHES)
@pytest.mark.parametrize("op", ["argmax", "argmin"])
def test_arg_extreme_without_dim(name, op):
    """A flat index into the packed buffer in NJT's layout: on a transposed tensor NJT's
    ``values()`` is ``(4, T)`` (padless's is ragged-first ``(T, 4)``), and the index is NJT's."""
    for transposed in (False, True):
        pl, njt, _ = _pair(_samples(BATCHES[name]), transposed=transposed)
        _same(getattr(torch, op)(pl), getattr(torch, op)(njt))
        _same(getattr(torch, op)(pl, keepdim=True), getattr(torch, op)(njt, keepdim=True))


@pytest.mark.xfail(strict=True, reason="torch.masked builds its count from torch.ones(x.shape), the padded "
                   "envelope, in plain torch code padless never sees (README: known limits)")
def test_torch_masked_mean_without_mask_counts_only_real_rows():
    """NJT refuses ``torch.masked.mean`` (jagged layout); padless reports a strided layout, so
    torch runs it and divides by the envelope length. Tracked here until torch.masked
    dispatches to subclasses; the plain ``x.mean(dim)`` is the supported call."""
    samples = _samples([(2, 3), (4, 3)])
    x = nested.nested_tensor(samples)
    out = torch.masked.mean(x, 1)
    torch.testing.assert_close(out, torch.stack([s.mean(0) for s in samples]))
