"""Samples skipped inside DataLoader workers are counted in the main process (``reader.skipped``)
and warned there once per epoch, whatever collate_fn keeps the samples' ``__key__``."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, default_collate

import padless
from padless.loaders import SkipAndWarn, SkipStats, WebDatasetReader, skip_silently
from padless.loaders.skips import clean
from padless.loaders.synthetic import write_shards

FIELDS = {"image": "jpg;png", "label": "cls"}
BAD = ["00100002", "00100004"]  # two corrupt images in shard 1


@pytest.fixture(scope="module")
def bad_shards(tmp_path_factory) -> list[str]:
    return write_shards(str(tmp_path_factory.mktemp("skips")), num_shards=4, per_shard=6, seed=0, corrupt=BAD)


def _keys(batch) -> list[str]:
    if isinstance(batch, list):
        return [s["__key__"] for s in batch]
    return list(batch["__key__"])


def _shape(image):
    return torch.tensor(image.shape)  # same-size tensors: torch's default_collate stacks them


COLLATES = {"list": list, "padless.collate": padless.collate, "default_collate": default_collate}


def _main_warnings(w) -> list[str]:
    return [str(x.message) for x in w if issubclass(x.category, RuntimeWarning) and "this epoch" in str(x.message)]


@pytest.mark.parametrize("collate", COLLATES)
def test_workers_skips_reach_the_main_process(bad_shards, collate) -> None:
    transform = {"image": _shape} if collate == "default_collate" else None
    reader = WebDatasetReader(bad_shards, fields=FIELDS, shuffle_shards=False, transform=transform)
    loader = DataLoader(reader, batch_size=4, num_workers=2, collate_fn=COLLATES[collate])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        keys = [k for b in loader for k in _keys(b)]
    assert sorted(keys) == sorted(f"{s:03d}{i:05d}" for s in range(4) for i in range(6) if f"{s:03d}{i:05d}" not in BAD)
    assert all(type(k) is str for k in keys)  # the carriers became plain strings
    stats = reader.skipped
    assert stats.total == 2 and stats.counts == {"UnidentifiedImageError": 2}
    assert sorted(key for _, key, _ in stats.examples["UnidentifiedImageError"]) == BAD
    (msg,) = _main_warnings(w)  # one warning in this process, once the epoch ended
    assert msg.startswith("padless.loaders: WebDatasetReader: 2 sample(s) skipped: UnidentifiedImageError x2 (shard ")
    assert "shard-000001.tar', key '00100002': decode_image: cannot identify the image data as an image" in msg
    assert "key '00100004'" in msg and "object at 0x" not in msg


def test_through_a_bucketed_stream_and_the_collator(bad_shards) -> None:
    reader = WebDatasetReader(bad_shards, fields=FIELDS)
    stream = padless.loaders.BucketedStream(
        reader, padless.loaders.StreamingBucketer(_hw, padless.loaders.PixelBudget(4096)), collate_fn=padless.Collator({})
    )
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        n = sum(b.num_samples for b in DataLoader(stream, batch_size=None, num_workers=2))
    assert n == 22 and reader.skipped.counts == {"UnidentifiedImageError": 2}
    assert len(_main_warnings(w)) == 1


def _hw(sample):
    return tuple(sample["image"].shape[1:])


@pytest.mark.parametrize("set_epoch", [True, False])
def test_counts_reset_per_epoch(bad_shards, set_epoch) -> None:
    """Epochs are delimited by ``set_epoch``, or (never called) by the workers ending their pass."""
    reader = WebDatasetReader(bad_shards, fields=FIELDS)
    loader = DataLoader(reader, batch_size=None, num_workers=2, persistent_workers=True)
    seen = []
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for epoch in range(2):
            if set_epoch:
                reader.set_epoch(epoch)
            n = sum(1 for _ in loader)
            seen.append((n, reader.skipped, reader.skipped.total))
    assert [(n, t) for n, _, t in seen] == [(22, 2), (22, 2)]
    assert seen[0][1] is not seen[1][1]  # a new SkipStats per epoch
    assert len(_main_warnings(w)) == 2


def test_no_workers_counts_in_place_and_silent_handlers_do_not_warn(bad_shards) -> None:
    reader = WebDatasetReader(bad_shards, fields=FIELDS, handler=SkipAndWarn())
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert len(list(reader)) == 22
    assert reader.skipped.counts == {"UnidentifiedImageError": 2}
    assert len(_main_warnings(w)) == 1
    quiet = WebDatasetReader(bad_shards, fields=FIELDS, handler=skip_silently)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(DataLoader(quiet, batch_size=None, num_workers=2))) == 22
    assert quiet.skipped.total == 2  # counted all the same


def test_skip_stats_merge_and_report() -> None:
    a, b = SkipStats(), SkipStats()
    for i in range(5):
        a.add(OSError(f"cannot identify image file <_io.BytesIO object at 0x7f{i}>"), shard="s.tar", key=f"k{i}")
    b.add(ValueError("bad"), shard="t.tar", key=None)
    a.merge(b)
    assert a.total == 6 and a.counts == {"OSError": 5, "ValueError": 1}
    assert len(a.examples["OSError"]) == 3  # a few examples per reason, not every key
    assert "object at 0x" not in str(a) and "cannot identify image file <data>" in str(a)
    assert a.as_dict()["examples"]["ValueError"] == [["t.tar", None, "bad"]]
    assert clean("x" * 1000).endswith("...") and len(clean("x" * 1000)) == 300
    c = pickle.loads(pickle.dumps(a))
    assert c.counts == a.counts and c.examples == a.examples
