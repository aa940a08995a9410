"""Triton kernels with torch twins, one family per module, chosen in one place.

* :mod:`~padless.ops.kernels.segment`: segmented sum/mean/amax/amin/logsumexp/var
* :mod:`~padless.ops.kernels.softmax`: ragged softmax / log_softmax (fused fwd and bwd)
* :mod:`~padless.ops.kernels.pair`: pair construction ``x[i, a] (+|*) y[i, b] (+ z)``
* :mod:`~padless.ops.kernels.layout`: packed <-> padded, mask
* :mod:`~padless.ops.kernels.grouped_mm`: per-sample matmuls in one launch
* :mod:`~padless.ops.kernels.dispatch`: the choice between kernel and twin, and ``explain()``

``triton`` is imported lazily (only when a kernel is about to run); the package
imports without it and then always runs the twins.
"""

from padless.ops.kernels.dispatch import Choice, explain
from padless.ops.kernels import layout as _layout  # noqa: F401  (registers the to_padded kernel)

__all__ = ["Choice", "explain"]
