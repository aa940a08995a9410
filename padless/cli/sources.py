"""Where ``padless inspect`` reads sizes: tar shards, image folders, saved Hugging Face datasets, files of lengths.

Every reader returns a :class:`SizeTable`: one size per sample (int64 ``(N, k)``) and what
the numbers are. Only sizes are read where the format allows it: image headers (Pillow
reads the header; no pixel is decoded), ``.npy`` headers, arrow list lengths or a length
column. The readers are padless.loaders' own pieces (shard expansion and tar streaming,
the restricted image opener, the Hugging Face length computation).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import re
import tarfile
from typing import Any, Callable

import numpy as np

from padless.loaders._deps import require
from padless.loaders.hf import HFDatasetReader
from padless.loaders.image_folder import image_paths
from padless.loaders.images import IMAGE_EXTENSIONS, image_header_size, open_image
from padless.loaders.tarstream import tar_members
from padless.loaders.webdataset import expand_urls, open_shard, split_key

FORMATS = ("shards", "images", "hf", "lengths")
SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")
LENGTH_SUFFIXES = (".txt", ".lengths", ".csv", ".tsv", ".json", ".jsonl", ".npy")
HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
ACCEPTED = (
    "webdataset shards (a .tar/.tar.gz file, a brace pattern such as 'data/shard-{000..009}.tar', or a folder of "
    "them), an image folder (a folder of .png/.jpg/... files, searched recursively), a Hugging Face dataset saved "
    "with save_to_disk (a folder holding dataset_info.json or dataset_dict.json), a file of lengths "
    f"({', '.join(LENGTH_SUFFIXES)}: one length or one HxW per line, a csv column, a json list)"
)
_LINE = re.compile(r"^\s*(\d+)\s*(?:[xX×,;\s]\s*(\d+))?\s*$")

Progress = Callable[[int, int], None]


class InspectError(ValueError):
    """A mistake in what ``padless inspect`` was asked to read (printed without a traceback)."""


@dataclasses.dataclass
class SizeTable:
    """Sizes read from a source: ``sizes`` int64 ``(N, k)``, ``(L,)`` or ``(H, W)`` per sample."""

    sizes: np.ndarray
    source: str
    format: str  # one of FORMATS
    detail: str  # what was read, e.g. "10 shard(s), field jpg;png"
    skipped: list[str] = dataclasses.field(default_factory=list)  # "where: why" of samples left out


def detect_format(path: str) -> str:
    """The format of ``path`` by its shape on disk (see ``ACCEPTED``); raises naming the path."""
    if "{" in path:
        return "shards"
    if not os.path.exists(path):
        raise InspectError(f"padless inspect: {path!r} does not exist")
    if os.path.isdir(path):
        names = set(os.listdir(path))
        if names & set(HF_MARKERS):
            return "hf"
        if any(n.lower().endswith(SHARD_SUFFIXES) for n in names):
            return "shards"
        return "images"
    low = path.lower()
    if low.endswith(SHARD_SUFFIXES):
        return "shards"
    if low.endswith(LENGTH_SUFFIXES):
        return "lengths"
    raise InspectError(
        f"padless inspect: cannot tell the format of {path!r} from its name; it reads {ACCEPTED}; "
        f"or pass --format {{{','.join(FORMATS)}}}"
    )


def read_sizes(
    path: str,
    *,
    format: str | None = None,  # noqa: A002 (the CLI's word)
    field: str | None = None,
    length_column: str | None = None,
    split: str | None = None,
    progress: Progress | None = None,
) -> SizeTable:
    """One size per sample of ``path`` (see the module docstring)."""
    fmt = format or detect_format(path)
    if fmt not in FORMATS:
        raise InspectError(f"padless inspect: unknown format {fmt!r}; the formats are {', '.join(FORMATS)} ({ACCEPTED})")
    if fmt != "shards" and not os.path.exists(path):
        raise InspectError(f"padless inspect: {path!r} does not exist")
    if fmt == "shards":
        return shard_sizes(path, field, progress)
    if fmt == "images":
        return folder_sizes(path, progress)
    if fmt == "hf":
        return hf_sizes(path, field=field, length_column=length_column, split=split, progress=progress)
    return file_sizes(path, length_column)


# ------------------------------------------------------------------------------ shards


def shard_sizes(pattern: str, field: str | None, progress: Progress | None) -> SizeTable:
    """Sizes of one field per sample in webdataset shards: the first image member of each sample
    (or the first of ``field``'s extensions, ``"jpg;png"``, ``"npy"``), read from its header."""
    if os.path.isdir(pattern):
        urls = sorted(os.path.join(pattern, n) for n in os.listdir(pattern) if n.lower().endswith(SHARD_SUFFIXES))
    else:
        urls = expand_urls(pattern)
    for u in urls:
        if "://" not in u and not u.startswith("pipe:") and not os.path.exists(u):
            where = f" (from {pattern!r})" if u != pattern else ""
            raise InspectError(f"padless inspect: shard {u!r}{where} does not exist")
    wanted = [e.strip().lstrip(".").lower() for e in field.split(";")] if field else None
    if wanted is not None and not all(wanted):
        raise InspectError(f"padless inspect: --field {field!r} has an empty extension")

    def rank(name_field: str) -> int | None:
        if wanted is None:
            ext = name_field.rsplit(".", 1)[-1]
            return IMAGE_EXTENSIONS.index(ext) if ext in IMAGE_EXTENSIONS else None
        return wanted.index(name_field) if name_field in wanted else None

    def select(name: str) -> bool:
        parts = split_key(name)
        return parts is not None and rank(parts[1].lower()) is not None

    sizes: list[tuple[int, ...]] = []
    skipped: list[str] = []
    for k, url in enumerate(urls):
        best: dict[str, tuple[int, str, Any]] = {}  # key -> (rank, field, bytes or error), in shard order
        try:
            with open_shard(url) as stream:
                for name, data in tar_members(stream, select=select):
                    parts = split_key(name)
                    if parts is None or data is None:
                        continue
                    key, f = parts[0], parts[1].lower()
                    r = rank(f)
                    if r is not None and (key not in best or r < best[key][0]):
                        best[key] = (r, f, data)
        except (tarfile.ReadError, OSError, EOFError) as e:
            skipped.append(f"{url}: {type(e).__name__}: {e} (the samples after it are not counted)")
        for key, (_, f, data) in best.items():
            try:
                if isinstance(data, Exception):
                    raise data
                sizes.append(member_size(f, data))
            except Exception as e:  # noqa: BLE001 (reported, the scan goes on)
                skipped.append(f"{url}:{key}.{f}: {type(e).__name__}: {e}")
        if progress is not None:
            progress(k + 1, len(urls))
    what = field if field else "the first image"
    return SizeTable(_table(sizes, pattern), pattern, "shards", f"{len(urls)} shard(s), {what} of each sample", skipped)


def member_size(field: str, data: bytes) -> tuple[int, ...]:
    """``(H, W)`` of an image member from its header, ``(L,)`` of an ``.npy`` member (its first dim)."""
    ext = field.rsplit(".", 1)[-1]
    if ext in IMAGE_EXTENSIONS:
        with open_image(io.BytesIO(data), "padless inspect") as img:
            return (img.height, img.width)
    if ext == "npy":
        f = io.BytesIO(data)
        version = np.lib.format.read_magic(f)
        reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape = reader(f)[0]
        if not shape:
            raise InspectError(f"the .npy member {field!r} holds a scalar; it has no length")
        return (int(shape[0]),)
    raise InspectError(
        f"padless inspect reads the sizes of image members ({', '.join(IMAGE_EXTENSIONS)}) and .npy members "
        f"(their first dim), not {field!r}; pick a field with --field"
    )


# ------------------------------------------------------------------------------ image folders


def folder_sizes(root: str, progress: Progress | None) -> SizeTable:
    """``(H, W)`` of every image file under ``root``, from the headers."""
    paths = image_paths(root, tuple("." + e for e in IMAGE_EXTENSIONS))
    if not paths:
        raise InspectError(f"padless inspect: no image files ({', '.join(IMAGE_EXTENSIONS)}) under {root!r}; it reads {ACCEPTED}")
    sizes, skipped = [], []
    step = max(1, len(paths) // 200)
    for i, p in enumerate(paths):
        try:
            sizes.append(image_header_size(p))
        except Exception as e:  # noqa: BLE001 (reported, the scan goes on)
            skipped.append(f"{os.path.relpath(p, root)}: {type(e).__name__}: {e}")
        if progress is not None and ((i + 1) % step == 0 or i + 1 == len(paths)):
            progress(i + 1, len(paths))
    return SizeTable(_table(sizes, root), root, "images", f"{len(paths)} image file(s)", skipped)


# ------------------------------------------------------------------------------ Hugging Face datasets


def hf_sizes(
    path: str, *, field: str | None, length_column: str | None, split: str | None, progress: Progress | None
) -> SizeTable:
    """Lengths from a dataset saved with ``save_to_disk``: a length column, the list lengths of a
    column (``field``; default: a ``length`` column, else the first list column), or the image
    sizes of an ``Image`` column, read from the headers."""
    datasets = require("datasets", "padless inspect (Hugging Face datasets)")
    ds = datasets.load_from_disk(path)
    where = ""
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        if split is None and len(splits) == 1:
            split = splits[0]
        if split is None:
            split = "train" if "train" in splits else None
        if split not in splits:
            raise InspectError(f"padless inspect: {path!r} holds the splits {splits}; choose one with --split")
        ds, where = ds[split], f"split {split!r}, "
    elif split is not None:
        raise InspectError(f"padless inspect: {path!r} is one dataset, not a DatasetDict; drop --split {split!r}")
    names = list(ds.column_names)
    for flag, c in (("--length-column", length_column), ("--field", field)):
        if c is not None and c not in names:
            raise InspectError(f"padless inspect: {flag} {c!r} is not a column of {path!r} (columns: {names})")
    if length_column is None and field is None:
        if "length" in names:
            length_column = "length"
        else:
            field = next((c for c in names if _is_list(ds, c) or _is_image(ds, c)), None)
            if field is None:
                raise InspectError(
                    f"padless inspect: {path!r} has no 'length' column and no list or Image column (columns: {names}); "
                    "pass --length-column or --field"
                )
    if length_column is not None:
        lengths = HFDatasetReader(ds, columns=[length_column], length_column=length_column, cache_lengths=False).lengths()
        return SizeTable(_table(lengths, path), path, "hf", f"{where}length column {length_column!r}")
    if _is_image(ds, field):
        sizes, skipped = _hf_image_sizes(ds, field, progress)
        return SizeTable(_table(sizes, path), path, "hf", f"{where}image sizes of column {field!r}", skipped)
    if not _is_list(ds, field):
        raise InspectError(
            f"padless inspect: column {field!r} of {path!r} is {ds.features[field]!r}, not a list or an Image; "
            "--field takes a list column (token ids) or an Image column, --length-column an int column"
        )
    lengths = HFDatasetReader(ds, columns=[field], length_column=None, lengths_of=field, cache_lengths=False).lengths()
    return SizeTable(_table(lengths, path), path, "hf", f"{where}list lengths of column {field!r}")


def _is_list(ds: Any, column: str) -> bool:
    pa = require("pyarrow", "padless inspect (Hugging Face datasets)")
    t = ds.data.schema.field(column).type
    return bool(pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t))


def _is_image(ds: Any, column: str) -> bool:
    return type(ds.features[column]).__name__ == "Image"


def _hf_image_sizes(ds: Any, column: str, progress: Progress | None) -> tuple[list[tuple[int, int]], list[str]]:
    col = ds.with_format("arrow", columns=[column])[:].column(column).combine_chunks()
    data, paths = col.field("bytes").to_pylist(), col.field("path").to_pylist()
    sizes, skipped = [], []
    step = max(1, len(data) // 200)
    for i, (b, p) in enumerate(zip(data, paths)):
        try:
            if b is not None:
                with open_image(io.BytesIO(b), "padless inspect") as img:
                    sizes.append((img.height, img.width))
            else:
                sizes.append(image_header_size(p))
        except Exception as e:  # noqa: BLE001 (reported, the scan goes on)
            skipped.append(f"row {i}: {type(e).__name__}: {e}")
        if progress is not None and ((i + 1) % step == 0 or i + 1 == len(data)):
            progress(i + 1, len(data))
    return sizes, skipped


# ------------------------------------------------------------------------------ files of lengths


def file_sizes(path: str, length_column: str | None = None) -> SizeTable:
    """Lengths (or ``HxW``) from a file: ``.npy``; ``.json`` (a list of lengths, of ``[H, W]`` or of
    ``"HxW"``, or an object holding such a list under ``length_column``); ``.jsonl`` (one number, pair
    or object per line); ``.csv``/``.tsv`` (a ``length`` column, ``height``/``width`` columns, the
    ``length_column`` named, or one or two unnamed columns); anything else: one ``L`` or ``HxW`` per line."""
    low = path.lower()
    if low.endswith(".npy"):
        arr = np.load(path, allow_pickle=False)
        if arr.ndim not in (1, 2) or (arr.ndim == 2 and arr.shape[1] not in (1, 2)):
            raise InspectError(f"padless inspect: {path!r} holds an array of shape {arr.shape}; expected (N,) or (N, 2)")
        return SizeTable(_table(arr, path), path, "lengths", ".npy array")
    if low.endswith(".json"):
        with open(path) as f:
            obj = json.load(f)
        if isinstance(obj, dict):
            key = length_column or next((k for k in ("lengths", "sizes", "length") if k in obj), None)
            if key not in obj:
                raise InspectError(f"padless inspect: {path!r} is a json object with keys {list(obj)[:8]}; name the list with --length-column")
            obj = obj[key]
        if not isinstance(obj, list):
            raise InspectError(f"padless inspect: {path!r} must hold a json list of lengths, of [H, W] or of 'HxW'")
        return SizeTable(_table([_entry(v, path, i + 1) for i, v in enumerate(obj)], path), path, "lengths", "json list")
    if low.endswith(".jsonl"):
        rows = []
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    v = json.loads(line)
                    if isinstance(v, dict):
                        v = _from_record(v, length_column, path, n)
                    rows.append(_entry(v, path, n))
        return SizeTable(_table(rows, path), path, "lengths", "json lines")
    if low.endswith((".csv", ".tsv")):
        return _csv_sizes(path, length_column)
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.split("#", 1)[0]
            if line.strip():
                rows.append(_entry(line, path, n))
    return SizeTable(_table(rows, path), path, "lengths", "one size per line")


def _csv_sizes(path: str, length_column: str | None) -> SizeTable:
    with open(path, newline="") as f:
        rows = list(csv.reader(f, delimiter="\t" if path.lower().endswith(".tsv") else ","))
    rows = [r for r in rows if any(c.strip() for c in r)]
    if not rows:
        return SizeTable(_table([], path), path, "lengths", "csv")
    header = [c.strip() for c in rows[0]]
    if all(_LINE.match(c) for c in header):  # no header: one or two numeric columns
        return SizeTable(_table([_entry(",".join(r), path, n) for n, r in enumerate(rows, 1)], path), path, "lengths", "csv")
    cols = length_column.split(",") if length_column else None
    if cols is None:
        lower = [c.lower() for c in header]
        for cand in (["length"], ["height", "width"], ["h", "w"]):
            if all(c in lower for c in cand):
                cols = [header[lower.index(c)] for c in cand]
                break
    if cols is None and len(header) == 1:
        cols = header
    if not cols or any(c not in header for c in cols):
        raise InspectError(
            f"padless inspect: {path!r} has the columns {header}; name the length column (or 'height,width') "
            "with --length-column"
        )
    idx = [header.index(c) for c in cols]
    out = [_entry("x".join(r[i] for i in idx), path, n) for n, r in enumerate(rows[1:], 2)]
    return SizeTable(_table(out, path), path, "lengths", f"csv column(s) {', '.join(cols)}")


def _from_record(v: dict, length_column: str | None, path: str, n: int) -> Any:
    for cand in ([length_column] if length_column else []) + ["length"]:
        if cand in v:
            return v[cand]
    if "height" in v and "width" in v:
        return [v["height"], v["width"]]
    raise InspectError(f"padless inspect: {path}:{n}: a record with keys {list(v)}; name its length with --length-column")


def _entry(v: Any, path: str, n: int) -> tuple[int, ...]:
    """One size from a number, a ``[H, W]`` pair or a string ``"L"`` / ``"HxW"``."""
    if isinstance(v, bool):
        v = None
    if isinstance(v, int):
        out: tuple[int, ...] = (v,)
    elif isinstance(v, float) and v.is_integer():
        out = (int(v),)
    elif isinstance(v, (list, tuple)) and len(v) in (1, 2) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        out = tuple(v)
    elif isinstance(v, str) and (m := _LINE.match(v)):
        out = tuple(int(g) for g in m.groups() if g is not None)
    else:
        raise InspectError(f"padless inspect: {path}:{n}: {v!r} is not a length or an HxW size")
    if min(out) < 0:
        raise InspectError(f"padless inspect: {path}:{n}: the size {v!r} is negative")
    return out


def _table(rows: Any, source: str) -> np.ndarray:
    """``(N, k)`` int64 from sizes of one rank; mixed ranks (a length beside an HxW) are refused."""
    if isinstance(rows, np.ndarray):
        arr = rows
    else:
        ranks = {len(r) if isinstance(r, tuple) else 1 for r in rows}
        if len(ranks) > 1:
            raise InspectError(f"padless inspect: {source!r} mixes lengths and HxW sizes; every sample needs the same kind")
        arr = np.asarray(rows, dtype=np.int64)
    arr = np.asarray(arr)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not np.all(np.mod(arr, 1) == 0):
            raise InspectError(f"padless inspect: {source!r} holds sizes that are not whole numbers")
    arr = arr.astype(np.int64).reshape(len(arr), -1) if len(arr) else np.zeros((0, 1), dtype=np.int64)
    if arr.size and arr.min() < 0:
        raise InspectError(f"padless inspect: {source!r} holds a negative size")
    return arr
