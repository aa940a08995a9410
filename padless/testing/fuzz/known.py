"""What the fuzzer knows to be broken today, as data: one entry per mechanism (a tag that the
steps using it carry, see :attr:`padless.testing.fuzz.core.Step.tags`), with the finding it
belongs to. A case that fails at a step carrying a listed tag (or, for the case-level tags,
that fails otherwise or not at all once that mode is switched off) is an expected failure: the tests count it and
mark the run xfail (not strict) instead of failing. Delete an entry once its fix is merged:
``tests/fuzz/test_known_bugs.py`` checks that a targeted draw still finds every entry, and
fails naming the entry when it no longer does.

``KNOWN_BUGS``: wrong values or crashes (any outcome but a pass). ``KNOWN_GAPS``: refusals
of code that has one clear per-sample meaning (a refusal where a sample alone also fails is a
correct outcome and needs no entry); only a refusal is excused by a gap entry.
"""

from __future__ import annotations

from padless.testing.fuzz.padded import OPERAND_DATA_WRITE
from padless.testing.fuzz.shapes import (
    EXTENT_MINMAX, FLATTEN_TRANSPOSED, RESHAPE_EXTENTS, RESHAPE_PLAIN, VIEW_REINTERPRET,
)
from padless.testing.fuzz.vision import IMAGES_TRANSPOSED
from padless.testing.fuzz.writes import STACK_WRITE, WINDOW_INPLACE, WINDOW_SETITEM

# case-level tags: set when a failure goes away, or changes, with that mode off (padless.testing.fuzz.run.judge)
INFERENCE_MODE = "inference_mode"
GRAD_INTERMEDIATE = "grad_intermediate"

KNOWN_BUGS: dict[str, str] = {
}

KNOWN_GAPS: dict[str, str] = {
    EXTENT_MINMAX: "documented (docs/tensor.md, envelope extents; issue 39 #2): max()/min() of sizes read from one "
    "batch's shape whose order differs between samples is refused, naming padless.extent_max / extent_min",
    FLATTEN_TRANSPOSED: "documented (docs/limits.md, ops): flatten() of two ragged dims stored in the other order "
    "(after a transpose), and view(-1, C) of such a batch, are refused: their elements are not adjacent in each "
    "sample's rows; .contiguous() first (reshape(-1, C) copies the rows in order)",
    STACK_WRITE: "documented (docs/tokens.md, stacking): torch.stack of NestedTensors keeps copy semantics "
    "without copying: a StackedBatch whose member was written in place after stacking refuses every use, "
    "naming the fix (stack after the write, or stack clones)",
    IMAGES_TRANSPOSED: "documented (docs/limits.md, vision): images must be (C, H_i, W_i) with both spatial dims "
    "ragged, stored in that order; spatial ops refuse a batch transposed to (C, W_i, H_i)",
    VIEW_REINTERPRET: "documented (docs/tensor.md, shape idioms): view() never copies, so a target that "
    "reads every sample's memory in a new shape is refused by view and done by reshape",
    RESHAPE_PLAIN: "documented (docs/tensor.md, shape idioms): a target without sizes read from a shape "
    "(x.reshape(B, -1) of images) must keep the batch dim and every ragged dim",
}


def known_reason(status: str, tags: frozenset) -> str | None:
    """The entry that excuses an outcome ``status`` at a step with ``tags``, or None (a gap
    entry is looked up first for a refusal)."""
    if status in ("pass", "refused", "lenient"):
        return None
    tables = (KNOWN_GAPS, KNOWN_BUGS) if status == "gap" else (KNOWN_BUGS,)
    for table in tables:
        for tag in sorted(tags):
            if tag in table:
                return f"{tag}: {table[tag]}"
    return None
