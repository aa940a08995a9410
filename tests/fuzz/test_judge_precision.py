"""The judge's low-precision rule (:func:`padless.testing.fuzz.run._as_accurate`): a bfloat16
result that differs from the dense bfloat16 one is right only when it is about as close to the
same chain run in float64 as the dense one is; a wrong answer is never excused by it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from padless.testing.fuzz.core import Case, Side, Step, inputs
from padless.testing.fuzz.run import _as_accurate, run_side


def _case() -> Case:
    step = Step("layer_norm(4)", lambda t, o: F.layer_norm(t, (4,)), family="basic")
    return Case(shapes=[(3, 4), (0, 4), (5, 4)], ragged=(0,), dtype=torch.bfloat16, seed=7, steps=[step], mode="no_grad")


def test_the_padless_answer_is_as_accurate_as_dense():
    case = _case()
    nt, dense = inputs(case.shapes, case.ragged, case.dtype, case.seed, grad=False)
    got = run_side(case.steps, nt, Side(True), case.mode).outs[0]
    refs = [run_side(case.steps, d, Side(False, i), case.mode).outs[0] for i, d in enumerate(dense)]
    assert _as_accurate(case, dense, got, refs, 0, 0.0)


def test_a_wrong_answer_is_not_excused():
    case = _case()
    nt, dense = inputs(case.shapes, case.ragged, case.dtype, case.seed, grad=False)
    got = run_side(case.steps, nt, Side(True), case.mode).outs[0]
    refs = [run_side(case.steps, d, Side(False, i), case.mode).outs[0] for i, d in enumerate(dense)]
    wrong = got * 1.5  # every value off by half of itself: far beyond bfloat16 rounding
    assert not _as_accurate(case, dense, wrong, refs, 0, 0.0)
    assert not _as_accurate(Case(**{**case.__dict__, "dtype": torch.float32}), dense, got, refs, 0, 0.0)
