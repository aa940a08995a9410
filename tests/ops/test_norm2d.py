"""Batch norm over the real pixels of all images, instance norm per image (padless/ops/vision/norm2d.py),
and the per-sample fallback refusing ops whose result mixes samples (padless/tensor/fallback.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import padless
from padless.testing import assert_close_samples
from padless.testing.vision import check_layer, image_batch

D = torch.float64
SIZES = [(5, 7), (2, 3), (6, 4), (1, 1)]


def _bn(c: int = 3, **kw) -> nn.BatchNorm2d:
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(c, **kw).to(D)
    if bn.affine:
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.normal_()
    return bn


def _batch_stats_reference(bn: nn.BatchNorm2d, images: list[torch.Tensor]) -> list[torch.Tensor]:
    """Training batch norm written against its definition: per-channel mean and biased variance
    over the pixels of every image (never padding); running stats with the unbiased variance."""
    pix = torch.cat([im.flatten(1) for im in images], 1)  # (C, N)
    mean, var = pix.mean(1), pix.var(1, unbiased=False)
    with torch.no_grad():
        m = bn.momentum
        bn.running_mean.mul_(1 - m).add_(m * mean)
        bn.running_var.mul_(1 - m).add_(m * pix.var(1, unbiased=True))
    w = bn.weight if bn.affine else torch.ones_like(mean)
    b = bn.bias if bn.affine else torch.zeros_like(mean)
    shape = (-1, 1, 1)
    return [(im - mean.view(shape)) / torch.sqrt(var.view(shape) + bn.eps) * w.view(shape) + b.view(shape) for im in images]


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("sizes", [SIZES, [(4, 6)]], ids=["four", "one_image"])
def test_batch_norm_training_uses_real_pixels_of_all_images(sizes, affine):
    bn, ref_bn = _bn(affine=affine), _bn(affine=affine)
    x, dense = image_batch(sizes, seed=1, dtype=D, requires_grad=True)
    out = bn(x)
    refs = _batch_stats_reference(ref_bn, dense)
    assert_close_samples(out, refs)
    torch.testing.assert_close(bn.running_mean, ref_bn.running_mean)
    torch.testing.assert_close(bn.running_var, ref_bn.running_var)
    assert int(bn.num_batches_tracked) == 1  # once per batch, not once per image
    g = torch.Generator().manual_seed(2)
    cot = [torch.randn(r.shape, generator=g, dtype=D) for r in refs]
    params = [bn.weight, bn.bias] if affine else []
    ref_params = [ref_bn.weight, ref_bn.bias] if affine else []
    got = torch.autograd.grad((out.values() * padless.from_list(cot, ragged_dims=(1, 2))._values).sum(), [x, *params])
    want = torch.autograd.grad(sum((r * c).sum() for r, c in zip(refs, cot)), [*dense, *ref_params])
    assert_close_samples(got[0], want[: len(dense)], what="input gradient")
    for a, b in zip(got[1:], want[len(dense):]):
        torch.testing.assert_close(a, b)


def test_batch_norm_eval_is_per_image_and_float32_path_matches_torch():
    bn = _bn().eval()
    with torch.no_grad():
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2)
    x, dense = image_batch(SIZES, seed=3, dtype=D, requires_grad=True)
    check_layer(bn, x, dense, params=[bn.weight, bn.bias])
    # float32 training: the row kernel against torch's own batch norm on the same (N, C) rows
    v = torch.randn(500, 4) * 3 + 1
    rm, rv, rm2, rv2 = torch.zeros(4), torch.ones(4), torch.zeros(4), torch.ones(4)
    xs = padless.from_values(v, sizes=torch.tensor([[4, 20, 25]]), ragged_dims=(1, 2))
    out = F.batch_norm(xs, rm, rv, None, None, True, 0.1, 1e-5)
    torch.testing.assert_close(out.values(), F.batch_norm(v, rm2, rv2, None, None, True, 0.1, 1e-5), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close((rm, rv), (rm2, rv2))


def test_batch_norm_on_sequences_and_gradcheck():
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(4).to(D)
    seqs = [torch.randn(4, n, dtype=D) for n in (3, 5, 1)]
    x = padless.from_list(seqs, ragged_dims=(1,))
    pix = torch.cat(seqs, 1)
    want = [(s - pix.mean(1, keepdim=True)) / torch.sqrt(pix.var(1, unbiased=False, keepdim=True) + 1e-5) for s in seqs]
    assert_close_samples(bn(x), want)
    sizes = torch.tensor([[2, 2, 3], [2, 1, 2]])
    v = torch.randn(8, 2, dtype=D, requires_grad=True)
    w = torch.rand(2, dtype=D, requires_grad=True)
    b = torch.randn(2, dtype=D, requires_grad=True)

    def f(v, w, b):
        xx = padless.from_values(v, sizes=sizes, ragged_dims=(1, 2))
        return F.batch_norm(xx, None, None, w, b, True).values()

    assert torch.autograd.gradcheck(f, (v, w, b))


def test_instance_norm_per_image_and_running_stats():
    torch.manual_seed(0)
    inorm = nn.InstanceNorm2d(3, affine=True, track_running_stats=True).to(D)
    with torch.no_grad():
        inorm.weight.uniform_(0.5, 1.5)
        inorm.bias.normal_()
    x, dense = image_batch(SIZES[:3], seed=4, dtype=D, requires_grad=True)
    ref = lambda s: F.instance_norm(s[None], None, None, inorm.weight, inorm.bias)[0]  # noqa: E731
    check_layer(inorm, x, dense, params=[inorm.weight, inorm.bias], ref=ref)
    # torch's update: the batch average of per-image means and unbiased variances
    means = torch.stack([d.detach().flatten(1).mean(1) for d in dense])
    vars_ = torch.stack([d.detach().flatten(1).var(1) for d in dense])
    torch.testing.assert_close(inorm.running_mean, 0.1 * means.mean(0))
    torch.testing.assert_close(inorm.running_var, 0.9 + 0.1 * vars_.mean(0))
    inorm.eval()  # running statistics now
    check_layer(inorm, x, dense, ref=lambda s: inorm(s[None])[0])


def test_norm_errors():
    x = padless.from_list([torch.randn(3, 4, 5), torch.randn(3, 2, 2)])
    with pytest.raises(ValueError, match=r"batch_norm\(\): over the 1 real positions of the batch: Expected more than 1 value per channel"):
        F.batch_norm(padless.from_list([torch.randn(3, 1, 1)], ragged_dims=(1, 2)), None, None, training=True)
    with pytest.raises(padless.StructureError, match=r"batch_norm\(\): expected channels-first samples \(C, \*spatial\)"):
        F.batch_norm(padless.from_list([torch.randn(4, 3), torch.randn(2, 3)]), None, None, training=True)
    with pytest.raises(TypeError, match=r"batch_norm\(\): only the input may be a NestedTensor"):
        F.batch_norm(x, x, None)
    with pytest.raises(ValueError, match=r"instance_norm\(\): use_input_stats=False needs running_mean and running_var"):
        F.instance_norm(x, use_input_stats=False)


def test_fallback_refuses_ops_that_mix_samples():
    x = padless.from_list([torch.randn(3, 4, 5), torch.randn(3, 2, 2)], ragged_dims=(1, 2))
    rm, rv = torch.zeros(3), torch.ones(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(NotImplementedError, match=r"aten.native_batch_norm.default is not supported .*its result mixes samples \(batch statistics"):
            torch.ops.aten.native_batch_norm(x, None, None, rm, rv, True, 0.1, 1e-5)
        with pytest.raises(NotImplementedError, match=r"aten.nansum.default is not supported .*it reduces over every dim, the batch dim included"):
            torch.ops.aten.nansum(x)  # (aten.amax has a handler: every real element, as torch.amax(x))
        with pytest.raises(NotImplementedError, match=r"aten.max.default is not supported on NestedTensor: it returns a scalar for a batch of one sample"):
            torch.ops.aten.max(x)
        # eval-mode batch norm is per sample: the fallback may run it (and torch.batch_norm has a handler)
        out = torch.batch_norm(x, None, None, rm, rv, False, 0.1, 1e-5, False)
        assert_close_samples(out, [F.batch_norm(s[None], rm, rv)[0] for s in x.unbind()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_norm_cumulative_average_and_low_precision_match_torch_on_all_pixels(dtype):
    # momentum=None (cumulative running stats) and bf16: torch's batch norm on every real pixel side by side
    bn, ref = nn.BatchNorm2d(3, momentum=None).to(dtype), nn.BatchNorm2d(3, momentum=None).to(dtype)
    x, dense = image_batch(SIZES, seed=3, dtype=dtype, requires_grad=True)
    flat = torch.cat([d.flatten(1) for d in dense], 1)[None, :, None]  # (1, C, 1, sum H_i W_i)
    for _ in range(2):
        out, want = bn(x), ref(flat)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(out.values(), want[0, :, 0].t(), **tol)
    torch.testing.assert_close(bn.running_mean, ref.running_mean, **tol)
    torch.testing.assert_close(bn.running_var, ref.running_var, **tol)
    assert out.dtype == dtype
