"""The fuzzer does not report torch's own position-dependent results as padless's (issue 25, item 10).

Torch's CPU ``gelu`` gives NaN for ``+inf`` in its vectorised loop (a packed buffer) and inf in
its scalar loop (a one-element tensor): a per-sample reference cannot judge padless there, so
such a step is compared with torch's dense op on the same packed values.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from padless.testing.fuzz import Case, Step, run_case, torch_disagrees

TO_INF = Step("to_inf", lambda x, o: x * 0 + float("inf"), pointwise=True)
GELU = Step("gelu", lambda x, o: F.gelu(x), pointwise=True)


def test_torch_disagrees_with_itself_on_gelu_of_inf() -> None:
    one = torch.full((1,), float("inf"))
    assert torch_disagrees(GELU, one, F.gelu(one))
    x = torch.randn(3)
    assert not torch_disagrees(GELU, x, F.gelu(x))


def test_gelu_of_inf_in_a_one_row_sample_is_not_reported() -> None:
    # sample 0 has one row: alone, torch's scalar loop gives inf; packed with sample 1, NaN
    run_case(Case([(1,), (20,)], (0,), torch.float32, 0, [TO_INF, GELU]))
    run_case(Case([(1, 2), (9, 2)], (0,), torch.bfloat16, 3, [TO_INF, GELU, Step("tanh", lambda x, o: torch.tanh(x), pointwise=True)]))


def test_a_wrong_pointwise_step_is_still_caught_on_packed_values() -> None:
    wrong = Step("wrong_gelu", lambda x, o: F.gelu(x) * (2.0 if o else 1.0), pointwise=True)
    half_inf = Step("half_inf", lambda x, o: torch.where(x > 0, x * 0 + float("inf"), x), pointwise=True)
    with pytest.raises(AssertionError, match=r"step 1 \(wrong_gelu\) differs from torch's dense op on the same packed values"):
        run_case(Case([(1,), (20,)], (0,), torch.float32, 0, [half_inf, wrong]))
    broken_before = Step("wrong", lambda x, o: x * (2.0 if o else 1.0))  # the steps before are still judged per sample
    with pytest.raises(AssertionError, match=r"steps=\[half_inf, wrong, gelu\]"):
        run_case(Case([(1,), (20,)], (0,), torch.float32, 0, [half_inf, broken_before, GELU]))
