"""F.interpolate on images at their own size, sample by sample against the dense op."""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F

import padless
from padless.ops.common.size_groups import shape_groups
from padless.testing import Variant, assert_close_samples, check_op, leaves

# Repeated sizes (grouped into one call), an image smaller than a bicubic window, 1-pixel sides.
IMAGES = Variant("images_repeat", ((2, 3, 4), (2, 5, 2), (2, 3, 4), (2, 1, 1), (2, 5, 2)), (1, 2))
ONE = Variant("one_image", ((3, 4, 6),), (1, 2))
SEQ = Variant("signals", ((3, 4), (3, 7), (3, 1)), (1,))  # (C, L_i): 1-d interpolation
VOL = Variant("volumes", ((2, 2, 3, 2), (2, 1, 2, 3)), (1, 2, 3))  # (C, D_i, H_i, W_i)

CASES = [
    (IMAGES, dict(scale_factor=2, mode="nearest")),
    (IMAGES, dict(scale_factor=(1.5, 1.3), mode="nearest-exact")),
    ("image", dict(scale_factor=(0.6, 0.4), mode="nearest")),
    (IMAGES, dict(scale_factor=2.5, mode="bilinear", align_corners=True)),
    ("image", dict(scale_factor=0.5, mode="bilinear", antialias=True)),
    (IMAGES, dict(size=(4, 3), mode="bicubic")),
    (IMAGES, dict(size=(2, 2), mode="bicubic", antialias=True, align_corners=False)),
    (IMAGES, dict(size=3, mode="area")),
    (IMAGES, dict(scale_factor=1.7, mode="bilinear", recompute_scale_factor=True)),
    ("image", dict(scale_factor=3, mode="bicubic", align_corners=True)),
    (ONE, dict(size=(5, 5), mode="bilinear")),
    (Variant("one_wide", ((2, 2, 1), (2, 3, 1)), (1, 2)), dict(size=(7, 1), mode="bicubic", antialias=True)),  # a side of 1
    (SEQ, dict(scale_factor=2, mode="linear")),
    (VOL, dict(scale_factor=2, mode="trilinear")),
]


@pytest.mark.parametrize("v, kw", CASES, ids=[f"{v if isinstance(v, str) else v.name}-{i}" for i, (v, kw) in enumerate(CASES)])
def test_interpolate(v, kw):
    check_op(lambda x: F.interpolate(x, **kw), v, atol=1e-5, rtol=1e-5)


def test_upsample_module():
    check_op(torch.nn.Upsample(scale_factor=2, mode="bilinear"), IMAGES, atol=1e-5, rtol=1e-5)


SHAPES = [(2, 3, 4), (2, 5, 2), (2, 3, 4), (2, 1, 1)]
TARGETS = [(6, 2), (5, 2), (1, 9), (3, 3)]


def _check_targets(size_arg, targets=TARGETS, **kw):
    nt, dense = leaves(SHAPES, seed=3)
    out = F.interpolate(nt, size=size_arg, **kw)
    refs = [F.interpolate(d[None], size=t, **kw)[0] for d, t in zip(dense, targets)]
    assert_close_samples(out, refs, atol=1e-5, rtol=1e-5)
    cot = [torch.randn(r.shape) for r in refs]
    out.backward(padless.from_list(cot, ragged_dims=(1, 2)))
    torch.autograd.backward(refs, cot)
    assert_close_samples(nt.grad, [d.grad for d in dense], what="gradient", atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["nearest", "bilinear", "bicubic"])
def test_interpolate_per_image_list(mode):
    _check_targets(TARGETS, mode=mode)


def test_interpolate_per_image_tensor_and_antialias():
    _check_targets(torch.tensor(TARGETS), mode="bilinear", antialias=True)


def test_interpolate_size_like_nested():
    """size=other: every image resized to the (H, W) of the same sample of other (e.g. labels)."""
    labels = padless.from_list([torch.zeros(h, w, dtype=torch.long) for h, w in TARGETS])
    _check_targets(labels, mode="bilinear", align_corners=True)


def test_interpolate_groups_equal_sizes():
    nt, _ = leaves(SHAPES)
    groups = shape_groups(nt, "interpolate")
    assert [ids for _, _, ids, _ in groups] == [[0, 2], [1], [3]]


def test_interpolate_gradcheck_float64():
    nt, dense = leaves([(1, 2, 3), (1, 3, 2), (1, 2, 3)], dtype=torch.float64)
    offsets, sizes = nt.offsets(), nt.sizes()

    def f(vals):
        x = padless.from_values(vals, sizes=sizes, ragged_dims=(1, 2))
        return F.interpolate(x, scale_factor=1.5, mode="bicubic", antialias=True).values()

    assert offsets.tolist() == [0, 6, 12, 18]
    torch.autograd.gradcheck(f, (nt.values().detach().clone().requires_grad_(),), fast_mode=True)


def test_interpolate_empty_image_names_it():
    x = padless.from_list([torch.randn(2, 3, 3), torch.randn(2, 0, 4)])
    with pytest.raises(RuntimeError, match=r"interpolate\(\): sample 1 of shape \(2, 0, 4\): Input and output sizes should be greater than 0"):
        F.interpolate(x, scale_factor=2)
    with pytest.raises(RuntimeError, match=r"interpolate\(\): sample 0 of shape \(2, 3, 3\): .*output \(H: 0, W: 0\)"):
        F.interpolate(x, scale_factor=0.2)


def test_interpolate_errors():
    nt, _ = leaves(SHAPES)
    with pytest.raises(ValueError, match=r"interpolate\(\): size lists 2 per-image targets for a batch of 4 images"):
        F.interpolate(nt, size=[(2, 2), (3, 3)])
    with pytest.raises(ValueError, match=r"interpolate\(\): the target size of image 1 is \(3,\); it needs 2 entries"):
        F.interpolate(nt, size=[(2, 2), (3,), (1, 1), (1, 1)])
    with pytest.raises(TypeError, match=r"interpolate\(\): size must hold ints, got 2.5"):
        F.interpolate(nt, size=[(2, 2.5), (3, 3), (1, 1), (1, 1)])
    with pytest.raises(ValueError, match=r"interpolate\(\): a tensor size must be a CPU int tensor \(B, 2\) = \(4, 2\)"):
        F.interpolate(nt, size=torch.ones(3, 2, dtype=torch.long))
    with pytest.raises(padless.StructureError, match=r"interpolate\(\): size is a NestedTensor of 1 samples, the input has 4"):
        F.interpolate(nt, size=padless.from_list([torch.zeros(2, 2)]))
    with pytest.raises(ValueError, match=r"interpolate\(\): only one of size or scale_factor should be defined"):
        F.interpolate(nt, size=TARGETS, scale_factor=2)
    seq, _ = leaves([(3,), (4,)])
    with pytest.raises(ValueError, match=r"interpolate\(\): samples must be \(C, \*spatial\) with 1 to 3 spatial dims"):
        F.interpolate(seq, scale_factor=2)


def test_interpolate_transposed_storage_and_bf16():
    """Images whose ragged dims are stored (W, H) (a transpose) and bfloat16 images."""
    check_op(lambda x: F.interpolate(x.transpose(2, 3), scale_factor=2, mode="bilinear"), IMAGES, atol=1e-5, rtol=1e-5)
    check_op(lambda x: F.interpolate(x, size=(3, 5), mode="bilinear"), IMAGES, dtype=torch.bfloat16, atol=1e-2, rtol=1e-2)


def test_interpolate_batch_level_errors():
    empty = padless.from_list([torch.randn(2, 3, 3)], ragged_dims=(1, 2))[:0]
    with pytest.raises(ValueError, match=r"interpolate\(\): the batch has no samples"):
        F.interpolate(empty, scale_factor=2)
    w_static, _ = leaves([(2, 3, 4), (2, 5, 4)])  # ragged H only: W is one extent for the batch
    with pytest.raises(ValueError, match=r"interpolate\(\): the outputs of different samples differ in the static dims \[\(2, 3\), \(2, 4\)\]"):
        F.interpolate(w_static, size=[(2, 3), (2, 4)])
    nt, _ = leaves(SHAPES)
    with pytest.raises(padless.StructureError, match=r"interpolate\(\): size is a NestedTensor of rank-1 samples; it needs at least 2 dims"):
        F.interpolate(nt, size=padless.from_list([torch.zeros(n) for n in (1, 2, 3, 4)]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_image_ops_on_cuda_match_cpu():
    """interpolate, ragged pad, pixel shuffles and unfold on CUDA give the CPU result (and gradients)."""
    fns = [
        lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"),
        lambda x: F.interpolate(x, size=[(2, 3), (4, 4), (5, 1), (1, 1), (3, 3)], mode="bicubic", antialias=True),
        lambda x: F.pad(x, (1, 1, 1, 1), mode="replicate"),
        lambda x: F.pixel_shuffle(torch.cat([x, x], 1), 2),
        lambda x: F.unfold(x, 1),
    ]
    for fn in fns:
        cpu, _ = leaves([s for s in IMAGES.shapes], seed=5, ragged=(1, 2))
        gpu = cpu.detach().to("cuda").requires_grad_()
        out_c, out_g = fn(cpu), fn(gpu)
        torch.testing.assert_close(out_g.values().cpu(), out_c.values(), atol=1e-4, rtol=1e-4)
        out_c.values().pow(2).sum().backward()
        out_g.values().pow(2).sum().backward()
        torch.testing.assert_close(gpu.grad.values().cpu(), cpu.grad.values(), atol=1e-4, rtol=1e-4)


FUZZ_CASES = int(os.environ.get("PADLESS_FUZZ_EXAMPLES", "6"))


@pytest.mark.parametrize("seed", range(FUZZ_CASES))
def test_interpolate_random_batches(seed):
    """Random batches (repeated sizes, 1-pixel sides, one-image batches) and random resampling
    arguments, against each image alone. ``PADLESS_FUZZ_EXAMPLES=500`` runs a long sweep."""
    rng = random.Random(seed)
    b = rng.randint(1, 5)
    pool = [(rng.randint(1, 7), rng.randint(1, 7)) for _ in range(3)]
    shapes = tuple((2, *rng.choice(pool)) for _ in range(b))
    mode = rng.choice(["nearest", "nearest-exact", "bilinear", "bicubic", "area"])
    kw: dict = {"mode": mode}
    if mode in ("bilinear", "bicubic"):
        kw["align_corners"] = rng.random() < 0.5
        kw["antialias"] = not kw["align_corners"] and rng.random() < 0.5
    if rng.random() < 0.5:
        kw["scale_factor"] = (rng.choice([1.0, 1.5, 2.0, 3.0]), rng.choice([1.0, 1.25, 2.0]))
    else:
        kw["size"] = (rng.randint(1, 9), rng.randint(1, 9))
    check_op(lambda x: F.interpolate(x, **kw), Variant(f"random-{seed}", shapes, (1, 2)), seed=seed, atol=1e-5, rtol=1e-5)
