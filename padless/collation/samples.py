"""What one sample field can hold, and turning it into a tensor.

Tensors, numpy arrays, PIL images (as ``(C, H, W)``, uint8 for 8-bit modes) and
numbers become tensors; strings and other objects stay Python objects. Pillow is
optional: it is only imported for a sample that already is a PIL image.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import numbers
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from padless.tensor.core import NestedTensor

TENSOR = "tensor"
NUMBER = "number"
STRING = "string"
NONE = "none"
MAPPING = "mapping"
NAMEDTUPLE = "namedtuple"
DATACLASS = "dataclass"
SEQUENCE = "sequence"
OBJECT = "object"


def fmt_shape(shape: Sequence[int]) -> str:
    s = tuple(int(x) for x in shape)
    return "(" + ", ".join(map(str, s)) + (",)" if len(s) == 1 else ")")


def field_label(path: str) -> str:
    """How errors name a field: its key path, or ``<sample>`` for the samples themselves."""
    return repr(path) if path else "<sample>"


def is_pil(x: Any) -> bool:
    """A PIL image, recognised without importing Pillow."""
    return any(c.__module__.startswith("PIL.") and c.__name__ == "Image" for c in type(x).__mro__)


_EXACT = {int: NUMBER, float: NUMBER, bool: NUMBER, complex: NUMBER, str: STRING, bytes: STRING, type(None): NONE,
          Tensor: TENSOR, dict: MAPPING, list: SEQUENCE, tuple: SEQUENCE}
_BY_TYPE: dict[type, str] = {}  # kinds of other types, found once per type (numpy's depend on the dtype)


def kind(x: Any) -> str:
    """What a sample value is: one of the kind names above (cached per type: this runs per value)."""
    t = type(x)
    k = _EXACT.get(t) or _BY_TYPE.get(t)
    if k is not None:
        return k
    if isinstance(x, np.ndarray):
        return TENSOR if x.dtype.kind in "biufc" else OBJECT
    if isinstance(x, np.generic):
        return NUMBER if x.dtype.kind in "biufc" else OBJECT
    k = _kind_of_type(x)
    _BY_TYPE[t] = k
    return k


def kind_of_type(t: type) -> str | None:
    """The kind every value of type ``t`` has, or None when it depends on the value (numpy arrays
    and scalars: their dtype) or the type was not seen yet (cheap: two dict lookups)."""
    return _EXACT.get(t) or _BY_TYPE.get(t)


def _kind_of_type(x: Any) -> str:
    """The kind of a value whose type alone decides it (everything but numpy values)."""
    if isinstance(x, Tensor):
        return TENSOR
    if isinstance(x, (str, bytes)):
        return STRING
    if isinstance(x, numbers.Number):
        return NUMBER
    if is_pil(x):
        return TENSOR
    if isinstance(x, collections.abc.Mapping):
        return MAPPING
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return NAMEDTUPLE
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return DATACLASS
    if isinstance(x, collections.abc.Sequence):
        return SEQUENCE
    return OBJECT


def is_number_list(x: Any) -> bool:
    """A Python list of numbers (or of such lists): what tokenizers and ``datasets`` give for a
    sequence. Collated as a tensor, like an array; tuples keep ``default_collate``'s rule."""
    while type(x) is list:
        if not x:
            return True
        x = x[0]
        if _EXACT.get(type(x)) == NUMBER or isinstance(x, np.generic):
            return True
    return False


def lists_to_tensors(path: str, samples: Sequence[Any]) -> list[Any]:
    """``samples`` with every number list made a tensor (``torch.tensor`` dtypes: int64, float32,
    bool). An empty list takes the dtype of the field's other samples."""
    out: list[Any] = list(samples)
    empty: list[int] = []
    dtypes: set[torch.dtype] = set()
    for i, x in enumerate(samples):
        if type(x) is not list:
            if isinstance(x, Tensor):
                dtypes.add(x.dtype)
            continue
        if not x:
            empty.append(i)
            continue
        try:
            t = torch.tensor(x)
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise TypeError(
                f"collate(): field {field_label(path)}: sample {i} is a list that cannot form a tensor ({e}); "
                "a list field needs numbers, or nested lists of one shape, in every sample"
            ) from None
        out[i] = t
        dtypes.add(t.dtype)
    if empty:
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.get_default_dtype()
        for i in empty:
            out[i] = torch.empty(0, dtype=dtype)
    return out


def to_tensor(x: Any, path: str, i: int) -> Tensor:
    """A tensor view of one array-like sample (no copy for tensors and numpy arrays)."""
    if isinstance(x, NestedTensor):
        raise TypeError(
            f"collate(): field {field_label(path)}: sample {i} is a NestedTensor; samples must be dense "
            "(collate packs them). Unbind it first, or concatenate batches with torch.cat."
        )
    if isinstance(x, Tensor):
        return x
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x if x.flags.writeable else x.copy())
    if is_pil(x):
        return pil_to_tensor(x)
    raise TypeError(f"collate(): field {field_label(path)}: sample {i} of type {type(x).__name__} is not array-like")


def pil_to_tensor(img: Any) -> Tensor:
    """``(C, H, W)`` view of a PIL image: uint8 for 8-bit modes, the mode's own dtype otherwise.

    Palette and 1-bit images are converted to RGB(A) / L first, as torchvision does.
    """
    _require_pillow()
    if img.mode == "1":
        img = img.convert("L")
    elif img.mode in ("P", "PA"):
        img = img.convert("RGBA" if "transparency" in img.info or img.mode == "PA" else "RGB")
    arr = np.array(img)  # writable; the (C, H, W) view below is copied once, into the batch
    if arr.ndim == 2:
        arr = arr[:, :, None]
    return torch.from_numpy(arr).permute(2, 0, 1)


def _require_pillow() -> None:
    try:
        import PIL.Image  # noqa: F401
    except ImportError:  # pragma: no cover - only reached with a PIL-like object and no Pillow
        raise ImportError(
            "collate(): PIL images need Pillow; install it with: pip install 'padless[loaders]'"
        ) from None


def numbers_tensor(values: Sequence[Any], path: str) -> Tensor:
    """Numbers as ``default_collate`` makes them: floats -> float64, ints -> int64, numpy keep theirs."""
    first = values[0]
    if isinstance(first, np.generic):
        return torch.from_numpy(np.asarray(values))
    if isinstance(first, float):
        return torch.tensor(values, dtype=torch.float64)
    if all(type(v) is int for v in values):  # labels: numpy reads a list of ints several times faster
        try:
            return torch.from_numpy(np.array(values, dtype=np.int64))
        except OverflowError:
            pass  # named below
    try:
        return torch.tensor(values)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        for i, v in enumerate(values):
            if isinstance(v, int) and not -(2**63) <= v < 2**63:
                raise OverflowError(
                    f"collate(): field {field_label(path)}: sample {i} is {v}, which does not fit in int64; "
                    "pass it as a float or a string, or scale it in the dataset"
                ) from None
        raise TypeError(f"collate(): field {field_label(path)}: numbers cannot form a tensor ({e})") from None
