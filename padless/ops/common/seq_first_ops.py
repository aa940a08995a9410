"""Ops on the sequence-first view ``(T, B, E)`` of a NestedTensor (:class:`~padless.ops.common.seq_first.SeqFirstView`).

The view is the batch read with its first two dims swapped, so an op on it is the same op on
the batch with dims 0 and 1 swapped back:

* **row-wise ops** (``F.linear``, ``layer_norm``, ``dropout``, activations, ``softmax(-1)``,
  ``x @ W``, ``chunk(3, dim=-1)``, ``contiguous``, dtype moves): run on the batch, the result
  viewed sequence-first again;
* **elementwise ops** (``x + y`` of two views, ``x * 0.5``, ``torch.where``): views are read
  as their batches; a dense operand that reaches the batch or time dim is read in
  sequence-first coordinates (its first two dims swapped: a ``(T, 1, E)`` position table
  gives each sample its own rows, by the padded-coordinate rule);
* **dims**: ``dim=0`` (time) is the batch's dim 1 (``x.mean(0)`` is each sample's mean over
  its own steps, ``(B, E)``); ``dim=1`` (batch) is the batch dim: joining (``cat``) works,
  reducing over it would mix samples at one time step and is refused;
* **view/reshape** ``(T, B * H, d)`` folds heads into the batch (fairseq's
  ``q.contiguous().view(T, B * H, d)``: ``B*H`` samples ``(T_b, d)``, one gather) and
  ``(T, B, E)`` of such a folded view unfolds it; ``(T, B, ...)`` reshapes each row.

Anything else raises, naming the op and the rewrite (transpose back with ``.transpose(0, 1)``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from padless.tensor.core import NestedTensor
from padless.tensor.errors import StructureError
from padless.tensor.registry import FAST_POINTWISE

# Row-wise: the first argument is the view, the others are parameters (never re-laid out).
_ROWWISE: set[Callable] = {
    F.linear, F.layer_norm, F.dropout, F.alpha_dropout, F.feature_alpha_dropout,
    torch.Tensor.contiguous, torch.Tensor.clone, torch.clone, torch.Tensor.detach, torch.detach,
    torch.Tensor.to, torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16, torch.Tensor.double,
    torch.Tensor.type_as, torch.Tensor.requires_grad_, torch.Tensor.cpu, torch.Tensor.cuda,
    F.gelu, F.relu, F.silu, F.mish, F.elu, F.leaky_relu, F.softplus, F.tanh, F.sigmoid, F.hardswish,
    torch.Tensor.relu, torch.Tensor.sigmoid, torch.Tensor.tanh,
}
for _name in ("rms_norm",):
    if hasattr(F, _name):
        _ROWWISE.add(getattr(F, _name))

# Take a ``dim`` (second positional argument or keyword): the dim is mapped to the batch's.
_WITH_DIM: set[Callable] = set()
for _owner in (torch, torch.Tensor):
    for _name in ("softmax", "log_softmax", "sum", "mean", "amax", "amin", "max", "min", "logsumexp", "prod",
                  "cumsum", "norm", "var", "std", "any", "all", "chunk", "split", "unbind", "argmax", "argmin",
                  "nansum", "nanmean"):
        if hasattr(_owner, _name):
            _WITH_DIM.add(getattr(_owner, _name))
_WITH_DIM |= {F.softmax, F.log_softmax, F.glu, F.normalize}
_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "logsumexp", "prod", "norm", "var", "std", "any",
               "all", "argmax", "argmin", "nansum", "nanmean"}
_JOIN = {torch.cat, torch.concat, torch.concatenate, torch.stack}
_VIEWS = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape}
_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}


def _elementwise(func: Callable) -> bool:
    if func in FAST_POINTWISE:
        return True
    name = getattr(func, "__name__", "")
    if name.endswith("_") and not name.startswith("__"):  # in place: x.add_(y), x.mul_(0.5)
        return getattr(torch.Tensor, name[:-1], None) in FAST_POINTWISE
    return name in ("__iadd__", "__isub__", "__imul__", "__itruediv__")


def handles(func: Callable) -> bool:
    """Whether :func:`run` has a rule for ``func``."""
    return func is torch.Tensor.__getitem__ or func in _ROWWISE or func in _WITH_DIM or func in _JOIN or func in _VIEWS or func in _MATMUL or _elementwise(func)


def run(func: Callable, args: tuple, kwargs: dict, wrap: Callable[[NestedTensor], Tensor], view_type: type) -> Any:
    """``func`` on sequence-first views (module docstring); ``wrap`` views a batch sequence-first."""
    name = getattr(func, "__name__", str(func))
    ref = next(a for a in (*args, *kwargs.values(), *_listed(args)) if isinstance(a, view_type))
    rank = ref.dim()
    unwrap = _unwrapper(view_type)
    if func in _VIEWS:
        return _view(name, args, kwargs, view_type, wrap)
    if func is torch.Tensor.__getitem__:
        return _getitem(args[0], args[1], rank, wrap)
    if func in _ROWWISE or (func in _MATMUL and _dense_right(args, view_type)):
        out = func(unwrap(args[0]), *args[1:], **kwargs)
        return _rewrap(out, wrap)
    if func in _JOIN:
        tensors = [unwrap(t) if isinstance(t, view_type) else _dense(t, rank) for t in args[0]]
        dim = kwargs.pop("dim", args[1] if len(args) > 1 else 0)
        if func is torch.stack:
            raise NotImplementedError(
                f"padless: {name}() of sequence-first views; stack the batches (transpose back with .transpose(0, 1))"
            )
        return _rewrap(func(tensors, _map_dim(name, dim, rank), **kwargs), wrap)
    if func in _WITH_DIM:
        return _with_dim(func, name, args, kwargs, rank, unwrap, wrap)
    if _elementwise(func):
        new_args = [unwrap(a) if isinstance(a, view_type) else _dense(a, rank) for a in args]
        new_kwargs = {k: unwrap(v) if isinstance(v, view_type) else _dense(v, rank) for k, v in kwargs.items()}
        out = func(*new_args, **new_kwargs)
        if name.endswith("_") or name.startswith("__i"):
            return args[0]  # in place: the view sees its batch's new values
        return _rewrap(out, wrap)
    raise RuntimeError(f"padless internal: no sequence-first rule for {name}")


def _listed(args: tuple) -> list:
    return [t for a in args if isinstance(a, (list, tuple)) for t in a]


def _unwrapper(view_type: type) -> Callable[[Any], Any]:
    return lambda x: x._nt if isinstance(x, view_type) else x


def _dense_right(args: tuple, view_type: type) -> bool:
    return len(args) == 2 and isinstance(args[0], view_type) and isinstance(args[1], Tensor) \
        and not isinstance(args[1], (NestedTensor, view_type)) and args[1].dim() <= 2


def _dense(x: Any, rank: int) -> Any:
    """A dense operand in sequence-first coordinates, in the batch's: dims 0 and 1 swapped
    (after aligning it to ``rank`` dims) when it reaches them."""
    if not isinstance(x, Tensor) or isinstance(x, NestedTensor) or x.dim() < rank - 1:
        return x
    if x.dim() > rank:
        raise StructureError(f"padless: a dense operand of shape {tuple(x.shape)} has more dims than the sequence-first view")
    return x.reshape((1,) * (rank - x.dim()) + tuple(x.shape)).transpose(0, 1)


def _rewrap(out: Any, wrap: Callable) -> Any:
    if isinstance(out, NestedTensor):
        return wrap(out)
    if isinstance(out, (tuple, list)) and type(out) in (tuple, list):
        return type(out)(_rewrap(o, wrap) for o in out)
    return out


def _map_dim(name: str, dim: Any, rank: int) -> Any:
    """A sequence-first dim as the batch's (0 <-> 1)."""
    if isinstance(dim, (tuple, list)):
        return type(dim)(_map_dim(name, d, rank) for d in dim)
    if not isinstance(dim, int) or isinstance(dim, bool):
        return dim
    d = dim % rank if -rank <= dim < rank else dim
    return {0: 1, 1: 0}.get(d, d)


def _with_dim(func, name: str, args: tuple, kwargs: dict, rank: int, unwrap, wrap) -> Any:
    args = list(args)
    if "dim" in kwargs:
        dim = kwargs["dim"]
    elif len(args) > 1 and not (name in ("chunk", "split") or func is F.normalize):
        dim = args[1]
    elif name in ("chunk", "split") and len(args) > 2:
        dim = args[2]
    elif name in ("chunk", "split", "unbind") and "dim" not in kwargs:
        dim = 0
    elif func is F.normalize and len(args) > 2:
        dim = args[2]
    elif func is F.normalize:
        dim = 1
    elif func in (F.softmax, F.log_softmax, F.glu):
        dim = -1
    else:
        dim = None  # a full reduction: x.sum()
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    norm = [d % rank for d in dims if isinstance(d, int) and not isinstance(d, bool)]
    if name in _REDUCTIONS and 1 in norm:
        raise StructureError(
            f"{name}(): dim 1 of a sequence-first view (T, B, ...) is the batch dim; reducing over it would mix "
            "samples at one time step. Reduce over time (dim=0) or features, or transpose back with .transpose(0, 1)"
        )
    if name in ("chunk", "split", "unbind") and 1 in norm:
        raise StructureError(
            f"{name}(): dim 1 of a sequence-first view (T, B, ...) is the batch dim; split the batch "
            "(transpose back with .transpose(0, 1), then split dim 0)"
        )
    mapped = _map_dim(name, dim, rank)
    if "dim" in kwargs:
        kwargs = {**kwargs, "dim": mapped}
    elif dim is not None:
        pos = 2 if (name in ("chunk", "split") or func is F.normalize) else 1
        if len(args) > pos:
            args[pos] = mapped
        else:
            kwargs = {**kwargs, "dim": mapped}
    args[0] = unwrap(args[0])
    out = func(*args, **kwargs)
    keep = kwargs.get("keepdim", False) or (len(args) > 2 and name in _REDUCTIONS and args[2] is True)
    if name in _REDUCTIONS and 0 in norm:
        if not keep:
            return out  # time reduced: (B, ...) per sample, the layout a dense (T, B, ...) reduction gives
        if isinstance(out, Tensor) and not isinstance(out, NestedTensor) and out.dim() >= 2:
            return out.transpose(0, 1)  # keepdim: (B, 1, ...) -> (1, B, ...)
    return _rewrap(out, wrap)


def _getitem(x: Any, index: Any, rank: int, wrap: Callable) -> Any:
    """``y[..., :k]`` (trailing dims), ``y[:, :, k]``, ``y[t]`` (time step ``t`` of every sample,
    ``(B, ...)``), ``y[:, b]`` (sample ``b``, ``(T_b, ...)``): the batch indexed with the first
    two entries swapped."""
    idx = index if isinstance(index, tuple) else (index,)
    nt = x._nt
    if idx and idx[0] is Ellipsis and sum(e is not None for e in idx[1:]) <= rank - 2:
        return _rewrap(nt[idx], wrap)
    if any(e is Ellipsis or e is None for e in idx[:2]):
        raise StructureError(
            f"__getitem__(): index {index!r} of a sequence-first view; index time and batch explicitly "
            "(y[t], y[:, b], y[a:b]) or trailing dims after ..., or transpose back with .transpose(0, 1)"
        )
    idx = idx + (slice(None),) * max(0, 2 - len(idx))
    out = nt[(idx[1], idx[0], *idx[2:])]
    keeps_time = isinstance(idx[0], slice) and not isinstance(idx[1], int)
    return _rewrap(out, wrap) if keeps_time else out


def _view(name: str, args: tuple, kwargs: dict, view_type: type, wrap: Callable) -> Any:
    """``view``/``reshape`` of a sequence-first view (module docstring)."""
    x = args[0]
    nt: NestedTensor = x._nt
    shape = list(args[1:]) + [kwargs[k] for k in ("shape", "size") if k in kwargs]
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = list(shape[0])
    method = torch.Tensor.view if name == "view" else torch.Tensor.reshape
    sizes = all(isinstance(s, (int, torch.SymInt)) and not isinstance(s, bool) for s in shape)
    if len(shape) >= 2 and sizes and (_same(shape[0], -1) or _same(shape[0], nt.shape[1])):
        t, b, rest = nt.shape[1], shape[1], list(shape[2:])
        batch = nt.batch_size
        if _same(b, batch):  # (T, B, ...): each row reshaped
            return wrap(method(nt, batch, t, *rest))
        per_row, width = _prod(nt._values.shape[1:]), _prod(rest)  # elements of one row, of the target's row
        k = per_row // width if rest and width and per_row % width == 0 else 0
        if k > 1 and (_same(b, -1) or _same(b, batch * k)):  # (T, B * H, d): heads folded into the batch
            split = method(nt, batch, t, k, *rest)
            return wrap(torch.Tensor.reshape(split.transpose(1, 2), batch * k, t, *rest))
        k = width // per_row if per_row and width % per_row == 0 else 0
        if k > 1 and _same(batch, b * k):  # (T, B, E) of a view whose heads were folded: unfold
            try:
                grouped = torch.Tensor.reshape(nt, b, k, *nt.shape[1:])
            except StructureError as e:
                raise StructureError(
                    f"{name}(): {tuple(shape)} of a sequence-first view of {batch} samples regroups them into "
                    f"{b} samples of {k}, which needs a batch folded from {b} samples: {e}"
                ) from None
            grouped = grouped.transpose(1, 2)  # (B, T, H, ...): its time dim is its own (t is the folded batch's)
            return wrap(method(grouped, b, grouped.shape[1], *rest))
    raise StructureError(
        f"{name}(): the sequence-first view has envelope {tuple(x.shape)}; it can be viewed as (T, B, ...) "
        "(each row reshaped), (T, B * H, d) (heads folded into the batch) or back to (T, B, E) from such a fold. "
        "For anything else transpose back with .transpose(0, 1)"
    )


def _same(a: Any, b: Any) -> bool:
    """``a == b`` for sizes, without a guard on a symbol (False unless known)."""
    if not isinstance(a, torch.SymInt) and not isinstance(b, torch.SymInt):
        return int(a) == int(b)
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(a == b))


def _prod(xs) -> int:
    out = 1
    for v in xs:
        out *= v
    return out
