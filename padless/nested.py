"""Drop-in for ``torch.nested``: the same function names and arguments, padless tensors.

Replace ``torch.nested`` by ``padless.nested`` and the calls keep working; in
addition samples may have several ragged dims (``(2, 5)`` next to ``(3, 4)``),
and binary ops work between equal structures built separately.

>>> import torch
>>> from padless import nested
>>> x = nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)], layout=torch.jagged)
>>> y = nested.nested_tensor_from_jagged(torch.arange(6.).view(6, 1).expand(6, 3), x.offsets())
>>> [t.sum().item() for t in (x + y).unbind()], nested.to_padded_tensor(x, 0.0).shape
([9.0, 54.0], torch.Size([2, 4, 3]))

Differences worth knowing:

* ``layout`` is accepted for compatibility (``torch.strided`` or ``torch.jagged``);
  padless has one packed layout.
* ``shape`` is the padded envelope (ints), not a symbolic ``j`` dim.
* ``narrow`` with per-sample starts copies the selected rows into a packed buffer
  (torch's jagged layout keeps a strided view with holes). Values are equal; the
  result is contiguous.
* Inside ``torch.compile``, ``nested_tensor_from_jagged(values, offsets or lengths)`` and
  ``as_nested_tensor(dense)`` build the NestedTensor in the graph (as NJT does). The
  padded extent of the ragged dim is ``max_seqlen`` when given, else the real maximum,
  read as an unbacked size: that needs
  ``torch._dynamo.config.capture_scalar_outputs = True`` (NJT needs it too).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from padless.tensor import layout as _layout
from padless.tensor.autograd import nested_from_values
from padless.tensor.construct import from_list, from_values, require_integer
from padless.tensor.convert import to_padded
from padless.tensor.core import NestedTensor, StructureMeta, _is_traced, register_carried
from padless.tensor.errors import StructureError

#: Carried in graphs built by :func:`_from_jagged_traced`: a stride-0 ``(max_seqlen,)``
#: tensor whose length is the ragged envelope, so the unbacked size read in the graph is
#: the size of an inner tensor of the result (what torch.compile needs of a returned size).
SEQLEN_MAX = register_carried("seqlen_max")

__all__ = [
    "nested_tensor",
    "as_nested_tensor",
    "nested_tensor_from_jagged",
    "narrow",
    "to_padded_tensor",
    "masked_select",
]

_LAYOUTS = (None, torch.strided, torch.jagged)


def _check_layout(fn: str, layout) -> None:
    if layout not in _LAYOUTS:
        raise ValueError(f"padless.nested.{fn}(): layout must be torch.strided or torch.jagged, got {layout}")


def nested_tensor(
    tensor_list: Sequence,
    *,
    dtype: torch.dtype | None = None,
    layout=None,
    device=None,
    requires_grad: bool = False,
    pin_memory: bool = False,
    ragged_dims: Sequence[int] | None = None,
) -> NestedTensor:
    """A leaf NestedTensor copied from a list of tensors (or nested lists); no autograd history.

    >>> a, b = torch.arange(3.), torch.arange(5.)
    >>> nt = nested_tensor([a, b], requires_grad=True)
    >>> nt.is_leaf
    True
    """
    _check_layout("nested_tensor", layout)
    return from_list(
        list(tensor_list), ragged_dims=ragged_dims, dtype=dtype, device=device,
        requires_grad=requires_grad, pin_memory=pin_memory, keep_history=False,
    )


def as_nested_tensor(
    ts,
    dtype: torch.dtype | None = None,
    device=None,
    layout=None,
    *,
    ragged_dims: Sequence[int] | None = None,
) -> NestedTensor:
    """A NestedTensor that keeps autograd history to its inputs.

    ``ts`` is a list/tuple of tensors (copied into one buffer), a dense tensor
    ``(B, ...)`` (each row a sample, no copy when contiguous), or a NestedTensor
    (returned, converted to ``dtype``/``device`` if given).
    """
    _check_layout("as_nested_tensor", layout)
    if isinstance(ts, NestedTensor):
        return ts.to(device=device, dtype=dtype)
    if isinstance(ts, Tensor):
        if ts.dim() < 2:
            raise RuntimeError("as_nested_tensor(): Expected tensor argument to have dim() > 1")
        b, n0 = ts.shape[0], ts.shape[1]
        t = ts.to(device=device, dtype=dtype)
        r = 0 if ragged_dims is None else tuple(ragged_dims)[0] % (ts.dim() - 1)
        rows = t.movedim(r + 1, 1).reshape(b * ts.shape[r + 1], *[s for i, s in enumerate(ts.shape[1:]) if i != r])
        if _traced(ts):
            offsets = torch.arange(b + 1, device=rows.device, dtype=torch.int64) * ts.shape[r + 1]
            return _from_jagged_traced(rows, offsets, r, ts.shape[r + 1])
        lengths = torch.full((b,), ts.shape[r + 1], dtype=torch.int64)
        del n0
        return from_values(rows, lengths=lengths, ragged_dims=(r,))
    if not (isinstance(ts, (list, tuple)) and all(isinstance(t, Tensor) for t in ts)):
        raise TypeError(
            "as_nested_tensor(): Expected first argument to be a tensor or a list / tuple of tensors"
        )
    return from_list(list(ts), ragged_dims=ragged_dims, dtype=dtype, device=device, keep_history=True)


def nested_tensor_from_jagged(
    values: Tensor,
    offsets: Tensor | None = None,
    lengths: Tensor | None = None,
    jagged_dim: int | None = None,
    min_seqlen: int | None = None,
    max_seqlen: int | None = None,
) -> NestedTensor:
    """A NestedTensor from packed ``values`` and ``offsets`` and/or ``lengths``.

    With both ``offsets`` and ``lengths`` ("holes"), sample i is
    ``values[offsets[i] : offsets[i] + lengths[i]]``; padless copies those rows into a
    packed buffer. ``jagged_dim`` is the dim of the result that is ragged (default 1,
    the one after the batch dim); ``values`` holds it at ``jagged_dim - 1``.
    ``max_seqlen`` avoids reading device metadata on the host. ``min_seqlen`` is accepted
    for compatibility.
    """
    if offsets is None and lengths is None:
        raise RuntimeError("nested_tensor_from_jagged(): At least one of offsets or lengths is required.")
    if jagged_dim is None:
        jagged_dim = 1
    elif jagged_dim < 1:
        raise ValueError(f"Expected jagged_dim >=1, but got {jagged_dim}.")
    r = jagged_dim - 1
    if r >= values.dim():
        raise StructureError(f"nested_tensor_from_jagged(): jagged_dim={jagged_dim} is out of range for values of rank {values.dim()}")
    rows = values.movedim(r, 0) if r else values
    if _traced(values, offsets, lengths):
        if offsets is not None and lengths is not None:
            raise NotImplementedError(
                "nested_tensor_from_jagged(): offsets together with lengths (holes) inside torch.compile; "
                "build the NestedTensor before the compiled region, or pass only offsets or lengths"
            )
        if offsets is None:
            require_integer(lengths, "lengths", "nested_tensor_from_jagged()")
            offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        require_integer(offsets, "offsets", "nested_tensor_from_jagged()")
        return _from_jagged_traced(rows, offsets.to(torch.int64), r, max_seqlen)
    if offsets is not None and lengths is not None:
        starts, lengths = _check_holes(rows, offsets, lengths, r)
        new_off = _layout.offsets_from_counts(lengths)
        total = int(new_off[-1])
        sid = _layout.row_sample_ids(new_off, total)
        local = torch.arange(total) - new_off[:-1].index_select(0, sid)
        idx = starts.cpu().index_select(0, sid) + local
        rows = rows.index_select(0, idx.to(rows.device))
        return from_values(rows, new_off, ragged_dims=(r,), max_seqlen=max_seqlen)
    if offsets is not None:
        return from_values(rows, offsets, ragged_dims=(r,), max_seqlen=max_seqlen)
    return from_values(rows, lengths=lengths, ragged_dims=(r,), max_seqlen=max_seqlen)


def _traced(*ts: Tensor | None) -> bool:
    """Whether a constructor runs inside ``torch.compile`` (or on fake tensors)."""
    return torch.compiler.is_compiling() or any(isinstance(t, Tensor) and _is_traced(t) for t in ts)


@torch._dynamo.allow_in_graph
def _from_jagged_traced(rows: Tensor, offsets: Tensor, r: int, max_seqlen) -> NestedTensor:
    """The NestedTensor of ``rows`` split at ``offsets`` (ragged sample dim ``r``), built as
    one node of a compiled graph: no host metadata, no checks that read data.

    The ragged envelope is ``max_seqlen`` when given, else ``max(lengths)`` read as an
    unbacked size; it is carried as the length of a stride-0 inner tensor
    (:data:`SEQLEN_MAX`), so graphs can return the result and ops keep it symbolic.
    """
    lengths = offsets[1:] - offsets[:-1]
    b = lengths.shape[0]
    static = list(rows.shape[1:])
    if max_seqlen is None:
        m = lengths.max().item() if b else 0
    else:
        m = max_seqlen
    torch._check(m >= 0)
    cols = [lengths.new_full((b,), s) for s in static]
    cols.insert(r, lengths)
    sizes = torch.stack(cols, 1)
    env = list(static)
    env.insert(r, m)
    meta = StructureMeta(None, None)
    meta.derived[(SEQLEN_MAX, rows.device)] = torch.empty(1, dtype=torch.uint8, device=rows.device).expand(m)
    return nested_from_values(rows, offsets, sizes, (r,), env, meta, shared=True)


def _check_holes(rows: Tensor, offsets: Tensor, lengths: Tensor, r: int) -> tuple[Tensor, Tensor]:
    """Host ``(starts, lengths)`` of a holey jagged layout, every window inside ``values``.

    An out-of-range window would make the gather read outside the buffer, so each
    sample's ``[offsets[i], offsets[i] + lengths[i])`` is checked here, on the host.
    """
    what = "nested_tensor_from_jagged()"
    require_integer(offsets, "offsets", what)
    require_integer(lengths, "lengths", what)
    if offsets.dim() != 1 or lengths.dim() != 1 or offsets.shape[0] != lengths.shape[0] + 1:
        raise StructureError(
            f"{what}: offsets must be (B+1,) and lengths (B,), got shapes {tuple(offsets.shape)} and "
            f"{tuple(lengths.shape)}"
        )
    starts = offsets[:-1].to(torch.int64).cpu()
    hl = lengths.to(torch.int64).cpu()
    n = rows.shape[0]
    bad = (hl < 0) | (starts < 0) | (starts + hl > n)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        s, ln = int(starts[i]), int(hl[i])
        problem = f"lengths[{i}]={ln} is negative" if ln < 0 else (
            f"its window [{s}, {s + ln}) (offsets[{i}]={s}, lengths[{i}]={ln}) lies outside values' "
            f"{n} rows along dim {r}"
        )
        raise StructureError(f"{what}: sample {i}: {problem}; every window must fit inside values")
    return starts, hl


def narrow(tensor: Tensor, dim: int, start, length, layout=torch.strided) -> NestedTensor:
    """Sample i is ``tensor[i].narrow(dim - 1, start[i], length[i])``.

    ``start`` and ``length`` are ints or ``(B,)`` tensors (per-sample windows need
    ``dim=1``, as in torch). Differentiable w.r.t. ``tensor``.
    """
    _check_layout("narrow", layout)
    if not isinstance(start, (int, torch.SymInt, Tensor)):
        raise RuntimeError("start must be an integer or a tensor")
    if not isinstance(length, (int, torch.SymInt, Tensor)):
        raise RuntimeError("length must be an integer or a tensor")
    if tensor.dim() < 2:
        raise StructureError(f"narrow(): tensor must be (B, ...) with a sample dim, got {tuple(tensor.shape)}")
    if not isinstance(start, Tensor) and not isinstance(length, Tensor):
        return as_nested_tensor(tensor.narrow(dim, start, length), ragged_dims=(dim - 1,))
    if dim != 1:
        raise RuntimeError("narrow(): per-sample start/length tensors need dim=1 (as in torch.nested)")
    b, n = tensor.shape[0], tensor.shape[1]
    start = torch.as_tensor(start, dtype=torch.int64).cpu().expand(b)
    length = torch.as_tensor(length, dtype=torch.int64).cpu().expand(b)
    bad = (start < 0) | (length < 0) | (start + length > n)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise StructureError(
            f"narrow(): sample {i} asks for [{int(start[i])}, {int(start[i] + length[i])}) along dim 1 of size {n}"
        )
    off = _layout.offsets_from_counts(length.contiguous())
    total = int(off[-1])
    sid = _layout.row_sample_ids(off, total)
    idx = sid * n + start.index_select(0, sid) + torch.arange(total) - off[:-1].index_select(0, sid)
    rows = tensor.reshape(b * n, *tensor.shape[2:]).index_select(0, idx.to(tensor.device))
    return from_values(rows, off)


def to_padded_tensor(input: NestedTensor, padding: float, output_size=None, out: Tensor | None = None) -> Tensor:
    """Dense copy with ``padding`` in padded positions; ``output_size`` may only enlarge."""
    if not isinstance(input, NestedTensor):
        raise TypeError(f"to_padded_tensor(): expected a padless NestedTensor, got {type(input).__name__}")
    res = to_padded(input, padding, output_size)
    if out is not None:
        out.resize_(res.shape).copy_(res)
        return out
    return res


def masked_select(tensor: Tensor, mask: Tensor) -> NestedTensor:
    """One sample per row of ``tensor`` (last dim), holding the elements where ``mask`` is True.

    >>> t = torch.arange(9.).view(3, 3)
    >>> m = torch.tensor([[False, False, True], [True, False, True], [False, False, True]])
    >>> masked_select(t, m).offsets().diff().tolist()
    [1, 2, 1]
    """
    if tensor.layout != torch.strided or isinstance(tensor, NestedTensor):
        raise RuntimeError(f"masked_select requires a strided tensor, given {tensor.layout}")
    if mask.layout != torch.strided:
        raise RuntimeError(f"masked_select requires a strided mask, given: {mask.layout}")
    vals = tensor.masked_select(mask)
    lengths = mask.expand(tensor.shape).sum(dim=tensor.dim() - 1).reshape(-1)
    return from_values(vals, lengths=lengths.to(torch.int64))
