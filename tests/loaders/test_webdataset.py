"""The webdataset reader on shards written here: native sizes, splitting, errors, epochs."""

from __future__ import annotations

import io
import os
import pickle
import tarfile
import warnings

import pytest
import torch
from torch.utils.data import DataLoader

import padless
from padless.loaders import (
    BucketedStream,
    PixelBudget,
    SampleError,
    SkipAndWarn,
    StreamingBucketer,
    WebDatasetReader,
    raise_error,
)
from padless.loaders.synthetic import random_sizes, write_shards

FIELDS = {"image": "jpg;png", "label": "cls"}
NUM_SHARDS, PER_SHARD = 4, 6


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[str]:
    return write_shards(str(tmp_path_factory.mktemp("clean")), num_shards=NUM_SHARDS, per_shard=PER_SHARD, seed=0)


@pytest.fixture(scope="module")
def bad_shards(tmp_path_factory) -> list[str]:
    """Shard 1 holds a corrupt image (key 00100002); shard 2's last image member is cut in half."""
    return write_shards(
        str(tmp_path_factory.mktemp("bad")), num_shards=NUM_SHARDS, per_shard=PER_SHARD, seed=0,
        corrupt=["00100002"], truncate=[2],
    )


def all_keys() -> list[str]:
    return [f"{s:03d}{i:05d}" for s in range(NUM_SHARDS) for i in range(PER_SHARD)]


def test_images_keep_their_native_size(shards) -> None:
    sizes = dict(zip(all_keys(), random_sizes(NUM_SHARDS * PER_SHARD, seed=0)))
    got = list(WebDatasetReader(shards, fields=FIELDS))
    assert sorted(s["__key__"] for s in got) == all_keys()
    for s in got:
        img = s["image"]
        assert img.dtype == torch.uint8 and img.shape == (3, *sizes[s["__key__"]])
        assert s["label"] == int(s["__key__"][-5:]) % 3
    nt = padless.from_list([s["image"] for s in got[:5]])
    assert nt.ragged_dims == (1, 2)


def test_size_rules_cap_and_round(shards) -> None:
    for s in WebDatasetReader(shards, fields=FIELDS, max_side=40, multiple_of=8):
        _, h, w = s["image"].shape
        assert h % 8 == 0 and w % 8 == 0 and max(h, w) <= 40


def test_all_fields_without_a_field_map(shards) -> None:
    s = next(iter(WebDatasetReader(shards, shuffle_shards=False)))
    assert set(s) == {"__key__", "__shard__", "png", "cls"} and isinstance(s["cls"], int)


def test_shards_split_by_node_and_worker_are_disjoint(shards) -> None:
    keys = []
    for rank in range(2):
        r = WebDatasetReader(shards, fields=FIELDS, rank=rank, world_size=2)
        loader = DataLoader(r, batch_size=None, num_workers=2)
        mine = [s["__key__"] for s in loader]
        assert len(mine) == 2 * PER_SHARD
        keys += mine
    assert sorted(keys) == all_keys()


def keys_of(reader: WebDatasetReader) -> list[str]:
    return [s["__key__"] for s in reader]


def test_shuffle_is_deterministic_per_epoch(shards) -> None:
    a = WebDatasetReader(shards, fields=FIELDS, shuffle_buffer=5, seed=1)
    b = WebDatasetReader(shards, fields=FIELDS, shuffle_buffer=5, seed=1)
    assert keys_of(a) == keys_of(b)
    first = keys_of(a)
    a.set_epoch(1)
    assert keys_of(a) != first and sorted(keys_of(a)) == sorted(first)


def test_epoch_samples_gives_every_rank_the_same_count(shards) -> None:
    # 4 shards for 2 ranks x 2 workers; each rank asks for 13 samples (more than its 12: re-reads)
    counts = []
    for rank in range(2):
        r = WebDatasetReader(shards[:4], fields=FIELDS, rank=rank, world_size=2, epoch_samples=13)
        loader = DataLoader(r, batch_size=4, num_workers=2, collate_fn=list)
        batches = list(loader)
        counts.append((len(batches), sum(len(b) for b in batches)))
    assert counts[0] == counts[1] and counts[0][1] == 13


def test_resampled_with_epoch_samples(shards) -> None:
    r = WebDatasetReader(shards[:1], fields=FIELDS, resampled=True, epoch_samples=30, rank=1, world_size=3)
    assert len(list(r)) == 30


def test_epoch_samples_without_enough_shards_names_the_fix(shards) -> None:
    r = WebDatasetReader(shards[:1], fields=FIELDS, epoch_samples=5, rank=1, world_size=2)
    with pytest.raises(ValueError, match="1 shard\\(s\\) for 2 consumers; write more shards, use fewer workers, or pass resampled=True"):
        list(r)


def test_too_few_shards_warns_about_uneven_ranks(shards) -> None:
    r = WebDatasetReader(shards[:1], fields=FIELDS, rank=1, world_size=2)
    with pytest.warns(RuntimeWarning, match="consumer 1 reads nothing; ranks may get different batch counts"):
        assert list(r) == []


def test_corrupt_image_and_truncated_member_are_skipped_with_one_warning_per_shard(bad_shards) -> None:
    handler = SkipAndWarn()
    r = WebDatasetReader(bad_shards, fields=FIELDS, handler=handler, shuffle_shards=False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        keys = keys_of(r)
    msgs = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
    assert len(msgs) == 3  # one per shard as it happens, then the epoch's count
    assert any("shard-000001.tar" in m and "'00100002'" in m for m in msgs[:2])
    assert any("shard-000002.tar" in m and "'00200005'" in m and ("truncated" in m or "unexpected end" in m) for m in msgs[:2])
    assert "WebDatasetReader: 2 sample(s) skipped: UnidentifiedImageError x1" in msgs[2] and "TruncatedShardError x1" in msgs[2]
    assert all("object at 0x" not in m for m in msgs)
    expected = [k for k in all_keys() if k not in ("00100002", "00200005")]
    assert keys == expected  # the stream went on after both failures
    assert handler.counts == {bad_shards[1]: 1, bad_shards[2]: 1}
    assert r.skipped.counts == {"UnidentifiedImageError": 1, "TruncatedShardError": 1}


def test_raise_option_names_shard_and_key(bad_shards) -> None:
    r = WebDatasetReader(bad_shards, fields=FIELDS, handler=raise_error, shuffle_shards=False)
    with pytest.raises(SampleError, match=r"shard '.*shard-000001\.tar', sample key '00100002': UnidentifiedImageError") as e:
        list(r)
    assert e.value.key == "00100002"
    r = WebDatasetReader(bad_shards[2:3], fields=FIELDS, handler=raise_error)
    with pytest.raises(SampleError, match=r"shard-000002\.tar', sample key '00200005': TruncatedShardError: member '00200005.jpg' is truncated"):
        list(r)


def test_handler_is_a_plain_function(bad_shards) -> None:
    seen = []

    def remember(exc, *, shard, key):
        seen.append((os.path.basename(shard), key))

    list(WebDatasetReader(bad_shards, fields=FIELDS, handler=remember, shuffle_shards=False))
    assert seen == [("shard-000001.tar", "00100002"), ("shard-000002.tar", "00200005")]


def test_missing_field_goes_to_the_handler(shards) -> None:
    seen = []

    def remember(exc, *, shard, key):
        seen.append((type(exc).__name__, key, str(exc)))

    r = WebDatasetReader(shards[:1], fields={"image": "webp"}, handler=remember)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a handler of its own: counted, not warned
        list(r)
    assert len(seen) == PER_SHARD and "field 'image' needs one of the extensions ['webp']" in seen[0][2]
    assert r.skipped.counts == {"KeyError": PER_SHARD}


def test_a_missing_shard_is_an_error_naming_it(shards, tmp_path) -> None:
    """A wrong path used to give an empty epoch and a warning."""
    missing = str(tmp_path / "nope.tar")
    with pytest.raises(FileNotFoundError, match=r"WebDatasetReader: shard '.*nope\.tar' does not exist; check the path"):
        WebDatasetReader([shards[0], missing])
    with pytest.raises(FileNotFoundError, match=r"shard '.*nope\.tar' does not exist"):
        WebDatasetReader("file://" + missing)
    pattern = os.path.join(os.path.dirname(shards[0]), "shard-{000002..000005}.tar")
    with pytest.raises(FileNotFoundError, match=r"shard '.*shard-000004\.tar' does not exist, from the pattern '.*shard-\{000002\.\.000005\}\.tar'"):
        WebDatasetReader(pattern)
    # remote URLs and pipes are not checked
    assert WebDatasetReader(["pipe:cat /nonexistent/x.tar", "http://example.invalid/x.tar"]).urls[0].startswith("pipe:")
    # a shard removed after the reader was made: an error at read time too
    gone = tmp_path / "gone.tar"
    gone.write_bytes(open(shards[0], "rb").read())
    r = WebDatasetReader(str(gone))
    gone.unlink()
    with pytest.raises(FileNotFoundError, match=r"shard '.*gone\.tar' does not exist"):
        list(r)


def test_pickled_payloads_stay_bytes_unless_allowed(tmp_path) -> None:
    path = str(tmp_path / "p.tar")
    payload = pickle.dumps({"a": 1})
    with tarfile.open(path, "w") as tf:
        for name, data in (("k1.pyd", payload), ("k1.txt", b"hello")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    s = next(iter(WebDatasetReader(path)))
    assert s["pyd"] == payload and s["txt"] == "hello"
    s = next(iter(WebDatasetReader(path, allow_pickle=True)))
    assert s["pyd"] == {"a": 1}


def test_brace_patterns_expand(shards) -> None:
    pattern = os.path.join(os.path.dirname(shards[0]), "shard-{000000..000003}.tar")
    assert WebDatasetReader(pattern).urls == shards
    assert len(list(WebDatasetReader("file://" + shards[0]))) == PER_SHARD


def test_reader_pickles(shards) -> None:
    r = pickle.loads(pickle.dumps(WebDatasetReader(shards, fields=FIELDS)))
    assert len(list(r)) == NUM_SHARDS * PER_SHARD


def image_hw(sample: dict) -> tuple[int, int]:
    return tuple(sample["image"].shape[1:])


def collate_images(batch: list[dict]) -> tuple:
    return padless.from_list([s["image"] for s in batch], ragged_dims=(1, 2)), torch.tensor([s["label"] for s in batch])


def test_streaming_bucketer_over_the_reader_in_workers(shards) -> None:
    budget = PixelBudget(6000)
    stream = BucketedStream(
        WebDatasetReader(shards, fields=FIELDS),
        StreamingBucketer(image_hw, budget, boundaries=[1000, 2500], buffer_size=8),
        epoch_batches=10,
        collate_fn=collate_images,
    )
    batches = list(DataLoader(stream, batch_size=None, num_workers=2))
    assert len(batches) == 10
    for nt, labels in batches:
        assert isinstance(nt, padless.NestedTensor) and nt.ragged_dims == (1, 2)
        pixels = int(nt.sizes()[:, 1:].prod(1).sum())
        assert len(labels) == 1 or pixels <= 6000


def test_argument_errors(shards) -> None:
    with pytest.raises(ValueError, match="max_side must be an int >= 1 or None, got 0"):
        WebDatasetReader(shards, max_side=0)
    with pytest.raises(TypeError, match="handler must be a function handler\\(exc, shard=, key=\\)"):
        WebDatasetReader(shards, handler="skip")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no shards given"):
        WebDatasetReader([])


def collate_float_images(batch: list[dict]) -> tuple:
    return padless.from_list([s["image"].float() / 255 for s in batch], ragged_dims=(1, 2)), torch.tensor([s["label"] for s in batch])


def test_shards_to_a_model_end_to_end(shards) -> None:
    """Variable-resolution images from shards, bucketed by pixels, collated in workers, into a ViT-style stem."""
    reader = WebDatasetReader(shards, fields=FIELDS, multiple_of=8, shuffle_buffer=4)
    stream = BucketedStream(
        reader,
        StreamingBucketer(image_hw, PixelBudget(8000), boundaries=[1024, 2048]),
        epoch_batches=6,
        collate_fn=collate_float_images,
    )
    embed, head = torch.nn.Linear(3 * 8 * 8, 16), torch.nn.Linear(16, 3)
    steps = 0
    for images, labels in DataLoader(stream, batch_size=None, num_workers=2):
        tokens = padless.patchify(images, 8)  # (H_i/8 * W_i/8, 192) tokens per image, no padding
        logits = head(embed(tokens).mean(dim=1))  # a dense (B, 3) tensor
        loss = torch.nn.functional.cross_entropy(logits, labels)
        loss.backward()
        steps += 1
    assert steps == 6 and embed.weight.grad is not None and torch.isfinite(embed.weight.grad).all()


def test_reader_samples_go_through_padless_collate(shards) -> None:
    collate = getattr(padless, "collate", None)
    if collate is None:
        pytest.skip("padless.collate is not built yet (the collator issue)")
    samples = list(WebDatasetReader(shards, fields=FIELDS))[:5]
    loader = DataLoader(samples, batch_size=5, num_workers=2, collate_fn=collate)
    batch = next(iter(loader))
    assert isinstance(batch["image"], padless.NestedTensor)
    assert [tuple(t.shape) for t in batch["image"].unbind()] == [tuple(s["image"].shape) for s in samples]
    assert batch["label"].tolist() == [s["label"] for s in samples]
    assert batch["__key__"] == [s["__key__"] for s in samples]
