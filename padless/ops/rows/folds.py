"""Folds: the first dim of every sample folded into the batch, and unfolded back.

A batch of B samples ``(N_i, N_i, d)`` stored row-major is also a batch of ``sum N_i``
samples ``(N_i, d)``: row ``i`` of sample ``b`` is sample ``(b, i)``. Code written for
padded batches reaches it by a reshape of the batch dim (AlphaFold's triangle attention,
einops' ``rearrange(z, 'b i j d -> (b i) j d')``, fairseq's heads folded into the batch):

==========================================  ==========================================  =====================
padded code                                 on a NestedTensor                           cost
==========================================  ==========================================  =====================
``z.reshape(B * N, N, d)``, ``-1`` for B*N  fold the leading ragged dim: ``sum N_i``    no copy (rows stay)
(``z`` of ``(N_i, N_i, d)``)                samples ``(N_i, d)``
the same of a transposed ``(N_i, M_i)``     fold dim 0, stored second                   one row gather
``x.reshape(B * H, L, d)`` (``x`` of        fold a static dim: ``B*H`` samples          one gather (heads are
``(H, L_i, d)``), ``x.flatten(0, 1)``       ``(L_i, d)``, sample ``(b, h)`` is ``x[b, h]``  interleaved in rows)
``o.reshape(B, N, N, d)``,                  unfold: the inverse of the fold             none (ragged fold);
``o.unflatten(0, (B, N))``                                                              one gather (static)
``bias.repeat_interleave(N, dim=0)``        every sample repeated per row of its        one gather
                                            sample: sample ``(b, i)`` is ``bias[b]``
``bias.unsqueeze(1).expand(B, N, ...)``     a static extent 1 expanded to sizes read    one gather; the fold
                                            from a shape: a new ragged dim              that follows is free
==========================================  ==========================================  =====================

The folded batch keeps a :class:`FoldLink` to its parent (the number of folded samples per
parent sample, a few ints: never the parent's structure or caches), carried by every op that
keeps the rows (linear, norms, attention, transposes, static reshapes), so the unfold
``reshape(B, N, N, d)`` resolves exactly. Without a link (the rows went through a pair
product, ``softmax(q @ k^T) @ v``), sizes read from the parent's shape (``N = z.shape[1]``,
an :class:`~padless.tensor.extents.Extent`) give each parent sample its own count. An unfold
target that matches neither is refused, naming the rewrite.

A fold (and a per-sample repeat) also gives its output a lineage derived from its input's
(:class:`padless.tensor.lineage.Fold`): sizes read from the parent's shape then apply to the
folded batch, sample ``(b, i)`` taking parent ``b``'s size (``q.view(B * N, N, H, d)``), sizes
of any other batch are refused, and the unfold back rejoins the parent's lineage.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any, Sequence

import torch
from torch import Tensor

from padless.ops.common import content
from padless.ops.common.host import host_structure
from padless.ops.common.structure import call
from padless.ops.rows import folds_traced
from padless.ops.rows.shape_rows import relayout
from padless.tensor import layout
from padless.tensor.autograd import nested_from_values, values_of
from padless.tensor.core import ROW_LEVEL_KEYS, NestedTensor, StructureMeta, _is_traced
from padless.tensor.errors import StructureError
from padless.tensor import lineage
from padless.tensor.extents import Extent, applies_to, check_extent

__all__ = ["FoldLink", "fold", "fold_link", "folds_own_dim", "unfold", "fold_reshape", "unfold_reshape"]

FOLD_LINK = "fold_link"
if FOLD_LINK not in ROW_LEVEL_KEYS:  # ops that keep the rows (linear, attention, transposes) keep the link
    ROW_LEVEL_KEYS.append(FOLD_LINK)
_KEY = (FOLD_LINK,)


@dataclasses.dataclass(frozen=True)
class FoldLink:
    """How a folded batch regroups into the batch it was folded from.

    ``kind`` is ``"ragged"`` (a ragged dim folded: parent sample ``b`` gave ``counts[b]``
    samples, its extent along that dim) or ``"static"`` (a static dim of extent ``extent``
    folded: every parent sample gave ``extent`` samples). ``extent`` is the folded dim's
    envelope in the parent (what an unfold target names). Host ints; under ``torch.compile``
    ``counts`` is a device tensor and ``extent`` a symbol (:mod:`padless.ops.rows.folds_traced`).
    """

    kind: str
    counts: tuple[int, ...] | Tensor
    extent: int | torch.SymInt
    #: when a parent sample gave no samples (count 0): the parent's sizes after the folded dim,
    #: ``(sizes per parent sample, the ragged ones among them)``, so the unfold gives an empty
    #: sample its own extents (nothing else holds them); ``()`` when every count is positive.
    #: Under ``torch.compile`` always there, the sizes a device tensor (:func:`folds_traced.unfold`)
    rest: tuple = ()

    def empty_sizes(self, nt: NestedTensor, rows: Tensor, nonempty: Tensor, op: str) -> None:
        """Fill ``rows`` (per parent sample, the unfolded sizes after the new leading dim) of the
        empty parent samples from :attr:`rest`, where ``nt`` (the folded batch, unfolding) still
        has the parent's ragged dims and every non-empty group its parent's sizes along them."""
        if not self.rest:
            return
        sizes, ragged = self.rest
        ref = torch.tensor(sizes, dtype=torch.int64).reshape(len(sizes), -1)
        cols = list(ragged)
        if tuple(nt._ragged) != ragged or ref.shape != rows.shape or not bool((rows[nonempty][:, cols] == ref[nonempty][:, cols]).all()):
            b = int((~nonempty).nonzero()[0, 0])
            raise StructureError(
                f"{op}(): parent sample {b} gave no samples to the fold, and the folded samples' ragged extents "
                f"changed since (ragged dims {tuple(nt._ragged)}, sizes of sample 0 {tuple(rows[0].tolist())}; at the fold "
                f"{ragged}, {sizes[0]}), so sample {b}'s own extents are not known; unfold before the op that changes "
                "them, or read them from the parent's shape (o.reshape(B, N, M, M) with sizes M = z.shape[2])"
            )
        for j in cols:
            rows[~nonempty, j] = ref[~nonempty, j]

    @property
    def batch_size(self) -> int:
        """Samples of the parent batch (a size under torch.compile, where ``counts`` is a tensor)."""
        return self.counts.shape[0] if isinstance(self.counts, Tensor) else len(self.counts)


def fold_link(nt: NestedTensor) -> FoldLink | None:
    """The :class:`FoldLink` of a folded batch (None for a batch that was not folded, or when
    several folds of different parents had its sample sizes)."""
    found = links(nt)
    return found[0] if len(found) == 1 else None


#: Folds seen lately, by the sample sizes of the folded batch (:func:`_signature`): the link of
#: a folded batch whose rows went through an op that builds a new structure (the pair product
#: of ``softmax(q @ k^T) @ v``) is found again by content. At most :data:`REGISTRY_ENTRIES`
#: entries (least recently used go first), each a few links of host ints.
_REGISTRY: collections.OrderedDict = collections.OrderedDict()
REGISTRY_ENTRIES = 256
_LOCK = threading.Lock()


def _signature(nt: NestedTensor) -> tuple | None:
    """Batch size and every sample's extent along its first stored ragged dim (host bytes)."""
    hs = nt._meta.host_sizes
    if hs is None or not nt._ragged:
        return None
    return (hs.shape[0], hs[:, nt._ragged[0]].numpy().tobytes())


def _remember(folded: NestedTensor, link: FoldLink) -> None:
    sig = _signature(folded)
    if sig is None:
        return
    with _LOCK:
        held = _REGISTRY.pop(sig, frozenset())
        _REGISTRY[sig] = held | {link}
        while len(_REGISTRY) > REGISTRY_ENTRIES:
            _REGISTRY.popitem(last=False)


def links(nt: NestedTensor) -> list[FoldLink]:
    """The folds ``nt`` may come from: its own link (carried by ops that keep the rows), else the
    recent folds whose folded batch had ``nt``'s sample sizes."""
    link = nt._meta.derived.get(_KEY)
    if link is not None:
        return [link]
    if not _REGISTRY:
        return []
    sig = _signature(nt)
    with _LOCK:
        held = _REGISTRY.get(sig) if sig is not None else None
        if held is not None:
            _REGISTRY.move_to_end(sig)
    return sorted(held, key=lambda k: (k.kind, k.counts)) if held else []


def _linked(out: NestedTensor, link: FoldLink) -> NestedTensor:
    out._meta.derived[_KEY] = link
    _remember(out, link)
    return out


def folds_own_dim(nt: NestedTensor, raw: Sequence[Any]) -> bool:
    """Whether the batch entry of ``raw`` is ``B * N`` with ``N`` read from this batch's own shape
    (``z.reshape(B * N, M, d)``, ``N = z.shape[1]``): an :class:`Extent` of this batch whose
    per-sample reading is ``B * n_b``, ``n_b`` each sample's size along its dim 0. A batch entry
    is never a sample's own size, so the only reading of such a product is the fold of that dim
    (also where ``B * N`` happens to equal ``B``, an envelope of 1, or where a recent fold of
    another batch had this batch's sample sizes)."""
    lead = raw[0] if raw else None
    if not isinstance(lead, Extent) or nt.sample_dim < 2 or 0 not in nt._ragged or _traced(nt):
        return False
    b = nt.batch_size
    if int(lead) != b * int(nt._env[0]) or lead.batch_size != b or not applies_to(lead, nt):
        return False
    own = host_structure(nt, "reshape")[0][:, 0].tolist()
    return lead.per_sample() == [b * n for n in own]


def folded_batch_entry(nt: NestedTensor, raw: list, op: str = "reshape") -> list:
    """``raw`` with its batch entry read as this batch: in a batch folded from ``B`` samples of
    envelope ``n``, padded code writes the batch as ``B * n`` (``q.view(B * N, N, H, d)``)."""
    if not raw:
        return raw
    lead = raw[0]
    if not isinstance(lead, (int, torch.SymInt)) or isinstance(lead, bool) or folds_traced.same(lead, -1):
        return raw
    if folds_traced.same(lead, nt.batch_size):
        return raw
    if _traced(nt):
        own = nt._meta.derived.get(_KEY)
        found = own is not None and folds_traced.same(lead, own.batch_size * own.extent)
        if found and folds_traced.same(own.extent, 1):  # B * 1 == B: the folded batch, or the unfold
            raise StructureError(_envelope_of_one(op, raw, "keep this folded batch or unfold it"))
    else:
        found = any(k.batch_size * k.extent == lead for k in links(nt))
    return [nt.batch_size, *raw[1:]] if found else raw


# ---------------------------------------------------------------------------- fold


def fold(nt: NestedTensor, op: str = "fold") -> NestedTensor:
    """Sample dim 0 of every sample folded into the batch (the module table): a ragged dim
    stored first keeps the rows (no copy), a ragged dim stored later costs one row gather,
    a static dim one gather."""
    if nt.sample_dim < 1:
        raise StructureError(f"{op}(): samples have no dim to fold into the batch")
    traced = _traced(nt)
    parent = None if traced else nt._lineage
    if 0 in nt._ragged:
        count = folds_traced.fold_count(nt) if traced else None  # from the carriers of nt's own structure
        if nt._ragged[0] != 0:  # (N_i, M_i) stored as (1, 0): bring dim 0 first (one gather)
            nt = relayout(nt, (0, *[r for r in nt._ragged if r != 0]))
        if traced:
            return folds_traced.fold_ragged(nt, FoldLink, _KEY, count)
        out = _fold_ragged(nt, op)
    elif traced:
        return folds_traced.fold_static(nt, FoldLink, _KEY)
    else:
        out = _fold_static(nt, op)
    return _regrouped(out, parent, out._meta.derived[_KEY].counts)


def _regrouped(out: NestedTensor, parent: Any, counts: Sequence[int]) -> NestedTensor:
    """``out`` made another batch of samples, ``counts[b]`` of them from parent sample ``b``: its
    lineage is derived from the parent's, so sizes read from the parent's shape give every sample
    its parent sample's size (:func:`padless.tensor.extents.for_batch`)."""
    if not torch.compiler.is_compiling():
        out._lineage = lineage.derive(parent, counts)
    return out


def _rest(hs: Tensor, counts: Tensor, nt: NestedTensor) -> tuple:
    """:attr:`FoldLink.rest` of a fold of ``nt`` (host sizes ``hs``) into ``counts`` per sample."""
    if bool((counts > 0).all()):
        return ()
    return tuple(map(tuple, hs[:, 1:].tolist())), tuple(r - 1 for r in nt._ragged if r > 0)


def _traced(nt: NestedTensor) -> bool:
    """Inside a compiled graph: sizes are runtime tensors and there is no host metadata."""
    return nt._meta.host_sizes is None and _is_traced(nt._sizes)


def _fold_ragged(nt: NestedTensor, op: str) -> NestedTensor:
    hit = nt._meta.derived.get(("fold", "ragged"))
    ragged = tuple(r - 1 for r in nt._ragged[1:])
    env = nt._env[1:]
    if hit is None:
        hs, ho = host_structure(nt, op)
        n = hs[:, 0]
        rows = ho[1:] - ho[:-1]
        per = torch.where(n > 0, rows // n.clamp_min(1), torch.zeros_like(rows))  # rows of each folded sample
        s = int(n.sum())
        new_hs = hs[:, 1:].repeat_interleave(n, dim=0)
        first = (n.cumsum(0) - n).repeat_interleave(n, output_size=s)
        starts = ho[:-1].repeat_interleave(n, output_size=s) + (torch.arange(s) - first) * per.repeat_interleave(n, output_size=s)
        new_ho = torch.cat([starts, ho[-1:]])
        meta = StructureMeta(new_hs, new_ho)
        meta.derived[_KEY] = FoldLink("ragged", tuple(n.tolist()), int(nt._env[0]), _rest(hs, n, nt))
        hit = (_to(new_ho, nt), _to(new_hs, nt), meta)
        nt._meta.derived[("fold", "ragged")] = hit
    offsets, sizes, meta = hit
    out = nested_from_values(values_of(nt), offsets, sizes, ragged, env, meta)
    _remember(out, meta.derived[_KEY])
    return out


def _fold_static(nt: NestedTensor, op: str) -> NestedTensor:
    h = int(nt._env[0])
    key = ("fold", "static", h)
    hit = nt._meta.derived.get(key)
    if hit is None:
        hs, ho = host_structure(nt, op)
        b = hs.shape[0]
        rows = ho[1:] - ho[:-1]
        new_hs = hs[:, 1:].repeat_interleave(h, dim=0)
        counts = rows.repeat_interleave(h)  # rows of sample (b, h)
        new_ho = layout.offsets_from_counts(counts)
        total = int(new_ho[-1])
        sample = torch.arange(b * h).repeat_interleave(counts, output_size=total)
        within = torch.arange(total) - new_ho[:-1].repeat_interleave(counts, output_size=total)
        row_idx = ho[:-1][sample // h] + within if h else within
        head_idx = sample % h if h else sample
        meta = StructureMeta(new_hs, new_ho)
        meta.derived[_KEY] = FoldLink("static", (h,) * b, h, _rest(hs, torch.full((b,), h), nt))
        hit = (_to(new_ho, nt), _to(new_hs, nt), meta, _to(row_idx, nt), _to(head_idx, nt))
        nt._meta.derived[key] = hit
    offsets, sizes, meta, row_idx, head_idx = hit
    vals = values_of(nt)[row_idx, head_idx]  # (sum over (b, h) of rows, *other static): the one gather
    out = nested_from_values(vals, offsets, sizes, tuple(r - 1 for r in nt._ragged), nt._env[1:], meta)
    _remember(out, meta.derived[_KEY])
    return out


def _to(t: Tensor, like: NestedTensor) -> Tensor:
    dev = like._offsets.device
    return t if dev.type == "cpu" else t.to(dev, non_blocking=True)


# ---------------------------------------------------------------------------- unfold


def unfold(nt: NestedTensor, counts: Sequence[int], kind: str, op: str = "unfold",
           extents: Sequence[Any] = (), link: FoldLink | None = None) -> NestedTensor:
    """The inverse of :func:`fold`: consecutive samples regrouped into ``len(counts)`` samples
    (``counts[b]`` of them each) along a new leading dim, ragged (``kind="ragged"``, rows
    unchanged) or static (``"static"``, every count equal: one gather). ``extents`` may give
    the sizes of an empty parent sample's other dims (sizes read from its shape)."""
    counts = [int(c) for c in counts]
    s = sum(counts)
    if s != nt.batch_size:
        raise StructureError(
            f"{op}(): the {nt.batch_size} samples cannot be regrouped into {len(counts)} samples of "
            f"{tuple(counts)} each (those hold {s})"
        )
    hs, ho = host_structure(nt, op)
    c = torch.tensor(counts, dtype=torch.int64)
    starts = c.cumsum(0) - c
    if s:
        lead = hs[starts.clamp_max(s - 1).repeat_interleave(c, output_size=s)]
        bad = (hs != lead).any(1).nonzero()
        if len(bad):
            j = int(bad[0, 0])
            b = int(torch.searchsorted(c.cumsum(0), torch.tensor(j), right=True))
            raise StructureError(
                f"{op}(): samples {int(starts[b])}..{int(starts[b]) + counts[b] - 1} become sample {b}, but sample {j} "
                f"has shape {tuple(hs[j].tolist())} and sample {int(starts[b])} {tuple(hs[int(starts[b])].tolist())}: "
                "the samples of one group must have one shape"
            )
    rows = hs.new_zeros((len(counts), hs.shape[1]))
    for j, e in enumerate(extents[: hs.shape[1]]):  # an empty group's sizes, when a shape names them
        if _parents(e, nt, len(counts)):
            rows[:, j] = torch.tensor(e.per_sample(), dtype=torch.int64)
        elif type(e) is int and j not in nt._ragged:
            rows[:, j] = e
    for j in range(hs.shape[1]):
        if j not in nt._ragged:
            rows[:, j] = nt._values.shape[1 + layout.static_dims(nt.sample_dim, nt._ragged).index(j)]
    nonempty = c > 0
    if s:
        rows[nonempty] = hs[starts[nonempty]]
    if link is not None and not any(_parents(e, nt, len(counts)) for e in extents):
        link.empty_sizes(nt, rows, nonempty, op)
    new_hs = torch.cat([c[:, None], rows], 1)
    if kind == "ragged":
        new_ho = torch.cat([ho[starts], ho[-1:]]) if len(counts) else ho[-1:]
        ragged = (0, *[r + 1 for r in nt._ragged])
        env = [int(new_hs[:, 0].max()) if len(counts) else 0, *nt._env]
        out = nested_from_values(values_of(nt), _to(new_ho, nt), _to(new_hs, nt), ragged, env, StructureMeta(new_hs, new_ho))
    else:
        h = counts[0] if counts else 0
        if any(k != h for k in counts):
            raise StructureError(f"{op}(): a static dim needs the same count in every group, got {tuple(counts)}")
        out = _unfold_static(nt, new_hs, ho, h, op)
    folded = nt._lineage
    if type(folded) is lineage.Fold and folded.parent is not None and folded.counts == tuple(counts):
        out._lineage = folded.parent  # the very regrouping undone: the parent's samples again
    return out


def _parents(e: Any, nt: NestedTensor, b: int) -> bool:
    """``e`` gives sizes of the ``b`` samples ``nt`` unfolds into: an :class:`Extent` of a batch of
    ``b`` samples that is not ``nt``'s own (a folded batch may have as many samples as its parent)."""
    return isinstance(e, Extent) and e.batch_size == b and not (b == nt.batch_size and applies_to(e, nt))


def _unfold_static(nt: NestedTensor, new_hs: Tensor, ho: Tensor, h: int, op: str) -> NestedTensor:
    b = new_hs.shape[0]
    rows = (ho[1:] - ho[:-1]).view(b, h)[:, 0] if h else torch.zeros(b, dtype=torch.int64)
    new_ho = layout.offsets_from_counts(rows)
    total = int(new_ho[-1])
    key = ("unfold_static", h, content.structure_key(nt))
    idx = content.get(key) if key[2] is not None else None
    if idx is None:
        sample = torch.arange(b).repeat_interleave(rows, output_size=total)
        within = torch.arange(total) - new_ho[:-1].repeat_interleave(rows, output_size=total)
        # parent row r of sample b holds, for every h, folded row ho[b*h + h'] + r
        idx = (ho[:-1].view(b, h)[sample] + within[:, None]).reshape(-1) if h else torch.zeros(0, dtype=torch.int64)
        idx = _to(idx, nt)
        if key[2] is not None:
            content.put(key, idx)
    vals = values_of(nt)
    out = vals.index_select(0, idx).view(total, h, *vals.shape[1:])
    ragged = tuple(r + 1 for r in nt._ragged)
    env = [h, *nt._env]
    for r in ragged:
        env[r] = int(new_hs[:, r].max()) if b else 0
    return nested_from_values(out, _to(new_ho, nt), _to(new_hs, nt), ragged, env, StructureMeta(new_hs, new_ho))


# ---------------------------------------------------------------------------- reshape targets


def _rest_reshape(nt: NestedTensor, rest: Sequence[Any], op: str) -> NestedTensor:
    """``nt`` reshaped to ``(its batch, *rest)`` (the dims inside every sample). Sizes read from a
    shape stay: read from the batch ``nt`` was folded from, they give every folded sample its
    parent sample's size (:func:`padless.tensor.extents.for_batch`)."""
    target = [nt.batch_size, *rest]
    if not any(isinstance(e, Extent) for e in rest) and len(target) == nt.dim() and all(
        folds_traced.same(a, t) for a, t in zip(nt.shape, target)
    ):
        return nt
    func = torch.Tensor.view if op == "view" else torch.Tensor.reshape
    out = call(func, nt, target)
    if out is not nt and out._lineage is None and not torch.compiler.is_compiling():
        out._lineage = nt._lineage  # the same samples (call() runs the handler without the lineage's inherit)
    return out


def fold_reshape(nt: NestedTensor, raw: Sequence[Any], op: str) -> NestedTensor | None:
    """``reshape``/``view`` whose target folds sample dim 0 into the batch, ``(B * n, *rest)``
    (``n`` that dim's envelope, or ``-1``), or None."""
    if not raw or nt.sample_dim < 2:
        return None
    lead = raw[0]
    b, n = nt.batch_size, nt._env[0]
    if not isinstance(lead, (int, torch.SymInt)) or isinstance(lead, bool):
        return None
    if folds_traced.same(lead, -1):
        if 0 in nt._ragged and len(nt._ragged) < 2:
            return None  # x.reshape(-1, C) of sequences: every row (shape_idioms.flatten_rows)
        if not nt._ragged:
            return None
        if _rows_target(nt, raw):
            return None  # x.reshape(-1, C) of pairs: every row, also where the sizes would let a fold fit
    elif not folds_traced.same(lead, b * n):
        return None
    elif 0 in nt._ragged and folds_traced.same(n, 1) and (type(lead) is int or _traced(nt)):
        # B * 1 == B: folding a ragged dim of envelope 1 or keeping the batch (each sample's own
        # reshape, x[i].reshape(*rest)); x.flatten(0, 1) says "fold". Under compile an envelope
        # of 1 is specialised (N = 1), so B * N is B itself, whatever the code wrote
        if _traced(nt):
            raise StructureError(_envelope_of_one(op, raw, "fold dim 1 into the batch or keep the batch"))
        raise StructureError(
            f"{op}(): target {_fmt(raw)} is ambiguous for a NestedTensor of envelope {tuple(nt.shape)}: its first "
            f"entry {lead} is both the batch size and batch * envelope of ragged dim 1 (which is 1), so it may fold "
            f"dim 1 into the batch or keep the batch. Write the fold as x.flatten(0, 1) (then {op} the folded batch), "
            "or reshape each sample alone (x.unbind()) to keep the batch"
        )
    folded = fold(nt, op)
    try:
        return _rest_reshape(folded, raw[1:], op)
    except StructureError as e:
        if folds_traced.same(lead, -1):
            return None  # not a fold after all (x.reshape(-1, C) of pairs: every row)
        raise StructureError(
            f"{op}(): the target {_fmt(raw)} folds dim 1 of envelope {tuple(nt.shape)} into the batch "
            f"({folded.batch_size} samples of envelope {tuple(folded.shape[1:])}), and then: {e}"
        ) from None


def _rows_target(nt: NestedTensor, raw: Sequence[Any]) -> bool:
    """``(-1, *tail)`` whose plain-int ``tail`` spans only the static dims of samples whose
    ragged dims come first (stored in any order): every real row (:func:`padless.ops.rows.shape_idioms.flatten_rows`), as
    each sample alone reads it (``(N_i * M_i, C)``). A fold then reshaping every folded sample
    ``(M_i, C)`` to ``tail`` fits only where each ``M_i`` is 0 or 1, by coincidence."""
    k = len(nt._ragged)
    tail = raw[1:]
    return (tuple(sorted(nt._ragged)) == tuple(range(k)) and len(tail) <= nt.sample_dim - k
            and all(type(t) is int and t >= 0 for t in tail))


def unfold_reshape(nt: NestedTensor, raw: Sequence[Any], op: str) -> NestedTensor | None:
    """``reshape``/``view`` to ``(B, n, *rest)`` of a folded batch (its link names ``B`` and
    ``n``), or of any batch when ``n`` is a size read from the shape of a batch of ``B``
    samples whose counts add up to this batch; None otherwise."""
    if len(raw) < 2:
        return None
    lead, n = raw[0], raw[1]
    if not all(isinstance(e, (int, torch.SymInt)) and not isinstance(e, bool) for e in (lead, n)):
        return None
    if folds_traced.same(lead, nt.batch_size) and op != "unflatten":  # unflatten(0, ...) never keeps the batch
        if isinstance(lead, Extent) or not _names_parent(nt, n):  # B * N names the folded batch, B the parent
            return None  # the batch stays: a reshape inside every sample
        # B == sum N_i (samples (2, 2) and (0, 0)): N read from the parent names the unfold; the
        # reading inside every sample, (N_b, *rest) of a folded sample (*rest), fits only where
        # the unfold does not (some N_b >= 2), so the unfold is tried first
        try:
            return _unfold_by_extent(nt, raw, op)
        except StructureError:
            return None
    own = nt._meta.derived.get(_KEY)
    if _traced(nt):
        if own is None or not (folds_traced.same(lead, own.batch_size) and folds_traced.same(n, own.extent)):
            return None
        return folds_traced.unfold(_rest_reshape(nt, raw[2:], op), own, op)
    if isinstance(n, Extent) and n.batch_size == lead:
        return _unfold_by_extent(nt, raw, op)
    found = [k for k in links(nt) if k.batch_size == lead and k.extent == n]
    if len(found) == 1:
        return _unfold_target(nt, list(found[0].counts), found[0].kind, raw, op, found[0])
    if len(found) > 1:
        raise StructureError(
            f"{op}(): {_fmt(raw)} could unfold this batch of {nt.batch_size} samples in {len(found)} ways (recent "
            f"folds of different batches gave these sample sizes: {[k.counts for k in found]}); read the size "
            "from the batch that was folded (N = z.shape[1] before folding) so each sample gets its own count"
        )
    if own is not None and lead == own.batch_size:
        raise StructureError(
            f"{op}(): this batch of {nt.batch_size} samples was folded from {own.batch_size} samples "
            f"(a {own.kind} dim of envelope {own.extent}); the target {_fmt(raw)} does not unfold it: "
            f"write it as ({own.batch_size}, {own.extent}, ...) (the folded dim first, its envelope or a "
            "size read from the batch's shape)"
        )
    return None


def _unfold_by_extent(nt: NestedTensor, raw: Sequence[Any], op: str) -> NestedTensor:
    """The unfold to ``(B, n, *rest)`` with ``n`` read from the shape of the batch ``nt`` was
    folded from: parent sample ``b`` regroups ``n_b`` samples."""
    lead, n = raw[0], raw[1]
    counts = n.per_sample()  # sizes read from the parent's shape: each parent its own count
    if sum(counts) != nt.batch_size:
        raise StructureError(
            f"{op}(): {_fmt(raw)} regroups this batch of {nt.batch_size} samples into {lead} samples of "
            f"{tuple(counts)} each (sizes read from a shape), which hold {sum(counts)} samples"
        )
    same = [k for k in links(nt) if list(k.counts) == counts]
    kinds = {k.kind for k in same}
    out = _unfold_target(nt, counts, "static" if kinds == {"static"} else "ragged", raw, op,
                         same[0] if len(same) == 1 else None)
    # n must be the parent's, not another batch's whose counts fit by chance (after the checks
    # above, whose messages say what is wrong with the counts themselves)
    check_extent(n, _Parent(lead, nt), op, "shape[1]", rewrite=_PARENT_REWRITE)
    return out


def _names_parent(nt: NestedTensor, n: Any) -> bool:
    """``n`` was read from the batch ``nt`` was folded from (not from ``nt``'s own batch, of as
    many samples), and regroups its samples otherwise than one by one."""
    own = nt._lineage
    return (isinstance(n, Extent) and type(own) is lineage.Fold and own.total == nt.batch_size and own.parent is not None
            and not applies_to(n, nt) and applies_to(n, _Parent(n.batch_size, nt))
            and any(c != 1 for c in n.per_sample()))


_PARENT_REWRITE = " that was folded (N = z.shape[1] before z.reshape(B * N, N, d))"


class _Parent:
    """What a size naming the unfold of ``nt`` into ``batch_size`` samples must come from: the
    batch ``nt`` was folded from (its lineage's parent), or, for a batch that was not folded,
    ``nt``'s own batch (then a size of another batch is refused)."""

    def __init__(self, batch_size: int, nt: NestedTensor) -> None:
        own = nt._lineage
        self.batch_size = batch_size
        self._lineage = own.parent if type(own) is lineage.Fold else own


def _unfold_target(nt: NestedTensor, counts: list[int], kind: str, raw: Sequence[Any], op: str,
                   link: FoldLink | None = None) -> NestedTensor:
    inner = _rest_reshape(nt, raw[2:], op)
    return unfold(inner, counts, kind, op, extents=raw[2:], link=link)


def _envelope_of_one(op: str, raw: Sequence[Any], readings: str) -> str:
    """The refusal of a fold or unfold target under ``torch.compile`` where the folded dim's
    envelope is 1 (every sample of length 0 or 1): the compiler specialises ``N = 1``, so the
    target's first entry ``B * N`` is ``B`` and says nothing of which reading the code meant."""
    return (
        f"{op}(): under torch.compile, target {_fmt(raw)} may {readings}: the batch's envelope along the folded "
        "dim is 1 (every sample of length 0 or 1), which the compiler specialises (N = 1), so B * N is B. Say "
        "which one with the explicit forms: fold with zf = z.flatten(0, 1), write the folded batch's size as "
        "zf.shape[0] (q.view(zf.shape[0], N, H, d)) and unfold with o.unflatten(0, (B, N)); or run this batch eagerly"
    )


def _fmt(raw: Sequence[Any]) -> str:
    return "(" + ", ".join(str(int(e)) if isinstance(e, int) else str(e) for e in raw) + ")"
