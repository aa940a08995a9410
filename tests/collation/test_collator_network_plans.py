"""``Field(spatial_plan=recipe)``: the worker builds every spatial plan of a whole network (each
stage's convolutions, pools, strided projections, adaptive pooling, nearest upsampling), the batch
carries them, and the first step of the network on a new batch builds none in the main process."""

from __future__ import annotations

import os
import pickle
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

import padless
import padless.vision
from padless import Collator, Field
from padless.ops.vision import conv as conv_mod
from padless.ops.vision import resample
from padless.ops.vision import spatial
from padless.testing.vision import ResNetish

SIZES = [(37, 29), (9, 7), (50, 23), (3, 5), (16, 16)]  # (9, 7), (3, 5): 1x1 by the last stages


class Net(nn.Module):
    """ResNet-ish: 7x7/2 stem, BN, max pool, residual stages with strided 1x1 projections, a ceil-mode
    max pool, an average pool and adaptive average pooling; optionally a 2x nearest upsampling,
    pooled back and added."""

    def __init__(self, upsample: bool = False) -> None:
        super().__init__()
        self.upsample = upsample
        self.body = ResNetish(widths=(4, 6, 8), classes=3)
        self.pool = nn.MaxPool2d(2, ceil_mode=True)
        self.avg = nn.AvgPool2d(3, 1, 1, count_include_pad=False)

    def forward(self, x):
        f = self.body.features(x)
        if self.upsample:  # 2x up, 2x down: f's sizes
            f = f + self.pool(F.interpolate(f, scale_factor=2.0, mode="nearest"))
        f = self.avg(self.pool(f))
        return self.body.fc(torch.flatten(self.body.pool(f), 1))


def _net(seed: int = 0, upsample: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    net = Net(upsample).double()
    for m in net.modules():  # eval-mode batch norm with non-trivial statistics: per image, like the dense runs
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    return net.eval()


def _recipe(net: nn.Module, channels: int = 3):
    g = torch.Generator().manual_seed(7)
    example = padless.from_list([torch.randn(channels, h, w, generator=g, dtype=torch.float64) for h, w in [(41, 33), (20, 45), (12, 9)]])
    return padless.vision.plan_recipe(net, example)


def _samples(sizes=SIZES, seed=0, channels=3):
    g = torch.Generator().manual_seed(seed)
    return [{"img": torch.randn(channels, h, w, generator=g, dtype=torch.float64)} for h, w in sizes]


def _graph(root: spatial.SpatialCache) -> set:
    """Every (structure sizes, cache key) reachable from ``root``: what the layers may find built."""
    out, todo, seen = set(), [root], set()
    while todo:
        c = todo.pop()
        if id(c) in seen:
            continue
        seen.add(id(c))
        for k, v in c.plans.items():
            out.add((c.hw.numpy().tobytes(), k))
            nxt = getattr(v, "cache", None) or (v[1] if isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], spatial.SpatialCache) else None)
            if nxt is not None:
                todo.append(nxt)
    return out


@pytest.fixture
def forget_plans(monkeypatch):
    """Drop the process-wide plan table, so only what a batch carries can be found."""

    def forget() -> None:
        monkeypatch.setattr(spatial, "_CACHES", weakref.WeakValueDictionary())

    return forget


@pytest.fixture
def no_builds(monkeypatch):
    """After ``arm()`` (until ``arm(False)``): building a plan, a canvas index, a strided
    projection's rows or upsampling maps in this process raises."""
    main = os.getpid()
    armed = [False]

    def arm(on: bool = True) -> None:
        armed[0] = on
        if not on:
            return

        def refuse(name, original):
            def f(*a, **k):
                if armed[0] and os.getpid() == main:
                    raise AssertionError(f"{name} built in the main process")
                return original(*a, **k)
            return f

        monkeypatch.setattr(spatial, "_new_plan", refuse("_new_plan", spatial._new_plan))
        monkeypatch.setattr(spatial, "grid_sources", refuse("grid_sources", spatial.grid_sources))
        monkeypatch.setattr(spatial, "grid_index", refuse("grid_index", spatial.grid_index))
        monkeypatch.setattr(conv_mod, "_subsample_rows", refuse("subsample rows", conv_mod._subsample_rows))
        monkeypatch.setattr(resample, "_nearest_maps", refuse("upsampling maps", resample._nearest_maps))

    return arm


def _check(net: nn.Module, x: padless.NestedTensor, samples) -> None:
    """Values and input gradients of ``net`` on the batch equal the dense runs on each image."""
    x = x.detach().requires_grad_()
    out = net(x)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)
    (out * cot).sum().backward()
    grads = x.grad.unbind()
    for i, s in enumerate(samples):
        xi = s["img"][None].clone().requires_grad_()
        want = net(xi)
        torch.testing.assert_close(out[i: i + 1], want, msg=f"image {i}")
        (want * cot[i: i + 1]).sum().backward()
        torch.testing.assert_close(grads[i], xi.grad[0], msg=f"image {i} grad")


def test_recipe_records_every_stage():
    recipe = _recipe(_net())
    kinds = [s.key[0] for s in recipe.steps]
    assert kinds.count("subsample") == 2  # stages 2 and 3: strided 1x1 projections
    assert kinds.count("adaptive") == 1
    strides = {(s.key[1].kernel, s.key[1].stride) for s in recipe.steps if s.key[0] == "plan"}
    assert {((7, 7), (2, 2)), ((3, 3), (2, 2)), ((3, 3), (1, 1)), ((2, 2), (2, 2))} <= strides
    assert recipe.nodes >= 5 and max(s.src for s in recipe.steps) >= 4  # later stages read later structures
    assert "subsample" in repr(recipe)


@pytest.mark.parametrize("fill_after", [None, 1], ids=["small-rows-path", "large-rows-path"])
@pytest.mark.parametrize("sizes", [SIZES, [(23, 31)]], ids=["five-images", "one-image"])
def test_collated_batch_needs_no_plan_and_matches_dense(fill_after, sizes, monkeypatch, no_builds, forget_plans):
    if fill_after is not None:  # SpatialPlan's other index for moves of many rows (a recipe picks by size)
        monkeypatch.setattr(spatial, "_FILL_AFTER", fill_after)
    net = _net()
    recipe = _recipe(net)
    samples = _samples(sizes)
    b = pickle.loads(pickle.dumps(Collator({"img": Field(ragged=(1, 2), spatial_plan=recipe)})(samples)))
    control = pickle.loads(pickle.dumps(Collator({"img": Field(ragged=(1, 2))})(_samples([(h + 1, w) for h, w in sizes]))))
    forget_plans()
    b = pickle.loads(pickle.dumps(b))  # what the main process receives, alone in a fresh plan table
    root = spatial._cache_of("test", b.img)
    before = _graph(root)
    no_builds()
    with pytest.raises(AssertionError, match="built in the main process"):  # the check works: without a recipe
        net(control.img)
    net(b.img).square().sum().backward()  # a train step: the images need no gradient
    added = _graph(root) - before
    assert added == set(), f"built in the main process: {sorted(str(k[1])[:60] for k in added)}"
    no_builds(False)  # the input gradient (the stem's backward into the images) is built on first use
    _check(net, b.img, samples)


def test_train_step_matches_without_recipe():
    """Training mode (batch-norm statistics over the batch's pixels): the recipe changes nothing."""
    net = _net().train()
    recipe = _recipe(net)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    samples = _samples(seed=2)
    got = []
    for field in (Field(ragged=(1, 2), spatial_plan=recipe), Field(ragged=(1, 2))):
        net.load_state_dict(state)
        net.zero_grad()
        x = Collator({"img": field})(samples).img
        loss = net(x).square().sum()
        loss.backward()
        got.append((loss.detach(), [p.grad.clone() for p in net.parameters()]))
    torch.testing.assert_close(got[0][0], got[1][0])
    for a, b in zip(got[0][1], got[1][1]):
        torch.testing.assert_close(a, b)


def test_recording_leaves_the_model_as_it_was():
    net = _net().train()
    state = {k: v.clone() for k, v in net.state_dict().items()}
    params = list(net.parameters())
    params[0].grad = torch.ones_like(params[0])  # one accumulated gradient, the others None
    grads_before = [p.grad for p in params]
    net.body.stages.append(nn.Dropout2d(0.5))  # draws from the random generator
    g = torch.Generator().manual_seed(7)
    example = padless.from_list([torch.randn(3, h, w, generator=g, dtype=torch.float64) for h, w in [(41, 33), (20, 45)]])
    torch.manual_seed(11)
    padless.vision.plan_recipe(net, example)
    after = torch.rand(4)
    torch.manual_seed(11)
    assert torch.equal(after, torch.rand(4))  # the global generator's stream is left as it was
    assert all(torch.equal(v, state[k]) for k, v in net.state_dict().items())  # running statistics, counters
    assert all(p.grad is g for p, g in zip(params, grads_before))
    assert torch.equal(params[0].grad, torch.ones_like(params[0]))


@pytest.mark.parametrize("recorded_with_upsampling", [False, True])
def test_upsampling_branch(recorded_with_upsampling, no_builds, forget_plans):
    """Nearest 2x upsampling, then pooling on the upsampled sizes: replayed in the worker when the
    recipe saw it; built on first use (and still right) when it did not."""
    net = _net(upsample=True)
    recipe = _recipe(_net(upsample=recorded_with_upsampling))
    assert any(s.key[0] == "nearest" for s in recipe.steps) == recorded_with_upsampling
    samples = _samples(seed=4)
    b = pickle.loads(pickle.dumps(Collator({"img": Field(ragged=(1, 2), spatial_plan=recipe)})(samples)))
    forget_plans()
    b = pickle.loads(pickle.dumps(b))
    if recorded_with_upsampling:
        no_builds()
        net(b.img).sum().backward()
        no_builds(False)
    _check(net, b.img, samples)


def test_other_geometry_than_the_recipe_is_still_right():
    """A network the recipe was not recorded on: its plans are built on first use, results exact."""
    recipe = _recipe(_net())
    torch.manual_seed(1)
    other = nn.Sequential(nn.Conv2d(3, 4, 5, stride=3, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2, 1, ceil_mode=True),
                          nn.Conv2d(4, 2, 3, dilation=2, padding=2), nn.AdaptiveAvgPool2d(1), nn.Flatten()).double()
    samples = _samples([(19, 23), (7, 11)])
    _check(other, Collator({"img": Field(ragged=(1, 2), spatial_plan=recipe)})(samples).img, samples)


def test_loader_worker_builds_the_whole_network(no_builds):
    net = _net()
    recipe = _recipe(net)
    samples = _samples()
    loader = DataLoader(samples, batch_size=3, num_workers=1, collate_fn=Collator({"img": Field(ragged=(1, 2), spatial_plan=recipe)}))
    no_builds()  # inherited by the worker, where it lets builds through (another process id)
    n = 0
    for k, b in enumerate(loader):
        no_builds()
        net(b.img).sum().backward()
        no_builds(False)
        _check(net, b.img, samples[3 * k: 3 * k + 3])
        n += 1
    assert n == 2


@pytest.mark.parametrize("sizes", [[(0, 5), (9, 9)], [(0, 0)]], ids=["one-empty", "all-empty"])
def test_empty_images_collate_and_keep_torchs_error(sizes):
    """The worker replays the recipe on a batch with empty images; the network then raises the
    same error as without a recipe (torch's, naming the image)."""
    net = _net()
    recipe = _recipe(net)
    errors = []
    for field in (Field(ragged=(1, 2), spatial_plan=recipe), Field(ragged=(1, 2))):
        b = Collator({"img": field})(_samples(sizes))
        with pytest.raises(RuntimeError, match=r"(conv2d|max_pool2d)\(\): image 0 of shape \(\d+, 0, \d+\) is too small") as e:
            net(b.img)
        errors.append(str(e.value))
    assert errors[0] == errors[1]


@pytest.mark.parametrize(
    "sample, field, match",
    [
        (torch.randn(1, 9, 8), Field(ragged=(1, 2)), r"field 'img': spatial_plan recipe was recorded on images \(C, H_i, W_i\) ragged along \(1, 2\) with 3 channels, this field holds samples of rank 3 ragged along \(1, 2\) with 1 channels"),
        (torch.randn(3, 9), Field(ragged=1), r"field 'img': .*this field holds samples of rank 2 ragged along \(1,\).*plan_recipe\(model"),
        (torch.randn(9, 8, 3), Field(ragged=(0, 1)), r"field 'img': .*ragged along \(0, 1\).*Field\(ragged=\(1, 2\)\)"),
        (torch.randn(3, 8, 8), Field(ragged=()), r"field 'img': .*this field holds a stacked field"),
    ],
)
def test_mismatching_recipe_is_a_clear_error(sample, field, match):
    recipe = _recipe(_net())
    collator = Collator({"img": dataclass_replace(field, spatial_plan=recipe)})
    with pytest.raises(ValueError, match=match):
        collator([{"img": sample}, {"img": sample}])


def dataclass_replace(field: Field, **kw) -> Field:
    import dataclasses

    return dataclasses.replace(field, **kw)


def test_plan_recipe_needs_a_nested_tensor():
    with pytest.raises(TypeError, match=r"plan_recipe\(\): example must be a NestedTensor"):
        padless.vision.plan_recipe(_net(), torch.randn(1, 3, 8, 8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_moved_batch_finds_the_plans_on_the_device(no_builds):
    net = _net()
    recipe = _recipe(net)
    samples = _samples(seed=5)
    b = Collator({"img": Field(ragged=(1, 2), spatial_plan=recipe)})(samples).to("cuda")
    gpu = _net().cuda()
    no_builds()
    out = gpu(b.img)
    out.sum().backward()
    no_builds(False)
    for i, s in enumerate(samples):
        torch.testing.assert_close(out[i: i + 1].cpu(), net(s["img"][None]), msg=f"image {i}")


def test_sequences_get_every_conv1d_plan(no_builds, forget_plans):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv1d(4, 8, 5, stride=2, padding=2), nn.ReLU(), nn.Conv1d(8, 8, 3, padding=1, dilation=1),
                        nn.ReLU(), nn.Conv1d(8, 2, 3, stride=2)).double()
    g = torch.Generator().manual_seed(0)
    recipe = padless.vision.plan_recipe(net, padless.from_list([torch.randn(4, n, generator=g, dtype=torch.float64) for n in (50, 23)]))
    assert [s.key[0] for s in recipe.steps] == ["plan"] * 3 and recipe.ragged == (1,)
    samples = [{"a": torch.randn(4, n, generator=g, dtype=torch.float64)} for n in (40, 9, 77)]
    b = pickle.loads(pickle.dumps(Collator({"a": Field(ragged=1, spatial_plan=recipe)})(samples)))
    forget_plans()
    b = pickle.loads(pickle.dumps(b))
    no_builds()
    out = net(b.a)
    out.values().sum().backward()
    no_builds(False)
    for i, (o, s) in enumerate(zip(out.unbind(), samples)):
        torch.testing.assert_close(o, net(s["a"][None])[0], msg=f"sequence {i}")
