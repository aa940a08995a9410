"""Stream webdataset tar shards: images at their native resolution, split by node and worker.

A shard is a tar file whose members are grouped into samples by key: the path up
to the first dot of the file name (``0001.jpg`` and ``0001.cls`` form sample
``"0001"`` with fields ``"jpg"`` and ``"cls"``), consecutive in the tar.

>>> import tempfile, torch
>>> from padless.loaders.synthetic import write_shards
>>> shards = write_shards(tempfile.mkdtemp(), num_shards=2, per_shard=2)
>>> reader = WebDatasetReader(shards, fields={"image": "jpg;png", "label": "cls"}, shuffle_shards=False)
>>> s = next(iter(reader))
>>> sorted(s), s["image"].dtype, s["image"].shape[0], s["label"]
(['__key__', '__shard__', 'image', 'label'], torch.uint8, 3, 0)

Decoded fields: images (jpg, jpeg, png, webp, ...) become ``(C, H, W)`` uint8
tensors at native size, channel-last views of the decoded ``(H, W, C)`` pixels
(``max_side`` caps the longest side, ``multiple_of`` rounds H and W to a patch
multiple, ``max_pixels`` refuses decompression bombs); ``cls``/``index``/``id`` become ints;
``txt``/``text`` strings; ``json`` objects; ``npy`` tensors (``allow_pickle=False``);
``pth`` tensors (``torch.load(weights_only=True)``). Pickled payloads
(``pyd``, ``pickle``, ``pkl``) stay raw bytes unless ``allow_pickle=True``: unpickling
runs code from the file. Anything else stays bytes.

**Equal batch counts per rank.** Shards are split among ``world_size * num_workers``
consumers, so ranks may see different numbers of samples. For DDP, set
``epoch_samples`` (samples per rank per epoch, split among workers): each
consumer then yields exactly its share, re-reading its shards (a new shuffled
pass) when they run out. ``resampled=True`` instead draws shards at random with
replacement, forever; combine it with ``epoch_samples`` (or
:class:`padless.loaders.BucketedStream` with ``epoch_batches``) to end epochs.
With a fixed DataLoader ``batch_size`` and the same ``num_workers`` on every
rank, equal samples give equal batches.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import pickle
import random
import re
import tarfile
import warnings
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import get_worker_info

from padless.loaders._deps import require
from padless.loaders.distributed import current_consumer, split_for
from padless.loaders.errors import ErrorHandler, SkipAndWarn
from padless.loaders.skips import SkipLedger, SkipStats, carry, ledger_for, new_token
from padless.loaders.images import DEFAULT_MAX_PIXELS, IMAGE_EXTENSIONS, check_max_pixels, check_size_rules, decode_image
from padless.loaders.streaming import share, shuffle_buffer
from padless.loaders.tarstream import (
    DEFAULT_MAX_MEMBER_BYTES,
    MemberError,
    TrailingDataError,
    TruncatedShardError,
    tar_members,
)
from padless.loaders.transforms import Transform, apply_transform, sample_transform

Record = Callable[[BaseException, str, "str | None"], None]  # counts a skip: (exc, shard, key)

_KEY_RE = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")
PICKLE_EXTENSIONS = ("pyd", "pickle", "pkl")


def _expand(urls: str | Sequence[str]) -> list[tuple[str, str]]:
    """``(shard, what the caller wrote)`` for every shard: a path, a URL or a brace pattern's expansion."""
    if isinstance(urls, (str, os.PathLike)):
        urls = [os.fspath(urls)]
    out: list[tuple[str, str]] = []
    for u in urls:
        u = os.fspath(u)
        if "{" in u:
            braceexpand = require("braceexpand", "padless.loaders.webdataset brace patterns")
            out.extend((e, u) for e in braceexpand.braceexpand(u))
        else:
            out.append((u, u))
    if not out:
        raise ValueError("WebDatasetReader: no shards given; pass a path, a list of paths or a brace pattern")
    return out


def expand_urls(urls: str | Sequence[str]) -> list[str]:
    """Shard list from a path, a list, or a brace pattern (``data/shard-{000000..000009}.tar``).

    >>> expand_urls("s-{0..2}.tar")
    ['s-0.tar', 's-1.tar', 's-2.tar']
    """
    return [e for e, _ in _expand(urls)]


def local_path(url: str) -> str | None:
    """The file a shard names on this machine (a path, or a ``file://`` URL); ``None`` for a
    remote URL or a ``pipe:`` command, which are not checked."""
    if url.startswith("file://"):
        return url[len("file://") :]
    if "://" in url or url.startswith("pipe:"):
        return None
    return url


def check_shards_exist(shards: list[tuple[str, str]]) -> None:
    """Raise ``FileNotFoundError`` naming the first local shard that does not exist (and the
    brace pattern it came from): a missing shard is a wrong path, not a damaged sample."""
    for url, given in shards:
        path = local_path(url)
        if path is not None and not os.path.exists(path):
            source = "" if given == url else f", from the pattern {given!r}"
            raise FileNotFoundError(
                f"WebDatasetReader: shard {url!r} does not exist{source}; check the path "
                "(remote URLs and pipe: commands are not checked)"
            )


def open_shard(url: str) -> Any:
    """A binary stream for a local path, or for a URL through ``webdataset.gopen`` (http, pipe:, ...)."""
    if "://" in url or url.startswith("pipe:"):
        if url.startswith("file://"):
            return open(url[len("file://") :], "rb")
        wds = require("webdataset", "padless.loaders.webdataset (remote shards)")
        return wds.gopen(url, "rb")
    return open(url, "rb")


def ended_early(exc: BaseException, last_key: str | None) -> tarfile.ReadError:
    """The error a handler gets for a shard that could not be read to its end."""
    if isinstance(exc, TrailingDataError):
        return exc
    what = str(exc) if isinstance(exc, TruncatedShardError) else f"{type(exc).__name__}: {exc}"
    after = f"the last complete sample is {last_key!r}" if last_key is not None else "no sample was complete"
    err = TruncatedShardError(
        f"{what}; {after}, the rest of the shard is lost (re-download or rewrite the shard)", getattr(exc, "offset", None)
    )
    err.__cause__ = exc
    return err


class DuplicateMemberError(ValueError):
    """A sample key whose field appears twice in a shard, or whose members are not consecutive.

    Webdataset groups consecutive members by key; a second ``0001.png`` (or
    ``0001.PNG`` beside ``0001.png``: fields are matched in lower case), or a key
    that reappears after another key's members, would otherwise replace data or
    split a sample silently.
    """


def parse_fields(fields: dict[str, Any] | None, what: str = "WebDatasetReader") -> dict[str, list[str]] | None:
    """``{name: [ext, ...]}`` from ``{name: "ext1;ext2"}`` or ``{name: ("ext1", "ext2")}`` (lower case).

    >>> parse_fields({"image": "jpg;PNG", "label": ("cls",)})
    {'image': ['jpg', 'png'], 'label': ['cls']}
    """
    if fields is None:
        return None
    if not isinstance(fields, dict):
        raise TypeError(f"{what}: fields must be a dict {{name: 'ext1;ext2'}} or {{name: ('ext1', 'ext2')}}, got {type(fields).__name__}")
    out: dict[str, list[str]] = {}
    for name, spec in fields.items():
        if isinstance(spec, str):
            exts = spec.split(";")
        elif isinstance(spec, (tuple, list)) and all(isinstance(e, str) for e in spec):
            exts = list(spec)
        else:
            raise TypeError(
                f"{what}: fields[{name!r}] must be extensions as a string 'jpg;png' or a tuple/list of strings "
                f"('jpg', 'png'), got {spec!r}"
            )
        exts = [e.strip().lstrip(".").lower() for e in exts]
        if not exts or any(not e for e in exts):
            raise ValueError(f"{what}: fields[{name!r}] has an empty extension: {spec!r}")
        out[name] = exts
    return out


def split_key(name: str) -> tuple[str, str] | None:
    """``("dir/0001", "jpg")`` for ``dir/0001.jpg``; ``None`` for names without a field.

    >>> split_key("a/b/0001.seg.png")
    ('a/b/0001', 'seg.png')
    """
    m = _KEY_RE.match(name)
    return (m.group(1), m.group(2)) if m else None


class WebDatasetReader(torch.utils.data.IterableDataset):
    """Stream samples (dicts) from tar shards; see the module docstring for fields and epochs.

    Args:
        urls: shard paths, a brace pattern, or URLs (remote ones need ``webdataset``).
        fields: optional ``{name: "ext1;ext2"}`` (or ``{name: ("ext1", "ext2")}``): output only
            these fields, each from the first extension present (a sample lacking one goes
            to the handler). Members whose extension no field names are streamed past unread.
        max_member_bytes: a member to be read whose header declares more bytes goes to the
            handler unread (:class:`~padless.loaders.tarstream.MemberTooLargeError`; default 1 GiB;
            ``None``: no limit). Members skipped by ``fields`` are never read, whatever their size.
        image_mode: PIL mode images are converted to (``"RGB"``; ``None`` keeps the file's).
        max_side, multiple_of: optional size rules (see :func:`padless.loaders.images.target_size`).
        max_pixels: images whose header declares more pixels go to the handler undecoded
            (:class:`~padless.loaders.images.ImageTooLargeError`; default 8192 x 8192; ``None``: no limit).
        transform: applied to each decoded sample in the worker: a function of the sample
            dict, or ``{field: function}`` (see :mod:`padless.loaders.transforms`). Its
            errors are raised (with a note naming the shard and key), not sent to the handler.
        shuffle_shards: shuffle the shard order each epoch (same order on every consumer).
        shuffle_buffer: samples held for an approximate shuffle (0: none).
        seed: base seed; the epoch (``set_epoch``), the pass and the consumer are mixed in.
        split_by_node, split_by_worker: give each rank / worker a disjoint share of shards.
        handler: ``handler(exc, shard=, key=)`` for unreadable samples and shards;
            default :class:`~padless.loaders.SkipAndWarn` (skip, count, warn once per
            shard); :func:`~padless.loaders.raise_error` stops with the shard and key.
        allow_pickle: unpickle ``pyd``/``pickle``/``pkl`` fields (runs code from the file).
        epoch_samples: samples per rank per epoch (see "Equal batch counts per rank").
        resampled: draw shards with replacement, forever.
        rank, world_size: override ``torch.distributed``.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        fields: dict[str, str | Sequence[str]] | None = None,
        image_mode: str | None = "RGB",
        max_side: int | None = None,
        multiple_of: int | None = None,
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
        max_member_bytes: int | None = DEFAULT_MAX_MEMBER_BYTES,
        transform: Transform | None = None,
        shuffle_shards: bool = True,
        shuffle_buffer: int = 0,
        seed: int = 0,
        split_by_node: bool = True,
        split_by_worker: bool = True,
        handler: ErrorHandler | Callable[..., None] | None = None,
        allow_pickle: bool = False,
        epoch_samples: int | None = None,
        resampled: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        check_size_rules(max_side, multiple_of, "WebDatasetReader")
        check_max_pixels(max_pixels, "WebDatasetReader")
        if epoch_samples is not None and (isinstance(epoch_samples, bool) or not isinstance(epoch_samples, int) or epoch_samples < 1):
            raise ValueError(f"WebDatasetReader: epoch_samples must be an int >= 1 or None, got {epoch_samples!r}")
        if handler is not None and not callable(handler):
            raise TypeError(f"WebDatasetReader: handler must be a function handler(exc, shard=, key=), got {type(handler).__name__}")
        expanded = _expand(urls)
        self.urls = [e for e, _ in expanded]
        if max_member_bytes is not None and (
            isinstance(max_member_bytes, bool) or not isinstance(max_member_bytes, int) or max_member_bytes < 0
        ):
            raise ValueError(f"WebDatasetReader: max_member_bytes must be an int >= 0 or None (no limit), got {max_member_bytes!r}")
        self.fields = parse_fields(fields) if fields else None
        self.max_member_bytes = max_member_bytes
        self.image_mode = image_mode
        self.max_side = max_side
        self.multiple_of = multiple_of
        self.max_pixels = max_pixels
        self.transform = sample_transform(transform, "WebDatasetReader")
        self.shuffle_shards = shuffle_shards
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.split_by_node = split_by_node
        self.split_by_worker = split_by_worker
        self.handler = handler if handler is not None else SkipAndWarn()
        self.allow_pickle = allow_pickle
        self.epoch_samples = epoch_samples
        self.resampled = resampled
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self._skip_token = new_token()  # names this reader's skip counts across worker processes
        self._ledger: SkipLedger | None = None
        self._main_ledger()  # registered now: workers' counts find it by token
        check_shards_exist(expanded)  # after the argument checks: a wrong path is named at once

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_ledger"] = None  # the main process's counts stay there; a copy finds them by token
        return state

    def _main_ledger(self) -> SkipLedger:
        if self._ledger is None:
            self._ledger = ledger_for(self._skip_token, "WebDatasetReader")
        # the epoch's count is warned when the handler is one that warns (SkipAndWarn, the default)
        self._ledger.warn = isinstance(self.handler, SkipAndWarn)
        return self._ledger

    @property
    def skipped(self) -> SkipStats:
        """The samples skipped this epoch, in this (the main) process: counts per reason and
        example ``(shard, key, message)``, also those skipped inside DataLoader workers (they
        travel with the samples' ``__key__``, see :mod:`padless.loaders.skips`). A new
        ``SkipStats`` starts at each ``set_epoch`` (or, without ``set_epoch``, with each epoch
        of the loader); when an epoch ends with skips, one warning gives its count."""
        return self._main_ledger().stats

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle shards and buffers for ``epoch``.

        Call it before each epoch's ``iter(loader)``: workers get a copy of the reader
        when the iterator starts, so with ``persistent_workers=True`` the new epoch
        does not reach them. It also closes the skip count of the epoch before (see
        :attr:`skipped`).
        """
        self.epoch = epoch
        if get_worker_info() is None:
            self._main_ledger().new_epoch(explicit=True)

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[dict[str, Any]]:
        consumer = current_consumer(self.rank, self.world_size)
        rng = random.Random(f"{self.seed}/{self.epoch}/{consumer.index}/samples")
        info = get_worker_info()
        if info is None:  # this process trains: count into the ledger directly
            ledger = self._main_ledger()
            ledger.start()
            record: Record = ledger.record
        else:  # a DataLoader worker: the counts travel with the samples
            pending = SkipStats()

            def record(exc: BaseException, shard: str, key: str | None) -> None:
                pending.add(exc, shard=shard, key=key)

        stream: Iterable[dict[str, Any]] = self._passes(consumer, record)
        if self.epoch_samples is not None:
            stream = itertools.islice(stream, share(self.epoch_samples, consumer.worker, consumer.num_workers))
        stream = shuffle_buffer(stream, self.shuffle_buffer, rng)
        if info is None:
            return _then(stream, ledger.finish)
        return carry(stream, pending, self._skip_token, info.id, info.num_workers)

    def _skip(self, record: "Record | None", exc: BaseException, shard: str, key: str | None) -> None:
        """The handler decides (raising stops the stream); a returned call is a skip, counted."""
        self.handler(exc, shard=shard, key=key)
        if record is not None:
            record(exc, shard, key)

    def _passes(self, consumer: Any, record: "Record | None" = None) -> Iterator[dict[str, Any]]:
        """Pass after pass over this consumer's shards (one pass unless a length or resampling asks for more)."""
        repeat = self.resampled or self.epoch_samples is not None
        p = 0
        while True:
            shards = self._shards_for(consumer, p)
            if not shards:
                if repeat:
                    raise ValueError(
                        f"WebDatasetReader: consumer {consumer.index} (rank {consumer.rank}, worker {consumer.worker}) "
                        f"has no shard: {len(self.urls)} shard(s) for {consumer.count} consumers; "
                        "write more shards, use fewer workers, or pass resampled=True"
                    )
                if len(self.urls) < consumer.count:
                    warnings.warn(
                        f"WebDatasetReader: {len(self.urls)} shard(s) for {consumer.count} consumers "
                        f"(ranks x workers): consumer {consumer.index} reads nothing; "
                        "ranks may get different batch counts (pass epoch_samples= or resampled=True)",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                return
            got = False
            for s in shards:
                for sample in self.read_shard(s, _record=record):
                    got = True
                    yield sample
            if not repeat:
                return
            if not got:
                raise ValueError(f"WebDatasetReader: shards {shards[:3]}... yielded no readable sample; cannot fill an epoch")
            p += 1

    def _shards_for(self, consumer: Any, p: int) -> list[str]:
        if self.resampled:
            rng = random.Random(f"{self.seed}/{self.epoch}/{p}/{consumer.index}/resample")
            return [rng.choice(self.urls) for _ in range(max(1, len(self.urls)))]
        urls = list(self.urls)
        if self.shuffle_shards:
            random.Random(f"{self.seed}/{self.epoch}/{p}/shards").shuffle(urls)
        return split_for(urls, consumer, by_node=self.split_by_node, by_worker=self.split_by_worker)

    def read_shard(self, url: str, _record: "Record | None" = None) -> Iterator[dict[str, Any]]:
        """The decoded samples of one shard; failures go to the handler.

        A shard that ends early (cut short, a damaged header or compressed stream;
        see :mod:`padless.loaders.tarstream`) reaches the handler as a
        :class:`~padless.loaders.tarstream.TruncatedShardError` naming the last
        complete sample, with ``key`` the sample that was being read (or the last
        complete one); the samples before it have been yielded.

        A sample with a field twice (``0001.png`` and ``0001.PNG``), a key that
        reappears after another key (:class:`DuplicateMemberError`), a link member
        (:class:`~padless.loaders.tarstream.UnsupportedMemberError`) or a member over
        ``max_member_bytes`` (:class:`~padless.loaders.tarstream.MemberTooLargeError`)
        goes to the handler, keyed by its sample, and is not decoded.

        A local shard that does not exist raises ``FileNotFoundError`` naming it (a wrong
        path, not a damaged sample); other failures to open go to the handler.
        """
        record = _record
        try:
            stream = open_shard(url)
        except FileNotFoundError as e:
            if local_path(url) is None:
                self._skip(record, e, url, None)
                return
            raise FileNotFoundError(f"WebDatasetReader: shard {url!r} does not exist; check the path") from e
        except Exception as e:  # noqa: BLE001 (the handler decides)
            self._skip(record, e, url, None)
            return
        with stream:
            members = tar_members(stream, select=self._member_filter(), max_member_bytes=self.max_member_bytes)
            cur: dict[str, bytes] = {}
            cur_fields: set[str] = set()  # the pending sample's fields (lower case), read or streamed past
            cur_error: Exception | None = None  # why the pending sample goes to the handler, if it does
            cur_key: str | None = None
            last_key: str | None = None  # the last sample whose members were all read
            done: set[str] = set()  # keys whose members ended: one reappearing is not consecutive
            while True:
                # Only tar reading sits in a try: errors from decoding, from the handler or from
                # the consumer of this generator must not be taken for a broken shard.
                try:
                    m = next(members, None)
                except Exception as e:  # noqa: BLE001 (the rest of the shard is lost)
                    # The pending sample is complete when the damage starts with another sample's member,
                    # or after the end-of-archive marker.
                    cut = split_key(getattr(e, "member", None) or "")
                    nxt = cut[0] if cut is not None else None
                    if cur_key is not None and ((nxt is not None and nxt != cur_key) or isinstance(e, TrailingDataError)):
                        last_key = cur_key
                        yield from self._decode_or_handle(cur, cur_key, url, cur_error, record)
                        cur_key = None
                    key = nxt or cur_key or last_key
                    self._skip(record, ended_early(e, last_key), url, key)
                    return
                if m is None:
                    break
                name, data = m
                parts = split_key(name)
                if parts is None:
                    if isinstance(data, MemberError):  # a link or a device without a sample key
                        self._skip(record, data, url, name)
                    continue
                key, field = parts
                field = field.lower()
                if key != cur_key:
                    if cur_key is not None:
                        last_key = cur_key
                        done.add(cur_key)
                        yield from self._decode_or_handle(cur, cur_key, url, cur_error, record)
                    cur, cur_fields, cur_error, cur_key = {}, set(), None, key
                    if key in done:
                        cur_error = DuplicateMemberError(
                            f"sample key {key!r} appears again at member {name!r}, after other keys: a sample's members "
                            "must be consecutive in the shard; this second group is not read"
                        )
                if field in cur_fields and cur_error is None:
                    cur_error = DuplicateMemberError(
                        f"member {name!r}: sample {key!r} already has a {field!r} member (fields are matched in lower "
                        "case); a field must appear once per sample, so the sample is not read"
                    )
                cur_fields.add(field)
                if isinstance(data, MemberError):
                    cur_error = cur_error or data
                elif data is not None and cur_error is None:
                    cur[field] = data
            if cur_key is not None:
                yield from self._decode_or_handle(cur, cur_key, url, cur_error, record)

    def _member_filter(self) -> Callable[[str], bool] | None:
        """Which members to read: with ``fields``, those whose extension a field names (the
        others are streamed past unread); without, all."""
        if self.fields is None:
            return None
        wanted = {e for exts in self.fields.values() for e in exts}

        def select(name: str) -> bool:
            parts = split_key(name)
            return parts is not None and parts[1].lower() in wanted

        return select

    def _decode_or_handle(
        self, raw: dict[str, bytes], key: str, url: str, error: Exception | None = None, record: "Record | None" = None
    ) -> Iterator[dict[str, Any]]:
        if error is not None:  # a duplicate, a link or an oversized member: the sample is not decoded
            self._skip(record, error, url, key)
            return
        try:
            sample = self.decode(raw)
        except Exception as e:  # noqa: BLE001
            self._skip(record, e, url, key)
            return
        sample["__key__"] = key
        sample["__shard__"] = url
        if self.transform is not None:
            sample = apply_transform(self.transform, sample, f"sample {key!r} of shard {url!r}")
        yield sample

    def decode(self, raw: dict[str, bytes]) -> dict[str, Any]:
        """Decode one sample's fields (``{ext: bytes}``) as the module docstring says."""
        if self.fields is None:
            return {f: self.decode_field(f, b) for f, b in raw.items()}
        out = {}
        for name, exts in self.fields.items():
            ext = next((e for e in exts if e in raw), None)
            if ext is None:
                raise KeyError(f"field {name!r} needs one of the extensions {exts}; the sample has {sorted(raw)}")
            out[name] = self.decode_field(ext, raw[ext])
        return out

    def decode_field(self, field: str, data: bytes) -> Any:
        ext = field.rsplit(".", 1)[-1]
        if ext in IMAGE_EXTENSIONS:
            return decode_image(
                data, mode=self.image_mode, max_side=self.max_side, multiple_of=self.multiple_of, max_pixels=self.max_pixels
            )
        if ext in ("cls", "cls2", "index", "id"):
            return int(data.decode().strip())
        if ext in ("txt", "text"):
            return data.decode()
        if ext == "json":
            return json.loads(data)
        if ext == "npy":
            return torch.from_numpy(np.load(io.BytesIO(data), allow_pickle=False))
        if ext == "pth":
            return torch.load(io.BytesIO(data), weights_only=True)
        if ext in PICKLE_EXTENSIONS and self.allow_pickle:
            return pickle.loads(data)
        return data

    def __repr__(self) -> str:
        return f"WebDatasetReader({len(self.urls)} shard(s), epoch={self.epoch}, epoch_samples={self.epoch_samples})"


def _then(stream: Iterable[Any], done: Callable[[], None]) -> Iterator[Any]:
    """``stream``, then ``done()`` once it is exhausted."""
    yield from stream
    done()
