"""Read a Hugging Face ``datasets.Dataset`` (arrow) of token ids or arrays, a batch at a time.

>>> import datasets
>>> ds = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7], [8], [9, 10]], "label": [0, 1, 0]})
>>> reader = HFDatasetReader(ds)
>>> reader.lengths().tolist()
[3, 1, 2]
>>> [s["input_ids"].tolist() for s in reader.__getitems__([2, 0])]
[[9, 10], [5, 6, 7]]
>>> reader[1]["label"]
1

``__getitems__`` is what ``DataLoader`` calls with a sampler's whole batch of
indices: one arrow ``take`` per batch, list columns split into per-sample
tensors from the arrow offsets (no per-row Python conversion). Pass
``reader.lengths()`` to a sampler; it is computed once from the arrow list
lengths (or read from ``length_column``) and cached in memory and, for a
dataset backed by files, next to its cache files, in a file named after the
dataset's fingerprint and length (a cache file of the wrong size or type is
ignored and rewritten). The reader pickles, so it
works with ``num_workers > 0``.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from padless.loaders._deps import require
from padless.loaders.transforms import Transform, apply_transform, sample_transform


class HFDatasetReader(torch.utils.data.Dataset):
    """Map-style dataset over a ``datasets.Dataset``; samples are dicts of tensors / numbers / strings.

    Args:
        dataset: a ``datasets.Dataset`` (not a ``DatasetDict``: pick a split).
        columns: columns to read (default: all).
        length_column: an int column holding each sample's length; if absent,
            lengths are the list lengths of ``lengths_of``.
        lengths_of: the list column that defines a sample's length (default: the first list column).
        dtypes: optional ``{column: torch.dtype}`` casts (e.g. ``{"input_ids": torch.int64}``).
        cache_lengths: also save the lengths as ``.npy`` beside the dataset's cache files.
        transform: applied to each sample dict in ``__getitems__`` (in the worker): a
            function of the sample, or ``{column: function}``. ``lengths()`` are the
            lengths before it: a transform that changes lengths must keep the sampler's
            budget true (e.g. only truncate).
    """

    def __init__(
        self,
        dataset: Any,
        *,
        columns: Sequence[str] | None = None,
        length_column: str | None = "length",
        lengths_of: str | None = None,
        dtypes: dict[str, torch.dtype] | None = None,
        cache_lengths: bool = True,
        transform: Transform | None = None,
    ) -> None:
        datasets = require("datasets", "padless.loaders.hf")
        if isinstance(dataset, datasets.DatasetDict):
            raise TypeError(
                f"HFDatasetReader: got a DatasetDict with splits {list(dataset)}; pass one split, e.g. dataset['train']"
            )
        if not isinstance(dataset, datasets.Dataset):
            raise TypeError(f"HFDatasetReader: expected a datasets.Dataset, got {type(dataset).__name__}")
        names = list(dataset.column_names)
        cols = list(columns) if columns is not None else names
        for c in cols + ([lengths_of] if lengths_of else []) + list(dtypes or {}):
            if c not in names:
                raise KeyError(f"HFDatasetReader: column {c!r} is not in the dataset (columns: {names})")
        self.dataset = dataset
        self.columns = cols
        self.length_column = length_column if length_column in names else None
        self.lengths_of = lengths_of
        self.dtypes = dict(dtypes or {})
        self.cache_lengths = cache_lengths
        self.transform = sample_transform(transform, "HFDatasetReader")
        self._lengths: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"HFDatasetReader: index must be an int, got {type(index).__name__}; use __getitems__ for a batch")
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"HFDatasetReader: index {index} is out of range for {n} samples")
        return self.__getitems__([int(index) % n])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """The samples at ``indices``: one arrow read for the whole batch."""
        table = self.dataset.with_format("arrow", columns=self.columns)[list(map(int, indices))]
        n = len(indices)
        out: list[dict[str, Any]] = [{} for _ in range(n)]
        for c in self.columns:
            vals = column_samples(table.column(c), c, indices)
            if c in self.dtypes:
                vals = [v.to(self.dtypes[c]) if isinstance(v, Tensor) else torch.tensor(v, dtype=self.dtypes[c]) for v in vals]
            for i in range(n):
                out[i][c] = vals[i]
        if self.transform is not None:
            out = [apply_transform(self.transform, s, f"sample {int(i)}") for s, i in zip(out, indices)]
        return out

    # ------------------------------------------------------------------ lengths

    def lengths(self) -> np.ndarray:
        """Each sample's length (int64 ``(N,)``), computed once and cached."""
        if self._lengths is not None:
            return self._lengths
        source = self.length_column or self._length_source()
        path = self._cache_path(source)
        cached = load_lengths(path, len(self.dataset)) if path is not None else None
        if cached is not None:
            self._lengths = cached
            return cached
        pc = require("pyarrow.compute", "padless.loaders.hf")
        col = self.dataset.with_format("arrow", columns=[source])[:].column(source)
        if self.length_column is not None:
            lengths = np.asarray(col.to_numpy(), dtype=np.int64)
        else:
            lengths = np.asarray(pc.list_value_length(col).to_numpy(zero_copy_only=False), dtype=np.int64)
        self._lengths = lengths
        if path is not None:
            save_lengths(path, lengths)
        return lengths

    def _length_source(self) -> str:
        pa = require("pyarrow", "padless.loaders.hf")
        if self.lengths_of is not None:
            return self.lengths_of
        schema = self.dataset.data.schema
        for c in self.columns:
            t = schema.field(c).type
            if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
                return c
        raise ValueError(
            f"HFDatasetReader.lengths: no list column among {self.columns} and no length column; "
            "pass lengths_of='<list column>' or length_column='<int column>'"
        )

    def _cache_path(self, source: str) -> str | None:
        files = getattr(self.dataset, "cache_files", None) or []
        fp = getattr(self.dataset, "_fingerprint", None)
        if not self.cache_lengths or not files or fp is None:
            return None
        kind = "column" if source == self.length_column else "listlen"
        n = len(self.dataset)
        return os.path.join(os.path.dirname(files[0]["filename"]), f"padless-lengths-{fp}-{n}-{kind}-{source}.npy")

    def __repr__(self) -> str:
        return f"HFDatasetReader({len(self)} samples, columns={self.columns})"


def load_lengths(path: str, n: int) -> np.ndarray | None:
    """The cached lengths at ``path`` if the file holds exactly ``n`` non-negative int64 lengths, else ``None``.

    The file name carries the dataset's fingerprint and length; the size check
    catches a cache cut short or overwritten (it is then recomputed and rewritten).
    """
    if not os.path.exists(path):
        return None
    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    if arr.dtype != np.int64 or arr.shape != (n,) or (n and arr.min() < 0):
        return None
    return arr


def save_lengths(path: str, lengths: np.ndarray) -> None:
    """Write the lengths cache atomically (a reader in another worker never sees half a file)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            np.save(f, lengths)
        os.replace(tmp, path)
    except OSError:  # a read-only cache directory: keep the in-memory copy
        try:
            os.remove(tmp)
        except OSError:
            pass


def column_samples(col: Any, name: str, indices: Sequence[int] | None = None) -> list[Any]:
    """Per-sample values of an arrow column: list columns become tensors (nested lists: ``(L_i, M_i, ...)``)."""
    pa = require("pyarrow", "padless.loaders.hf")
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    t = arr.type
    if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
        return arr.to_pylist()
    if arr.null_count:
        k = next(k for k, v in enumerate(arr.is_null().to_pylist()) if v)
        row = indices[k] if indices is not None else k
        raise ValueError(f"HFDatasetReader: column {name!r} is null in sample {row}; fill or filter the nulls first")
    flat, shapes = _flatten(arr, name, indices)
    if flat is None:
        return arr.to_pylist()
    values = torch.from_numpy(flat)
    counts = [int(np.prod(s)) for s in shapes]
    return [p.reshape(s) for p, s in zip(torch.split(values, counts), shapes)]


def _flatten(arr: Any, name: str, indices: Sequence[int] | None = None) -> tuple[np.ndarray | None, list[tuple[int, ...]]]:
    """Leaf values and one shape per row of a (nested) list array; ``(None, [])`` for non-numeric leaves."""
    pa = require("pyarrow", "padless.loaders.hf")
    pc = require("pyarrow.compute", "padless.loaders.hf")
    lens = np.asarray(pc.list_value_length(arr).to_numpy(zero_copy_only=False), dtype=np.int64)
    inner = arr.flatten()
    it = inner.type
    if pa.types.is_list(it) or pa.types.is_large_list(it) or pa.types.is_fixed_size_list(it):
        flat, inner_shapes = _flatten(inner, name)
        if flat is None:
            return None, []
        shapes = []
        pos = 0
        for r, n in enumerate(lens.tolist()):
            rows = inner_shapes[pos : pos + n]
            pos += n
            if any(s != rows[0] for s in rows):
                row = indices[r] if indices is not None else r
                raise ValueError(
                    f"HFDatasetReader: column {name!r} in sample {row} is a ragged nested list (inner shapes {rows[:3]}...); "
                    "each sample must be a rectangular array"
                )
            shapes.append((n, *(rows[0] if rows else (0,) * (len(inner_shapes[0]) if inner_shapes else 1))))
        return flat, shapes
    if not (pa.types.is_integer(it) or pa.types.is_floating(it) or pa.types.is_boolean(it)):
        return None, []
    flat = np.array(inner.to_numpy(zero_copy_only=False), copy=True)  # arrow memory is read-only
    return flat, [(n,) for n in lens.tolist()]
