"""Compiled CNNs on native-resolution images: ``torch.compile(fullgraph=True)`` of convolution,
pooling, batch/group norm, interpolation, patches and the CNNs of ``examples/native_cnn.py``.

Every test runs 8 batches whose size (2 to 32) and image sizes change, compares compiled
outputs and gradients with eager, and counts graphs with ``CompileCounterWithBackend``:
one graph over all batches. aot_eager throughout (compiles are slow on a 2-core CPU);
``PADLESS_COMPILE_INDUCTOR=1`` adds inductor to the model test.
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import padless
from padless.tensor.errors import StructureError
from padless.testing import assert_close_samples
from padless.testing.vision import image_batch
from padless.vision import AxisMap, prepare_for_compile

INDUCTOR = os.environ.get("PADLESS_COMPILE_INDUCTOR", "") not in ("", "0")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "native_cnn.py"
# Batch sizes of the 8 batches: B=2 first, then up to 32 (B equal to a side at times).
BATCHES = [2, 5, 32, 3, 9, 4, 17, 6]


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _native_cnn():
    spec = importlib.util.spec_from_file_location("native_cnn_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dynamo looks the model's module up by name
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def _sizes(step: int, b: int, lo: int, hi: int) -> list[tuple[int, int]]:
    rng = random.Random(1000 + step)
    return [(rng.randint(lo, hi), rng.randint(lo, hi)) for _ in range(b)]


def _flat(out) -> list[torch.Tensor]:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [o.values() if isinstance(o, padless.NestedTensor) else o for o in outs]


def _loss(out) -> torch.Tensor:
    """A loss touching every output element with a different weight (gradients are not uniform)."""
    total = 0.0
    for t in _flat(out):
        w = torch.linspace(0.5, 1.5, t.numel(), dtype=t.dtype).view(t.shape)
        total = total + (t * w).sum() + 0.1 * t.square().sum()
    return total


def _check_against_eager(
    fn: Callable, params: list[torch.Tensor], batches, *, prepare: Callable, backend: str = "aot_eager",
    channels: int = 3, dtype: torch.dtype = torch.float32, atol: float = 1e-5, rtol: float = 1e-5, buffers: Callable[[], list[torch.Tensor]] | None = None,
) -> CompileCounterWithBackend:
    """Run ``fn`` compiled and eagerly on each batch: outputs (structure and values), input and
    parameter gradients (and optional buffers such as running stats) must agree."""
    cnt = CompileCounterWithBackend(backend)
    cfn = torch.compile(fn, backend=cnt, fullgraph=True)
    for sizes, seed in batches:
        results = []
        for run in (cfn, fn):
            x, _ = image_batch(sizes, channels, seed=seed, dtype=dtype, requires_grad=True)
            before = [b.clone() for b in buffers()] if buffers else []
            out = run(prepare(x))
            _loss(out).backward()
            grads = [None if p.grad is None else p.grad.clone() for p in params]
            for p in params:
                p.grad = None
            after = [b.clone() for b in buffers()] if buffers else []
            if buffers:  # both runs start from the same running stats
                for b, v in zip(buffers(), before):
                    b.copy_(v)
            results.append((out, x.grad, grads, after))
        (out_c, gx_c, gp_c, buf_c), (out_e, gx_e, gp_e, buf_e) = results
        outs_c = out_c if isinstance(out_c, (tuple, list)) else (out_c,)
        outs_e = out_e if isinstance(out_e, (tuple, list)) else (out_e,)
        for c, e in zip(outs_c, outs_e):
            if isinstance(e, padless.NestedTensor):
                assert c.sizes().tolist() == e.sizes().tolist() and tuple(c.shape) == tuple(e.shape)
                assert_close_samples(c, list(e.unbind()), atol=atol, rtol=rtol)
            else:
                torch.testing.assert_close(c, e, atol=atol, rtol=rtol)
        torch.testing.assert_close(gx_c.values(), gx_e.values(), atol=atol, rtol=rtol)
        for a, b in zip(gp_c, gp_e):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, atol=atol, rtol=rtol)
        for a, b in zip(buf_c, buf_e):
            torch.testing.assert_close(a, b, atol=atol, rtol=rtol)
    assert cnt.frame_count == 1, f"{cnt.frame_count} graphs over {len(batches)} batches"
    return cnt


@pytest.mark.parametrize("backend", ["aot_eager"] + (["inductor"] if INDUCTOR else []))
def test_native_cnn_classifier_and_segmenter_train_in_one_graph(backend):
    """examples/native_cnn.py: the ResNet classifier (cross-entropy on (B, classes)) and the FCN
    segmenter (logits resized to every image with size=images, per-pixel cross-entropy) in one
    compiled training step; BatchNorm in training mode, running stats compared too."""
    ex = _native_cnn()
    torch.manual_seed(0)
    cls, seg = ex.SmallResNet(classes=3), ex.FCN(ex.SEG_CLASSES)
    mods = nn.ModuleList([cls, seg]).double()  # float64: the compiled backward sums in another order

    def step(x):
        return cls(x), seg(x)

    batches = [(_sizes(i, b, 8, 28), i) for i, b in enumerate(BATCHES)]
    bufs = lambda: [b for n, b in mods.named_buffers() if "running" in n]  # noqa: E731
    # no preparation: the plain batches carry their host sides when they enter the graph
    _check_against_eager(step, list(mods.parameters()), batches, prepare=lambda x: x, backend=backend,
                         dtype=torch.float64, atol=1e-9, rtol=1e-9, buffers=bufs)


def test_conv2d_strides_paddings_dilations_groups_in_one_graph():
    """Every conv2d path (canvas, patch conv, 1x1, strided 1x1, depthwise, dilated, "same",
    rectangular kernels and strides, unpadded) with the levels they reach prepared."""
    torch.manual_seed(0)
    convs = nn.ModuleList([
        nn.Conv2d(4, 6, 3, stride=2, padding=1),  # ceil(n/2)
        nn.Conv2d(4, 6, 3, padding=2, dilation=2, groups=2),  # n
        nn.Conv2d(4, 6, (3, 5), stride=(1, 2), padding=(1, 2)),  # (n, ceil(n/2))
        nn.Conv2d(4, 6, 3),  # n - 2
        nn.Conv2d(4, 6, 4, stride=4),  # floor(n/4): the patch path
        nn.Conv2d(4, 6, 1),  # a matmul on the rows
        nn.Conv2d(4, 6, 5, padding="same", bias=False),
        nn.Conv2d(4, 6, 1, stride=2),  # the strided 1x1 path, ceil(n/2)
        nn.Conv2d(4, 4, 3, stride=3, padding=1, groups=4),  # depthwise, ceil(n/3)
    ]).double()

    def f(x):
        return tuple(torch.relu(c(x)) for c in convs)

    def prepare(x):
        return prepare_for_compile(x, strides=(2, 3, (1, 2)), levels=(AxisMap(1, -2, 1), AxisMap(1, 0, 4)))

    batches = [(_sizes(i, b, 4, 16), i) for i, b in enumerate(BATCHES)]
    _check_against_eager(f, list(convs.parameters()), batches, prepare=prepare, channels=4, dtype=torch.float64,
                         atol=1e-9, rtol=1e-9)



def test_pooling_norms_and_resampling_in_one_graph():
    """max/avg pooling (padding, count_include_pad, floor sizes), adaptive avg/max pooling (dense
    outputs), BatchNorm2d in training (running stats) and eval, GroupNorm, and F.interpolate:
    nearest x2, nearest x0.5, bilinear to a fixed size and bilinear back to every image's size."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 8, 3, padding=1)
    bn_train, bn_eval, gn = nn.BatchNorm2d(8), nn.BatchNorm2d(8), nn.GroupNorm(2, 8)
    with torch.no_grad():
        bn_eval.running_mean.uniform_(-1, 1), bn_eval.running_var.uniform_(0.5, 2)
    bn_eval.eval()
    mods = nn.ModuleList([conv, bn_train, bn_eval, gn]).double()

    def f(x):
        y = conv(x)
        down = F.max_pool2d(y, 3, 2, 1)
        return (
            down,
            F.max_pool2d(y, 2),  # floor(n/2)
            F.avg_pool2d(y, 3, 1, 1, count_include_pad=False),
            F.avg_pool2d(bn_train(y), 2, 2, 1),  # floor(n/2) + 1
            F.adaptive_avg_pool2d(y, 1),
            F.adaptive_max_pool2d(gn(y), (2, 3)),
            bn_eval(y),
            F.interpolate(down, scale_factor=2, mode="nearest"),
            F.interpolate(y, scale_factor=0.5, mode="nearest"),
            F.interpolate(down, size=(5, 7), mode="bilinear", align_corners=False),
            F.interpolate(down, size=x, mode="bilinear", align_corners=True),
        )

    def prepare(x):
        return prepare_for_compile(x, strides=(2,), levels=(AxisMap(1, 0, 2), AxisMap(1, 2, 2)))

    batches = [(_sizes(i, b, 2, 15), i) for i, b in enumerate(BATCHES)]
    bufs = lambda: [bn_train.running_mean, bn_train.running_var]  # noqa: E731
    _check_against_eager(f, list(mods.parameters()), batches, prepare=prepare, dtype=torch.float64,
                         atol=1e-9, rtol=1e-9, buffers=bufs)


def test_patchify_unpatchify_and_patch_embedding_in_one_graph():
    """ViT-style patches of images whose sides are multiples of the patch: patchify, a linear
    layer on the tokens, unpatchify back to the images, and the kernel == stride conv."""
    torch.manual_seed(0)
    embed = nn.Linear(3 * 16, 3 * 16).double()
    conv = nn.Conv2d(3, 5, 4, stride=4).double()

    def f(x):
        tokens = padless.patchify(x, 4)
        return tokens, padless.unpatchify(embed(tokens), 4, x), conv(x)

    batches = [([(4 * h, 4 * w) for h, w in _sizes(i, b, 1, 6)], i) for i, b in enumerate(BATCHES)]
    _check_against_eager(f, [*embed.parameters(), *conv.parameters()], batches,
                         prepare=lambda x: prepare_for_compile(x, patch=4), dtype=torch.float64, atol=1e-9, rtol=1e-9)


# ------------------------------------------------------------------ size maps and messages


@pytest.mark.parametrize("seed", range(3))
def test_axis_maps_compose_like_the_layers_they_stand_for(seed):
    """A stack of layers (kernel, stride, padding, dilation) maps every side n exactly as the
    composed AxisMap does: the level arithmetic the carried maps rely on."""
    rng = random.Random(seed)
    geoms = [(rng.randint(1, 7), rng.randint(1, 3), rng.randint(0, 3), rng.randint(1, 2)) for _ in range(4)]
    level = AxisMap()
    for k, s, p, d in geoms:
        level = level.then(AxisMap.of_geometry(k, s, 2 * p, d))
    for n in range(0, 200):
        m = n
        for k, s, p, d in geoms:
            m = max(0, (m + 2 * p - d * (k - 1) - 1) // s + 1)
        if all(v > 0 for v in [n, m]):  # once a side vanishes torch refuses the image anyway
            assert level(n) == m, (n, geoms, level)
    assert AxisMap.ceil_div(4) == AxisMap.ceil_div(2).then(AxisMap.ceil_div(2))
    assert str(AxisMap.ceil_div(8)) == "floor((n + 7) / 8)"


def _traced(fn, x):
    return torch.compile(fn, backend="eager", fullgraph=True)(x)


def test_a_strided_layer_compiles_without_preparation():
    """Stride 3 used to need a prepared level: its sizes are now computed in the graph."""
    x, _ = image_batch([(9, 12), (5, 7)])
    w = torch.ones(2, 3, 3, 3)
    out = _traced(lambda t: F.conv2d(t, w, stride=3, padding=1), x)
    ref = F.conv2d(x, w, stride=3, padding=1)
    assert out.sizes().tolist() == ref.sizes().tolist() == [[2, 3, 4], [2, 2, 3]]
    assert_close_samples(out, list(ref.unbind()))


def test_a_plain_image_batch_carries_its_host_sides_when_it_enters_a_graph():
    x, _ = image_batch([(9, 12), (5, 7)])
    assert not any(isinstance(k, tuple) and k[0] == "image_host_hw" for k in x._meta.derived)
    out = _traced(lambda t: F.conv2d(t, torch.ones(2, 3, 3, 3), stride=2, padding=1), x)
    ref = F.conv2d(x, torch.ones(2, 3, 3, 3), stride=2, padding=1)
    assert out.sizes().tolist() == ref.sizes().tolist() == [[2, 5, 6], [2, 3, 4]]
    assert_close_samples(out, list(ref.unbind()))
    names, _ = x.__tensor_flatten__()
    assert "_image_host_hw" in names and not any(n.startswith("_image_rows_") for n in names)
    assert x._image_host_hw.device.type == "cpu" and x._image_host_hw.tolist() == [[9, 12], [5, 7]]


def test_ceil_mode_pooling_compiles():
    x, _ = image_batch([(9, 12), (5, 7), (1, 2)])
    out = _traced(lambda t: F.max_pool2d(t, 2, ceil_mode=True), prepare_for_compile(x))
    ref = F.max_pool2d(x, 2, ceil_mode=True)
    assert out.sizes().tolist() == ref.sizes().tolist() and tuple(out.shape) == tuple(ref.shape)
    assert_close_samples(out, list(ref.unbind()))


def test_interpolate_under_compile_refuses_inexact_scales_and_size_tensors():
    x, _ = image_batch([(9, 12), (5, 7)])
    with pytest.raises(Exception, match=r"scale_factor must be an integer or a fraction over a power of two"):
        _traced(lambda t: F.interpolate(t, scale_factor=1 / 3), x)
    with pytest.raises(Exception, match=r"a size tensor is data whose largest entry"):
        _traced(lambda t: F.interpolate(t, size=torch.tensor([(3, 3), (4, 4)])), x)


def test_patches_under_compile_need_the_patch_maps_and_the_image_batch():
    x, _ = image_batch([(8, 12), (4, 4)])
    with pytest.raises(Exception, match=r"carries no 'image_maxtok_4x4'.*prepare_for_compile\(images, patch=4\)"):
        _traced(lambda t: padless.patchify(t, 4), prepare_for_compile(x, strides=(), levels=(AxisMap(1, 0, 4),)))
    with pytest.raises(Exception, match=r"unpatchify\(\): under torch.compile image_sizes must be the image batch itself"):
        _traced(lambda t: padless.unpatchify(padless.patchify(t, 4), 4, torch.tensor([[8, 12], [4, 4]])),
                prepare_for_compile(x, patch=4))


def test_prepare_for_compile_refuses_what_it_cannot_serve():
    seqs = padless.from_list([torch.randn(3, 5), torch.randn(3, 2)], ragged_dims=(1,))
    with pytest.raises(StructureError, match=r"prepare_for_compile\(\): expected images \(C, H_i, W_i\)"):
        prepare_for_compile(seqs)
    x, _ = image_batch([(8, 12)])
    with pytest.raises(ValueError, match=r"each entry of strides must be an int >= 1"):
        prepare_for_compile(x, strides=(0,))
    with pytest.raises(ValueError, match=r"AxisMap: mul and div must be positive ints"):
        AxisMap(1, 0, 0)


def test_island_checks_the_promised_row_count_and_keeps_torch_errors():
    """The opaque op checks the row count computed from the host sides (sides that do not
    belong to the batch), and an image the layer cannot run on gets eager's error, naming it."""
    from padless.ops.vision.compiled import image_island

    x, _ = image_batch([(9, 12), (5, 7)])
    spec = repr((2, 1, 1, 1, False))
    hw = torch.tensor([[9, 12], [5, 7]])
    with pytest.raises(StructureError, match=r"the host sizes gave 10 output rows"):
        image_island("conv2d", spec, x._values, x._sizes, x._offsets, [1, 2], hw, [torch.ones(2, 3, 3, 3)], 10, [2])
    e, _ = image_batch([(5, 6), (0, 0)])
    with pytest.raises(RuntimeError, match=r"conv2d\(\): image 1 of shape \(3, 0, 0\) is too small for this layer"):
        image_island("conv2d", spec, e._values, e._sizes, e._offsets, [1, 2], torch.tensor([[5, 6], [0, 0]]),
                     [torch.ones(2, 3, 3, 3)], 9, [2])
