"""Patch tokens from variable-size images and kernel == stride convolution (padless/ops/vision/patchify.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import padless
from padless.ops import patch_grid
from padless.ops.vision import patchify
from padless.ops import unpatchify
from padless.testing import Variant, check_op, make_batch

# Images whose sides are multiples of 2 (and of (2, 3) for "div6"): a zero-area image,
# a one-image batch, equal sizes.
DIVISIBLE = {
    "div": Variant("div", ((3, 4, 6), (3, 2, 2), (3, 0, 4), (3, 6, 2)), (1, 2)),
    "div_one": Variant("div_one", ((2, 4, 4),), (1, 2)),
    "div_equal": Variant("div_equal", ((1, 2, 6), (1, 2, 6)), (1, 2)),
    "div6": Variant("div6", ((2, 4, 6), (2, 2, 3), (2, 0, 0)), (1, 2)),
}


def _pair(k):
    return (k, k) if isinstance(k, int) else tuple(k)


def _unfold_ref(patch):
    """Dense reference: ``F.unfold`` gives (C*ph*pw, N) columns, row-major over the patch grid.
    (torch refuses zero-area images; their token list is empty.)"""
    kh, kw = _pair(patch)

    def ref(s):
        if s.numel() == 0:
            return s.new_zeros(0, s.shape[0] * kh * kw)
        return F.unfold(s.unsqueeze(0), (kh, kw), stride=(kh, kw))[0].T

    return ref


def _conv_ref(w, b, k):
    """Dense conv per sample; torch refuses empty images, whose output is empty here (an image
    smaller than the kernel raises torch's error, see tests/ops/test_conv.py)."""

    def ref(s):
        if s.shape[1] * s.shape[2] == 0:
            return s.new_zeros(w.shape[0], s.shape[1] // k[0], s.shape[2] // k[1])
        return F.conv2d(s.unsqueeze(0), w, b, stride=k)[0]

    return ref


@pytest.mark.parametrize("v, patch", [("div", 2), ("div_one", 2), ("div_equal", (2, 3)), ("div6", (2, 3)), ("div", 1)])
def test_patchify_matches_unfold(v, patch):
    out = check_op(lambda x: patchify(x, patch), DIVISIBLE[v], ref=_unfold_ref(patch))
    assert out.ragged_dims == (0,)


def test_patchify_layout_and_grid():
    x = padless.from_list([torch.arange(8.0).reshape(1, 2, 4), torch.arange(4.0).reshape(1, 2, 2) + 10], ragged_dims=(1, 2))
    t = patchify(x, 2)
    assert t.shape == (2, 2, 4)
    assert t.values().tolist() == [[0, 1, 4, 5], [2, 3, 6, 7], [10, 11, 12, 13]]
    assert t.offsets().tolist() == [0, 2, 3] and t.sizes().tolist() == [[2, 4], [1, 4]]
    g = patch_grid(x, 2)
    assert g.dtype == torch.int64 and g.same_structure(t.detach()[..., :2])
    assert g.values().tolist() == [[0, 0], [0, 1], [0, 0]]
    g = patch_grid(make_batch(DIVISIBLE["div"])[0], 2)
    assert [s.tolist() for s in g.unbind()][0] == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]


def test_patchify_keeps_host_metadata_and_caches_the_permutation():
    x, _ = make_batch(DIVISIBLE["div"])
    a = patchify(x, 2)
    assert torch.equal(a._meta.host_sizes, torch.tensor([[6, 12], [1, 12], [0, 12], [3, 12]]))
    assert any(k[0] == "patch_rows" for k in x._meta.derived if isinstance(k, tuple))
    b = patchify(x, 2)
    assert torch.equal(a.values(), b.values())


@pytest.mark.parametrize("v, patch", [("div", 2), ("div6", (2, 3)), ("div_one", 4)])
def test_unpatchify_inverts_patchify(v, patch):
    x, dense = make_batch(DIVISIBLE[v], requires_grad=True)
    back = unpatchify(patchify(x, patch), patch, x)
    assert back.ragged_dims == (1, 2)
    for got, want in zip(back.unbind(), dense):
        torch.testing.assert_close(got, want)
    back.values().sum().backward()
    torch.testing.assert_close(x.grad.values(), torch.ones_like(x.values()))
    sizes = x.host_sizes()[:, 1:]
    assert unpatchify(patchify(x, patch), patch, sizes).same_structure(x)


def test_patchify_errors():
    x, _ = make_batch("image")  # (3, 4, 5): not a multiple of 2
    with pytest.raises(ValueError, match=r"patchify\(\): sample 0 has size \(3, 4, 5\); its height and width must be multiples of the patch \(2, 2\)"):
        patchify(x, 2)
    with pytest.raises(ValueError, match=r"patchify\(\): patch must be a positive int or a pair of them, got 0"):
        patchify(x, 0)
    with pytest.raises(ValueError, match=r"patchify\(\): expected images \(C, H_i, W_i\) with ragged sample dims \(1, 2\) stored in that order, got samples of rank 2"):
        patchify(make_batch("seq")[0], 2)
    with pytest.raises(ValueError, match=r"patch_grid\(\): expected images .* ragged sample dims stored as \(2, 1\)"):
        patch_grid(x.transpose(2, 3), 1)
    with pytest.raises(TypeError, match=r"patchify\(\): expected a NestedTensor of images"):
        patchify(torch.zeros(1, 3, 4, 4), 2)
    t = patchify(make_batch(DIVISIBLE["div"])[0], 2)
    with pytest.raises(ValueError, match=r"unpatchify\(\): sample 0 has 6 tokens, but an image of size \(2, 2\) cut into \(2, 2\) patches has 1"):
        unpatchify(t, 2, torch.tensor([[2, 2], [2, 2], [0, 4], [6, 2]]))
    with pytest.raises(ValueError, match=r"unpatchify\(\): image_sizes must be a CPU \(B, 2\) tensor of \(H_i, W_i\) with B = 4"):
        unpatchify(t, 2, torch.tensor([[2, 2]]))
    with pytest.raises(ValueError, match=r"unpatchify\(\): 12 token features are not a multiple of the patch area 9"):
        unpatchify(t, 3, torch.tensor([[3, 3]] * 4))
    with pytest.raises(ValueError, match=r"unpatchify\(\): tokens must be a NestedTensor \(N_i, C\*ph\*pw\)"):
        unpatchify(make_batch("image")[0], 2, torch.tensor([[2, 2]] * 3))


# ---------------------------------------------------------------------------- conv2d


@pytest.mark.parametrize(
    "v, kernel",
    [(v, k) for v in ["image", "div", "div_one", "div_equal"] for k in [2, (2, 3), 1] if (v, k) != ("div", (2, 3))],
)
def test_conv2d_kernel_equals_stride(v, kernel):
    """Dense conv per sample, including sizes that are not multiples (the remainder is dropped)."""
    torch.manual_seed(0)
    c = make_batch(DIVISIBLE.get(v, v))[0].shape[1]
    k = _pair(kernel)
    w, b = torch.randn(5, c, *k), torch.randn(5)
    out = check_op(lambda x: F.conv2d(x, w, b, stride=k), DIVISIBLE.get(v, v), ref=_conv_ref(w, b, k))
    assert out.ragged_dims == (1, 2)


def test_conv2d_module_and_weight_gradients():
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 2, stride=2)
    ref = torch.nn.Conv2d(3, 4, 2, stride=2)
    ref.load_state_dict(conv.state_dict())
    x, dense = make_batch("image")
    check_op(conv, "image")
    conv.zero_grad()
    conv(x).values().pow(2).sum().backward()
    sum(ref(s.unsqueeze(0)).pow(2).sum() for s in dense).backward()
    torch.testing.assert_close(conv.weight.grad, ref.weight.grad)
    torch.testing.assert_close(conv.bias.grad, ref.bias.grad)


def test_conv2d_equals_patchify_matmul():
    torch.manual_seed(0)
    x, _ = make_batch(DIVISIBLE["div"])
    w, b = torch.randn(6, 3, 2, 2), torch.randn(6)
    tokens = F.linear(patchify(x, 2), w.flatten(1), b)  # patchify(x) @ W.flatten(1).T + b
    conv = F.conv2d(x, w, b, stride=2)
    for tok, img in zip(tokens.unbind(), conv.unbind()):
        torch.testing.assert_close(tok, img.flatten(1).T)


def test_conv2d_1x1_keeps_the_structure():
    x, _ = make_batch("image")
    out = F.conv2d(x, torch.randn(2, 3, 1, 1), padding="valid")
    # same rows and image sizes (the structure object may be one shared by every batch of these sizes)
    assert torch.equal(out.offsets(), x.offsets()) and out.shape == (3, 2, 4, 6)
    assert torch.equal(out.sizes()[:, 1:], x.sizes()[:, 1:])


def test_conv2d_errors():
    """The patch path's own messages (the general path is tested in tests/ops/test_conv.py)."""
    x, _ = make_batch("image")
    with pytest.raises(ValueError, match=r"conv2d\(\): weight expects 2 input channels \(weight.shape\[1\] \* groups\), the images have 3"):
        F.conv2d(x, torch.randn(3, 2, 2, 2), stride=2)
    with pytest.raises(ValueError, match=r"conv2d\(\): expected images \(C, H_i, W_i\)"):
        F.conv2d(make_batch("pair")[0], torch.randn(3, 3, 1, 1))
    with pytest.raises(ValueError, match=r"conv2d\(\): weight must be \(out_channels, in_channels / groups, kh, kw\), got shape \(3, 3, 2\)"):
        F.conv2d(x, torch.randn(3, 3, 2))
    with pytest.raises(TypeError, match=r"conv2d\(\): weight and bias must be dense tensors"):
        F.conv2d(x, torch.randn(3, 3, 1, 1), x)
    with pytest.raises(RuntimeError, match=r"conv2d\(\): image 1 of shape \(3, 2, 6\) (is too small for this layer|gives an empty output)"):
        F.conv2d(x, torch.randn(3, 3, 3, 3), stride=3)
