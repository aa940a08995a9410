"""Broadcasting ops on few large samples: one dense op per sample on views of the rows.

The general broadcast path (:mod:`padless.ops.common.broadcast`) maps every operand onto the
result's rows with one gather each. A gather costs per row, whatever the row's width, so where
rows are narrow and samples large (triangle-attention scores ``(N_i, H, N_i, N_i)`` with two
heads, plus a bias ``(1, H, N_i, N_i)`` or a mask ``(N_i, 1, 1, N_i)``) it costs several times
the op. With a handful of samples of many rows each, this path runs the op once per sample on
views: every operand's rows of sample ``i`` viewed with its dense sample shape (extent 1 where it
broadcasts), so torch's own broadcasting does the mapping and nothing is gathered::

    scores rows of sample i  (N_i * N_i * N_i, H)  -> view (N_i, H, N_i, N_i)
    bias rows of sample i    (N_i * N_i, H)        -> view (1, H, N_i, N_i)
    scores_i.add_(bias_i)                             (in place: writes the scores' rows)

Out of place, each sample's result is laid back into rows (one copy) and the samples are
concatenated. Segmented sums and means over ragged dims (the gradient of a broadcast bias, a
mean over a pair axis) take the same route in :mod:`padless.ops.common.segment`. Only eager
CPU calls whose tensor operands are all NestedTensors with host
metadata, with at least :data:`ROWS_PER_SAMPLE` result rows per sample, take it; on an
accelerator the single gather launch is cheaper than a launch per sample.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from padless.tensor import layout
from padless.tensor.core import NestedTensor, _is_traced

ROWS_PER_SAMPLE = 4096
"""Result rows per sample from which per-sample views beat one gather per operand (measured on
the project's CPU: ``(N, 2, N, N)`` scores plus a bias, N 22..42, 4 samples: 0.2 vs 0.7 ms)."""

MAX_SAMPLES = 32


def pays(b: int, total, device: torch.device) -> bool:
    """Whether ``b`` samples of ``total`` rows on ``device`` are few and large enough for per-sample
    views (eager CPU only)."""
    return (0 < b <= MAX_SAMPLES and isinstance(total, int) and total >= ROWS_PER_SAMPLE * b
            and device.type == "cpu" and not torch.compiler.is_compiling())


def eligible(template: NestedTensor, nts: list[NestedTensor], args: tuple, kwargs: dict) -> bool:
    """Whether :func:`run` takes this call (see the module docstring)."""
    if not pays(template.batch_size, template._values.shape[0], template._values.device):
        return False
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor) and not isinstance(a, NestedTensor) and a.dim() > 0:
            return False  # dense operands keep the rows path
    # deferred rows (attention scores, padless.ops.pairs.pending) take the rows path: sliced
    # per sample they would be computed; on rows a bias read onto them extends their recipe
    return all(n._meta.host_sizes is not None and not _is_traced(n._values)
               and not getattr(type(n._values), "padless_deferred", False) for n in nts)


def _views(n: NestedTensor) -> list[Tensor]:
    hs, ho = n._meta.host_sizes.tolist(), n.host_offsets().tolist()
    order = layout.storage_order(len(hs[0]) if hs else 0, n._ragged)
    return [layout.sample_view(n._values[ho[i] : ho[i + 1]], hs[i], order) for i in range(len(hs))]


NOT_TAKEN = object()


def run(func: Callable, args: tuple, kwargs: dict, nts: list[NestedTensor], template: NestedTensor, inplace: bool):
    """``func`` sample by sample on views; in place writes the first operand's rows, else the
    result's rows (``template``'s layout) are returned. :data:`NOT_TAKEN` when ``func`` turns
    out not to return one tensor (``frexp``): the caller takes the rows path."""
    views = {id(n): _views(n) for n in nts}
    out_hs = template._meta.host_sizes.tolist()
    order = layout.storage_order(template.sample_dim, template._ragged)
    nr = len(template._ragged)
    parts = []
    for i, shape in enumerate(out_hs):
        if parts and 0 in [shape[d] for d in template._ragged]:
            continue  # an empty sample adds no rows (the first one still runs: the result's dtype)
        a_i = [views[id(a)][i] if isinstance(a, NestedTensor) else a for a in args]
        k_i = {k: views[id(a)][i] if isinstance(a, NestedTensor) else a for k, a in kwargs.items()}
        r = func(*a_i, **k_i)
        if not isinstance(r, Tensor):
            return NOT_TAKEN  # only the first sample ran, and out of place (no write to undo)
        if not inplace:
            rows = math.prod(r.shape[d] for d in order[:nr])
            parts.append(r.permute(order).reshape(rows, *[r.shape[d] for d in order[nr:]]))
    if inplace:
        return None
    if not parts:  # no samples
        static = [template._env[d] for d in order[nr:]]
        return template._values.new_empty((0, *static))
    return torch.cat(parts)
