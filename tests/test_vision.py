"""padless.vision: position embeddings and token dropping, image by image against dense references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import padless
from padless.testing import assert_close_samples
from padless.vision import apply_rope_2d, drop_tokens, factorized_pos_embed, grid_sizes, interpolate_pos_embed, rope_2d, take_tokens

P = 4
# patch grids (2, 3), (1, 1), (0, 2) (an empty image), (2, 3) (a repeated size), (3, 1)
HW = [(8, 12), (4, 4), (0, 8), (8, 12), (12, 4)]


def _images(dtype=torch.float32) -> padless.NestedTensor:
    g = torch.Generator().manual_seed(0)
    return padless.from_list([torch.randn(3, h, w, generator=g, dtype=dtype) for h, w in HW], ragged_dims=(1, 2))


def test_grid_sizes():
    assert grid_sizes(_images(), P).tolist() == [[2, 3], [1, 1], [0, 2], [2, 3], [3, 1]]


def _ref_pos(pos, h, w, mode, ar):
    if h * w == 0:
        return pos.new_zeros(0, pos.shape[0])
    size = (max(h, w),) * 2 if ar else (h, w)
    return F.interpolate(pos[None], size=size, mode=mode, antialias=True, align_corners=False)[0, :, :h, :w].flatten(1).t()


@pytest.mark.parametrize("mode, ar", [("bilinear", False), ("bicubic", False), ("bilinear", True)])
def test_interpolate_pos_embed(mode, ar):
    images = _images()
    pos = torch.randn(5, 4, 3, requires_grad=True)
    out = interpolate_pos_embed(pos, images, P, mode=mode, ar_preserving=ar)
    refs = [_ref_pos(pos, h // P, w // P, mode, ar) for h, w in HW]
    assert_close_samples(out, refs, atol=1e-6, rtol=1e-6)
    tokens = padless.patchify(images, P)
    assert torch.equal(out.offsets(), tokens.offsets())
    (tokens[..., :5] + out).sum()  # adds to the tokens it was made for
    cot = [torch.randn(r.shape) for r in refs]
    (out.values() * torch.cat(cot)).sum().backward()
    got = pos.grad.clone()
    pos.grad = None
    sum((r * c).sum() for r, c in zip(refs, cot)).backward()
    torch.testing.assert_close(got, pos.grad, atol=1e-5, rtol=1e-5)


def test_interpolate_pos_embed_gradcheck_float64():
    images = padless.from_list([torch.zeros(1, 4, 6), torch.zeros(1, 2, 2)], ragged_dims=(1, 2))
    pos = torch.randn(1, 2, 3, 3, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda p: interpolate_pos_embed(p, images, 2).values(), (pos,), fast_mode=True)


def test_factorized_pos_embed_lookup_and_resized():
    images = _images()
    row, col = torch.randn(3, 6, requires_grad=True), torch.randn(3, 6, requires_grad=True)
    out = factorized_pos_embed(row, col, images, P)
    refs = [(row[:h // P, None] + col[None, :w // P]).reshape(-1, 6) for h, w in HW]
    assert_close_samples(out, refs)
    out.values().sum().backward()
    assert row.grad[:, 0].tolist() == [8, 7, 1] and col.grad[:, 0].tolist() == [8, 4, 4]  # tokens per row / column
    for antialias in (False, True):

        def resize(t, n):  # antialias: torch antialiases 2-d modes only, so a (g, 1) bilinear resize
            if n == 0:
                return t[:0]
            if antialias:
                return F.interpolate(t.t()[None, :, :, None], size=(n, 1), mode="bilinear", antialias=True)[0, :, :, 0].t()
            return F.interpolate(t.t()[None], size=n, mode="linear")[0].t()

        resized = factorized_pos_embed(row, col, images, P, mode="linear", antialias=antialias)
        refs = [(resize(row, h // P)[:, None] + resize(col, w // P)[None]).reshape(-1, 6) for h, w in HW]
        assert_close_samples(resized, refs, atol=1e-6, rtol=1e-6)


def test_factorized_pos_embed_errors():
    images = _images()
    with pytest.raises(ValueError, match=r"factorized_pos_embed\(\): image 4 has a patch grid of \(3, 1\), larger than the tables \(2 rows, 3 columns\)"):
        factorized_pos_embed(torch.randn(2, 6), torch.randn(3, 6), images, P)
    with pytest.raises(ValueError, match=r"factorized_pos_embed\(\): row must be \(gh, D\) and col \(gw, D\) with one D"):
        factorized_pos_embed(torch.randn(2, 6), torch.randn(3, 5), images, P)
    with pytest.raises(ValueError, match=r"interpolate_pos_embed\(\): pos must be a dense \(D, gh, gw\)"):
        interpolate_pos_embed(torch.randn(4, 4), images, P)
    with pytest.raises(ValueError, match=r"interpolate_pos_embed\(\): sample 0 has size \(3, 8, 12\); its height and width must be multiples of the patch \(5, 5\)"):
        interpolate_pos_embed(torch.randn(2, 3, 3), images, 5)


def _ref_rope(x: torch.Tensor, h: int, w: int, theta: float) -> torch.Tensor:
    """Rotate pairs as complex numbers: (x[j], x[j + d/4]) in the row half, the same in the column half."""
    d = x.shape[-1]
    q = d // 4
    rr, cc = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    freqs = theta ** (-torch.arange(q, dtype=torch.float64) / q)
    out = []
    for half, coord in ((0, rr.reshape(-1)), (1, cc.reshape(-1))):
        a = x[..., half * 2 * q : half * 2 * q + q]
        b = x[..., half * 2 * q + q : (half + 1) * 2 * q]
        z = torch.complex(a.double(), b.double())
        rot = torch.polar(torch.ones(len(coord), q, dtype=torch.float64), coord[:, None].double() * freqs)
        z = z * rot.view(len(coord), *([1] * (x.dim() - 2)), q)
        out += [z.real.to(x.dtype), z.imag.to(x.dtype)]
    return torch.cat(out, -1)


def test_rope_2d_matches_complex_rotation():
    images = _images()
    cos, sin = rope_2d(padless.patch_grid(images, P), 8, theta=10.0)
    g = torch.Generator().manual_seed(1)
    qs = [torch.randn((h // P) * (w // P), 2, 8, generator=g) for h, w in HW]
    q = padless.from_list(qs, requires_grad=True)
    out = apply_rope_2d(q, cos, sin)
    assert_close_samples(out, [_ref_rope(x, h // P, w // P, 10.0) for x, (h, w) in zip(qs, HW)], atol=1e-5, rtol=1e-5)
    # a rotation keeps norms, and so its gradient of |out|^2 is 2 q
    (out.values() ** 2).sum().backward()
    torch.testing.assert_close(q.grad.values(), 2 * q.values().detach(), atol=1e-5, rtol=1e-5)


def test_rope_2d_errors():
    images = _images()
    coords = padless.patch_grid(images, P)
    with pytest.raises(ValueError, match=r"rope_2d\(\): dim must be a positive multiple of 4"):
        rope_2d(coords, 6)
    with pytest.raises(TypeError, match=r"rope_2d\(\): coords must be a NestedTensor \(N_i, 2\) of token \(row, col\)"):
        rope_2d(images, 8)
    cos, sin = rope_2d(coords, 8)
    wrong = padless.from_list([torch.randn(n, 8) for n in (6, 1, 0, 5, 3)])
    with pytest.raises(padless.StructureError, match=r"apply_rope_2d\(\): x and cos must have the same tokens: sample 3 has \(5, 8\), cos has \(6, 8\)"):
        apply_rope_2d(wrong, cos, sin)
    short = padless.from_list([torch.randn(n, 4) for n in (6, 1, 0, 6, 3)])
    with pytest.raises(ValueError, match=r"apply_rope_2d\(\): the last dim of x is 4, the rotary angles cover 8"):
        apply_rope_2d(short, cos, sin)


def test_drop_tokens():
    lens = [10, 1, 0, 7, 3]
    g = torch.Generator().manual_seed(2)
    samples = [torch.randn(n, 4, generator=g) for n in lens]
    x = padless.from_list(samples, requires_grad=True)
    kept, index = drop_tokens(x, 0.5, generator=torch.Generator().manual_seed(7))
    idx = [t.tolist() for t in index.unbind()]
    assert [len(i) for i in idx] == [5, 1, 0, 4, 2]  # round(0.5 N_i), at least one per non-empty image
    assert all(i == sorted(set(i)) for i in idx)  # original order, no repeats
    assert_close_samples(kept, [s[i] for s, i in zip(samples, idx)])
    again, index2 = drop_tokens(x, 0.5, generator=torch.Generator().manual_seed(7))
    assert [t.tolist() for t in index2.unbind()] == idx and torch.equal(again.values(), kept.values())
    other = drop_tokens(x, 0.5, generator=torch.Generator().manual_seed(8))[1]
    assert [t.tolist() for t in other.unbind()] != idx
    kept.values().sum().backward()
    want = [torch.zeros(n, 4).index_fill_(0, torch.tensor(i, dtype=torch.long), 1.0) for n, i in zip(lens, idx)]
    assert_close_samples(x.grad, want, what="gradient")
    full, _ = drop_tokens(x, 1.0)
    assert torch.equal(full.values(), x.values())


def test_drop_tokens_errors():
    x = padless.from_list([torch.randn(3, 4), torch.randn(2, 4)])
    with pytest.raises(ValueError, match=r"drop_tokens\(\): keep must be a fraction in \(0, 1\], got 0"):
        drop_tokens(x, 0)
    with pytest.raises(TypeError, match=r"drop_tokens\(\): tokens must be a NestedTensor \(N_i, \.\.\.\) ragged along dim 1"):
        drop_tokens(x.transpose(1, 2), 0.5)


def test_apply_rope_2d_input_errors():
    images = _images()
    cos, sin = rope_2d(padless.patch_grid(images, P), 8)
    with pytest.raises(TypeError, match=r"apply_rope_2d\(\): x, cos and sin must be NestedTensors of tokens"):
        apply_rope_2d(torch.randn(19, 8), cos, sin)
    fewer = padless.from_list([torch.randn(n, 8) for n in (6, 1)])
    with pytest.raises(padless.StructureError, match=r"apply_rope_2d\(\): x and cos must have the same tokens: 2 vs 5 samples"):
        apply_rope_2d(fewer, cos, sin)


def test_take_tokens_and_rope_after_dropping():
    """Dropping tokens then rotating by the kept coordinates == rotating then dropping."""
    images = _images()
    coords = padless.patch_grid(images, P)
    g = torch.Generator().manual_seed(4)
    q = padless.from_list([torch.randn(n, 2, 8, generator=g) for n in (6, 1, 0, 6, 3)])
    kept, index = drop_tokens(q, 0.5, generator=torch.Generator().manual_seed(5))
    assert torch.equal(take_tokens(q, index).values(), kept.values())
    late = apply_rope_2d(kept, *rope_2d(take_tokens(coords, index), 8))
    early = take_tokens(apply_rope_2d(q, *rope_2d(coords, 8)), index)
    torch.testing.assert_close(late.values(), early.values())
    assert [tuple(t.shape) for t in take_tokens(coords, index).unbind()] == [(3, 2), (1, 2), (0, 2), (3, 2), (2, 2)]


def test_take_tokens_errors():
    x = padless.from_list([torch.randn(3, 4), torch.randn(2, 4)])
    idx = padless.from_list([torch.tensor([0, 2])])
    with pytest.raises(padless.StructureError, match=r"take_tokens\(\): x has 2 samples, index has 1"):
        take_tokens(x, idx)
    with pytest.raises(TypeError, match=r"take_tokens\(\): x \(N_i, \.\.\.\) and index \(K_i,\) must be NestedTensors"):
        take_tokens(x, torch.tensor([0]))
    with pytest.raises(IndexError, match=r"take_tokens\(\): index 2 of sample 1 is out of range for its 2 tokens"):
        take_tokens(x, padless.from_list([torch.tensor([0, 2]), torch.tensor([1, 2])]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_vision_helpers_on_cuda_match_cpu():
    images = _images()
    pos = torch.randn(5, 4, 3)
    gi = images.to("cuda")
    torch.testing.assert_close(interpolate_pos_embed(pos.cuda(), gi, P).values().cpu(), interpolate_pos_embed(pos, images, P).values(), atol=1e-5, rtol=1e-5)
    cos, sin = rope_2d(padless.patch_grid(gi, P), 8)
    assert cos.device.type == "cuda"
    torch.testing.assert_close(cos.values().cpu(), rope_2d(padless.patch_grid(images, P), 8)[0].values())
    q = padless.from_list([torch.randn(n, 8) for n in (6, 1, 0, 6, 3)]).to("cuda")
    kept, index = drop_tokens(q, 0.5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(take_tokens(q, index).values(), kept.values())
