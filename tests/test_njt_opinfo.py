"""torch's own NJT OpInfo samples against padless, forward and backward
(:mod:`padless.testing.njt_opinfo`): for every op of ``njt_op_db`` and each sample, the op on the
NJT sample and on the same values as padless NestedTensors, compared sample by sample with
the OpInfo's reference (values; gradients of the inputs).

The rule checked: every sample NJT passes, padless passes, or refuses / answers differently
by a rule in ``BY_DESIGN``, or hits a ``KNOWN`` bug. Gradients with respect to padless tensors
converted from the NJTs with their history (intermediates) must match too (issue 39 #7, fixed;
``KNOWN_INTERMEDIATE`` would turn such failures into xfails while a fix is pending).

``make test`` runs a fixed subsample (about three samples per op and phase);
``PADLESS_NJT_OPINFO=full`` runs every sample. The last test prints the counts.
``python -m padless.testing.njt_opinfo [--full]`` prints them without pytest.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("expecttest", reason="torch.testing._internal (the NJT OpInfo database) needs expecttest")

import padless  # noqa: E402
from padless.testing import njt_opinfo  # noqa: E402

FULL = os.environ.get("PADLESS_NJT_OPINFO", "").strip().lower() == "full"
OPS = njt_opinfo.njt_ops()
RESULTS: list = []


pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny cases: no second OpenMP thread


class _FakeOp:
    """An OpInfo-like entry whose op doubles padless inputs (wrong) and is right on NJTs."""

    full_name = "fake_double"
    supports_autograd = True

    @staticmethod
    def op(x):
        return x * (2.0 if isinstance(x, padless.NestedTensor) else 1.0)

    @staticmethod
    def ref(op, sample):
        return torch.nested.as_nested_tensor([c * 1.0 for c in sample.input.unbind()], layout=torch.jagged)


class _Sample:
    def __init__(self, requires_grad):
        parts = [torch.randn(2, 3), torch.randn(4, 3)]
        self.input = torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=requires_grad)
        self.args, self.kwargs, self.name = (), {}, "fake"


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_the_harness_catches_a_wrong_padless_op(phase):
    r = njt_opinfo.check_sample(_FakeOp, 0, _Sample(phase == "backward"), phase)
    assert (r.njt, r.padless) == ("pass", "fail") and not r.ok and "output 0" in r.detail


@pytest.mark.parametrize("op", OPS, ids=[op.full_name for op in OPS])
def test_njt_opinfo_samples(op):
    results = njt_opinfo.run_op(op, FULL)
    RESULTS.extend(results)
    bad = [r for r in results if not r.ok]
    assert not bad, "\n".join(
        f"{r.phase} sample {r.idx} ({r.name}): NJT passes, padless {r.padless}: {r.detail[:400]}" for r in bad[:5]
    )
    inter = [r for r in results if r.inter == "unused"]
    if inter and njt_opinfo.KNOWN_INTERMEDIATE:
        pytest.xfail(f"{len(inter)} samples: gradients wrt converted intermediates: {njt_opinfo.KNOWN_INTERMEDIATE}")


def test_njt_opinfo_counts(capsys):
    """The counts (printed), and the known entries still hold: each one is hit by a sample."""
    if not RESULTS:
        pytest.skip("run with the per-op tests")
    with capsys.disabled():
        print(f"\nNJT OpInfo samples ({'all' if FULL else 'make-test subsample'}):\n" + njt_opinfo.summarize(RESULTS))
    if njt_opinfo.KNOWN_INTERMEDIATE:
        assert any(r.inter == "unused" for r in RESULTS), (
            "no sample's gradient wrt converted intermediates is missing any more: if issue 39 #7's fix is merged, set "
            "padless.testing.njt_opinfo.KNOWN_INTERMEDIATE to None"
        )
    for rule in njt_opinfo.KNOWN if FULL else ():  # the subsample need not meet every rule
        assert any(r.padless == "known" and r.reason == rule.reason for r in RESULTS), (
            f"KNOWN rule for {rule.op} is hit by no sample any more: delete it ({rule.reason})"
        )
