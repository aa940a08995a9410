"""The image folder reader: labels by subfolder, native sizes, unreadable files."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader

import padless
from padless.loaders import BudgetBatchSampler, ImageFolder, PixelBudget, SkipAndWarn, raise_error
from padless.loaders.synthetic import random_sizes, write_image_folder


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("folder"))
    write_image_folder(path, ("cat", "dog", "eel"), per_class=5, seed=2, corrupt=1)
    return path


def test_labels_sizes_and_the_corrupt_file_left_out(root) -> None:
    handler = SkipAndWarn()
    with pytest.warns(RuntimeWarning, match="sample key 'cat/corrupt0.jpg'"):
        ds = ImageFolder(root, handler=handler)
    assert handler.total == 1 and len(ds) == 15 and ds.classes == ["cat", "dog", "eel"]
    sizes = random_sizes(15, seed=2)
    for i in range(len(ds)):
        s = ds[i]
        assert s["image"].dtype == torch.uint8 and s["image"].shape == (3, *sizes[i])
        assert s["label"] == i // 5
        assert tuple(ds.sizes()[i]) == sizes[i]


def test_size_rules_are_reflected_in_sizes(root) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = ImageFolder(root, max_side=32, multiple_of=8, image_mode="L")
    for i in range(len(ds)):
        img = ds[i]["image"]
        assert img.shape == (1, *ds.sizes()[i]) and max(img.shape[1:]) <= 32 and img.shape[1] % 8 == 0


def collate(samples: list[dict]) -> tuple:
    return padless.from_list([s["image"] for s in samples], ragged_dims=(1, 2)), torch.tensor([s["label"] for s in samples])


def test_dataloader_with_a_pixel_budget(root) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = ImageFolder(root)
    sampler = BudgetBatchSampler(ds.sizes(), PixelBudget(6000))
    n = 0
    for images, labels in DataLoader(ds, batch_sampler=sampler, num_workers=2, collate_fn=collate):
        assert images.ragged_dims == (1, 2)
        assert int(images.sizes()[:, 1:].prod(1).sum()) <= 6000 or len(labels) == 1
        n += len(labels)
    assert n == len(ds)


def test_raise_handler_and_errors(root, tmp_path) -> None:
    with pytest.raises(Exception, match="sample key 'cat/corrupt0.jpg'"):
        ImageFolder(root, handler=raise_error)
    with pytest.raises(FileNotFoundError, match="has no subfolders \\(one per class\\); pass labels=False"):
        ImageFolder(tmp_path)
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        ImageFolder(tmp_path / "missing")


def test_pixels_that_fail_to_decode_raise_naming_the_file(tmp_path) -> None:
    from padless.loaders.synthetic import image_bytes

    (tmp_path / "a").mkdir()
    data = image_bytes(64, 64, "jpg", seed=1)
    (tmp_path / "a" / "cut.jpg").write_bytes(data[: len(data) // 2])  # the header reads, the pixels do not
    ds = ImageFolder(tmp_path)
    assert len(ds) == 1
    with pytest.raises(RuntimeError, match="ImageFolder: cannot decode '.*cut.jpg' \\(index 0\\)"):
        ds[0]
    with pytest.raises(IndexError, match="index 1 is out of range for 1 images"):
        ds[1]
