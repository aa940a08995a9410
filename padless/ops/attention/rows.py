"""Attention where the ragged dims are not (only) the sequence dim.

:mod:`padless.ops.attention.sdpa` handles samples ``(..., L_i, E)`` whose one ragged dim is
the sequence. ``F.scaled_dot_product_attention`` on every other layout comes here
(one dispatch line at the top of :func:`padless.ops.attention.attention`), in two
families. The contract is the same: each output sample equals torch's dense SDPA on
that sample (values, structure, gradients); the output takes the query's structure.

**Ragged batch dims, static sequence** (NJT's "ragged dim is not the sequence dim",
e.g. SAM-style ``(B, j, L, E)``: samples ``(N_i, L, E)`` or ``(N_i, H, L, E)``, every
ragged dim before the last two). Each packed row is one independent ``(..., L, E)``
attention problem, so SDPA runs *once* on the packed values ``(T, ..., L, E)``: no
loop, no padding, any backend torch picks. ``attn_mask`` may be dense (one
``(..., L, S)`` mask for every sample, extent 1 at ragged dims) or a NestedTensor with
the query's rows. torch's NJT refuses masks here; otherwise results equal NJT's.

**Ragged batch dims and ragged sequence** (pair states). A Pairformer/AlphaFold pair
state ``z`` of samples ``(N_i, N_i, H, E)`` seen as ``(N_i, H, N_i, E)``
(``z.transpose(2, 3)``, a metadata change) is a batch of ``N_i`` sequences of length
``N_i``: row ``a`` of sample ``i`` attends over its ``N_i`` keys. Plain SDPA on that
layout is row attention, and a pair bias ``(N_i, N_i, H)`` permuted to ``(H, N_i, N_i)``
is a per-sample ``attn_mask`` broadcast over the rows::

    qt, kt, vt = (t.transpose(2, 3) for t in (q, k, v))        # (N_i, H, N_i, E)
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias.permute(0, 3, 1, 2))
    out = out.transpose(2, 3)                                   # (N_i, N_i, H, E)

:func:`row_attention` does exactly this, adds a key mask, and checks the shapes.
Eagerly each sample is one SDPA call on a view of its rows (rows ``a`` batched, torch's
fused CPU kernel with a 4-D mask when no mask gradient is needed, else torch's math path).
The views come from one autograd node per buffer whose backward writes every sample's
gradient once (O(T), no per-sample slice node), and the outputs are packed with one copy.
Measured against a hand-written loop over separately stored dense samples this costs one
transposing copy per tensor each way (``benchmarks/row_attention.py``). Under
``torch.compile`` the loop runs in the custom op
:func:`padless.ops.attention.rows_compiled.ragged_sdpa` (fullgraph; the row count
``sum N_i**2`` stays symbolic when the pair state comes from a batch given to
:func:`padless.prepare_for_compile`). Not under compile: dropout. Not here at all:
``mask_mod`` / ``score_mod`` (use the sequence layout for those).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from padless.ops.common import padded
from padless.ops.common.structure import call
from padless.ops.attention.rows_compiled import ragged_sdpa, sample_sdpa
from padless.tensor.layout import sample_view
from padless.tensor.autograd import rewrap, values_of
from padless.tensor.core import NestedTensor, _is_traced
from padless.tensor.errors import StructureError

_OP = "scaled_dot_product_attention"


def claims(query: Tensor, key: Tensor, value: Tensor) -> bool:
    """Whether SDPA on these inputs belongs here: all NestedTensors with a static feature dim,
    and some input's ragged dims are not exactly its sequence dim (sample dim D-2)."""
    ts = (query, key, value)
    if not all(isinstance(t, NestedTensor) for t in ts):
        return False
    if any(t.sample_dim < 2 or t.sample_dim - 1 in t._ragged for t in ts):
        return False  # no static feature dim: the sequence layout's checks name the problem
    return any(t._ragged != (t.sample_dim - 2,) for t in ts)


def _check_layout(op: str, name: str, t: NestedTensor, rank: int) -> None:
    d = t.sample_dim
    if d < 2:
        raise StructureError(f"{op}(): {name} samples must be (..., L, E), got rank {d}")
    if d != rank:
        raise StructureError(
            f"{op}(): {name} samples have rank {d}, query samples rank {rank}; give every input the same "
            "sample rank (unsqueeze a broadcast dim)"
        )


def _rows_only(t: NestedTensor) -> bool:
    """Every ragged dim is a batch dim (before the sequence and feature dims)."""
    return all(r < t.sample_dim - 2 for r in t._ragged)


def _same_rows(a: NestedTensor, b: NestedTensor) -> bool:
    """Same samples' rows (same ragged dims and extents), static extents free. Under
    tracing only the schema is compared (host data is not readable there)."""
    if a._meta is b._meta:
        return True
    if a._ragged != b._ragged or a.batch_size != b.batch_size:
        return False
    if _is_traced(a._values):
        return True
    r = list(a._ragged)
    return torch.equal(a.host_sizes()[:, r], b.host_sizes()[:, r])


def attention_rows(
    query: NestedTensor,
    key: NestedTensor,
    value: NestedTensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    mask_mod: Callable | None = None,
    score_mod: Callable | None = None,
    keep: NestedTensor | None = None,
    op: str = _OP,
) -> NestedTensor:
    """SDPA on layouts whose ragged dims are not only the sequence dim (module docstring).

    ``keep`` (internal, from :func:`row_attention`): a boolean NestedTensor whose samples
    broadcast against each sample's scores; False drops a key (combined with ``attn_mask``).
    """
    if mask_mod is not None or score_mod is not None:
        raise StructureError(
            f"{op}(): mask_mod/score_mod need samples (..., L_i, E) whose only ragged dim is the sequence; "
            f"query has ragged dims {query.ragged_dims} (pass an attn_mask NestedTensor instead)"
        )
    rank = query.sample_dim
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_layout(op, name, t, rank)
    if not (query.batch_size == key.batch_size == value.batch_size):
        raise StructureError(
            f"{op}(): batch sizes differ: query {query.batch_size}, key {key.batch_size}, value {value.batch_size}"
        )
    if (
        keep is None
        and all(_rows_only(t) for t in (query, key, value))
        and _same_rows(query, key)
        and _same_rows(key, value)
    ):
        return _packed_rows(op, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return _per_sample_layout(op, query, key, value, attn_mask, keep, dropout_p, is_causal, scale, enable_gqa)


# ---------------------------------------------------------------------------- static sequence


def _dense_mask_rows(op: str, mask: Tensor, q: NestedTensor) -> Tensor:
    """A dense mask for every sample, as a mask of the packed rows ``(1, *static)``."""
    d = q.sample_dim
    if mask.dim() <= d + 1:  # in padded coordinates: (B or 1, ..., envelope extents at ragged dims)
        aligned = (1,) * (d + 1 - mask.dim()) + tuple(mask.shape)
        ext = [aligned[1 + r] for r in q._ragged]
        if all(n in (1, q._env[r]) for n, r in zip(ext, q._ragged)) and padded.padded_extents(op, aligned, q, mask.shape):
            return padded.read_rows(op, mask, q, aligned)
    if mask.dim() > d:
        raise StructureError(
            f"{op}(): a dense attn_mask applies to every sample, so it has at most the sample rank {d} dims; "
            f"got shape {tuple(mask.shape)} (for a mask per sample pass a NestedTensor)"
        )
    m = mask.reshape((1,) * (d - mask.dim()) + tuple(mask.shape))
    bad = [r for r in q._ragged if m.shape[r] != 1]
    if bad:
        raise StructureError(
            f"{op}(): dense attn_mask of shape {tuple(mask.shape)} has extent {m.shape[bad[0]]} at the ragged "
            f"sample dim {bad[0] + 1}; a mask shared by every sample needs extent 1 there (or pass a "
            "NestedTensor mask with the query's rows)"
        )
    static = [s for s in range(d) if s not in q._ragged]
    return m.permute(list(q._ragged) + static).reshape((1, *[m.shape[s] for s in static]))


def _packed_rows(op, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> NestedTensor:
    """Every row of ``(T, ..., L, E)`` is its own attention problem: one SDPA call on the values."""
    mask = None
    if isinstance(attn_mask, NestedTensor):
        if attn_mask.sample_dim != q.sample_dim or not _same_rows(attn_mask, q):
            raise StructureError(
                f"{op}(): attn_mask must have the query's rows (ragged dims {q.ragged_dims} with the same "
                f"extents, rank {q.sample_dim}); it has ragged dims {attn_mask.ragged_dims}, rank {attn_mask.sample_dim}"
            )
        mask = values_of(attn_mask)
    elif attn_mask is not None:
        mask = _dense_mask_rows(op, attn_mask, q)
    out = F.scaled_dot_product_attention(
        values_of(q), values_of(k), values_of(v), attn_mask=mask, dropout_p=dropout_p,
        is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
    )
    return rewrap(out, q)


# ---------------------------------------------------------------------------- ragged sequence


def _fmt(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ")"


def _check_samples(op: str, q, k, v, masks: dict[str, NestedTensor], enable_gqa: bool) -> None:
    """Per-sample shape rules of SDPA, with the sample named (host sizes; eager only)."""
    hq, hk, hv = (t.host_sizes().tolist() for t in (q, k, v))
    hm = {name: m.host_sizes().tolist() for name, m in masks.items()}
    for i in range(q.batch_size):
        qs, ks, vs = hq[i], hk[i], hv[i]
        if ks[:-1] != vs[:-1]:
            raise StructureError(
                f"{op}(): sample {i}: key has shape {_fmt(ks)} and value {_fmt(vs)}; they must agree "
                "in every dim but the last"
            )
        if qs[-1] != ks[-1]:
            raise StructureError(
                f"{op}(): sample {i}: query feature size {qs[-1]} differs from key feature size {ks[-1]}"
            )
        if enable_gqa:
            continue  # head counts may differ: torch's SDPA checks them
        try:
            batch = torch.broadcast_shapes(tuple(qs[:-2]), tuple(ks[:-2]))
        except RuntimeError:
            raise StructureError(
                f"{op}(): sample {i}: query {_fmt(qs)} and key {_fmt(ks)} have batch dims that do not broadcast"
            ) from None
        scores = (*batch, qs[-2], ks[-2])
        for name, sizes in hm.items():
            ms = tuple(sizes[i])
            try:
                ok = torch.broadcast_shapes(ms, scores) == torch.Size(scores)
            except RuntimeError:
                ok = False
            if not ok:
                raise StructureError(
                    f"{op}(): {name} sample {i} has shape {_fmt(ms)}, which does not broadcast to that "
                    f"sample's attention scores {_fmt(scores)} (query {_fmt(qs)}, key {_fmt(ks)})"
                )


def _per_sample_layout(op, q, k, v, attn_mask, keep, dropout_p, is_causal, scale, enable_gqa) -> NestedTensor:
    dense_mask = None
    if attn_mask is not None and not isinstance(attn_mask, NestedTensor):
        if _is_traced(q._values):
            raise StructureError(
                f"{op}(): with a ragged sequence dim (query ragged dims {q.ragged_dims}) under torch.compile "
                f"attn_mask must be a NestedTensor of per-sample masks; a dense mask of shape "
                f"{tuple(attn_mask.shape)} in padded coordinates is read eagerly only (e.g. a pair bias: "
                "bias.permute(0, 3, 1, 2), samples (H, N_i, N_i))"
            )
        dense_mask, attn_mask = _dense_masks(op, attn_mask, q, k), None
    masks = {name: m for name, m in (("attn_mask", attn_mask), ("key mask", keep)) if m is not None}
    for name, m in masks.items():
        if m.batch_size != q.batch_size:
            raise StructureError(f"{op}(): {name} has {m.batch_size} samples, query {q.batch_size}")
    if _is_traced(q._values):
        if dropout_p > 0.0:
            raise ValueError(
                f"{op}(): dropout_p > 0 with ragged batch dims (query ragged dims {q.ragged_dims}) is eager "
                "only; under torch.compile apply dropout to the output or the probabilities' input instead"
            )
        return rewrap(_traced(q, k, v, attn_mask, keep, is_causal, scale, enable_gqa), q)
    _check_samples(op, q, k, v, masks, enable_gqa)
    return rewrap(_eager(q, k, v, attn_mask, keep, dropout_p, is_causal, scale, enable_gqa, dense_mask), q)


def _dense_masks(op: str, mask: Tensor, q: NestedTensor, k: NestedTensor) -> list[Tensor]:
    """A dense mask in padded coordinates ``(B or 1, *score envelope)`` as per-sample views:
    sample i reads its own window (:func:`padless.ops.common.padded.dense_samples`)."""
    hq, hk = q.host_sizes().tolist(), k.host_sizes().tolist()
    d = q.sample_dim
    extents = [hq[i][:-1] + [hk[i][-2]] for i in range(q.batch_size)]
    envelope = list(q._env[:-1]) + [k._env[-2]]
    ragged = [j for j in range(d - 1) if j in q._ragged] + ([d - 1] if d - 2 in k._ragged else [])
    return padded.dense_samples(op, "attn_mask", mask, extents, envelope, ragged, q)


class _SampleViews(torch.autograd.Function):
    """Every sample of a packed buffer as a dense view (sample dim order). The backward writes
    each sample's gradient into one buffer, one copy per sample (a split's backward would copy
    twice: the permuted gradient is made contiguous, then concatenated); O(T) either way."""

    @staticmethod
    def forward(ctx, values: Tensor, offsets: list[int], shapes: list[list[int]], order: tuple[int, ...]):  # type: ignore[override]
        ctx.meta = (values.shape, offsets, shapes, order)
        return tuple(sample_view(values[offsets[i]:offsets[i + 1]], s, order) for i, s in enumerate(shapes))

    @staticmethod
    def backward(ctx, *grads: Tensor | None):  # type: ignore[override]
        shape, offsets, shapes, order = ctx.meta
        like = next((g for g in grads if g is not None), None)
        if like is None:
            return None, None, None, None
        buf = like.new_empty(shape)
        for i, (g, s) in enumerate(zip(grads, shapes)):
            view = sample_view(buf[offsets[i]:offsets[i + 1]], s, order)
            if g is None:
                view.zero_()
            else:
                view.copy_(g)
        return buf, None, None, None


class _PackRows(torch.autograd.Function):
    """Dense output samples written once into the packed rows of the query's layout; the
    backward hands each sample a view of the gradient rows (no copy)."""

    @staticmethod
    def forward(ctx, shape: tuple[int, ...], offsets: list[int], order: tuple[int, ...], *samples: Tensor):  # type: ignore[override]
        out = samples[0].new_empty(shape)
        for i, s in enumerate(samples):
            sample_view(out[offsets[i]:offsets[i + 1]], s.shape, order).copy_(s)
        ctx.meta = (offsets, order, [s.shape for s in samples])
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        offsets, order, shapes = ctx.meta
        views = [sample_view(grad[offsets[i]:offsets[i + 1]], s, order) for i, s in enumerate(shapes)]
        return (None, None, None, *views)


def _eager(q, k, v, attn_mask, keep, dropout_p, is_causal, scale, enable_gqa, dense_mask=None) -> Tensor:
    """One SDPA call per sample on views of its rows (rows of a pair sample are its batch)."""
    cache: dict[int, tuple[Tensor, ...]] = {}

    def samples(t):
        if t is None:
            return None
        if id(t) not in cache:  # q is k is v (self-attention): one set of views, one gradient buffer
            cache[id(t)] = _SampleViews.apply(
                values_of(t), t.host_offsets().tolist(), t.host_sizes().tolist(), t.storage_order
            )
        return cache[id(t)]

    qs, ks, vs, ms, kp = samples(q), samples(k), samples(v), samples(attn_mask), samples(keep)
    if dense_mask is not None:
        ms = dense_mask
    outs = [
        sample_sdpa(
            qs[i], ks[i], vs[i], None if ms is None else ms[i], None if kp is None else kp[i],
            dropout_p, is_causal, scale, enable_gqa,
        )
        for i in range(q.batch_size)
    ]
    qv = q._values
    shape = (qv.shape[0], *qv.shape[1:-1], v._values.shape[-1])
    if not outs:
        return qv.new_empty(shape)
    return _PackRows.apply(shape, q.host_offsets().tolist(), q.storage_order, *outs)


def _traced(q, k, v, attn_mask, keep, is_causal, scale, enable_gqa) -> Tensor:
    """Under torch.compile: the per-sample loop as one custom op (symbolic row counts)."""
    ts = [t for t in (q, k, v, attn_mask, keep) if t is not None]
    orders = [d for t in ts for d in t.storage_order]
    return ragged_sdpa(
        values_of(q), values_of(k), values_of(v),
        None if attn_mask is None else values_of(attn_mask), None if keep is None else keep._values,
        [t._offsets for t in ts], [t._sizes for t in ts], orders, is_causal, scale, enable_gqa,
    )


# ---------------------------------------------------------------------------- public API


def _check_pair(op: str, name: str, t: Tensor, rank: int, what: str) -> None:
    if not isinstance(t, NestedTensor):
        raise TypeError(f"{op}(): {name} must be a NestedTensor of {what} samples, got a dense {type(t).__name__}")
    if t.sample_dim != rank or set(t._ragged) != {0, 1}:
        raise StructureError(
            f"{op}(): {name} must have {what} samples (ragged sample dims (0, 1)); got rank {t.sample_dim} "
            f"with ragged sample dims {t.ragged_dims}"
        )


def row_attention(
    query: NestedTensor,
    key: NestedTensor,
    value: NestedTensor,
    bias: NestedTensor | None = None,
    key_mask: NestedTensor | None = None,
    scale: float | None = None,
) -> NestedTensor:
    """Row-wise attention over a pair state (AlphaFold/Pairformer "triangle attention").

    Samples are pair states ``(N_i, N_i, H, E)`` (value: ``(N_i, N_i, H, Ev)``). For every
    sample ``i``, row ``a`` and head ``h``, query position ``b`` attends over the keys
    ``c < N_i`` of the same row::

        out[a, b, h] = softmax_c(q[a, b, h] . k[a, c, h] * scale + bias[b, c, h]) @ v[a, c, h]

    * ``bias``: NestedTensor ``(N_i, N_i, H)``, shared by every row ``a`` (typically
      ``bias = linear(pair)``); differentiable.
    * ``key_mask``: boolean NestedTensor, ``(N_i,)`` (key ``c`` is dropped for every row)
      or ``(N_i, N_i)`` (AlphaFold's pair mask: key ``c`` is dropped in row ``a`` where
      ``key_mask[a, c]`` is False). A query whose keys are all dropped gets zeros, as
      torch's SDPA gives for a fully masked row.

    Column ("ending node") attention is the same call on transposed pairs:
    ``row_attention(q.transpose(1, 2), ...).transpose(1, 2)`` (metadata changes only).
    Equal to ``F.scaled_dot_product_attention`` on each dense sample transposed to
    ``(N_i, H, N_i, E)`` with ``attn_mask = bias.permute(2, 0, 1)`` (module docstring).
    Compiles with ``fullgraph=True`` (see :mod:`padless.ops.attention.rows_compiled`).

    Example (``N = 3, 2``, one head)::

        x = padless.from_list([torch.randn(n, 8) for n in (3, 2)])
        pair = x.unsqueeze(2) + x.unsqueeze(1)                # (N_i, N_i, 8): 9 + 4 rows
        q = pair.unflatten(-1, (1, 8))                        # (N_i, N_i, 1, 8)
        out = padless.ops.row_attention(q, q, q, bias=pair[..., :1])   # (N_i, N_i, 1, 8)
    """
    args = tuple(t for t in (query, key, value, bias, key_mask) if t is not None)
    if not any(isinstance(t, NestedTensor) for t in args):
        raise TypeError(
            "row_attention(): query, key and value must be NestedTensors of (N_i, N_i, H, E) pair samples, got "
            f"{type(query).__name__}, {type(key).__name__}, {type(value).__name__}"
        )
    # as NestedTensor.__torch_function__ runs a handler: torch-function dispatch off
    with torch._C.DisableTorchFunctionSubclass():
        return row_attention_nested(query, key, value, bias, key_mask, scale)


# torch.compile puts the call in its graph whole (as it does with F.scaled_dot_product_attention) and
# AOTAutograd runs it on fake NestedTensors: Dynamo itself cannot trace the autograd bridges on
# NestedTensors made inside the graph (their envelopes are SymInts it has no source for).
row_attention = torch.compiler.allow_in_graph(row_attention)


def row_attention_nested(
    query: NestedTensor,
    key: NestedTensor,
    value: NestedTensor,
    bias: NestedTensor | None = None,
    key_mask: NestedTensor | None = None,
    scale: float | None = None,
) -> NestedTensor:
    """:func:`row_attention` on NestedTensors (the handler behind the public function)."""
    op = "row_attention"
    _check_pair(op, "query", query, 4, "(N_i, N_i, H, E)")
    _check_pair(op, "key", key, 4, "(N_i, N_i, H, E)")
    _check_pair(op, "value", value, 4, "(N_i, N_i, H, Ev)")
    traced = _is_traced(query._values)
    if bias is not None:
        _check_pair(op, "bias", bias, 3, "(N_i, N_i, H)")
        if bias.batch_size != query.batch_size:
            raise StructureError(f"{op}(): bias has {bias.batch_size} samples, query {query.batch_size}")
        if not traced:
            _check_bias(op, bias, query)
    keep = None
    if key_mask is not None:
        keep = _keep_from(op, key_mask, query, traced)
    # (N, N, H, E) -> (N, H, N, E): storage order only. Handlers run with torch-function
    # dispatch off, so the rows family's shape handlers are reached through the registry.
    t = torch.transpose
    out = attention_rows(
        call(t, query, 2, 3), call(t, key, 2, 3), call(t, value, 2, 3),
        None if bias is None else call(torch.permute, bias, 0, 3, 1, 2), scale=scale, keep=keep, op=op,
    )
    return call(t, out, 2, 3)


def _check_bias(op: str, bias: NestedTensor, q: NestedTensor) -> None:
    hq, hb = q.host_sizes().tolist(), bias.host_sizes().tolist()
    for i, (qs, bs) in enumerate(zip(hq, hb)):
        want = (qs[0], qs[1], qs[2])
        if tuple(bs) != want:
            raise StructureError(
                f"{op}(): bias sample {i} has shape {_fmt(bs)}, expected (N_i, N_i, H) = {_fmt(want)} "
                f"(query sample {i} is {_fmt(qs)}); one additive bias per (query, key) position and head, "
                "shared by every row, e.g. bias = linear(pair) with out_features = H"
            )


def _keep_from(op: str, key_mask: NestedTensor, q: NestedTensor, traced: bool) -> NestedTensor:
    """The key mask as a NestedTensor broadcasting against each sample's ``(N, H, N, N)`` scores."""
    if not isinstance(key_mask, NestedTensor) or key_mask.dtype != torch.bool:
        raise TypeError(
            f"{op}(): key_mask must be a boolean NestedTensor of (N_i,) or (N_i, N_i) samples, got "
            f"{type(key_mask).__name__} of dtype {key_mask.dtype}"
        )
    if key_mask.batch_size != q.batch_size:
        raise StructureError(f"{op}(): key_mask has {key_mask.batch_size} samples, query {q.batch_size}")
    d = key_mask.sample_dim
    if d not in (1, 2) or set(key_mask._ragged) != set(range(d)):
        raise StructureError(
            f"{op}(): key_mask samples must be (N_i,) or (N_i, N_i) with every dim ragged; got rank {d} "
            f"with ragged dims {key_mask.ragged_dims}"
        )
    if not traced:
        hq, hm = q.host_sizes().tolist(), key_mask.host_sizes().tolist()
        for i, (qs, ms) in enumerate(zip(hq, hm)):
            if any(m != qs[0] for m in ms):
                raise StructureError(
                    f"{op}(): key_mask sample {i} has shape {_fmt(ms)}, expected ({qs[0]},) or ({qs[0]}, {qs[0]}) "
                    f"(query sample {i} is {_fmt(qs)})"
                )
    # (N,) broadcasts against the keys as it is; (N_rows, N_keys) -> (N_rows, 1, 1, N_keys)
    if d == 1:
        return key_mask
    return call(torch.unsqueeze, call(torch.unsqueeze, key_mask, 2), 2)
