"""The main process does no structure computation on a collated batch: its first use of
every precomputed piece of metadata is a cache hit (counted as calls into
padless.tensor.layout, where all structure arithmetic lives)."""

from __future__ import annotations

import functools
import pickle

import pytest
import torch
from torch.utils.data import DataLoader

import padless
from padless import Collator, Field
from padless.collation import collated_plan
from padless.ops.common import broadcast
from padless.tensor import layout
from padless.testing import assert_close_samples

_COUNTED = ("row_counts", "offsets_from_counts", "row_sample_ids", "row_coords", "padded_row_index",
            "partitions", "source_rows", "relayout_rows")


@pytest.fixture
def layout_calls(monkeypatch):
    calls: list[str] = []
    for name in _COUNTED:
        fn = getattr(layout, name)

        @functools.wraps(fn)
        def counted(*a, _fn=fn, _name=name, **k):
            calls.append(_name)
            return _fn(*a, **k)

        monkeypatch.setattr(layout, name, counted)
    return calls


def _samples(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 9, (n,), generator=g).tolist()
    return [{"ids": torch.randint(0, 50, (m,), generator=g), "x": torch.randn(m, 4, generator=g),
             "img": torch.randn(2, m, m + 1, generator=g)} for m in lens]


COLLATOR = Collator({
    "ids": Field(ragged=0, position_ids="pos", labels="labels", row_maps=True),
    "x": Field(ragged=0, pair=True, padded_index=True, row_maps=True),
    "img": Field(ragged=(1, 2), padded_index=True, row_maps=True),
})


def _model_step(b) -> None:
    """What a training loop touches: kernel metadata, pair creation and reductions, padding."""
    x = b.x.detach().requires_grad_()
    b.x.cu_seqlens(), b.x.row_sample_ids(), b.x.max_seqlen(), b.x.partitions()
    p = x.unsqueeze(2) + x.unsqueeze(1)
    q = x.unsqueeze(1) * x.unsqueeze(2)
    loss = p.mean(dim=2).pow(2).mean() + q.sum(dim=1).mean() + torch.softmax(p, dim=2).amax(dim=2).mean()
    loss = loss + x.mean(dim=1).sum() + (x * torch.ones(len(b), 1, 4)).sum()
    loss.backward()
    b.padded("x"), b.padded("img"), b.hf_kwargs("ids"), b.flash_attn_kwargs("ids")
    b.img.mean(dim=(2, 3)), b.img.cu_seqlens(), b.img.row_sample_ids(), b.img.partitions()


def test_main_process_does_no_structure_computation(layout_calls):
    """Batches come from a worker process; the main process only reads caches."""
    loader = DataLoader(_samples(8), batch_size=4, num_workers=1, collate_fn=COLLATOR)
    n = 0
    for b in loader:
        _model_step(b)
        n += 1
    assert n == 2
    assert layout_calls == [], sorted(set(layout_calls))


def test_pickled_batch_needs_no_structure_computation(layout_calls):
    b = COLLATOR(_samples())
    layout_calls.clear()  # collation itself (the worker's share) is allowed to compute
    _model_step(pickle.loads(pickle.dumps(b)))
    assert layout_calls == [], sorted(set(layout_calls))


def test_control_uncollated_batch_computes(layout_calls):
    """The counter sees the work a batch without collated metadata does."""
    b = COLLATOR(_samples())
    plain = padless.Batch({k: (padless.from_list(list(v.unbind()), ragged_dims=v.ragged_dims)
                               if isinstance(v, padless.NestedTensor) else v) for k, v in b.items()}, len(b))
    layout_calls.clear()
    x = plain.x
    x.unsqueeze(2) + x.unsqueeze(1)
    assert "source_rows" in layout_calls


def test_cached_results_equal_fresh_results():
    samples = _samples()
    b = COLLATOR(samples)
    fresh = padless.from_list([s["x"] for s in samples])
    for f in (lambda x: x.unsqueeze(2) + x.unsqueeze(1), lambda x: (x.unsqueeze(2) * x.unsqueeze(1)).mean(dim=2),
              lambda x: x.mean(dim=1), lambda x: x.cu_seqlens(), lambda x: x.row_sample_ids()):
        got, want = f(b.x), f(fresh)
        if isinstance(got, padless.NestedTensor):
            assert_close_samples(got, [s for s in want.unbind()])
        else:
            assert torch.equal(got, want)


def test_transformed_fields_reach_the_maps_through_the_plan_hook(layout_calls):
    """``u(x).unsqueeze(2) + v(x).unsqueeze(1)``: the collated maps reach the op layer
    through ``padless.ops.common.broadcast.PLAN_PROVIDERS``; no layout work in the main process."""
    assert collated_plan in broadcast.PLAN_PROVIDERS
    samples = _samples()
    b = COLLATOR(samples)
    u, v = torch.nn.Linear(4, 8), torch.nn.Linear(4, 8)
    layout_calls.clear()
    with torch.no_grad():
        p = u(b.x).unsqueeze(2) + v(b.x).unsqueeze(1)
        r = v(b.x).unsqueeze(1) + u(b.x).unsqueeze(2)
    assert layout_calls == [], sorted(set(layout_calls))
    with torch.no_grad():
        ref = [u(s["x"]).unsqueeze(1) + v(s["x"]).unsqueeze(0) for s in samples]
    assert_close_samples(p, ref)
    assert_close_samples(r, ref)
    assert collated_plan("add", [b.x, b.x]) is None  # anything else is left to the op layer
