"""Losses on NestedTensors: computed on packed rows, averaged over real elements only.

A ``mean`` reduction equals torch's mean over the concatenation of every sample's
elements (padding never counts); ``sum`` sums them; ``reduction='none'`` returns a
NestedTensor (the target's structure for class-index targets, the input's otherwise).

**Class dim rule** (``cross_entropy``, ``nll_loss``). Input samples are logits with
one static class dim of extent K, which is either

* sample dim 0 (NestedTensor dim 1): torch's own convention, dense ``(B, C, d1, ...)``,
  e.g. ``(K, N_i)`` or segmentation logits ``(K, H_i, W_i)``; or
* the last sample dim: ``(N_i, K)`` token logits, ``(N_i, N_i, K)`` pair logits.

Class-index targets (integer, one rank less than the input) must have the input's
structure with the class dim removed; the candidate (of the two ends, only static
ones count) whose removal gives the target's structure is the class dim. Probability
targets (floating, the input's structure) need exactly one static end. When both
ends fit, the call is ambiguous and raises. Either way ``values`` holds rows of K
classes, so the loss is one dense call on ``values``::

    logits (N_i, K), L = 2, 1      values [[l00 .. l0K] [l10 .. l1K] [l20 .. l2K]]   (3, K)
    target (N_i,)                  values [t0 t1 t2]                                 (3,)
    loss mean                      sum_r loss_r / 3  (weighted: / sum_r weight[t_r])

Elementwise losses (``mse_loss``, ``l1_loss``, ``smooth_l1_loss``, ``huber_loss``,
``binary_cross_entropy[_with_logits]``) take input and target of the same structure,
or one NestedTensor and one dense tensor that broadcasts over its static dims (``(C,)``)
or per sample (``(B, 1, C)``), mapped onto rows like a pointwise operand.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import _reduction

from padless.ops.common.engine import dense_to_rows
from padless.ops.common.structure import keep_all, restructure, values_dim
from padless.tensor.autograd import rewrap, values_of
from padless.tensor.core import NestedTensor, _structure_mismatch, check_same_structure
from padless.tensor.registry import implements
from padless.tensor.errors import StructureError


def _reduction_mode(op: str, reduction: str, size_average: bool | None = None, reduce: bool | None = None) -> str:
    if size_average is not None or reduce is not None:
        reduction = _reduction.legacy_get_string(size_average, reduce)
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"{op}(): reduction={reduction!r} is not one of 'none', 'mean', 'sum'")
    return reduction


def _without_dim(x: NestedTensor, c: int) -> tuple[NestedTensor, list]:
    """A NestedTensor with ``x``'s structure minus static sample dim ``c`` (zero-storage values)."""
    dims = keep_all(x)
    del dims[c]
    shape = list(x._values.shape)
    del shape[values_dim(x, c)]
    return restructure(x, x._values.new_zeros(()).expand(shape), dims), dims


def _class_dim(op: str, x: Tensor, target: Tensor, allow_probs: bool) -> tuple[int, bool]:
    """The class sample dim of ``x`` and whether ``target`` holds probabilities (see module doc)."""
    if not isinstance(x, NestedTensor):
        raise TypeError(f"{op}(): target is a NestedTensor but input is a dense Tensor of shape {tuple(x.shape)}; "
                        "make the input a NestedTensor too")
    if not isinstance(target, NestedTensor):
        raise TypeError(
            f"{op}(): input is a NestedTensor but target is a dense Tensor of shape {tuple(target.shape)}; "
            "target must be a NestedTensor with the input's structure without the class dim"
        )
    d = x.sample_dim
    ends = sorted({0, d - 1} - set(x._ragged)) if d else []
    if not ends:
        raise StructureError(
            f"{op}(): input samples have ragged dims {x.ragged_dims} at both ends; the class dim must be a "
            "static first sample dim (torch's (C, d1, ...)) or a static last one ((N_i, C))"
        )
    if target.sample_dim == d:
        if not allow_probs:
            raise ValueError(f"{op}(): target has the input's rank {d + 1}; {op} takes class-index targets "
                             f"of rank {d} (the input without its class dim)")
        if not target.dtype.is_floating_point:
            raise TypeError(f"{op}(): target has the input's rank, so it holds class probabilities and must be "
                            f"floating point, got {target.dtype}")
        check_same_structure(op, x, target)
        if len(ends) > 1:
            raise StructureError(_ambiguous(op, x))
        return ends[0], True
    if target.sample_dim != d - 1:
        raise StructureError(f"{op}(): target has rank {target.sample_dim + 1}, input has rank {d + 1}; class-index "
                         f"targets have rank {d} (the input without its class dim)")
    if target.dtype.is_floating_point or target.dtype == torch.bool:
        raise TypeError(f"{op}(): class-index targets must be an integer NestedTensor, got {target.dtype}")
    fits, reasons = [], []
    for c in ends:
        msg = _structure_mismatch(_without_dim(x, c)[0], target)
        if msg is None:
            fits.append(c)
        else:
            reasons.append(f"without dim {c + 1}: {msg}")
    if len(fits) > 1:
        raise StructureError(_ambiguous(op, x))
    if not fits:
        raise StructureError(
            f"{op}(): target (ragged dims {target.ragged_dims}) does not match the input without its class dim ("
            + "; ".join(reasons) + "). The class dim is dim 1 (torch's (B, C, d1, ...)) or the last dim "
            "((B, N_i, C)); the target must have the input's structure with that dim removed"
        )
    return fits[0], False


def _ambiguous(op: str, x: NestedTensor) -> str:
    return (
        f"{op}(): ambiguous class dim: input dims 1 and {x.sample_dim} are both static and the target fits "
        "either; move a ragged dim to one end (e.g. x.movedim(2, -1) keeps classes at dim 1) "
        "or call the loss on the dense values"
    )


def _class_loss(
    op: str, loss_fn: Callable[..., Tensor], x: Tensor, target: Tensor, weight: Tensor | None,
    reduction: str, allow_probs: bool, **kwargs,
) -> Tensor:
    if isinstance(weight, NestedTensor):
        raise TypeError(f"{op}(): weight must be a dense (K,) tensor of class weights, got a NestedTensor")
    c, probs = _class_dim(op, x, target, allow_probs)
    vc = values_dim(x, c)
    # Classes go to dim 1 of values, torch's layout. Moving them makes a copy: torch's
    # nll_loss2d backward refuses a non-contiguous input ("grad_input must be contiguous").
    inp = values_of(x) if vc == 1 else values_of(x).movedim(vc, 1).contiguous()
    tgt = target._values
    if probs:
        tgt = values_of(target) if vc == 1 else values_of(target).movedim(vc, 1).contiguous()
    loss = loss_fn(inp, tgt, weight, reduction=reduction, **kwargs)
    if reduction != "none":
        return loss
    if probs:
        return restructure(x, loss, _without_dim(x, c)[1])
    return rewrap(loss, target)


@implements(F.cross_entropy, accepts="packed logits, packed class-index or probability target, dense weight")
def cross_entropy(
    func, input: Tensor, target: Tensor, weight: Tensor | None = None, size_average: bool | None = None,
    ignore_index: int = -100, reduce: bool | None = None, reduction: str = "mean", label_smoothing: float = 0.0,
) -> Tensor:
    """Cross entropy of NestedTensor logits; class dim chosen by the module-level rule.

    >>> logits = padless.from_list([torch.randn(3, 5), torch.randn(2, 5)])   # (N_i, K)
    >>> target = padless.from_list([torch.tensor([0, 4, 1]), torch.tensor([2, 2])])
    >>> F.cross_entropy(logits, target)          # mean over the 5 tokens
    >>> F.cross_entropy(logits.transpose(1, 2), target)   # torch's (K, N_i): same value
    """
    red = _reduction_mode("cross_entropy", reduction, size_average, reduce)
    return _class_loss("cross_entropy", F.cross_entropy, input, target, weight, red, True,
                       ignore_index=ignore_index, label_smoothing=label_smoothing)


@implements(F.nll_loss, accepts="packed log-probabilities, packed class-index target, dense weight")
def nll_loss(
    func, input: Tensor, target: Tensor, weight: Tensor | None = None, size_average: bool | None = None,
    ignore_index: int = -100, reduce: bool | None = None, reduction: str = "mean",
) -> Tensor:
    """Negative log-likelihood of NestedTensor log-probabilities (class dim rule as ``cross_entropy``)."""
    red = _reduction_mode("nll_loss", reduction, size_average, reduce)
    return _class_loss("nll_loss", F.nll_loss, input, target, weight, red, False, ignore_index=ignore_index)


# ---------------------------------------------------------------------------- elementwise losses


def _rows(op: str, name: str, t: Tensor | None, ref: NestedTensor, expand: bool = True) -> Tensor | None:
    """Operand ``t`` as rows aligned with ``ref``'s values (NestedTensor of the same structure, or dense)."""
    if t is None:
        return None
    if isinstance(t, NestedTensor):
        if t is not ref:
            check_same_structure(op, ref, t)
        return values_of(t)
    rows = dense_to_rows(op, t, ref)
    want = ref._values.shape
    try:
        got = torch.broadcast_shapes(rows.shape, want)
    except RuntimeError:
        got = None
    if got != want:
        raise StructureError(
            f"{op}(): {name} of shape {tuple(t.shape)} does not broadcast to the NestedTensor's elements "
            f"(rows of static shape {tuple(want[1:])}); give a NestedTensor of the same structure or a dense "
            "tensor over the static dims"
        )
    return rows.expand(want) if expand else rows


def _pointwise_loss(
    op: str, loss_fn: Callable[..., Tensor], input: Tensor, target: Tensor, reduction: str,
    weights: dict[str, Tensor | None] | None = None, **kwargs,
) -> Tensor:
    if isinstance(input, NestedTensor):
        ref = input
    elif isinstance(target, NestedTensor):
        ref = target
    else:
        raise TypeError(f"{op}(): input and target are dense tensors; only they can carry the ragged structure, "
                        "so a NestedTensor weight needs a NestedTensor input or target")
    extra = {k: _rows(op, k, w, ref, expand=k != "pos_weight") for k, w in (weights or {}).items()}
    loss = loss_fn(_rows(op, "input", input, ref), _rows(op, "target", target, ref),
                   reduction=reduction, **extra, **kwargs)
    return rewrap(loss, ref) if reduction == "none" else loss


@implements(F.mse_loss, accepts="packed or dense input/target/weight")
def mse_loss(
    func, input: Tensor, target: Tensor, size_average: bool | None = None, reduce: bool | None = None,
    reduction: str = "mean", weight: Tensor | None = None,
) -> Tensor:
    """Squared error over real elements (``mean`` divides by their count, or by ``weight.sum()``)."""
    red = _reduction_mode("mse_loss", reduction, size_average, reduce)
    return _pointwise_loss("mse_loss", F.mse_loss, input, target, red, {"weight": weight})


@implements(F.l1_loss, accepts="packed or dense input/target")
def l1_loss(
    func, input: Tensor, target: Tensor, size_average: bool | None = None, reduce: bool | None = None,
    reduction: str = "mean", weight: Tensor | None = None,
) -> Tensor:
    """Absolute error over real elements.

    torch 2.13's ``F.l1_loss`` drops ``weight=`` when it dispatches to a tensor
    subclass, so a weight never reaches this handler; pass it to ``F.l1_loss`` on
    ``x.values()`` or multiply ``reduction='none'`` output instead.
    """
    red = _reduction_mode("l1_loss", reduction, size_average, reduce)
    return _pointwise_loss("l1_loss", F.l1_loss, input, target, red, {"weight": weight})


@implements(F.smooth_l1_loss, accepts="packed or dense input/target")
def smooth_l1_loss(
    func, input: Tensor, target: Tensor, size_average: bool | None = None, reduce: bool | None = None,
    reduction: str = "mean", beta: float = 1.0,
) -> Tensor:
    """Smooth L1 over real elements (quadratic below ``beta``)."""
    red = _reduction_mode("smooth_l1_loss", reduction, size_average, reduce)
    return _pointwise_loss("smooth_l1_loss", F.smooth_l1_loss, input, target, red, beta=beta)


@implements(F.huber_loss, accepts="packed or dense input/target/weight")
def huber_loss(
    func, input: Tensor, target: Tensor, reduction: str = "mean", delta: float = 1.0, weight: Tensor | None = None,
) -> Tensor:
    """Huber loss over real elements (quadratic below ``delta``)."""
    red = _reduction_mode("huber_loss", reduction)
    return _pointwise_loss("huber_loss", F.huber_loss, input, target, red, {"weight": weight}, delta=delta)


@implements(F.binary_cross_entropy_with_logits, accepts="packed or dense input/target/weight/pos_weight")
def binary_cross_entropy_with_logits(
    func, input: Tensor, target: Tensor, weight: Tensor | None = None, size_average: bool | None = None,
    reduce: bool | None = None, reduction: str = "mean", pos_weight: Tensor | None = None,
) -> Tensor:
    """Binary cross entropy on logits; ``pos_weight`` is typically dense ``(C,)`` over the last dim."""
    red = _reduction_mode("binary_cross_entropy_with_logits", reduction, size_average, reduce)
    return _pointwise_loss("binary_cross_entropy_with_logits", F.binary_cross_entropy_with_logits, input, target,
                           red, {"weight": weight, "pos_weight": pos_weight})


@implements(F.binary_cross_entropy, accepts="packed or dense input/target/weight")
def binary_cross_entropy(
    func, input: Tensor, target: Tensor, weight: Tensor | None = None, size_average: bool | None = None,
    reduce: bool | None = None, reduction: str = "mean",
) -> Tensor:
    """Binary cross entropy on probabilities in ``[0, 1]``."""
    red = _reduction_mode("binary_cross_entropy", reduction, size_average, reduce)
    return _pointwise_loss("binary_cross_entropy", F.binary_cross_entropy, input, target, red, {"weight": weight})
