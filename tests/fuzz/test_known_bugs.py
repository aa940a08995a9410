"""Every entry of the fuzzer's known-failure lists (:mod:`padless.testing.fuzz.known`) is still
found by a targeted draw of the generator on the current code: the generator reaches each
mechanism, and the lists hold nothing that no longer fails. When a fix is merged, the test of
its entry fails, saying to delete the entry (then the differential test guards the fix)."""

from __future__ import annotations

import random

import pytest

from padless.testing.fuzz import KNOWN_BUGS, KNOWN_GAPS, RandomChooser, draw_case, judge

#: tag -> (families, layout, modes) of the targeted draws that find it
TARGETS = {
    "reshape_extents": ({"reshape"}, "images", None),
    "reshape_plain": ({"reshape"}, "tokens", None),
    "extent_minmax": ({"interpolate"}, "images", None),
    "operand_data_write": ({"padded"}, None, {"no_grad"}),
    "window_inplace": ({"window_write"}, None, {"no_grad"}),
    "window_setitem": ({"window_write"}, None, {"no_grad"}),
    "stack_write": ({"stack"}, None, {"no_grad"}),
    "inference_mode": ({"basic"}, "tokens", {"inference"}),
    "grad_intermediate": ({"basic"}, "tokens", {"grad"}),
    "window_extent_bound": ({"window"}, "tokens", {"no_grad"}),
    "view_reinterpret": ({"reshape"}, "images", {"no_grad"}),
    "images_transposed": ({"basic", "interpolate", "batch_dense"}, "images", {"no_grad"}),
    "flatten_transposed": ({"basic", "reshape"}, "images", {"no_grad"}),
}

TRIES = 400


def _find(tag: str, table: dict) -> str | None:
    families, layout, modes = TARGETS[tag]
    for seed in range(TRIES):
        case = draw_case(RandomChooser(random.Random(seed)), families=families, layout=layout, modes=modes)
        v = judge(case)
        if v.known is not None and v.known.split(":", 1)[0] == tag and (table is KNOWN_BUGS) == (v.status != "gap"):
            return f"seed {seed}: {case!r}"
    return None


pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny cases: no second OpenMP thread


def test_every_entry_has_a_target():
    assert set(KNOWN_BUGS) | set(KNOWN_GAPS) <= set(TARGETS)


@pytest.mark.parametrize("table,tag", [(KNOWN_BUGS, t) for t in KNOWN_BUGS] + [(KNOWN_GAPS, t) for t in KNOWN_GAPS],
                         ids=[f"bug-{t}" for t in KNOWN_BUGS] + [f"gap-{t}" for t in KNOWN_GAPS])
def test_known_entry_is_still_found(table, tag):
    found = _find(tag, table)
    kind = "KNOWN_BUGS" if table is KNOWN_BUGS else "KNOWN_GAPS"
    assert found is not None, (
        f"no targeted draw hits {kind}[{tag!r}] any more ({table[tag]}); if its fix is merged, delete the entry "
        "from padless/testing/fuzz/known.py (and its TARGETS line here)"
    )
