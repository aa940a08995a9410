"""torch.compile of ops that build new rows or leave the packed layout: ragged ``cat``,
``narrow``, ``gather``, ``nt[i]``, ``to_padded`` / ``from_padded`` (and ``to_padded_tensor``
through torch and ``padless.nested``), ``embedding_bag`` over JaggedTensor / KeyedJaggedTensor.

Every test compiles with ``fullgraph=True`` and runs 8 batches whose batch size (2..9) and
lengths change, with empty samples; compiled outputs (values, sizes, envelope) and
gradients are compared with eager, and eager is compared with the dense op on each sample.
Batches start at B >= 2 with a largest extent >= 2 (Dynamo specialises sizes 0 and 1);
a one-sample batch runs after the graph count is checked (in the ``gather`` test).
aot_eager by default; ``PADLESS_COMPILE_INDUCTOR=1`` runs the ``like=`` round trip on inductor.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import padless
from padless.testing import assert_close_samples

INDUCTOR = os.environ.get("PADLESS_COMPILE_INDUCTOR", "") not in ("", "0")
SIZES = [4, 2, 5, 3, 7, 9, 3, 6]  # batch sizes of the 8 batches (the first: B == a length)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _lengths(g: torch.Generator, b: int, lo: int = 0, hi: int = 7) -> list[int]:
    out = torch.randint(lo, hi, (b,), generator=g).tolist()
    out[0] = max(out[0], 2)  # a largest extent >= 2 (not specialised)
    return out


def _seq(g: torch.Generator, b: int, c: int = 4, lo: int = 0) -> list[torch.Tensor]:
    return [torch.randn(n, c, generator=g) for n in _lengths(g, b, lo)]


def _images(g: torch.Generator, b: int) -> list[torch.Tensor]:
    out = [torch.randn(3, *torch.randint(2, 6, (2,), generator=g).tolist(), generator=g) for _ in range(b)]
    out[0] = torch.randn(3, 2, 5, generator=g)
    if b > 1:
        out[1] = torch.randn(3, 5, 2, generator=g)  # both dims vary
    return out


def _leaf(samples: list[torch.Tensor]) -> padless.NestedTensor:
    return padless.from_list(samples, requires_grad=True)


def _flat(out: Any) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _same(got: torch.Tensor, ref: torch.Tensor) -> None:
    if isinstance(ref, padless.NestedTensor):
        assert isinstance(got, padless.NestedTensor)
        assert tuple(got.shape) == tuple(ref.shape), (tuple(got.shape), tuple(ref.shape))
        assert got.ragged_dims == ref.ragged_dims
        assert torch.equal(got.sizes(), ref.sizes()) and torch.equal(got.offsets(), ref.offsets())
        torch.testing.assert_close(got.values(), ref.values(), atol=1e-5, rtol=1e-5)
    else:
        assert tuple(got.shape) == tuple(ref.shape)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def _loss(outs: list[torch.Tensor]) -> torch.Tensor:
    total = torch.zeros(())
    for o in outs:
        if o.is_floating_point():
            v = o.values() if isinstance(o, padless.NestedTensor) else o
            total = total + (v * v).sum()
    return total


def _check(
    fn: Callable,
    make: Callable[[torch.Generator, int], tuple],
    *,
    backend: str = "aot_eager",
    graphs: int = 1,
    sizes: list[int] = SIZES,
    after: tuple[int, ...] = (),
) -> None:
    """Compiled ``fn`` against eager ``fn`` over ``sizes`` batches (then ``after``, uncounted):
    outputs, then gradients of every input that requires one."""
    cnt = CompileCounterWithBackend(backend)
    cfn = torch.compile(fn, backend=cnt, fullgraph=True)
    for i, b in enumerate(list(sizes) + list(after)):
        if i == len(sizes):
            assert cnt.frame_count <= graphs, f"{cnt.frame_count} graphs over {len(sizes)} batches"
        args = make(torch.Generator().manual_seed(i), b)
        args2 = make(torch.Generator().manual_seed(i), b)
        got, ref = _flat(cfn(*args)), _flat(fn(*args2))
        assert len(got) == len(ref)
        for a, r in zip(got, ref):
            _same(a, r)
        leaves = [t for t in args if isinstance(t, torch.Tensor) and t.requires_grad]
        leaves2 = [t for t in args2 if isinstance(t, torch.Tensor) and t.requires_grad]
        if leaves:
            _loss(got).backward()
            _loss(ref).backward()
            for a, r in zip(leaves, leaves2):
                _same(a.grad, r.grad)


# ---------------------------------------------------------------------------- cat


def test_cat_along_the_ragged_dim_one_graph():
    """Rows: the inputs' rows together (a size the graph has); envelope max(L_i + M_i): a new
    symbol, carried; the result feeds a reduction, to_padded and a pointwise op."""

    def f(x, y):
        z = torch.cat([x, y * 2], 1)
        return z.relu(), z.sum(dim=1), z.to_padded()

    def make(g, b):
        return _leaf(_seq(g, b)), _leaf(_seq(g, b))

    _check(f, make)
    x, y = make(torch.Generator().manual_seed(0), 4)
    assert_close_samples(f(x, y)[0], [torch.cat([a, 2 * b]).relu() for a, b in zip(x.unbind(), y.unbind())])


def test_cat_batches_static_dims_image_heights_flatten_and_relayout():
    """Also ``(C, H_i, W_i).flatten(2)`` (tokens: envelope max H_i*W_i, a new symbol) and a
    cat whose second input is stored transposed (re-laid out from device sizes)."""

    def f(x, y, im, im_t):
        return (
            torch.cat([x, y], 0), torch.cat([im, im.sin()], 2),
            im.flatten(2).to_padded(), torch.cat([im, im_t.transpose(2, 3)], 1),
        )

    def make(g, b):
        ims = _images(g, b)
        return _leaf(_seq(g, b)), _leaf(_seq(g, b)), _leaf(ims), _leaf([s.transpose(1, 2).cos() for s in ims])

    _check(f, make)
    x, y, im, im_t = make(torch.Generator().manual_seed(0), 3)
    out = f(x, y, im, im_t)
    assert_close_samples(out[1], [torch.cat([s, s.sin()], 1) for s in im.unbind()])
    assert_close_samples(out[3], [torch.cat([s, s.cos()], 0) for s in im.unbind()])


# ---------------------------------------------------------------------------- narrow / gather


def test_narrow_of_the_ragged_dim_one_graph():
    """One ragged dim: B * length rows; images: narrowing H gives length * sum W_i rows (new)."""

    def f(x, im):
        return x.narrow(1, -2, 2) * 3, im.narrow(2, 1, 1).cos()

    def make(g, b):
        return _leaf(_seq(g, b, lo=2)), _leaf(_images(g, b))

    _check(f, make)
    x, im = make(torch.Generator().manual_seed(0), 3)
    assert_close_samples(f(x, im)[0], [s[-2:] * 3 for s in x.unbind()])
    assert_close_samples(f(x, im)[1], [s[:, 1:2].cos() for s in im.unbind()])


def test_flat_rows_loss_one_graph():
    """``F.cross_entropy(logits.reshape(-1, V), labels)``: the flat rows (plain dense inside a
    compiled graph) and a loss on them, one graph, equal to eager."""
    import torch.nn.functional as F

    def f(x, lab):
        return F.cross_entropy(x.reshape(-1, 4), lab)

    def make(g, b):
        x = _leaf(_seq(g, b))
        return x, torch.randint(0, 4, (int(x.sizes()[:, 0].sum()),), generator=g)

    _check(f, make)


def test_fixed_windows_of_ragged_dims_one_graph():
    """``x[:, 0:2]`` and boltz's dropout-mask window ``z[:, :, 0:1]`` inside torch.compile: a
    leading window is narrow's (every sample long enough; see the next test for a short one)."""

    def f(x, im):
        return x[:, 0:2] * 3, im[:, :, 0:1].cos()

    def make(g, b):
        return _leaf(_seq(g, b, lo=2)), _leaf(_images(g, b))

    _check(f, make)
    x, im = make(torch.Generator().manual_seed(0), 3)
    assert_close_samples(f(x, im)[0], [s[0:2] * 3 for s in x.unbind()])


def test_narrow_too_short_a_sample_fails_at_run_time_under_compile():
    f = torch.compile(lambda x: x.narrow(1, 1, 3), backend="aot_eager", fullgraph=True)
    x = padless.from_list([torch.randn(5, 2), torch.randn(2, 2)])
    with pytest.raises(RuntimeError, match=r"narrow\(\): a sample is too short along dim 1 for the window start=1, length=3"):
        f(x)


def test_gather_with_sample_local_indices_one_graph():
    def f(x, idx):
        return torch.gather(x, 1, idx) * 2

    def make(g, b):
        samples = _seq(g, b, lo=1)
        ids = [torch.randint(0, s.shape[0], (k, 4), generator=g) for s, k in zip(samples, _lengths(g, b, 0, 5))]
        return _leaf(samples), padless.from_list(ids)

    _check(f, make, after=(1,))  # then a one-sample batch (B = 1 is specialised: a second graph)
    x, idx = make(torch.Generator().manual_seed(0), 3)
    assert_close_samples(f(x, idx), [torch.gather(s, 0, i) * 2 for s, i in zip(x.unbind(), idx.unbind())])


# ---------------------------------------------------------------------------- nt[i]


def test_sample_and_sub_batch_indexing_without_unbind_one_graph():
    """``nt[i]`` is one custom op (the sample's extents are new symbols of the graph); a
    sub-batch (``nt[1:3]``, ``split``/``narrow`` of the batch dim) has new rows and envelope."""

    def f(x, im):
        head, rest = torch.split(x, [1, x.shape[0] - 1], 0)
        return (
            x[1] * 2, x[-1], x[0, ..., 1], im[0][..., 1],
            x[1:3].relu(), rest.sum(dim=1), x.narrow(0, 1, 1).to_padded(),
        )

    def make(g, b):
        return _leaf(_seq(g, b)), _leaf(_images(g, b))

    _check(f, make)
    x, im = make(torch.Generator().manual_seed(0), 3)
    out = f(x, im)
    torch.testing.assert_close(out[0], x.unbind()[1] * 2)
    assert_close_samples(out[4], [s.relu() for s in x.unbind()[1:3]])


def test_sample_indexing_that_drops_a_ragged_dim_asks_for_two_steps():
    f = torch.compile(lambda im: im[0, :, 1], backend="aot_eager", fullgraph=True)
    im = padless.from_list([torch.randn(3, 2, 5), torch.randn(3, 5, 2)])
    with pytest.raises(Exception, match=r"take the sample first and index it next: s = nt\[i\]; s\[\.\.\.\]"):
        f(im)


# ---------------------------------------------------------------------------- to / from padded


def test_to_padded_every_spelling_is_b_by_max_n_symbolic():
    def f(x):
        return (
            padless.to_padded(x, -1.0),
            padless.nested.to_padded_tensor(x, 0.5),
            x.to_padded_tensor(0.0, (x.shape[0], x.shape[1] + 2, 4)),
        )

    def make(g, b):
        return (_leaf(_seq(g, b)),)

    _check(f, make)
    (x,) = make(torch.Generator().manual_seed(0), 3)
    n = max(s.shape[0] for s in x.unbind())
    want = torch.stack([torch.cat([s, s.new_full((n - s.shape[0], 4), -1.0)]) for s in x.unbind()])
    torch.testing.assert_close(f(x)[0], want)


def test_from_padded_like_round_trip():
    """``from_padded(dense(x.to_padded()), like=x)`` keeps x's rows: it adds to x in one graph.
    aot_eager here; ``PADLESS_COMPILE_INDUCTOR=1`` runs it on inductor (12 s on this CPU)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)

    def f(x):
        return padless.from_padded(lin(x.to_padded()).tanh(), like=x) + x

    def make(g, b):
        return (_leaf(_seq(g, b)),)

    _check(f, make, backend="inductor" if INDUCTOR else "aot_eager")
    (x,) = make(torch.Generator().manual_seed(0), 3)
    assert_close_samples(f(x), [lin(s).tanh() + s for s in x.unbind()], atol=1e-6, rtol=1e-5)


def test_from_padded_lengths_and_mask_one_graph():
    """Lengths are runtime data: the rows and the envelope are new symbols. (The dense input
    is marked dynamic; unmarked, Dynamo recompiles once at warm-up, as for any dense tensor.)"""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 6)

    def f(p, lens, mask):
        z = padless.from_padded(lin(p), lens)
        return z * 2, z.sum(dim=1), z.to_padded(), padless.from_padded(p, mask=mask)

    def make(g, b):
        lens = torch.tensor(_lengths(g, b))
        p = torch.randn(b, 7, 4, generator=g, requires_grad=True)
        mask = torch.arange(7) < torch.tensor(_lengths(g, b))[:, None]
        for t in (p, lens, mask):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        return p, lens, mask

    _check(f, make)
    p, lens, mask = make(torch.Generator().manual_seed(0), 3)
    assert_close_samples(f(p, lens, mask)[0], [lin(p[i, : lens[i]]) * 2 for i in range(3)])


def test_from_padded_mask_not_a_prefix_fails_at_run_time_under_compile():
    f = torch.compile(lambda p, m: padless.from_padded(p, mask=m), backend="aot_eager", fullgraph=True)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0, 2] = False
    with pytest.raises(RuntimeError, match=r"from_padded: mask is not a prefix mask \(a True after a False in some sample\)"):
        f(torch.randn(2, 5, 3), mask)


def test_from_padded_like_errors():
    x = padless.from_list([torch.randn(3, 2), torch.randn(5, 2)])
    with pytest.raises(padless.StructureError, match=r"from_padded\(like=\): padded of shape \(3, 5, 2\) must have like's batch size 2"):
        padless.from_padded(torch.zeros(3, 5, 2), like=x)
    with pytest.raises(padless.StructureError, match=r"from_padded\(like=\): padded has extent 4 along ragged dim 1, less than like's envelope 5"):
        padless.from_padded(torch.zeros(2, 4, 2), like=x)
    with pytest.raises(padless.StructureError, match=r"like= gives the whole structure; pass no lengths, mask or ragged_dims"):
        padless.from_padded(torch.zeros(2, 5, 2), torch.tensor([3, 5]), like=x)
    with pytest.raises(TypeError, match=r"from_padded\(like=\): like must be a padless NestedTensor, got Tensor"):
        padless.from_padded(torch.zeros(2, 5, 2), like=torch.zeros(2, 5, 2))


def test_from_padded_like_eager_shares_the_structure_and_takes_new_static_extents():
    x = padless.from_list([torch.randn(3, 2), torch.randn(0, 2), torch.randn(5, 2)], requires_grad=True)
    y = padless.from_padded(x.to_padded(), like=x)
    assert y._meta is x._meta and torch.equal(y.values(), x.values())
    wide = torch.randn(3, 6, 7, requires_grad=True)  # padded beyond the envelope, 7 channels
    z = padless.from_padded(wide, like=x)
    assert z.shape == (3, 5, 7)
    assert_close_samples(z, [wide[0, :3], wide[1, :0], wide[2, :5]])
    z.values().sum().backward()
    assert wide.grad.sum() == 8 * 7


# ---------------------------------------------------------------------------- pooled embeddings


def test_embedding_bag_of_jagged_and_keyed_jagged_one_graph():
    """JaggedTensor / KeyedJaggedTensor are plain objects holding dense tensors: marked dynamic
    here (unmarked, Dynamo recompiles once at warm-up). Gradients reach the tables."""
    torch.manual_seed(0)
    shared = torch.nn.EmbeddingBag(20, 4)
    tables = torch.nn.ModuleDict({"a": torch.nn.Embedding(20, 4), "b": torch.nn.Embedding(30, 3)})

    def f(jt, kjt, w):
        one = padless.ops.embedding_bag(jt, shared.weight, mode="mean")
        keyed = padless.ops.embedding_bag(kjt, tables)
        weighted = padless.ops.embedding_bag(kjt, shared, per_sample_weights=w)
        return one.values(), keyed.values(), weighted["b"]

    def make(g, b):
        lens = torch.tensor(_lengths(g, b, 0, 5))
        jt = padless.JaggedTensor(values=torch.randint(0, 20, (int(lens.sum()),), generator=g), lengths=lens)
        klens = torch.tensor(_lengths(g, 2 * b, 0, 5))
        kjt = padless.KeyedJaggedTensor(
            keys=["a", "b"], values=torch.randint(0, 20, (int(klens.sum()),), generator=g), lengths=klens
        )
        w = torch.rand(int(klens.sum()), generator=g)
        for t in (jt.values(), lens, kjt.values(), klens, w):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        return jt, kjt, w

    def grads() -> list[torch.Tensor]:
        out = [p.grad.clone() for p in [shared.weight, *tables.parameters()]]
        shared.zero_grad(), tables.zero_grad()
        return out

    cnt = CompileCounterWithBackend("aot_eager")
    cf = torch.compile(f, backend=cnt, fullgraph=True)
    for i, b in enumerate(SIZES):
        args = make(torch.Generator().manual_seed(i), b)
        got = cf(*args)
        _loss(list(got)).backward()
        g_got = grads()
        ref = f(*args)
        _loss(list(ref)).backward()
        for a, r in zip(list(got) + g_got, list(ref) + grads()):
            torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)
    assert cnt.frame_count == 1, f"{cnt.frame_count} graphs"
    jt, kjt, _ = make(torch.Generator().manual_seed(0), 3)
    keyed = f(jt, kjt, None)[1]
    a_ids = [kjt.values()[int(s):int(e)] for s, e in zip(kjt.offsets()[:3], kjt.offsets()[1:4])]
    torch.testing.assert_close(keyed[:, :4], torch.stack([tables["a"](i).sum(0) for i in a_ids]))
