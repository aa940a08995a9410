"""The readers' transform= hook and padless.loaders.transforms (issue 10): Normalize on (C, H, W) and
channel-last views, budget_size / resize_to_budget checked exactly against a brute-force search."""

from __future__ import annotations

import os
import sys
from fractions import Fraction
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from padless.loaders import (
    Compose,
    HFDatasetReader,
    ImageFolder,
    Normalize,
    WebDatasetReader,
    BudgetBatchSampler,
    PixelBudget,
    budget_size,
    budget_sizes,
    resize_to_budget,
)
from padless.loaders.synthetic import write_image_folder, write_shards

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def brute_budget(h: int, w: int, p: int, t: int, cap: float | None) -> tuple[int, int]:
    """The definition, searched over every scale at which the patch grid changes."""
    best = (Fraction(0), 1, 1)
    scales = {Fraction(k * p, h) for k in range(1, t + 1)} | {Fraction(k * p, w) for k in range(1, t + 1)}
    for s in scales:
        if cap is not None and s > Fraction(cap):
            continue
        gh, gw = max(1, int(h * s / p)), max(1, int(w * s / p))
        if gh * gw <= t and s > best[0]:
            best = (s, gh, gw)
    return best[1] * p, best[2] * p


@pytest.mark.parametrize("cap", [1.0, None, 2.5, 0.3])
def test_budget_size_is_the_largest_fitting_size_at_the_image_aspect(cap) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        h, w = (int(v) for v in torch.randint(1, 700, (2,), generator=g))
        p = int(torch.randint(1, 33, (1,), generator=g))
        t = int(torch.randint(1, 300, (1,), generator=g))
        got = budget_size(h, w, p, t, max_upsample=cap)
        assert got == brute_budget(h, w, p, t, cap), (h, w, p, t, cap)
        gh, gw = got[0] // p, got[1] // p
        assert got[0] % p == 0 and got[1] % p == 0 and gh * gw <= t or (gh, gw) == (1, 1)


def test_budget_size_exact_values() -> None:
    assert budget_size(480, 640, 16, 256) == (224, 288)  # 14 x 18 patches
    assert budget_size(640, 480, 16, 256) == (288, 224)
    assert budget_size(224, 224, 16, 196) == (224, 224)  # already at its budget
    assert budget_size(224, 224, 16, 195) == (208, 208)
    assert budget_size(20, 30, 16, 256) == (16, 16)  # no upsampling by default
    assert budget_size(20, 30, 16, 256, max_upsample=None) == (208, 304)
    assert budget_size(20, 30, 16, 256, max_upsample=4.0) == (80, 112)
    assert budget_size(10, 1000, 16, 8) == (16, 128)  # a strip: one patch high, at least
    assert budget_size(1, 1, 8, 1) == (8, 8)


def test_budget_size_argument_errors() -> None:
    with pytest.raises(ValueError, match="budget_size: max_tokens must be an int >= 1, got 0"):
        budget_size(10, 10, 4, 0)
    with pytest.raises(ValueError, match="budget_size: patch must be an int >= 1, got 2.0"):
        budget_size(10, 10, 2.0, 9)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="budget_size: max_upsample must be a finite number > 0 or None, got 0"):
        budget_size(10, 10, 2, 9, max_upsample=0)
    with pytest.raises(ValueError, match=r"resize_to_budget: expected a \(C, H, W\) image tensor, got shape \(4, 4\)"):
        resize_to_budget(torch.zeros(4, 4), 2, 4)
    with pytest.raises(ValueError, match=r"resize_to_budget: the image has an empty side \(0x4\)"):
        resize_to_budget(torch.zeros(3, 0, 4), 2, 4)


def test_resize_to_budget_keeps_dtype_and_layout() -> None:
    img = torch.randint(0, 256, (200, 300, 3), dtype=torch.uint8).permute(2, 0, 1)  # channel-last view
    out = resize_to_budget(img, 16, 100)
    assert out.shape == (3, 128, 192) and out.dtype == torch.uint8 and out.permute(1, 2, 0).is_contiguous()
    ref = F.interpolate(img[None].contiguous().float(), size=(128, 192), mode="bilinear", antialias=True)[0]
    assert (out.float() - ref).abs().max() <= 1  # uint8 rounding
    f = img.float().contiguous()
    assert torch.equal(resize_to_budget(f, 16, 100), F.interpolate(f[None], size=(128, 192), mode="bilinear", antialias=True)[0])
    assert resize_to_budget(f[:, :192, :128], 16, 100) is not None
    same = torch.zeros(3, 32, 48)
    assert resize_to_budget(same, 16, 6) is same


@pytest.mark.parametrize("layout", ["contiguous", "channel_last"])
def test_normalize_per_channel(layout) -> None:
    hwc = torch.randint(0, 256, (5, 7, 3), dtype=torch.uint8)
    img = hwc.permute(2, 0, 1) if layout == "channel_last" else hwc.permute(2, 0, 1).contiguous()
    out = Normalize(MEAN, STD)(img)
    for c in range(3):
        ref = (img[c].float() / 255 - MEAN[c]) / STD[c]
        assert torch.equal(out[c], ref)
    assert out.dtype == torch.float32 and out.stride() == tuple(torch.empty_like(img, dtype=torch.float32).stride())
    assert img.dtype == torch.uint8  # the input is untouched
    x = torch.rand(3, 4, 4)
    assert torch.allclose(Normalize(0.5, 0.25)(x), (x - 0.5) / 0.25)  # floats are not rescaled; one value for all
    assert Normalize(MEAN, STD, dtype=torch.float64)(img).dtype == torch.float64


def test_normalize_errors() -> None:
    with pytest.raises(ValueError, match="Normalize: the image has 1 channels but mean/std hold 3 values"):
        Normalize(MEAN, STD)(torch.zeros(1, 2, 2))
    with pytest.raises(ValueError, match=r"Normalize: expected a \(C, H, W\) image tensor, got shape \(2, 2\)"):
        Normalize(MEAN, STD)(torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"Normalize: std must be finite and > 0"):
        Normalize(MEAN, [1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="Normalize: mean has 3 values and std 2; give one per channel"):
        Normalize(MEAN, [1.0, 2.0])
    with pytest.raises(TypeError, match="Normalize: dtype must be a floating dtype"):
        Normalize(MEAN, STD, dtype=torch.int32)


def pid_of(sample: dict) -> dict:
    return {**sample, "pid": os.getpid()}


FIELDS = {"image": "jpg;png", "label": "cls"}


def test_webdataset_transform_runs_per_sample_in_the_workers(tmp_path) -> None:
    shards = write_shards(str(tmp_path), num_shards=2, per_shard=3)
    tf = Compose(partial(resize_to_budget, patch=8, max_tokens=16), Normalize(MEAN, STD))
    plain = {s["__key__"]: s for s in WebDatasetReader(shards, fields=FIELDS, shuffle_shards=False)}
    reader = WebDatasetReader(shards, fields=FIELDS, transform={"image": tf}, shuffle_shards=False)
    for s in reader:
        assert torch.equal(s["image"], tf(plain[s["__key__"]]["image"]))
        _, h, w = s["image"].shape
        assert h % 8 == 0 and w % 8 == 0 and (h // 8) * (w // 8) <= 16
    loader = DataLoader(WebDatasetReader(shards, fields=FIELDS, transform=pid_of), batch_size=None, num_workers=2)
    pids = {s["pid"] for s in loader}
    assert len(pids) == 2 and os.getpid() not in pids


def test_image_folder_and_hf_transforms(tmp_path) -> None:
    write_image_folder(str(tmp_path), ("a", "b"), per_class=2)
    ds = ImageFolder(tmp_path, transform={"image": Normalize(MEAN, STD), "label": lambda c: c + 10})
    plain = ImageFolder(tmp_path)
    s = ds[3]
    assert s["label"] == 11 and torch.equal(s["image"], Normalize(MEAN, STD)(plain[3]["image"]))
    datasets = pytest.importorskip("datasets")
    hf = datasets.Dataset.from_dict({"ids": [[1, 2, 3], [4]]})
    r = HFDatasetReader(hf, transform={"ids": lambda t: t[:2]})
    assert [x["ids"].tolist() for x in r.__getitems__([0, 1])] == [[1, 2], [4]]
    assert r.lengths().tolist() == [3, 1]  # lengths before the transform


def test_transform_errors_name_the_sample(tmp_path) -> None:
    shards = write_shards(str(tmp_path), num_shards=1, per_shard=2)
    with pytest.raises(TypeError, match=r"WebDatasetReader: transform must be a function of the sample dict or a \{field: function\} dict, got int"):
        WebDatasetReader(shards, transform=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ImageFolder: transform for field 'image' must be callable, got str"):
        ImageFolder(tmp_path, transform={"image": "resize"})  # type: ignore[dict-item]
    with pytest.raises(KeyError, match=r"transform: field 'mask' is not in the sample \(fields: \['__key__', '__shard__', 'image', 'label'\]\)"):
        list(WebDatasetReader(shards, fields=FIELDS, transform={"mask": abs}))

    def broken(sample: dict) -> dict:
        raise ZeroDivisionError("boom")

    with pytest.raises(ZeroDivisionError, match="boom") as e:
        list(WebDatasetReader(shards, fields=FIELDS, transform=broken))
    if sys.version_info >= (3, 11):
        assert "sample '00000000' of shard" in e.value.__notes__[0]


def test_budget_sizes_feed_a_sampler_the_sizes_after_the_resize(tmp_path) -> None:
    write_image_folder(str(tmp_path), ("a",), per_class=5, low=20, high=90)
    resize = partial(resize_to_budget, patch=8, max_tokens=20)
    ds = ImageFolder(tmp_path, transform={"image": resize})
    sizes = budget_sizes(ds.sizes(), 8, 20)
    assert [tuple(ds[i]["image"].shape[1:]) for i in range(len(ds))] == [tuple(s) for s in sizes.tolist()]
    sampler = BudgetBatchSampler(sizes, PixelBudget(40, patch_size=8), seed=0)
    for batch in sampler:
        assert len(batch) == 1 or sum((h // 8) * (w // 8) for h, w in sizes[batch].tolist()) <= 40
