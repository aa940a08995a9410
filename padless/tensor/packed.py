"""``PackedSequence`` interop: a batch of sequences in the time-major order RNN kernels read.

A NestedTensor of ``(L_i, *F)`` samples stores its rows sample-major. ``torch.nn.utils.rnn``'s
``PackedSequence`` stores the same rows time-major, the samples sorted by length (longest
first): step 0 of every sample, then step 1 of every sample still running, and so on.
Converting is one row gather each way, planned on the host from the batch's lengths.

Three samples of lengths 2, 0, 3 (rows ``a b | | c d e``)::

    values          [a0 a1 c0 c1 c2]     offsets [0, 2, 2, 5]
    sorted order    [2, 0, 1]            (sample 2 is longest; sample 1 is empty)
    batch_sizes     [2, 2, 1]            (samples still running at steps 0, 1, 2)
    packed data     [c0 a0 c1 a1 c2]     = values[rows], rows = [2, 0, 3, 1, 4]

A ``PackedSequence`` cannot hold an empty sample (torch refuses length 0), so
:func:`to_packed_sequence` refuses one; the recurrent modules (``padless.ops.recurrent``)
read the same plan and set empty samples aside.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from padless.tensor import layout
from padless.tensor.autograd import nested_from_values, values_of
from padless.tensor.core import ROW_LEVEL_KEYS, NestedTensor, StructureMeta
from padless.tensor.dynamo import _is_traced
from padless.tensor.errors import StructureError

_KEY = "packed_sequence"
if _KEY not in ROW_LEVEL_KEYS:  # the plan depends on the rows only: a Linear's output keeps it
    ROW_LEVEL_KEYS.append(_KEY)


@dataclasses.dataclass(frozen=True)
class PackPlan:
    """How one batch's rows map to ``PackedSequence`` order (device tensors on the values'
    device, ``batch_sizes`` and ``host_order`` on the CPU). ``n`` samples are non-empty.

    * ``rows``: packed position k holds ``values[rows[k]]`` (``(T,)``);
    * ``unpack``: values row r is packed position ``unpack[r]`` (the inverse permutation);
    * ``order``: the non-empty samples, longest first (ties keep batch order) (``(n,)``);
    * ``empty``: the empty samples, in batch order (``(B - n,)``);
    * ``restore``: sample b sits at ``restore[b]`` in ``order ++ empty`` (``(B,)``);
    * ``identity``: no sample is empty and ``order`` is the batch order (states need no gather).
    """

    batch_sizes: Tensor
    host_order: Tensor
    rows: Tensor
    unpack: Tensor
    order: Tensor
    empty: Tensor
    restore: Tensor
    n: int
    identity: bool


def _time_major_rows(order: Tensor, starts: Tensor, batch_sizes: Tensor) -> Tensor:
    """Values row of every packed position, for samples ``order`` (longest first)."""
    steps = batch_sizes.shape[0]
    t = torch.repeat_interleave(torch.arange(steps), batch_sizes)
    first = torch.cumsum(batch_sizes, 0) - batch_sizes  # packed position of step t's first sample
    j = torch.arange(t.shape[0]) - torch.repeat_interleave(first, batch_sizes)
    return starts[order][j] + t


def _batch_sizes(lengths: Tensor) -> Tensor:
    """Samples still running at each step (``lengths`` on the host)."""
    steps = int(lengths.max()) if lengths.numel() else 0
    counts = torch.bincount(lengths, minlength=steps + 1)
    return (lengths.shape[0] - torch.cumsum(counts, 0))[:steps].contiguous()


def _build(host_sizes: Tensor, host_offsets: Tensor, dev: torch.device) -> PackPlan:
    lengths = host_sizes[:, 0]
    b = lengths.shape[0]
    host_order = torch.sort(lengths, descending=True, stable=True).indices
    n = int((lengths > 0).sum())
    batch_sizes = _batch_sizes(lengths)
    rows = _time_major_rows(host_order[:n], host_offsets[:-1], batch_sizes)
    unpack = torch.empty_like(rows)
    unpack[rows] = torch.arange(rows.shape[0])
    restore = torch.empty_like(host_order)
    restore[host_order] = torch.arange(b)
    empty = host_order[n:].sort().values  # stable sort: the empties are already in batch order
    identity = n == b and bool((host_order == torch.arange(b)).all())

    def on(t: Tensor) -> Tensor:
        return t.to(dev, non_blocking=True)

    return PackPlan(batch_sizes, host_order, on(rows), on(unpack), on(host_order[:n]), on(empty), on(restore), n, identity)


def check_sequences(x: NestedTensor, op: str) -> None:
    """``x`` must be a batch of ``(L_i, *F)`` sequences: one ragged dim, the first."""
    if x._ragged != (0,):
        raise StructureError(
            f"{op}: expects a batch of sequences (B, L_i, *features) whose only ragged dim is the first "
            f"sample dim; this NestedTensor has ragged dims {x.ragged_dims} and {x.sample_dim}-D samples"
        )


def pack_plan(x: NestedTensor, op: str) -> PackPlan:
    """The cached :class:`PackPlan` of ``x``'s rows. Built once per structure from host
    metadata (a batch built on a device without it syncs once, see ``host_sizes``)."""
    check_sequences(x, op)
    if _is_traced(x._values):
        raise NotImplementedError(
            f"{op}: packing sequences by length reads the batch's host metadata; it is not available "
            "inside torch.compile. Run the recurrent module outside the compiled region."
        )
    dev = x._values.device
    m = x._meta
    hit = m.derived.get((_KEY, dev))
    if hit is None:
        hit = _build(x.host_sizes(), x.host_offsets(), dev)
        m.derived[(_KEY, dev)] = hit
    return hit


def to_packed_sequence(x: NestedTensor, enforce_sorted: bool = False) -> PackedSequence:
    """The batch as a ``torch.nn.utils.rnn.PackedSequence`` (what ``pack_sequence(x.unbind(),
    enforce_sorted)`` gives), built with one row gather from host metadata: no device sync.
    Differentiable. Samples must be non-empty (a ``PackedSequence`` cannot hold length 0).

    With ``enforce_sorted=True`` the samples must already be sorted by length, longest first,
    and ``sorted_indices`` is None (as torch does).

    >>> x = NestedTensor.from_list([torch.ones(2, 1), torch.ones(3, 1)])
    >>> ps = to_packed_sequence(x)
    >>> ps.batch_sizes.tolist(), ps.sorted_indices.tolist()
    ([2, 2, 1], [1, 0])
    """
    op = "to_packed_sequence()"
    if not isinstance(x, NestedTensor):
        raise TypeError(f"{op}: expects a NestedTensor, got {type(x).__name__}")
    plan = pack_plan(x, op)
    b = x.batch_size
    if b == 0:
        raise StructureError(f"{op}: the batch holds no sample; a PackedSequence needs at least one")
    if plan.n < b:
        i = int(x._meta.host_sizes[:, 0].eq(0).nonzero()[0, 0])  # host metadata: no sync
        raise StructureError(
            f"{op}: sample {i} has length 0; a PackedSequence cannot hold an empty sequence (torch refuses "
            "length 0). Drop the empty samples first (x[mask] with mask = x.lengths() > 0), or run the "
            "recurrent module on x itself (padless sets empty samples aside there)"
        )
    data = values_of(x).index_select(0, plan.rows)
    if enforce_sorted:
        if not plan.identity:
            lengths = x._meta.host_sizes[:, 0]
            i = int((lengths[1:] > lengths[:-1]).nonzero()[0, 0]) + 1
            raise StructureError(
                f"{op}: enforce_sorted=True needs the samples sorted by length, longest first; sample {i} "
                f"(length {int(lengths[i])}) is longer than sample {i - 1} (length {int(lengths[i - 1])}). "
                "Pass enforce_sorted=False"
            )
        return PackedSequence(data, plan.batch_sizes, None, None)
    return PackedSequence(data, plan.batch_sizes, plan.order, plan.restore)  # no empty sample: order is complete


def from_packed_sequence(ps: PackedSequence) -> NestedTensor:
    """The samples of a ``PackedSequence`` as a NestedTensor of ``(L_i, *F)`` samples, in the
    batch's own order (``sorted_indices`` undone), with one row gather. Differentiable.

    Reads ``batch_sizes`` (always on the CPU) and ``sorted_indices``: one device sync when
    those live on a device (torch keeps them with the data). The recurrent modules never
    call this; they use the batch's own plan.

    >>> x = NestedTensor.from_list([torch.ones(2, 1), torch.ones(3, 1)])
    >>> [tuple(s.shape) for s in from_packed_sequence(to_packed_sequence(x)).unbind()]
    [(2, 1), (3, 1)]
    """
    op = "from_packed_sequence()"
    if not isinstance(ps, PackedSequence):
        raise TypeError(f"{op}: expects a torch.nn.utils.rnn.PackedSequence, got {type(ps).__name__}")
    data, batch_sizes, sorted_indices = ps.data, ps.batch_sizes, ps.sorted_indices
    if isinstance(data, NestedTensor):
        raise TypeError(f"{op}: the PackedSequence's data is a NestedTensor; its data must be the dense packed rows")
    if data.dim() < 1:
        raise StructureError(f"{op}: the packed data must have a row dim, got a 0-d tensor")
    batch_sizes = batch_sizes.to("cpu", torch.int64)
    if int(batch_sizes.sum()) != data.shape[0]:
        raise StructureError(
            f"{op}: batch_sizes sum to {int(batch_sizes.sum())} steps but the data has {data.shape[0]} rows"
        )
    b = int(batch_sizes[0]) if batch_sizes.numel() else 0
    order = torch.arange(b) if sorted_indices is None else sorted_indices.to("cpu", torch.int64)
    b = order.shape[0]
    # Sorted position j runs for as many steps as have more than j samples running.
    sorted_lengths = (batch_sizes.unsqueeze(0) > torch.arange(b).unsqueeze(1)).sum(1)
    lengths = torch.empty_like(sorted_lengths)
    lengths[order] = sorted_lengths
    host_offsets = layout.offsets_from_counts(lengths)
    rows = _time_major_rows(order, host_offsets[:-1], batch_sizes)
    unpack = torch.empty_like(rows)
    unpack[rows] = torch.arange(rows.shape[0])
    dev = data.device
    values = data.index_select(0, unpack.to(dev, non_blocking=True))
    static = list(data.shape[1:])
    host_sizes = torch.tensor([[0, *static]], dtype=torch.int64).repeat(b, 1)
    host_sizes[:, 0] = lengths
    env = (int(lengths.max()) if b else 0, *static)
    meta = StructureMeta(host_sizes, host_offsets)
    offsets = host_offsets.to(dev, non_blocking=True)
    sizes = host_sizes.to(dev, non_blocking=True)
    return nested_from_values(values, offsets, sizes, (0,), env, meta)


__all__ = ["PackPlan", "check_sequences", "from_packed_sequence", "pack_plan", "to_packed_sequence"]
