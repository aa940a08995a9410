"""Which torch calls keep dim 0 of a dense tensor that stands for a batch.

Two dense tensors remember where they came from: the packed rows of a batch
(:class:`padless.ops.rows.packed_rows.PackedRows`, dim 0 = its rows) and a pooled map of an
image batch (:class:`padless.ops.vision.batch_dense.BatchDense`, dim 0 = its images). A result
keeps that memory only when its dim 0 still means the same thing, index for index. Its size
alone cannot say so: ``rows.t()`` of ``T`` rows of ``T`` features, ``rows.flip(0)``,
``rows[perm]`` or ``rows.cumsum(0)`` have ``T`` entries on dim 0 and none of them is row ``i``.

:func:`keeps_dim0` answers from the call itself, by a list of what is known to keep it
(elementwise ops, casts, row-wise layers, reductions and reshapes of the other dims); every
other call gives a plain tensor. ``mixing`` also accepts ops whose values mix entries along
dim 0 while each index keeps its meaning (batch norm in training on a pooled map, as the
dense code computes it).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from padless.tensor.registry import FAST_POINTWISE

__all__ = ["keeps_dim0"]

# calls whose result is the input, elementwise, cast or copied
_SAME = {
    "to", "float", "double", "half", "bfloat16", "type", "type_as", "contiguous", "clone", "detach", "detach_",
    "requires_grad_", "cpu", "cuda", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__", "dropout",
    "alpha_dropout", "feature_alpha_dropout", "zero_", "fill_", "copy_", "empty_like", "zeros_like", "ones_like",
    "full_like", "rand_like", "randn_like",
}
# row-wise layers of their first argument (the input), whatever the other arguments
_INPUT_WISE = {"linear", "layer_norm", "rms_norm", "embedding", "expand", "expand_as"}
# calls whose dim arguments name the dims they work along (the result keeps dim 0 when none is 0)
_ALONG = {
    "softmax", "log_softmax", "sum", "mean", "amax", "amin", "max", "min", "norm", "std", "var", "prod",
    "logsumexp", "all", "any", "argmax", "argmin", "normalize", "unsqueeze", "squeeze", "flatten",
    "unflatten", "split", "chunk", "unbind", "narrow", "select", "cat", "concat", "concatenate",
    "tensor_split", "cumsum", "cumprod", "flip", "roll",
}
# ops whose values mix entries along dim 0 while dim 0 keeps its meaning (``mixing``)
_BATCH_WISE = {
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "batch_norm",
    "group_norm", "instance_norm", "interpolate", "upsample", "avg_pool1d", "avg_pool2d", "avg_pool3d",
    "max_pool1d", "max_pool2d", "max_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
    "adaptive_avg_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d", "pad",
}
_POINTWISE_NAMES: set[str] = set()  # names of FAST_POINTWISE (filled by the op layer), read on first use
_DEFAULT_DIM = {"normalize": 1, "flatten": 0, "squeeze": None}
_DIM_KEYS = ("dim", "dims", "start_dim", "end_dim", "axis")


def _dims(name: str, args: tuple, kwargs: dict) -> list[Any] | None:
    """The dim arguments of a call in ``_ALONG`` (``None`` where it works over every dim)."""
    if name == "normalize":  # F.normalize(input, p=2.0, dim=1)
        return [kwargs.get("dim", args[2] if len(args) > 2 else 1)]
    if name in ("flatten",):
        start = kwargs.get("start_dim", args[1] if len(args) > 1 else 0)
        return [start]
    if name in ("split", "chunk", "tensor_split"):
        return [kwargs.get("dim", args[2] if len(args) > 2 else 0)]
    if name in ("narrow", "select", "unflatten", "unsqueeze", "roll"):
        if name == "roll":
            return [kwargs.get("dims", args[2] if len(args) > 2 else None)]
        return [kwargs.get("dim", args[1] if len(args) > 1 else None)]
    if name in ("cat", "concat", "concatenate"):
        return [kwargs.get("dim", args[1] if len(args) > 1 else 0)]
    for k in _DIM_KEYS:
        if k in kwargs:
            return [kwargs[k]]
    if len(args) > 1 and not isinstance(args[1], Tensor):
        return [args[1]]
    return [_DEFAULT_DIM.get(name)]


def _not_dim0(dims: list[Any], ndim: int) -> bool:
    flat: list[Any] = []
    for d in dims:
        flat.extend(d if isinstance(d, (tuple, list)) else [d])
    if not flat or any(d is None or isinstance(d, bool) or not isinstance(d, int) for d in flat):
        return False  # every dim (or one a name gives): dim 0 too
    return all(-ndim <= d < ndim and d % ndim != 0 for d in flat)


def _first_index_keeps(index: Any, ndim: int) -> bool:
    """``t[index]`` takes dim 0 whole, in order (``t[:, k]``, ``t[..., :2]``)."""
    entries = index if isinstance(index, tuple) else (index,)
    if not entries:
        return False
    first = entries[0]
    if first is Ellipsis:  # dim 0 is under the ellipsis unless the other entries reach it
        return sum(e is not None for e in entries[1:]) < ndim
    return isinstance(first, slice) and first == slice(None)


def keeps_dim0(func: Any, args: tuple, kwargs: dict, owner: Tensor, mixing: bool = False) -> bool:
    """Whether ``func(*args, **kwargs)`` keeps dim 0 of ``owner`` (one of its tensor arguments)
    index for index; ``mixing`` also accepts ops that mix values along it (module docstring)."""
    if func in FAST_POINTWISE:
        return True
    if not _POINTWISE_NAMES:
        _POINTWISE_NAMES.update(getattr(f, "__name__", "") for f in FAST_POINTWISE)
    name = getattr(func, "__name__", "")
    if name in _SAME or name in _POINTWISE_NAMES or (name.endswith("_") and name[:-1] in _POINTWISE_NAMES):
        return True
    first = args[0] if args else kwargs.get("input")
    if name in _INPUT_WISE:
        return first is owner
    if name in ("view", "reshape"):
        return True  # a row-major reshape that keeps dim 0's size keeps every row (the caller checks the size)
    if name == "__getitem__":
        return first is owner and len(args) > 1 and _first_index_keeps(args[1], owner.dim())
    if name == "addmm":
        return len(args) > 2 and args[1] is owner and args[2] is not owner
    if name in ("matmul", "mm", "__matmul__"):
        other = args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("mat2"))
        return first is owner and owner.dim() >= 2 and isinstance(other, Tensor) and other.dim() <= 2 and other is not owner
    if name in _ALONG:
        if first is not owner and name not in ("cat", "concat", "concatenate"):
            return False
        ndim = owner.dim() + (name == "unsqueeze")  # unsqueeze names a dim of its result
        return _not_dim0(_dims(name, args, kwargs), ndim)
    if mixing and name in _BATCH_WISE:
        if name == "pad":
            pad = args[1] if len(args) > 1 else kwargs.get("pad", ())
            return first is owner and len(pad) <= 2 * (owner.dim() - 1)
        return first is owner
    return False

