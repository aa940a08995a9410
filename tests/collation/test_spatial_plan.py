"""``Field(spatial_plan=...)``: the worker builds the first layer's spatial plan, the batch carries
it, and the layer in the main process finds it ready (no plan built there)."""

from __future__ import annotations

import pickle
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from padless import Collator, Field
from padless.ops.vision import spatial

STEM = dict(kernel_size=7, stride=2, padding=3)
POOL = dict(kernel_size=3, stride=2, padding=1)
SIZES = [(20, 31), (9, 7), (33, 12), (1, 5), (16, 16)]


@pytest.fixture
def plan_builds(monkeypatch):
    """Geometries of the spatial plans built in this process."""
    built: list[spatial.Geometry] = []
    original = spatial._new_plan

    def counted(cache, g, *a, **k):
        built.append(g)
        return original(cache, g, *a, **k)

    monkeypatch.setattr(spatial, "_new_plan", counted)
    return built


def _samples(sizes=SIZES, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"img": torch.randn(3, h, w, generator=g), "label": i % 2} for i, (h, w) in enumerate(sizes)]


def _check_conv(batch, samples, conv: nn.Conv2d) -> None:
    x = batch.img.detach().requires_grad_()
    y = conv(x)
    (y * y).sum().backward()
    for i, (got, s) in enumerate(zip(y.unbind(), samples)):
        xi = s["img"][None].clone().requires_grad_()
        want = conv(xi)[0]
        torch.testing.assert_close(got, want, msg=f"image {i}")
        (want * want).sum().backward()
        torch.testing.assert_close(x.grad.unbind()[i], xi.grad[0], msg=f"image {i} grad")


def test_loader_batches_need_no_plan_in_the_main_process(plan_builds):
    collator = Collator({"img": Field(ragged=(1, 2), spatial_plan=[STEM, POOL])})
    samples = _samples()
    conv = nn.Conv2d(3, 4, 7, stride=2, padding=3)
    loader = DataLoader(samples, batch_size=3, num_workers=1, collate_fn=collator)
    n = 0
    for k, b in enumerate(loader):
        _check_conv(b, samples[3 * k: 3 * k + 3], conv)
        pooled = F.max_pool2d(b.img, 3, 2, 1)
        for got, s in zip(pooled.unbind(), samples[3 * k: 3 * k + 3]):
            torch.testing.assert_close(got, F.max_pool2d(s["img"][None], 3, 2, 1)[0])
        n += 1
    assert n == 2
    assert plan_builds == []


def _forget_plans(monkeypatch) -> None:
    """Drop the process-wide plan table, so only what a batch carries can be found."""
    monkeypatch.setattr(spatial, "_CACHES", weakref.WeakValueDictionary())


def test_pickled_batch_carries_the_plan(plan_builds, monkeypatch):
    collator = Collator({"img": Field(ragged=(1, 2), spatial_plan=STEM)})
    samples = _samples(seed=1)
    b = collator(samples)
    assert len(plan_builds) == 1  # the worker's share
    plan_builds.clear()
    _forget_plans(monkeypatch)
    _check_conv(pickle.loads(pickle.dumps(b)), samples, nn.Conv2d(3, 2, 7, stride=2, padding=3))
    assert plan_builds == []


def test_control_without_spatial_plan_builds_in_the_main_process(plan_builds, monkeypatch):
    samples = _samples()
    b = pickle.loads(pickle.dumps(Collator({"img": Field(ragged=(1, 2))})(samples)))
    _forget_plans(monkeypatch)
    nn.Conv2d(3, 2, 7, stride=2, padding=3)(b.img)
    assert len(plan_builds) == 1


def test_other_geometries_and_one_image():
    """A layer whose geometry differs from the carried one builds its own plan and is still right."""
    samples = _samples([(11, 6)])
    b = Collator({"img": Field(ragged=(1, 2), spatial_plan=dict(kernel_size=(3, 5), padding=(1, 2, 0, 2), dilation=2))})(samples)
    conv = nn.Conv2d(3, 2, (3, 5), padding=(1, 2), dilation=2)
    _check_conv(b, samples, conv)
    _check_conv(b, samples, nn.Conv2d(3, 2, 3, stride=2, padding=1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_moved_batch_finds_the_plan_on_the_device(plan_builds):
    samples = _samples()
    b = Collator({"img": Field(ragged=(1, 2), spatial_plan=STEM)})(samples)
    plan_builds.clear()
    conv = nn.Conv2d(3, 2, 7, stride=2, padding=3).cuda()
    y = conv(b.pin_memory().to("cuda", non_blocking=True).img)
    assert plan_builds == []
    for got, s in zip(y.unbind(), samples):
        torch.testing.assert_close(got, conv(s["img"][None].cuda())[0])


@pytest.mark.parametrize(
    "spec, match",
    [
        (7, r"Collator: field 'img': spatial_plan must be a dict like dict\(kernel_size=7, stride=2, padding=3\) or a non-empty list of them, got 7"),
        ([], "or a non-empty list of them, got \\[\\]"),
        (dict(kernel=7), r"field 'img': spatial_plan has unknown key\(s\) \['kernel'\]; the keys are \['kernel_size'"),
        (dict(stride=2), "spatial_plan has no kernel_size; the keys are"),
        ([STEM, dict(kernel_size=0)], r"spatial_plan\[1\]\(\): kernel_size must be an int >= 1 or a pair of them, got 0"),
        (dict(kernel_size=3, padding="same"), "padding 'same' is not supported here; give the numbers"),
        (dict(kernel_size=3, ceil_mode=1), "spatial_plan: ceil_mode must be a bool, got 1"),
    ],
)
def test_bad_spatial_plan_specs(spec, match):
    with pytest.raises((TypeError, ValueError), match=match):
        Collator({"img": Field(ragged=(1, 2), spatial_plan=spec)})


def test_spatial_plan_needs_channels_first_images():
    c = Collator({"img": Field(ragged=(0, 1), spatial_plan=STEM)})
    with pytest.raises(ValueError, match=r"field 'img': spatial_plan needs images \(C, H_i, W_i\) ragged along dims \(1, 2\) or sequences \(C, L_i\) ragged along dim 1; this field's ragged dims are \(0, 1\)"):
        c([{"img": torch.zeros(4, 5, 3)}, {"img": torch.zeros(6, 2, 3)}])
    c = Collator({"seq": Field(ragged=0, spatial_plan=STEM)})
    with pytest.raises(ValueError, match=r"field 'seq': spatial_plan needs images .* ragged dims are \(0,\)"):
        c([{"seq": torch.zeros(4, 3)}, {"seq": torch.zeros(6, 3)}])


def test_rebuilt_batch_finds_the_plan(plan_builds, monkeypatch):
    """What a device move does (new tensors, new structure, caches refilled from the metadata),
    with copies on the CPU: the copied plan is found and gives the same result."""
    from padless.collation import transfer

    samples = _samples(seed=2)
    b = Collator({"img": Field(ragged=(1, 2), spatial_plan=STEM)})(samples)
    plan_builds.clear()
    _forget_plans(monkeypatch)
    moved = transfer.map_fields({"img": b.img}, lambda t, host: t.clone())["img"]
    assert moved._meta is not b.img._meta
    _check_conv(type(b)({"img": moved}, len(b)), samples, nn.Conv2d(3, 2, 7, stride=2, padding=3))
    assert plan_builds == []


def test_sequences_get_a_conv1d_plan(plan_builds, monkeypatch):
    g = torch.Generator().manual_seed(4)
    samples = [{"audio": torch.randn(2, n, generator=g)} for n in (17, 5, 40, 9)]
    b = Collator({"audio": Field(ragged=1, spatial_plan=dict(kernel_size=5, stride=2, padding=2))})(samples)
    plan_builds.clear()
    _forget_plans(monkeypatch)
    conv = nn.Conv1d(2, 3, 5, stride=2, padding=2)
    y = conv(pickle.loads(pickle.dumps(b)).audio)
    assert plan_builds == []
    for got, s in zip(y.unbind(), samples):
        torch.testing.assert_close(got, conv(s["audio"][None])[0])
    c = Collator({"audio": Field(ragged=1, spatial_plan=dict(kernel_size=(1, 5)))})
    with pytest.raises(ValueError, match=r"field 'audio': spatial_plan on sequences \(C, L_i\) takes one int per number"):
        c(samples)
