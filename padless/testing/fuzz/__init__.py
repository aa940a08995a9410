"""The differential fuzzer: random op chains over random ragged batches, against the same
code run on every dense sample alone.

A *case* is a batch (a named layout of padded code, tokens ``(L_i, C)``, heads
``(H, L_i, D)``, images ``(C, H_i, W_i)``, square pairs ``(N_i, N_i, C)``, or a random
structure of one to three ragged dims; empty samples and one-sample batches included;
float32/float64/bf16), a mode (grad, no_grad, inference_mode; in grad mode sometimes the
gradient of an intermediate too) and a chain of steps drawn one after the other, each from
the steps that apply to the current result. Every step is one callable ``fn(x, o)`` written
once for both sides: ``o`` is ``1`` on the NestedTensor (dim 0 is the batch) and ``0`` on one
dense sample (a :class:`~padless.testing.fuzz.core.Side`, which also carries the sample's
index and the dense operands of the run). The families (:data:`~padless.testing.fuzz.draw.FAMILIES`):

========== ==================================================================================
basic      pointwise and feature ops, softmax, reductions, cumsum, transposes, pair states
reshape    reshape/view targets from ``x.shape``/``x.size(d)`` and their arithmetic; tokens
           ``x.flatten(2).transpose(1, 2)`` and back by ``reshape(B, C, h, w)``
rows       ``x.reshape(-1, C)`` / ``view``, a row op, ``rows.reshape(x.shape)`` back
window     ``x[:, a:b]``, ``x[:, -1]``, bounds from the shape (``x[:, :L - 1]``)
window_write  ``x[:, :1].zero_()``, ``x[:, -1] = v``, ``x[:, a:b] += v`` (on a clone)
inplace    ``add_``, ``mul_``, ``+=``, ``clamp_``, ``masked_fill_`` on a clone
stack      ``torch.stack([a, b])`` then ``.sum(0)``/``.mean(0)``/``[k]``, with a later write to
           an input
padded     dense operands in padded coordinates (positions, masks, pair biases, attention
           masks; buffers and parameters) and writes to them between two reads
interpolate  ``F.interpolate`` to sizes from shapes (``h // 2``, ``max(h, w)``), scale factors,
           a U-Net skip (``size=skip.shape[2:]``)
batch_dense  pyramid pooling: ``adaptive_avg_pool2d`` then ``interpolate(size=(h, w))``
========== ==================================================================================

:func:`~padless.testing.fuzz.run.judge` runs a case on both sides and returns a
:class:`~padless.testing.fuzz.run.Verdict` (pass, refused where a sample refuses too, gap,
wrong, error), attributed to a step and its tags; :mod:`padless.testing.fuzz.known` lists,
as data, the failures known today. Choices come from a :class:`Chooser` (``integer``/
``choice``), so the same builders run under hypothesis (``tests/fuzz/``, which shrinks
failures) or from :class:`random.Random` (:class:`RandomChooser`), as the sweep does::

    python -m padless.testing.fuzz --examples 5000 --seed 0

    >>> import random
    >>> case = draw_case(RandomChooser(random.Random(0)))
    >>> run_case(case)  # raises AssertionError naming the case unless it passes
"""

from padless.testing.fuzz.core import (
    DTYPES,
    LAYOUTS,
    MODES,
    TOLERANCES,
    Case,
    Chooser,
    RandomChooser,
    Side,
    Step,
    draw_layout,
    draw_structure,
)
from padless.testing.fuzz.draw import FAMILIES, applicable, draw_case
from padless.testing.fuzz.known import KNOWN_BUGS, KNOWN_GAPS, known_reason
from padless.testing.fuzz.run import Verdict, judge, run_case, torch_disagrees

__all__ = [
    "DTYPES",
    "FAMILIES",
    "KNOWN_BUGS",
    "KNOWN_GAPS",
    "LAYOUTS",
    "MODES",
    "TOLERANCES",
    "Case",
    "Chooser",
    "RandomChooser",
    "Side",
    "Step",
    "Verdict",
    "applicable",
    "draw_case",
    "draw_layout",
    "draw_structure",
    "judge",
    "known_reason",
    "run_case",
    "torch_disagrees",
]
