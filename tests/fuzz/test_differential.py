"""Differential fuzzer: random op chains over random ragged structures, forward and
gradients, against per-sample dense torch (builders in :mod:`padless.testing.fuzz`).

``PADLESS_FUZZ_EXAMPLES`` sets the number of cases (default 25, a few seconds); a long
run, e.g. ``PADLESS_FUZZ_EXAMPLES=3000 pytest tests/fuzz``, explores further.
``PADLESS_FUZZ_RANDOM=1`` draws new cases every run instead of the fixed sequence.
"""

from __future__ import annotations

import os

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from padless.testing.fuzz import Case, Step, draw_case, run_case  # noqa: E402

EXAMPLES = int(os.environ.get("PADLESS_FUZZ_EXAMPLES", "25"))
DERANDOMIZE = os.environ.get("PADLESS_FUZZ_RANDOM") is None


class _HypothesisChooser:
    def __init__(self, data) -> None:
        self.data = data

    def integer(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))

    def choice(self, options):
        return self.data.draw(st.sampled_from(list(options)))


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny tensors: a second OpenMP thread only adds wake-up latency on a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=DERANDOMIZE,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
@given(st.data())
def test_op_chains_match_per_sample_dense_torch(data):
    case = draw_case(_HypothesisChooser(data))
    run_case(case)


def test_fuzzer_reports_a_wrong_op_with_its_case():
    """The harness itself: a step that differs between the two sides is caught and named."""
    wrong = Step("wrong", lambda x, o: x * (2.0 if o else 1.0))
    case = Case([(2, 3), (0, 3)], (0,), torch.float32, 0, [wrong])
    with pytest.raises(AssertionError, match=r"steps=\[wrong\]"):
        run_case(case)
