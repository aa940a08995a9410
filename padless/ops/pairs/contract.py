"""Contractions: ``matmul`` / ``@``, ``bmm`` and ``einsum`` on NestedTensors.

* NestedTensor ``@`` dense weight (contracting a static trailing dim) runs once on
  ``values`` (one GEMM for the whole batch); so does dense ``@`` NestedTensor when
  the contracted dim is static.
* NestedTensor ``@`` NestedTensor (``q @ k.transpose(-1, -2)`` giving ``(Q_i, K_i)``,
  ``attn @ v``, triangle products) contracts a ragged dim whose extent differs per
  sample. There is no segmented GEMM in torch, so on CUDA one grouped-GEMM launch runs
  it (:mod:`padless.ops.pairs.grouped`); otherwise samples of similar size share padded
  buckets and one dense call runs per bucket (:mod:`padless.ops.pairs.bucketed`: at most
  four calls whatever the batch size). The per-sample loop on views of ``values`` is
  the fallback (under ``torch.compile``, or ragged extents that broadcast).
* ``einsum`` whose product is no larger than its largest operand (outer products
  ``bic,bjc->bijc``, ``bijc,bjc->bic``, ...) is computed as pair broadcasting plus
  a segmented sum; other equations (triangle multiplication ``bikc,bjkc->bijc``,
  ``bihd,bjhd->bhij``) contract as above.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor


from padless.ops.common import partners
from padless.ops.pairs import bucketed, grouped
from padless.ops.common.structure import STATIC, call, keep_all, restructure, values_dim
from padless.tensor import layout
from padless.tensor.autograd import nested_from_values, rewrap, values_of
from padless.tensor.construct import from_list
from padless.tensor.convert import unbind_samples
from padless.ops.pairs.einsum_forms import einsum_with_dense, expand_ellipsis
from padless.ops.pairs.triangle import eager_pair_einsum, traced_pair_einsum
from padless.ops.pairs.traced import traced_einsum, traced_matmul
from padless.ops.pairs import traced_softmax  # noqa: F401  (registers the compiled softmax island)
from padless.tensor.core import NestedTensor, _fmt_shape, _is_traced
from padless.tensor.registry import implements
from padless.tensor.errors import StructureError


def per_sample(
    op: str, fn: Callable[..., Tensor], operands: Sequence[NestedTensor], out_ragged: tuple[int, ...]
) -> NestedTensor:
    """Run ``fn`` on every sample (dense views, differentiable) and pack the results."""
    b = operands[0].batch_size
    for o in operands[1:]:
        if o.batch_size != b:
            raise StructureError(f"{op}(): batch sizes differ: {b} vs {o.batch_size}")
    per_op = [unbind_samples(o) for o in operands]
    outs = [fn(*[s[i] for s in per_op]) for i in range(b)]
    if not outs:
        raise StructureError(f"{op}(): empty batch")
    if _is_traced(operands[0]._values):
        return from_list(outs, ragged_dims=out_ragged, keep_history=True)
    # The result's structure is cached on the first operand's metadata, keyed by the partners'
    # structures and the per-sample result shapes: the same op on the same batch gets the same
    # structure object back, so whatever was derived from it last time (softmax groups,
    # broadcast plans) is reused; a deep stack builds its index maps once per batch, not once
    # per layer, and packs with one cat.
    key = (out_ragged, tuple(tuple(int(n) for n in o.shape) for o in outs))
    partners_ = [o._meta for o in operands[1:]]
    hit = partners.get(operands[0]._meta, "per_sample_out", key, partners_)
    if hit is None:
        res = from_list(outs, ragged_dims=out_ragged, keep_history=True)
        if res._meta.host_sizes is not None:
            partners.put(operands[0]._meta, "per_sample_out", key, partners_,
                         (res._offsets, res._sizes, res._meta, res._ragged, tuple(res._env)), PER_SAMPLE_CACHE_SIZE)
        return res
    offsets, sizes, meta, ragged, env = hit
    order = layout.storage_order(outs[0].dim(), ragged)
    static = [env[d] for d in order[len(ragged):]]
    rows = [o.permute(order).reshape(-1, *static) for o in outs]
    return nested_from_values(torch.cat(rows) if len(rows) > 1 else rows[0], offsets, sizes, ragged, env, meta)


PER_SAMPLE_CACHE_SIZE = 16
"""Result structures one structure keeps for its latest contraction partners (LRU; the partners
are referenced weakly, see :mod:`padless.ops.common.partners`)."""

CHECKED_SIZE = 16
"""Partner sets one structure remembers as checked by :func:`check_contraction` (LRU; weakly)."""


def check_contraction(
    op: str, operands: Sequence[NestedTensor], dims: Sequence[Sequence[int | None]], ones_broadcast: bool = False
) -> None:
    """Raise :class:`StructureError` unless, in every sample, the sample dims contracted together
    (``dims[k][j]``: operand ``j``'s dim for contraction ``k``, or None) have one extent
    (``ones_broadcast``: or extent 1, as einsum allows).

    A mismatch here is a structure mismatch (the lengths of sample ``i`` differ), named by
    sample, instead of the per-sample shape error torch would raise. Under compile sizes are
    runtime data and the per-sample op checks them."""
    if any(_is_traced(o._sizes) for o in operands) or any(o.batch_size != operands[0].batch_size for o in operands):
        return
    # checked before for these structures (a deep stack checks once); the partners are held
    # weakly, so a long-lived operand met by a new structure every step keeps none of them
    key = (tuple(tuple(g) for g in dims), ones_broadcast)
    others = [o._meta for o in operands]  # the first operand too: it may appear again as a partner
    if partners.get(operands[0]._meta, "contraction_checked", key, others) is not None:
        return
    hs = [o.host_sizes() for o in operands]
    for group in dims:
        cols = [hs[j][:, d] for j, d in enumerate(group) if d is not None]
        for c in cols[1:]:
            clash = c != cols[0]
            if ones_broadcast:
                clash &= (c != 1) & (cols[0] != 1)
            bad = clash.nonzero()
            if len(bad):
                i = int(bad[0, 0])
                shapes = ", ".join(_fmt_shape(h[i].tolist()) for h in hs)
                raise StructureError(
                    f"{op}(): ragged structures differ: sample {i} contracts dims of extents "
                    f"{int(cols[0][i])} and {int(c[i])} (sample shapes {shapes})"
                )
    partners.put(operands[0]._meta, "contraction_checked", key, others, True, CHECKED_SIZE)


def _ragged_set(nt: NestedTensor) -> set[int]:
    return set(nt._ragged)


def _matmul_nested_dense(op: str, a: NestedTensor, w: Tensor) -> Tensor:
    """Contract a's last sample dim (static) with a dense matrix or vector."""
    d = a.sample_dim - 1
    if d in a._ragged:
        raise StructureError(
            f"{op}(): the contracted dim (last of the NestedTensor) is ragged; multiply by another "
            "NestedTensor with the same ragged extent, or transpose the static features last"
        )
    if w.dim() > 2 and w.dim() == a.dim():
        return _matmul_nested_batched_dense(op, a, w)
    if w.dim() > 2:
        raise ValueError(
            f"{op}(): a dense right operand must be 1-D, 2-D, or batched with one matrix per sample "
            f"(as many dims as the NestedTensor, {a.dim()}), got shape {tuple(w.shape)}"
        )
    vals = values_of(a)
    vd = values_dim(a, d)
    moved = vals.movedim(vd, -1) if vd != vals.dim() - 1 else vals
    out = moved @ w
    if w.dim() == 1:
        dims = [spec for p, spec in enumerate(keep_all(a)) if p != d]
        return restructure(a, out, dims)
    if vd != vals.dim() - 1:
        out = out.movedim(-1, vd)
    return rewrap(out, a)


def _matmul_nested_batched_dense(op: str, a: NestedTensor, w: Tensor) -> NestedTensor:
    """NestedTensor ``(B, j, D)`` @ batched dense ``(B, D, E)``: ``sample_i @ w[i]`` (NJT's
    NestedTensor x dense case), one matmul per sample on views of ``values``; a dense batch
    dim of 1 applies ``w[0]`` to every sample."""
    if w.shape[0] not in (a.batch_size, 1):
        raise StructureError(
            f"{op}(): a dense right operand with {w.dim()} dims is batched: its dim 0 ({w.shape[0]}) must be "
            f"the NestedTensor's batch size ({a.batch_size}) or 1; use a 2-D matrix to apply one to every sample"
        )
    outs = [s @ w[i if w.shape[0] > 1 else 0] for i, s in enumerate(unbind_samples(a))]
    if not outs:
        raise StructureError(f"{op}(): empty batch")
    return from_list(outs, ragged_dims=a.ragged_dims, keep_history=True)


def _matmul_dense_nested(op: str, w: Tensor, b: NestedTensor) -> Tensor:
    """Dense matrix @ NestedTensor contracting b's second-to-last sample dim (static)."""
    if b.sample_dim < 2:
        raise StructureError(f"{op}(): dense @ NestedTensor needs samples of rank >= 2 (got rank {b.sample_dim})")
    d = b.sample_dim - 2
    if w.dim() == 3 and b.sample_dim == 2 and d not in b._ragged:
        return _matmul_batched_dense_nested(op, w, b)
    if d in b._ragged or w.dim() != 2:
        raise StructureError(
            f"{op}(): dense @ NestedTensor contracts the second-to-last sample dim, which must be "
            f"static, with a 2-D matrix (dim {d + 1} ragged: {d in b._ragged}, matrix shape {tuple(w.shape)})"
        )
    vals = values_of(b)
    vd = values_dim(b, d)
    out = torch.movedim(torch.matmul(vals.movedim(vd, -1), w.transpose(0, 1)), -1, vd)
    dims = keep_all(b)
    dims[d] = (STATIC, w.shape[0])
    return restructure(b, out, dims)


def _matmul_batched_dense_nested(op: str, w: Tensor, b: NestedTensor) -> NestedTensor:
    """Batched dense ``(B, F, E)`` @ NestedTensor ``(B, E, j)``: ``w[i] @ sample_i`` (NJT's
    dense x NJT case), one matmul per sample on views of ``values``."""
    if w.shape[0] != b.batch_size:
        raise StructureError(
            f"{op}(): a 3-D dense left operand is batched: its dim 0 ({w.shape[0]}) must be the "
            f"NestedTensor's batch size ({b.batch_size}); use a 2-D matrix to apply one to every sample"
        )
    outs = [w[i] @ s for i, s in enumerate(unbind_samples(b))]
    if not outs:
        raise StructureError(f"{op}(): empty batch")
    return from_list(outs, ragged_dims=b.ragged_dims, keep_history=True)


def _matmul_out_ragged(a: NestedTensor, b: NestedTensor) -> tuple[int, ...]:
    """Ragged dims of matmul(a, b) per sample: broadcast batch dims, then M (from a), N (from b)."""
    ra, rb = a.sample_dim, b.sample_dim
    if ra < 2 or rb < 2:
        raise StructureError(f"matmul(): NestedTensor @ NestedTensor needs samples of rank >= 2 (got {ra}, {rb})")
    n = max(ra, rb)
    ragged = set()
    for d in range(n - 2):
        da, db = d - (n - ra), d - (n - rb)
        if (da >= 0 and da in a._ragged) or (db >= 0 and db in b._ragged):
            ragged.add(d)
    if ra - 2 in a._ragged:
        ragged.add(n - 2)
    if rb - 1 in b._ragged:
        ragged.add(n - 1)
    return tuple(sorted(ragged))


@implements(torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, accepts="packed or dense operands")
def matmul(func, a=None, b=None, **kwargs) -> Tensor:
    """``a @ b`` with NestedTensor operands (see module docstring for the three cases);
    torch's keywords ``input=``/``other=`` are accepted."""
    a, b = kwargs.pop("input", a), kwargs.pop("other", b)
    if kwargs:
        raise TypeError(f"matmul(): unexpected keyword arguments {sorted(kwargs)}")
    if func is torch.Tensor.__rmatmul__:
        a, b = b, a
    na, nb = isinstance(a, NestedTensor), isinstance(b, NestedTensor)
    if na and not nb:
        return _matmul_nested_dense("matmul", a, b)
    if nb and not na:
        return _matmul_dense_nested("matmul", a, b)
    out_ragged = _matmul_out_ragged(a, b)
    if _is_traced(a._values) or _is_traced(b._values):  # compiled: the eager handler as one opaque op
        return traced_matmul("matmul", a, b, out_ragged)
    check_contraction("matmul", [a, b], [[a.sample_dim - 1, b.sample_dim - 2]])
    fused = grouped.matmul_nested(a, b)  # one Triton launch on CUDA (kernels.dispatch), else None
    if fused is not None:
        return fused
    batched = bucketed.matmul(a, b)  # a few dense calls over padded buckets of similar samples
    if batched is not None:
        return batched
    if a.sample_dim == 3 == b.sample_dim:  # (C, N_i, N_i) @ (C, N_i, N_i): permuted pair states
        tri = eager_pair_einsum(["zhmk", "zhkn"], "zhmn", [a, b])
        if tri is not None:
            return tri
    return per_sample("matmul", torch.matmul, [a, b], out_ragged)


@implements(torch.bmm, torch.Tensor.bmm)
def bmm(func, a: NestedTensor | None = None, b: NestedTensor | None = None, **kwargs) -> Tensor:
    """Batched matmul of ``(B, n_i, m_i)`` by ``(B, m_i, p_i)``: sample by sample (torch's
    keywords ``input=``/``mat2=`` are accepted)."""
    a, b = kwargs.pop("input", a), kwargs.pop("mat2", b)
    if kwargs:
        raise TypeError(f"bmm(): unexpected keyword arguments {sorted(kwargs)}")
    if isinstance(a, NestedTensor) and a.sample_dim == 2 and isinstance(b, Tensor) and not isinstance(b, NestedTensor):
        if b.dim() != 3:
            raise StructureError(f"bmm(): mat2 must be 3-D (one matrix per sample), got shape {tuple(b.shape)}")
        return _matmul_nested_batched_dense("bmm", a, b)
    for x in (a, b):
        if not isinstance(x, NestedTensor) or x.sample_dim != 2:
            raise StructureError(
                "bmm(): expects a NestedTensor with 2-D samples and, as mat2, another such NestedTensor or a "
                "dense (B, m, p) tensor (use matmul for other ranks)"
            )
    if _is_traced(a._values) or _is_traced(b._values):
        return traced_matmul("bmm", a, b, _matmul_out_ragged(a, b))
    check_contraction("bmm", [a, b], [[1, 0]])
    batched = bucketed.matmul(a, b)
    if batched is not None:
        return batched
    return per_sample("bmm", torch.mm, [a, b], _matmul_out_ragged(a, b))


# ---------------------------------------------------------------------------- einsum


def _parse(equation: str, n_operands: int) -> tuple[list[str], str]:
    eq = equation.replace(" ", "")
    if "->" not in eq:
        raise ValueError("einsum(): give the output explicitly (an equation with '->')")
    lhs, out = eq.split("->")
    ins = lhs.split(",")
    if len(ins) != n_operands:
        raise ValueError(f"einsum(): equation {equation!r} has {len(ins)} operands, got {n_operands}")
    return ins, out


@implements(torch.einsum, accepts="packed operands sharing a leading batch index; dense operands beside one; ellipsis")
def einsum(func, equation: str, *operands) -> Tensor:
    """einsum over NestedTensors whose first index is the batch index in every operand and the output
    (an ellipsis is spelled out first; dense operands beside one NestedTensor run on its rows:
    :mod:`padless.ops.pairs.einsum_forms`)."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    equation, operands = expand_ellipsis(equation, operands)  # "... i d, ... j d -> ... i j": letters
    ins, out = _parse(equation, len(operands))
    if not all(isinstance(o, NestedTensor) for o in operands):  # dense weights: once on the rows
        return einsum_with_dense(ins, out, operands, equation)
    batch = ins[0][0]
    if any(s[0] != batch for s in ins) or not out or out[0] != batch:
        raise ValueError(
            f"einsum(): {equation!r}: the first index must be the batch index in every operand and the output"
        )
    for s, o in zip(ins, operands):
        if len(s) != o.dim():
            raise StructureError(f"einsum(): operand {s!r} has {len(s)} indices but the NestedTensor has {o.dim()} dims")
    ragged_letters = {s[1 + d] for s, o in zip(ins, operands) for d in o._ragged}
    summed = [c for c in dict.fromkeys("".join(ins)) if c not in out]
    order = list(out) + summed
    largest = max(len(set(s)) for s in ins)
    if not summed or len(order) <= largest:
        return _einsum_broadcast(ins, out, summed, order, operands)
    out_ragged = tuple(i for i, c in enumerate(out[1:]) if c in ragged_letters)
    letters = dict.fromkeys("".join(s[1:] for s in ins))
    check_contraction("einsum", operands, [[s.index(c, 1) - 1 if c in s[1:] else None for s in ins] for c in letters], True)
    if _is_traced(operands[0]._values):  # compiled: triangle products as one custom op
        traced = traced_pair_einsum(ins, out, operands)
        if traced is not None:
            return traced
        return traced_einsum(ins, out, operands)  # the eager handler as one opaque op
    if len(operands) == 2:
        fused = grouped.contract_nested(operands[0], ins[0][1:], operands[1], ins[1][1:], out[1:])
        if fused is not None:
            return fused
    # a few dense calls over padded buckets of similar samples (op count independent of B)
    batched = bucketed.contract([s[1:] for s in ins], out[1:], operands)
    if batched is not None:
        return batched
    if len(operands) == 2 and not _is_traced(operands[0]._values):
        tri = eager_pair_einsum(ins, out, operands)
        if tri is not None:
            return tri
    sample_eq = ",".join(s[1:] for s in ins) + "->" + out[1:]
    return per_sample("einsum", lambda *xs: torch.einsum(sample_eq, *xs), operands, out_ragged)


def _einsum_broadcast(ins, out, summed, order, operands) -> Tensor:
    """Product by broadcasting (creating pair axes as needed), then a segmented sum."""
    prod = None
    for s, o in zip(ins, operands):
        # Move this operand's indices into the global order, inserting singleton dims.
        # (Handlers run with torch-function dispatch off, so call sibling handlers directly.)
        present = [c for c in order if c in s]
        x = call(torch.permute, o, [s.index(c) for c in present]) if present != list(s) else o
        for pos, c in enumerate(order):
            if c not in s:
                x = call(torch.unsqueeze, x, pos)
        prod = x if prod is None else prod * x
    if summed:
        prod = call(torch.sum, prod, dim=tuple(range(len(out), len(order))))
    return prod
