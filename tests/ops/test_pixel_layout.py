"""F.pad of ragged dims, pixel_shuffle/unshuffle, F.unfold and channel cat on images, sample by
sample against the dense op."""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F

import padless
from padless.testing import Variant, check_op, check_samples, leaves

IMAGES = Variant("images_repeat", ((2, 3, 4), (2, 5, 2), (2, 3, 4), (2, 2, 3)), (1, 2))
WITH_EMPTY = Variant("images_empty", ((2, 3, 4), (2, 0, 3), (2, 2, 2)), (1, 2))
ONE = Variant("one_image", ((3, 4, 6),), (1, 2))
CHANNELS = Variant("images_c8", ((8, 2, 3), (8, 1, 1), (8, 3, 2), (8, 2, 3)), (1, 2))
EVEN = Variant("images_even", ((3, 4, 2), (3, 2, 6), (3, 6, 2), (3, 4, 2)), (1, 2))
TRANSPOSED = Variant("images_hw_static_w", ((2, 3, 4), (2, 5, 4)), (1,))  # (C, H_i, 4)

PAD = [
    (IMAGES, lambda x: F.pad(x, (1, 2, 0, 1))),
    (WITH_EMPTY, lambda x: F.pad(x, (1, 1, 2, 0), value=-3.0)),
    (IMAGES, lambda x: F.pad(x, (1, 1, 1, 1, 1, 0))),  # channels too
    (IMAGES, lambda x: F.pad(x, (-1, 0, 1, -1))),  # negative pads crop
    (IMAGES, lambda x: F.pad(x, (1, 1, 1, 1), mode="reflect")),
    (IMAGES, lambda x: F.pad(x, (2, 0, 1, 1), mode="replicate")),
    ("empty_sample", lambda x: F.pad(x, (0, 0, 1, 1), value=2.0)),  # (L_i, C) with an empty sample
    (ONE, lambda x: F.pad(x, (2, 1, 3, 0), mode="circular")),
    (IMAGES, lambda x: F.pad(x.unsqueeze(1), (1, 1, 1, 1, 1, 0), mode="replicate")),  # (C, 1, H, W): a 3-d pad
    ("channels_first", lambda x: F.pad(x, (1, 1), mode="reflect")),  # (C, L_i)
    ("seq", lambda x: F.pad(x, (0, 0, 1, 2))),  # (L_i, C): the ragged dim leads
    (TRANSPOSED, lambda x: F.pad(x, (1, 1, 1, 1), mode="replicate")),
]


@pytest.mark.parametrize("v, fn", PAD, ids=[f"{v if isinstance(v, str) else v.name}-{i}" for i, (v, fn) in enumerate(PAD)])
def test_pad_ragged(v, fn):
    check_op(fn, v)


def test_pad_ragged_errors_name_the_sample():
    x, _ = leaves([(2, 3, 4), (2, 1, 4)], ragged=(1, 2))
    with pytest.raises(RuntimeError, match=r"pad\(\): sample 1 of shape \(2, 1, 4\): Argument #\d+: Padding size should be less than"):
        F.pad(x, (1, 1, 1, 1), mode="reflect")
    with pytest.raises(NotImplementedError, match=r"pad\(\): sample 0 of shape \(2, 3, 4\): Padding size 2 is not supported for 4D input"):
        F.pad(x, (1, 1), mode="reflect")  # as torch refuses it for the dense batch (B, C, H, W)


@pytest.mark.parametrize("v", [CHANNELS, Variant("one_c8", ((8, 3, 2),), (1, 2))], ids=["images", "one"])
def test_pixel_shuffle(v):
    check_op(lambda x: F.pixel_shuffle(x, 2), v)
    check_op(torch.nn.PixelShuffle(2), v)


@pytest.mark.parametrize("v", [EVEN, Variant("one_even", ((2, 6, 4),), (1, 2))], ids=["images", "one"])
def test_pixel_unshuffle(v):
    check_op(lambda x: F.pixel_unshuffle(x, 2), v)


def test_pixel_shuffle_empty_images():
    """Forward only: torch's own backward fails on an empty image, and its pixel_unshuffle returns
    an empty input unchanged; here an empty image gets the channel count of the others."""
    x = padless.from_list([torch.randn(8, 2, 2), torch.randn(8, 0, 2)], ragged_dims=(1, 2))
    assert [tuple(s.shape) for s in F.pixel_shuffle(x, 2).unbind()] == [(2, 4, 4), (2, 0, 4)]
    assert [tuple(s.shape) for s in F.pixel_unshuffle(x, 2).unbind()] == [(32, 1, 1), (32, 0, 1)]


def test_pixel_shuffle_round_trip_and_other_layouts():
    x, _ = leaves([(4, 2, 3), (4, 1, 5)])
    assert torch.equal(F.pixel_unshuffle(F.pixel_shuffle(x, 2), 2).values(), x.values())
    check_op(lambda x: F.pixel_shuffle(x.unsqueeze(1), 1), "image")  # (C, 1, H, W): by sample shape
    check_op(lambda x: F.pixel_unshuffle(x, 2), Variant("w_static", ((3, 2, 4), (3, 4, 4)), (1,)))


def test_pixel_shuffle_errors():
    x, _ = leaves([(3, 4, 2), (3, 3, 4)])
    with pytest.raises(ValueError, match=r"pixel_shuffle\(\): the images have 3 channels, which is not divisible by upscale_factor\*\*2 = 4"):
        F.pixel_shuffle(x, 2)
    with pytest.raises(ValueError, match=r"pixel_unshuffle\(\): sample 1 has shape \(3, 3, 4\); its height and width must be divisible by downscale_factor=2"):
        F.pixel_unshuffle(x, 2)
    with pytest.raises(ValueError, match=r"pixel_shuffle\(\): upscale_factor must be a positive int, got 0"):
        F.pixel_shuffle(x, 0)
    seq, _ = leaves([(3, 4), (2, 4)])
    with pytest.raises(ValueError, match=r"pixel_shuffle\(\): samples must be \(\*, C, H, W\) with at least 3 dims"):
        F.pixel_shuffle(seq, 2)


@pytest.mark.parametrize("kw", [dict(kernel_size=2), dict(kernel_size=(2, 3), padding=1, stride=2), dict(kernel_size=2, dilation=2, padding=1)])
def test_unfold(kw):
    check_op(lambda x: F.unfold(x, **kw), IMAGES)


def test_unfold_image_too_small_names_it():
    x, _ = leaves([(2, 3, 4), (2, 1, 4)])
    with pytest.raises(RuntimeError, match=r"unfold\(\): sample 1 of shape \(2, 1, 4\):"):
        F.unfold(x, 2)


def test_cat_channels_unet_skip():
    """torch.cat along channels of two images batches built apart with the same spatial sizes."""
    hw = [(3, 4), (0, 2), (5, 2)]
    a = leaves([(2, h, w) for h, w in hw], seed=1)
    b = leaves([(3, h, w) for h, w in hw], seed=2)
    out = check_samples(lambda x, y: torch.cat([x, y], 1), lambda x, y: torch.cat([x, y], 0), [a, b])
    assert out.shape[1] == 5
    c, _ = leaves([(3, 3, 4), (3, 0, 2), (3, 2, 5)])
    with pytest.raises(ValueError, match=r"cat\(\).*sample 2"):
        torch.cat([a[0], c], 1)


def test_pad_transposed_storage_and_bf16():
    check_op(lambda x: F.pad(x.transpose(2, 3), (1, 0, 2, 1), mode="replicate"), IMAGES)
    check_op(lambda x: F.pad(x, (1, 1, 1, 1), value=0.5), IMAGES, dtype=torch.bfloat16)


def test_unfold_needs_images():
    seq, _ = leaves([(3, 4), (2, 4)])
    with pytest.raises(ValueError, match=r"unfold\(\): expected images \(C, H_i, W_i\), got samples of rank 2"):
        F.unfold(seq, 2)


FUZZ_CASES = int(os.environ.get("PADLESS_FUZZ_EXAMPLES", "4"))


@pytest.mark.parametrize("seed", range(FUZZ_CASES))
def test_pad_unfold_shuffle_random_batches(seed):
    """Random image batches (sides of 1, repeated sizes, one image) through ragged pad (every
    mode), unfold and the pixel shuffles, against each image alone."""
    rng = random.Random(seed)
    pool = [(rng.randint(2, 7), rng.randint(2, 7)) for _ in range(3)]
    shapes = tuple((4, *rng.choice(pool)) for _ in range(rng.randint(1, 5)))
    v = Variant(f"random-{seed}", shapes, (1, 2))
    mode = rng.choice(["constant", "reflect", "replicate", "circular"])
    pads = tuple(rng.randint(0, 1) for _ in range(4))
    check_op(lambda x: F.pad(x, pads, mode=mode), v, seed=seed)
    k = (rng.randint(1, 2), rng.randint(1, 2))
    pad_u, stride_u = rng.randint(0, 1), rng.randint(1, 2)
    check_op(lambda x: F.unfold(x, k, padding=pad_u, stride=stride_u), v, seed=seed)
    check_op(lambda x: F.pixel_shuffle(x, 2), v, seed=seed)
    even = Variant(f"random-even-{seed}", tuple((3, 2 * h, 2 * w) for _, h, w in shapes), (1, 2))
    check_op(lambda x: F.pixel_unshuffle(x, 2), even, seed=seed)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: F.pad(x, (1, 1, 1, 0), mode="reflect"),
        lambda x: F.pad(x, (1, 0, 0, 2), value=1.0),
        lambda x: F.pixel_shuffle(x, 2),
        lambda x: F.pixel_unshuffle(x, 2),
        lambda x: F.unfold(x, 2, padding=1),
    ],
    ids=["pad_reflect", "pad_constant", "pixel_shuffle", "pixel_unshuffle", "unfold"],
)
def test_gradcheck_float64(fn):
    nt, _ = leaves([(4, 2, 4), (4, 4, 2), (4, 2, 4)], dtype=torch.float64, ragged=(1, 2))
    sizes = nt.sizes()

    def f(vals):
        return fn(padless.from_values(vals, sizes=sizes, ragged_dims=(1, 2))).values()

    torch.autograd.gradcheck(f, (nt.values().detach().clone().requires_grad_(),), fast_mode=True)
