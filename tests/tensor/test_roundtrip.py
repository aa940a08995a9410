"""Property-based round trips on random ragged inputs, zero-length samples included."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import padless


@st.composite
def ragged_batches(draw, max_batch=5, max_len=5):
    ndim = draw(st.integers(1, 3))
    ragged = tuple(sorted(draw(st.sets(st.integers(0, ndim - 1), min_size=1, max_size=ndim))))
    b = draw(st.integers(1, max_batch))
    static = [draw(st.integers(1, 3)) for _ in range(ndim)]
    shapes = [
        tuple(draw(st.integers(0, max_len)) if d in ragged else static[d] for d in range(ndim)) for _ in range(b)
    ]
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes], ragged


SETTINGS = settings(max_examples=60, deadline=None)


@SETTINGS
@given(ragged_batches())
def test_list_round_trip(batch):
    samples, ragged = batch
    nt = padless.from_list(samples, ragged_dims=ragged)
    assert nt.ragged_dims == ragged and nt.numel() == sum(s.numel() for s in samples)
    back = nt.unbind()
    assert len(back) == len(samples)
    for a, b in zip(back, samples):
        assert a.shape == b.shape and torch.equal(a, b)
    assert nt.tolist() == [s.tolist() for s in samples]


@SETTINGS
@given(ragged_batches())
def test_padded_round_trip(batch):
    samples, ragged = batch
    nt = padless.from_list(samples, ragged_dims=ragged)
    padded = nt.to_padded(value=float("nan"))
    sizes = nt.sizes()
    again = padless.from_padded(padded, sizes[:, list(ragged)], ragged_dims=ragged)
    assert torch.equal(again.sizes(), sizes) and torch.equal(again.values(), nt.values())
    assert torch.equal(again.to_padded(value=0.0), nt.to_padded(value=0.0))
    k = len(ragged)
    # A prefix mask over the leading ragged dims. With several ragged dims a sample with no
    # element, e.g. (1, 0), cannot be told from (0, 0) by its mask, so those are skipped.
    unambiguous = k == 1 or all(s.numel() > 0 for s in samples)
    if ragged == tuple(range(k)) and unambiguous:
        m = nt.mask()
        if m.dim() > k + 1:
            m = m.flatten(k + 1)[..., 0]
        again_mask = padless.from_padded(padded, mask=m)
        assert torch.equal(again_mask.sizes(), sizes) and torch.equal(again_mask.values(), nt.values())


@SETTINGS
@given(ragged_batches())
def test_values_round_trip(batch):
    samples, ragged = batch
    nt = padless.from_list(samples, ragged_dims=ragged)
    again = padless.from_values(nt.values(), nt.offsets(), sizes=nt.sizes(), ragged_dims=ragged)
    assert again.same_structure(nt) and again.shape == nt.shape


@st.composite
def jagged_batches(draw):
    b = draw(st.integers(1, 5))
    lengths = [draw(st.integers(0, 6)) for _ in range(b)]
    c = draw(st.integers(1, 4))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    return [torch.randn(n, c, generator=g) for n in lengths]


@SETTINGS
@given(jagged_batches())
def test_njt_round_trip(samples):
    njt = torch.nested.nested_tensor(samples, layout=torch.jagged)
    nt = padless.from_njt(njt)
    for a, b in zip(nt.unbind(), samples):
        assert torch.equal(a, b)
    back = nt.to_njt()
    for a, b in zip(back.unbind(), samples):
        assert torch.equal(a, b)
