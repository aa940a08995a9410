"""The per-sample fallback for ATen ops without a handler (eager mode only).

An op with no handler runs once per sample on a dense batch of one
(``sample.unsqueeze(0)``), and the results are packed again. It is correct for
ops that treat samples independently, which is why it is refused when an
argument names the batch dim or a size list (view/reshape-like ops), for
in-place ops, and under ``torch.compile``. It warns once per op: a loop over
samples is slow, and the op deserves a real handler.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from padless.tensor import convert
from padless.tensor.construct import from_list
from padless.tensor.core import NeedsPerSample, NestedTensor, warn_once
from padless.tensor.dynamo import _is_traced
from padless.tensor.registry import lend, op_name

_SIZE_NAMES = ("size", "shape", "sizes", "stride", "output_size")
# Ops that run per sample only in their eval form (``training`` / ``use_input_stats`` False).
_MIX_FLAGS = ("training", "use_input_stats")


def _mixes_samples(func, bound: dict) -> str | None:
    """Why ``func``'s result would depend on several samples (so a per-sample run would be
    silently wrong), or None. Batch norm in training normalises with statistics over the whole
    batch and updates running statistics once per batch; a reduction over every dim includes
    the batch dim."""
    name = func._schema.name.split("::")[-1]
    if "batch_norm" in name or name == "instance_norm":
        flags = [bound[f] for f in _MIX_FLAGS if isinstance(bound.get(f), bool)]
        eval_only = name.endswith(("_no_training", "_no_update")) or (flags and not any(flags))
        if name == "instance_norm" and bound.get("running_mean") is None:
            eval_only = True  # per-sample statistics and nothing to update: each sample alone
        if not eval_only:
            return (
                "its result mixes samples (batch statistics over the whole batch, running statistics updated "
                "once per batch); per sample it would silently normalise each sample with its own statistics. "
                "F.batch_norm / nn.BatchNorm*d and F.instance_norm have NestedTensor handlers: call them"
            )
    for a in func._schema.arguments:
        if a.name in ("dim", "dims") and ("List" in str(a.type) or "Optional" in str(a.type)):
            v = bound.get(a.name)
            if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
                return "it reduces over every dim, the batch dim included (its result mixes samples)"
    return None


def describe_args(args: tuple, kwargs: dict) -> str:
    """Short type description of call arguments for error messages."""

    def one(a: Any) -> str:
        if isinstance(a, NestedTensor):
            return f"NestedTensor(ragged_dims={a.ragged_dims}, dtype={a.dtype})"
        if isinstance(a, torch.Tensor):
            return f"Tensor(shape={tuple(a.shape)}, dtype={a.dtype})"
        if isinstance(a, (list, tuple)):
            inner = ", ".join(one(x) for x in a[:4])
            return f"{type(a).__name__}[{inner}{', ...' if len(a) > 4 else ''}]"
        return type(a).__name__

    parts = [one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    return ", ".join(parts)


def _refusal(func, args: tuple, kwargs: dict) -> str | None:
    """Why the per-sample fallback cannot run this call, or None if it can."""
    nts = [a for a in (*args, *kwargs.values()) if isinstance(a, NestedTensor)]
    if any(_is_traced(n._values) for n in nts):
        return "the per-sample fallback is eager-only (this call is being traced by torch.compile)"
    schema = func._schema
    if schema.is_mutable:
        return "it is an in-place or out= op"
    if torch.Tag.dynamic_output_shape in func.tags or torch.Tag.data_dependent_output in func.tags:
        return "its output shape depends on the data (no per-sample batch dim to keep)"
    ndim = nts[0].dim()
    bound = dict(zip((a.name for a in schema.arguments), args))
    bound.update(kwargs)
    mixes = _mixes_samples(func, bound)
    if mixes is not None:
        return mixes
    for a in schema.arguments:
        t = str(a.type)
        v = bound.get(a.name)
        if v is None:
            continue
        if a.name in ("dim", "dims", "dim0", "dim1", "start_dim", "end_dim"):
            ds = v if isinstance(v, (list, tuple)) else [v]
            if any(isinstance(d, int) and d % ndim == 0 for d in ds):
                return f"argument {a.name}={v!r} names the batch dim"
        elif a.name in _SIZE_NAMES and ("List" in t or "[]" in t):
            return f"argument {a.name} is a size list (padded sizes have no per-sample meaning)"
    return None


# NestedTensor's dispatch entry points call these two; core cannot import this module.
@lend("per_sample")
def per_sample(func, args: tuple, kwargs: dict, inside_function: bool = False) -> Any:
    """Run ATen ``func`` sample by sample, or raise NotImplementedError saying why it cannot.

    When the op was reached from a torch-level call (``inside_function``), that call is
    re-run per sample above autograd instead (gradients then follow the dense samples).
    """
    why = _refusal(func, args, kwargs)
    if why is not None:
        raise NotImplementedError(
            f"padless: {op_name(func)} is not supported on NestedTensor (called with "
            f"{describe_args(args, kwargs)}): no handler is registered, and {why}. "
            "Workaround: operate on x.values() (packed rows) or on x.unbind() samples."
        )
    if inside_function:
        raise NeedsPerSample(func)
    return _run(func, args, kwargs, func, differentiable=False)


@lend("per_sample_function")
def per_sample_function(func, args: tuple, kwargs: dict, aten_op) -> Any:
    """Re-run a torch-level call sample by sample, with autograd through the samples."""
    return _run(func, args, kwargs, aten_op, differentiable=True)


def _run(func, args: tuple, kwargs: dict, named_op, differentiable: bool) -> Any:
    warn_once(
        ("per_sample", named_op),
        f"padless: {op_name(named_op)} has no NestedTensor handler; running it sample by sample "
        "(eager only, a Python loop: slow). Please report it so it gets a packed implementation.",
    )
    ref = next(a for a in (*args, *kwargs.values()) if isinstance(a, NestedTensor))
    b = ref.batch_size
    unbound = {
        id(a): convert.unbind_samples(a, differentiable=differentiable)  # read at call time: tests patch it
        for a in (*args, *kwargs.values())
        if isinstance(a, NestedTensor)
    }

    def pick(a, i):
        return unbound[id(a)][i].unsqueeze(0) if isinstance(a, NestedTensor) else a

    results = [func(*[pick(a, i) for a in args], **{k: pick(v, i) for k, v in kwargs.items()}) for i in range(b)]
    if b == 0:
        raise NotImplementedError(f"padless: {op_name(func)}: the per-sample fallback needs at least one sample")

    def pack(outs: list) -> Any:
        if not isinstance(outs[0], Tensor):
            raise NotImplementedError(
                f"padless: {op_name(func)} returns {type(outs[0]).__name__} per sample; the per-sample "
                "fallback only packs tensors"
            )
        if outs[0].dim() == 0:
            raise NotImplementedError(
                f"padless: {op_name(named_op)} is not supported on NestedTensor: it returns a scalar for a batch "
                "of one sample, so it reduces over the batch dim and its result mixes samples (per-sample results "
                "are not the batch's result). Reduce x.values() (packed rows) or each sample of x.unbind() instead"
            )
        samples = [o.squeeze(0) for o in outs]
        return from_list(samples, ragged_dims=_out_ragged(samples, ref), keep_history=differentiable)

    if isinstance(results[0], (tuple, list)):
        return type(results[0])(pack([r[k] for r in results]) for k in range(len(results[0])))
    return pack(results)


def _out_ragged(samples: list[Tensor], ref: NestedTensor) -> tuple[int, ...] | None:
    """The ragged dims of per-sample results: the input's when the results have its rank and
    differ only there (an op that keeps dims in place); the dims that differ when an op moved
    them (``transpose`` run per sample: as many differ as the input had ragged dims); None for
    another rank (inferred by ``from_list``); else the input's, and ``from_list`` names the
    static dim that differs."""
    if samples[0].dim() != ref.sample_dim:
        return None
    varying = tuple(d for d in range(samples[0].dim()) if any(s.shape[d] != samples[0].shape[d] for s in samples))
    if set(varying) <= set(ref.ragged_dims) or len(varying) != len(ref.ragged_dims):
        return ref.ragged_dims
    return varying

