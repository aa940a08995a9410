"""Attention on packed rows: ``F.scaled_dot_product_attention`` with NestedTensors.

Query, key and value are NestedTensors whose samples are ``(..., L_i, E)`` with the
sequence dim ragged (``(H, L_i, E)`` is the usual multi-head form; ``(L_i, H, E)``
becomes it with ``.transpose(1, 2)``, a metadata change). Key/value may have another
ragged structure than the query (cross-attention, same batch size); the output takes
the query's structure. Both are stored as ``(T, H, E)`` rows: exactly the packed
layout variable-length kernels take, so no copy is made to call them.

Backends, chosen at call time (``explain(...)`` says which one runs and why the
others were skipped; ``PADLESS_DEBUG_ATTENTION=1`` logs every choice):

* ``flash_attn`` / ``varlen`` (CUDA, fp16/bf16): ``flash_attn_varlen_func`` when
  flash-attn is installed, else ``torch.nn.attention.varlen.varlen_attn``, with
  int32 ``cu_seqlens`` and python-int ``max_seqlen`` from the host metadata (no sync).
  Not used for masks, for causal attention with ``L_q != L_k`` in some sample (these
  kernels align causal masks bottom-right; torch's ``is_causal`` is top-left), nor
  (``varlen``) with dropout.
* ``flex``: FlexAttention over all rows with a document mask built from per-row
  sample ids, plus the user's ``mask_mod`` / ``score_mod`` written in sample-local
  indices. Chosen when a ``mask_mod``/``score_mod`` is given, or on CUDA for what the
  varlen kernels cannot express (use it under ``torch.compile``; eager flex is a
  slow reference).
* ``runs`` (eager; the CPU, or any device with a mask): samples that come in runs of equal
  lengths, as a pair state folded into the batch does (``z.reshape(B * N, N, d)``: parent
  ``b`` gives ``N_b`` consecutive samples of length ``N_b``), attend once per run on views of
  the rows, a per-row repeated bias read from its source (:mod:`~padless.ops.attention.runs`).
* ``per_sample`` (any device, any dtype): torch's SDPA on each sample's rows (views
  of ``values`` with unit leading dims, so torch's fused CPU kernel runs), no padded
  position computed. The samples come from one ``torch.split`` of each buffer
  (:func:`padless.tensor.autograd.split_rows`), so the backward writes every sample's
  gradient once, O(T) (per-sample slices cost a zero-filled buffer of all T rows per
  sample: O(B x T)). Without mods or dropout, samples sharing one (query, key) length
  pair run as one batched ``(G, H, L, E)`` SDPA call (a ``torch.stack`` of their views:
  exact lengths, nothing padded, each sample's own dense SDPA; their masks, when of one
  shape, stacked the same way: the rows of a pair state folded into the batch, each with
  its sample's bias, run as one call per length instead of one per row); dropout stays
  per sample so the RNG stream matches a loop over samples. Self-attention batches of
  many short samples (where one call's fixed cost outweighs its scores: a d=128 layer at
  B=64, lengths 4..64) run in length buckets instead (:mod:`~padless.ops.attention.buckets`:
  a few ``(G, H, L_b, E)`` calls padded to each bucket's longest with a key mask, chosen by
  a cost model once per structure; padded query rows are dropped, padded keys masked, so
  values and gradients are each sample's own). The host plan of either path (offsets,
  groups, buckets and their gather indices) is built once per structure and cached on it, so
  every layer of a stack reuses it. Measured on this project's
  2-core CPU, B=16, H=4, E=64, lengths U[16, 256], SDPA forward + backward (``python
  benchmarks/attention_cpu.py``, one run, before the split): per-sample 32.4 ms, padded
  with a key mask 37.6 ms, one block-diagonal SDPA over all rows 515 ms (it computes
  every cross-sample score). FlexAttention has no
  CPU backward in torch 2.13; forward only, compiled FlexAttention with the document
  mask takes 23.9 ms (after a 10.7 s compile) where per-sample takes 8.4 ms
  (``--flex-compiled``), and eager flex is a dense reference (28.7 ms on 4 samples vs
  1.2 ms). Per-sample is therefore the CPU default. Groups of similar (not equal)
  lengths padded to the group's longest were measured slower than this on U[16, 256]
  and U[4, 64] batches, and would compute padded positions, which this path never does.

Semantics (identical to dense SDPA on each sample): a sample with zero keys and some
queries gets zeros (and zero gradients), as torch's SDPA does for an empty key set;
``is_causal`` is aligned top-left as in torch (query i sees keys ``j <= i``) even
when ``L_q != L_k``; ``attn_mask`` is a NestedTensor of per-sample ``(L_i, S_i)``
(or ``(H, L_i, S_i)``) boolean or additive masks.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from padless.ops.attention import sdpa_compiled as attention_compiled
from padless.ops.attention import buckets
from padless.ops.attention import runs
from padless.ops.attention import rows as attention_rows
from padless.ops.common import padded
from padless.tensor.autograd import rewrap, split_rows, values_of
from padless.tensor.convert import unbind_samples
from padless.tensor.core import NestedTensor, _is_traced, _structure_mismatch
from padless.tensor.errors import StructureError
from padless.tensor.registry import implements

log = logging.getLogger("padless.attention")
_DEBUG = os.environ.get("PADLESS_DEBUG_ATTENTION", "") not in ("", "0")


@dataclasses.dataclass
class Choice:
    """Which backend runs, and why each other one was skipped."""

    backend: str
    skipped: dict[str, str]

    def __str__(self) -> str:
        why = "; ".join(f"{k}: {v}" for k, v in self.skipped.items())
        return f"padless attention backend={self.backend} (skipped: {why or 'none'})"


last_choice: Choice | None = None


def _seq_dim(op: str, nt: NestedTensor, name: str) -> int:
    """The ragged sequence dim (sample dim D-2); every other sample dim must be static."""
    d = nt.sample_dim
    if d < 2:
        raise ValueError(f"{op}(): {name} samples must be (..., L, E), got rank {d}")
    if nt._ragged != (d - 2,):
        raise StructureError(
            f"{op}(): {name} must have exactly one ragged dim, the sequence dim {d - 1} "
            f"(samples (..., L_i, E)); it has ragged dims {tuple(r + 1 for r in nt.ragged_dims)}. "
            "For (L_i, H, E) samples use x.transpose(1, 2)."
        )
    return d - 2


@functools.cache
def _flash_attn():
    # cached: a failed import searches the file system again on every call (~150 us per
    # attention call on the CPU, where flash-attn is never installed)
    try:
        from flash_attn import flash_attn_varlen_func  # type: ignore[import-not-found]
    except ImportError:
        return None
    return flash_attn_varlen_func


@functools.cache
def _varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def explain(
    q: NestedTensor,
    k: NestedTensor,
    v: NestedTensor,
    attn_mask=None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    mask_mod: Callable | None = None,
    score_mod: Callable | None = None,
) -> Choice:
    """The backend ``scaled_dot_product_attention`` would use for these inputs, and why."""
    skipped: dict[str, str] = {}
    custom = mask_mod is not None or score_mod is not None
    cuda = q._values.is_cuda
    half = q.dtype in (torch.float16, torch.bfloat16)
    layout_ok = q.sample_dim == 3 and q._values.dim() == 3
    causal_mismatch = is_causal and not _same_lengths(q, k)
    for name, available in (("flash_attn", _flash_attn() is not None), ("varlen", _varlen() is not None)):
        if custom:
            skipped[name] = "a mask_mod/score_mod was given"
        elif not cuda:
            skipped[name] = "not on CUDA"
        elif not half:
            skipped[name] = f"dtype {q.dtype} (needs float16/bfloat16)"
        elif not available:
            skipped[name] = "not installed (pip install flash-attn)" if name == "flash_attn" else "torch has no varlen_attn"
        elif attn_mask is not None:
            skipped[name] = "an attn_mask was given"
        elif causal_mismatch:
            skipped[name] = "causal with L_q != L_k in some sample (kernel aligns bottom-right, torch top-left)"
        elif name == "varlen" and dropout_p > 0:
            skipped[name] = "dropout_p > 0"
        elif not layout_ok:
            skipped[name] = "samples are not (H, L, E)"
        else:
            return Choice(name, skipped)
    if not cuda:
        skipped["flex"] = "CPU default is per-sample (faster here, and flex has no CPU backward; see module docstring)"
    elif q.sample_dim != 3:
        skipped["flex"] = "samples are not (H, L, E)"
    elif attn_mask is not None:
        skipped["flex"] = "an attn_mask NestedTensor was given (pass a mask_mod instead)"
    elif dropout_p > 0:
        skipped["flex"] = "dropout_p > 0"
    else:
        return Choice("flex", skipped)
    if dropout_p == 0.0 and not custom and not _is_traced(q._values) and runs.plan(q, k, v, attn_mask) is not None:
        return Choice("runs", {**skipped, "per_sample": _RUNS_REASON})
    return Choice("per_sample", skipped)


_RUNS_REASON = "samples come in runs of equal lengths (a folded batch): one call per run on views of the rows"


def _same_lengths(q: NestedTensor, k: NestedTensor) -> bool:
    if q._meta is k._meta:
        return True
    if _is_traced(q._values):  # lengths are runtime data in a graph: equal only if the rows are
        return q._offsets is k._offsets
    dq, dk = q.sample_dim - 2, k.sample_dim - 2
    return torch.equal(q.host_sizes()[:, dq], k.host_sizes()[:, dk])


# ---------------------------------------------------------------------------- backends


def _materialise(i: int, qi: Tensor, ki: Tensor, mask_mod, score_mod, scale, is_causal, enable_gqa):
    """A per-sample additive mask equivalent to FlexAttention's mods (CPU path)."""
    lq, lk = qi.shape[-2], ki.shape[-2]
    h = torch.arange(qi.shape[-3] if qi.dim() >= 3 else 1, device=qi.device).view(-1, 1, 1)
    qq = torch.arange(lq, device=qi.device).view(1, -1, 1)
    kk = torch.arange(lk, device=qi.device).view(1, 1, -1)
    b = torch.tensor(i, device=qi.device)
    add = torch.zeros((h.shape[0], lq, lk), dtype=qi.dtype, device=qi.device)
    if score_mod is not None:
        kx = ki.repeat_interleave(qi.shape[-3] // ki.shape[-3], dim=-3) if enable_gqa and qi.dim() >= 3 else ki
        s = (qi @ kx.transpose(-1, -2)) * (scale if scale is not None else qi.shape[-1] ** -0.5)
        add = score_mod(s, b, h, qq, kk) - s  # the mod's change to each score (differentiable)
    if mask_mod is not None:
        keep = mask_mod(b, h, qq, kk).expand(add.shape)
        add = add.masked_fill(~keep, float("-inf"))
    if is_causal:
        add = add.masked_fill(kk > qq, float("-inf"))
    return add if qi.dim() >= 3 else add[0]


def _four_d(x: Tensor, lead: int) -> Tensor:
    return x.reshape((1,) * lead + tuple(x.shape)) if lead else x


def _drop_lead(x: Tensor, lead: int) -> Tensor:
    return x.reshape(x.shape[lead:]) if lead else x


# Samples whose (query, key) lengths repeat at least this often run as one batched SDPA call.
_MIN_GROUP = 2
# Self-attention without masks, mods or dropout on the CPU runs in length buckets
# (buckets.py) where its cost model says the saved calls outweigh the copies; False keeps
# one call per sample (and per group of equal lengths), e.g. to compare them.
BUCKETS = True


def _length_groups(q: NestedTensor, k: NestedTensor) -> tuple[list[int], list[list[int]]]:
    """Samples run alone, and groups of samples sharing one (query, key) length pair.

    Exact lengths only: a group is a dense ``(G, ..., L, E)`` batch with no padded
    position, so its SDPA call is each sample's own dense SDPA, batched. Host ints only.
    """
    dq, dk = q.sample_dim - 2, k.sample_dim - 2
    lq, lk = q.host_sizes()[:, dq].tolist(), k.host_sizes()[:, dk].tolist()
    by_len: dict[tuple[int, int], list[int]] = {}
    for i, key in enumerate(zip(lq, lk)):
        by_len.setdefault(key, []).append(i)
    alone = [i for members in by_len.values() if len(members) < _MIN_GROUP for i in members]
    groups = [members for members in by_len.values() if len(members) >= _MIN_GROUP]
    return alone, groups


def _sample_plan(q: NestedTensor, k: NestedTensor, grouped: bool):
    """``(query offsets, key offsets, samples run alone, groups of equal lengths)``, host ints.

    Cached on the structure when query and key share it (self-attention: every layer of a
    stack, and the query, key and value of one layer, read one entry), so a steady-state
    call does no host arithmetic.
    """
    same = q._meta is k._meta and q.sample_dim == k.sample_dim
    key = ("attention_samples", q.sample_dim, grouped)
    if same:
        hit = q._meta.derived.get(key)
        if hit is not None:
            return hit
    qo = q.host_offsets().tolist()
    ko = qo if same else k.host_offsets().tolist()
    alone, groups = _length_groups(q, k) if grouped else (list(range(q.batch_size)), [])
    plan = (qo, ko, alone, groups)
    if same:
        q._meta.derived[key] = plan
    return plan


def _grouped(qs, ks, vs, dq: int, groups, is_causal, scale, enable_gqa, masks=None) -> dict[int, Tensor]:
    """One batched SDPA call per group of equal-length samples; output rows per sample.

    A group's operand is a ``torch.stack`` of its samples' split views: only the grouped
    rows are copied, and the backward hands each sample its gradient slice (no buffer-wide
    scatter), which the split's one concatenation then writes once. Per-sample masks of one
    shape are stacked the same way (a mask of a sample is its own: nothing crosses samples).
    """
    out: dict[int, Tensor] = {}
    lead = 3 - (dq + 2)  # (G, *rest) -> 4-D (G, 1, L, E) for (L, E) samples

    def batch(parts, g: list[int]) -> Tensor:
        x = torch.stack([parts[i] for i in g]).movedim(1, dq + 1)
        return x.unsqueeze(1) if lead else x

    for g in groups:
        qg = batch(qs, g)
        kg = qg if ks is qs else batch(ks, g)
        vg = kg if vs is ks else (qg if vs is qs else batch(vs, g))
        mg = None
        if masks is not None:
            mg = torch.stack([masks[i] for i in g])
            mg = mg.unsqueeze(1) if mg.dim() == 3 else mg  # (G, L, S) masks broadcast over heads
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mg, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        o = (o.squeeze(1) if lead else o).movedim(dq + 1, 1)
        for i, rows in zip(g, o.unbind(0)):
            out[i] = rows
    return out


def _per_sample(q, k, v, masks, dropout_p, is_causal, scale, enable_gqa, mask_mod=None, score_mod=None) -> Tensor:
    """SDPA per sample on views of the rows; returns packed output rows (Tq, *static).

    Samples come from one split of each buffer (:func:`split_rows`), so the backward
    writes every sample's gradient once (O(T), not O(B x T)). Without masks, mods or
    dropout, samples of equal (query, key) lengths run as one batched call per length
    (exact lengths, nothing padded); dropout stays per sample to keep torch's RNG order.
    """
    qv, kv, vv = values_of(q), values_of(k), values_of(v)
    if k is q:
        kv = qv
    if v is k:
        vv = kv
    dq = q.sample_dim - 2
    simple = masks is None and mask_mod is None and score_mod is None and dropout_p == 0.0
    if simple and BUCKETS and not qv.is_cuda and q.sample_dim == 3 and qv.dim() == 3 and _same_lengths(q, k):
        plan = _bucket_plan(q, is_causal)
        if plan is not None:
            return buckets.attention(qv, kv, vv, plan, is_causal, scale, enable_gqa)
    plain = mask_mod is None and score_mod is None and dropout_p == 0.0  # masks group too (folded rows: one per row)
    qo, ko, alone, groups = _sample_plan(q, k, plain and q.sample_dim <= 3 and q.batch_size >= _MIN_GROUP)
    if masks is not None and groups:
        alone, groups = _mask_groups(masks, alone, groups)
    qs = split_rows(qv, qo)
    ks = split_rows(kv, ko) if kv is not qv else qs
    vs = ks if vv is kv else (qs if vv is qv else split_rows(vv, ko))
    done = _grouped(qs, ks, vs, dq, groups, is_causal, scale, enable_gqa, masks)
    # torch's fused CPU kernel runs on 4-D (batch, heads, L, E) inputs (3-D falls back to the
    # unfused math path, ~1.6x slower here), so each sample is viewed with leading unit dims.
    lead = max(0, 4 - (dq + 2))
    for i in alone:
        qi = _four_d(qs[i].movedim(0, dq), lead)
        ki = _four_d(ks[i].movedim(0, dq), lead)
        vi = _four_d(vs[i].movedim(0, dq), lead)
        mi = None if masks is None else masks[i]
        causal = is_causal
        if mask_mod is not None or score_mod is not None:
            mi = _materialise(i, qi, ki, mask_mod, score_mod, scale, is_causal, enable_gqa)
            causal = False
            if mi.numel() and bool(torch.isinf(mi).all(-1).any()):
                # rows with every key masked: FlexAttention returns zeros, SDPA would give NaN
                mi = mi.masked_fill(torch.isinf(mi).all(-1, keepdim=True), 0.0)
                oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mi, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa)
                dead = torch.isinf(_materialise(i, qi.detach(), ki.detach(), mask_mod, None, scale, is_causal, enable_gqa)).all(-1)
                done[i] = _drop_lead(oi.masked_fill(dead.unsqueeze(-1), 0.0), lead).movedim(dq, 0)
                continue
        oi = F.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=mi, dropout_p=dropout_p, is_causal=causal, scale=scale, enable_gqa=enable_gqa
        )
        done[i] = _drop_lead(oi, lead).movedim(dq, 0)
    if not done:  # a batch of no samples: the empty result, on the inputs' graph as each dense call would be
        out = qv.new_empty((0, *qv.shape[1:-1], vv.shape[-1]))
        parts = [t for t in (qv, kv, vv) if t.requires_grad]
        return out + sum(t.sum() for t in parts) * 0 if parts and torch.is_grad_enabled() else out
    return torch.cat([done[i] for i in range(q.batch_size)])


def _mask_groups(masks, alone: list[int], groups: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """Groups of equal lengths split further by mask shape and dtype (stacked masks must agree)."""
    alone = list(alone)
    out = []
    for g in groups:
        by: dict[tuple, list[int]] = {}
        for i in g:
            by.setdefault((tuple(masks[i].shape), masks[i].dtype), []).append(i)
        for members in by.values():
            (out.append(members) if len(members) >= _MIN_GROUP else alone.extend(members))
    return sorted(alone), out


def _bucket_plan(q: NestedTensor, is_causal: bool) -> buckets.Plan | None:
    """The bucket plan of ``q``'s structure (:mod:`~padless.ops.attention.buckets`), cached on
    it; None where one call per sample costs less."""
    width = q._values.shape[1] * q._values.shape[2]
    key = ("attention_buckets", q._values.device, bool(is_causal), width)
    derived = q._meta.derived
    if key in derived:
        return derived[key]
    lengths = q.host_sizes()[:, 1].tolist()
    plan = derived[key] = buckets.plan(lengths, q.host_offsets().tolist(), width, is_causal, q._values.device)
    return plan


def _varlen_call(backend, q, k, v, dropout_p, is_causal, scale, enable_gqa) -> Tensor:
    qv, kv, vv = values_of(q), values_of(k), values_of(v)
    mq, mk = q.max_seqlen(1), k.max_seqlen(1)
    if backend == "flash_attn":
        return _flash_attn()(
            qv, kv, vv, q.cu_seqlens(), k.cu_seqlens(), mq, mk, dropout_p=dropout_p, softmax_scale=scale, causal=is_causal
        )
    return _varlen()(
        qv, kv, vv, q.cu_seqlens(), k.cu_seqlens(), mq, mk,
        scale=scale, window_size=(-1, 0) if is_causal else (-1, -1), enable_gqa=enable_gqa,
    )


def _flex(q, k, v, is_causal, scale, enable_gqa, mask_mod, score_mod) -> Tensor:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    qv, kv, vv = values_of(q), values_of(k), values_of(v)
    q_sid, k_sid = q.row_sample_ids(), k.row_sample_ids()
    q_start = q._offsets[:-1].index_select(0, q_sid)
    k_start = k._offsets[:-1].index_select(0, k_sid)

    def doc_mask(b, h, qi, ki):
        keep = q_sid[qi] == k_sid[ki]
        ql, kl = qi - q_start[qi], ki - k_start[ki]
        if is_causal:
            keep = keep & (kl <= ql)
        if mask_mod is not None:
            keep = keep & mask_mod(q_sid[qi], h, ql, kl)
        return keep

    local_score = None
    if score_mod is not None:

        def local_score(score, b, h, qi, ki):
            return score_mod(score, q_sid[qi], h, qi - q_start[qi], ki - k_start[ki])

    tq, tk = qv.shape[0], kv.shape[0]
    block = create_block_mask(doc_mask, None, None, tq, tk, device=qv.device)
    out = flex_attention(
        qv.permute(1, 0, 2).unsqueeze(0), kv.permute(1, 0, 2).unsqueeze(0), vv.permute(1, 0, 2).unsqueeze(0),
        score_mod=local_score, block_mask=block, scale=scale, enable_gqa=enable_gqa,
    )
    return out.squeeze(0).permute(1, 0, 2)


# ---------------------------------------------------------------------------- public entry points


def attention(
    query: NestedTensor,
    key: NestedTensor,
    value: NestedTensor,
    attn_mask: NestedTensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    mask_mod: Callable | None = None,
    score_mod: Callable | None = None,
) -> NestedTensor:
    """SDPA over NestedTensors (see module docstring); also takes FlexAttention-style
    ``mask_mod(sample, head, q_local, kv_local)`` / ``score_mod(score, sample, head, q_local, kv_local)``."""
    global last_choice
    op = "scaled_dot_product_attention"
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, NestedTensor):
            raise TypeError(f"{op}(): {name} must be a NestedTensor when any input is (got a dense {type(t).__name__})")
    mods = mask_mod is not None or score_mod is not None
    if torch.compiler.is_dynamo_compiling() and not (mods and query.is_cuda):
        # Dynamo is inlining a direct call: hand it the torch-level op, whose handler (this
        # function) then runs on the graph's fake tensors. (CUDA mods: the flex backend, inlined.)
        if mods:
            raise NotImplementedError(_MODS_UNDER_COMPILE.format(op=op, device=query.device.type))
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    if attention_rows.claims(query, key, value):  # ragged dims other than the sequence dim alone
        return attention_rows.attention_rows(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, mask_mod=mask_mod, score_mod=score_mod
        )
    _seq_dim(op, query, "query")
    _seq_dim(op, key, "key")
    _seq_dim(op, value, "value")
    if not (query.batch_size == key.batch_size == value.batch_size):
        raise StructureError(
            f"{op}(): batch sizes differ: query {query.batch_size}, key {key.batch_size}, value {value.batch_size}"
        )
    if _structure_mismatch(key, value) is not None:
        raise StructureError(f"{op}(): key and value must have the same ragged structure: {_structure_mismatch(key, value)}")
    masks = None
    traced = _is_traced(query._values)
    plan = runs.plan(query, key, value, attn_mask) if dropout_p == 0.0 and not mods and not traced else None
    if plan is not None:  # runs of equal-length samples (a folded batch): one call per run, in place
        last_choice = Choice("runs", {"per_sample": _RUNS_REASON})
        if _DEBUG:
            log.warning(str(last_choice))
        return rewrap(runs.attention(query, key, value, plan, is_causal, scale, enable_gqa), query)
    if attn_mask is not None:
        if not isinstance(attn_mask, NestedTensor):
            if traced:
                raise TypeError(
                    f"{op}(): under torch.compile attn_mask must be a NestedTensor of per-sample (L_i, S_i) "
                    f"masks; a dense mask of shape {tuple(attn_mask.shape)} in padded coordinates is read "
                    "eagerly only (padless.from_padded(mask, like=scores) makes one)"
                )
            masks = _dense_masks(op, attn_mask, query, key)
        elif traced:
            attention_compiled.check_mask_layout(op, attn_mask)  # per-sample shapes: checked when the op runs
        else:
            masks = unbind_samples(attn_mask)
            _check_masks(op, masks, query, key)
    choice = explain(query, key, value, attn_mask, dropout_p, is_causal, mask_mod, score_mod)
    last_choice = choice
    if _DEBUG and not _is_traced(query._values):
        log.warning(str(choice))
    if choice.backend in ("flash_attn", "varlen"):
        out = _varlen_call(choice.backend, query, key, value, dropout_p, is_causal, scale, enable_gqa)
    elif choice.backend == "flex":
        out = _flex(query, key, value, is_causal, scale, enable_gqa, mask_mod, score_mod)
    elif traced:
        # under torch.compile: one opaque op over the packed rows (host offsets read at run time)
        if mods:
            raise NotImplementedError(_MODS_UNDER_COMPILE.format(op=op, device=query.device.type))
        out = attention_compiled.traced_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    else:
        out = _per_sample(query, key, value, masks, dropout_p, is_causal, scale, enable_gqa, mask_mod, score_mod)
    return rewrap(out, query)


_MODS_UNDER_COMPILE = (
    "{op}(): mask_mod/score_mod on {device} do not run under torch.compile (the per-sample path that "
    "evaluates them reads host lengths). Build the mask outside the compiled region as a NestedTensor "
    "of per-sample (L_i, S_i) masks (padless.from_list(masks, ragged_dims=(0, 1))) and pass it as attn_mask "
    "(an additive mask holds a score_mod that adds a bias), or keep this call eager with "
    "torch.compiler.disable."
)


def _dense_masks(op: str, mask: Tensor, q: NestedTensor, k: NestedTensor) -> list[Tensor]:
    """A dense mask in padded coordinates, ``(B or 1, ..., max L_q, max L_k)`` (extent 1 where it
    broadcasts), as per-sample views: sample i reads ``[..., :L_q_i, :L_k_i]``."""
    hq, hk = q.host_sizes().tolist(), k.host_sizes().tolist()
    lead = list(q._env[:-2])
    extents = [hq[i][:-1] + [hk[i][-2]] for i in range(q.batch_size)]
    envelope = lead + [q._env[-2], k._env[-2]]
    d = q.sample_dim
    return padded.dense_samples(op, "attn_mask", mask, extents, envelope, (d - 2, d - 1), q)


def _check_masks(op: str, masks, q: NestedTensor, k: NestedTensor) -> None:
    lq, lk = q.host_sizes()[:, q.sample_dim - 2].tolist(), k.host_sizes()[:, k.sample_dim - 2].tolist()
    if len(masks) != len(lq):
        raise StructureError(
            f"{op}(): attn_mask is a batch of {len(masks)} samples and the query a batch of {len(lq)}; a NestedTensor "
            "mask must have the query's samples (for a folded query, repeat the bias per row with "
            "bias.repeat_interleave(N, dim=0), N read from the shape of the batch that was folded)"
        )
    for i, m in enumerate(masks):
        if m.dim() < 2 or m.shape[-2:] != (lq[i], lk[i]):
            raise StructureError(
                f"{op}(): attn_mask sample {i} has shape {tuple(m.shape)}, expected (..., {lq[i]}, {lk[i]}) "
                "(query length x key length of that sample)"
            )


@implements(F.scaled_dot_product_attention, accepts="packed query, key, value; packed mask")
def scaled_dot_product_attention(
    func, query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False, scale=None, enable_gqa: bool = False
) -> NestedTensor:
    """``F.scaled_dot_product_attention`` on NestedTensors (see module docstring)."""
    return attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
