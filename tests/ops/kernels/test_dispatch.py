"""The dispatch point: which implementation runs, why, and its error messages."""

import pytest
import torch

from padless.ops.kernels import dispatch, explain
from padless.ops.kernels.segment import twin_reduce
from padless.ops.common.segment import groups
from padless.testing import make_batch


def test_cpu_default_is_the_twin(monkeypatch):
    monkeypatch.delenv("PADLESS_KERNELS", raising=False)
    nt, _ = make_batch("pair")
    torch.softmax(nt, dim=2)
    c = explain("softmax")
    assert c.backend == "torch" and "not on CUDA" in c.reason


def test_forced_twins(monkeypatch):
    monkeypatch.setenv("PADLESS_KERNELS", "torch")
    nt, _ = make_batch("pair")
    torch.sum(nt, dim=2)
    assert explain("segment_reduce") == dispatch.Choice("torch", "PADLESS_KERNELS=torch")
    assert explain()["segment_reduce"].backend == "torch"


def test_bad_mode_is_an_error(monkeypatch):
    monkeypatch.setenv("PADLESS_KERNELS", "cuda")
    with pytest.raises(ValueError, match=r"PADLESS_KERNELS='cuda' is not a kernel mode; use one of auto, torch, triton"):
        dispatch.mode()


def test_forcing_kernels_on_cpu_needs_the_interpreter(monkeypatch):
    if dispatch.triton_missing() is not None:
        pytest.skip(dispatch.triton_missing())
    monkeypatch.setenv("PADLESS_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    nt, _ = make_batch("seq")
    with pytest.raises(RuntimeError, match=r"segment_reduce: PADLESS_KERNELS=triton with tensors on cpu: .*TRITON_INTERPRET=1"):
        torch.sum(nt, dim=1)


def test_forcing_kernels_without_triton(monkeypatch):
    monkeypatch.setenv("PADLESS_KERNELS", "triton")
    monkeypatch.setattr(dispatch, "triton_missing", lambda: "triton is not importable (ImportError: x)")
    nt, _ = make_batch("seq")
    with pytest.raises(RuntimeError, match=r"segment_reduce: PADLESS_KERNELS=triton but triton is not importable"):
        torch.sum(nt, dim=1)


def test_unknown_reduction_mode():
    nt, _ = make_batch("seq")
    with pytest.raises(ValueError, match=r"segment_reduce\(\): unknown mode 'median'; use one of sum, mean"):
        twin_reduce(nt._values, groups(nt, [0]), "median")
