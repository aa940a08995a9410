"""The generic pointwise path: one handler for every elementwise ATen op.

Every ATen op tagged ``torch.Tag.pointwise`` reaches :func:`padless.ops.common.engine.pointwise_aten`
through the tensor layer's generic ATen handler; this module registers the untagged
elementwise ops with the same engine, and the torch-level fast path (no autograd) for
the common elementwise callables. How operands map onto rows is described in
:mod:`padless.ops.common.engine`.
"""

from __future__ import annotations

import torch

from padless.ops.common.engine import pointwise_aten, pointwise_function
from padless.tensor.registry import FAST_POINTWISE, implements_aten

aten = torch.ops.aten



# Out-of-place elementwise callables at the torch level. In-place ones are left to the
# ATen path on purpose: there autograd bumps the version counter of the NestedTensor.
_FAST_NAMES = (
    "__add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ __floordiv__ "
    "__rfloordiv__ __mod__ __pow__ __rpow__ __neg__ __abs__ __invert__ __and__ __or__ __xor__ "
    "__eq__ __ne__ __lt__ __le__ __gt__ __ge__ "
    "add sub mul div true_divide floor_divide remainder fmod pow neg abs exp exp2 expm1 log log1p "
    "log2 log10 sqrt rsqrt sin cos tan asin acos atan atan2 sinh cosh tanh sigmoid relu erf erfc "
    "floor ceil round trunc frac sign sgn square reciprocal clamp clamp_min clamp_max clip "
    "maximum minimum fmax fmin eq ne lt le gt ge logical_and logical_or logical_xor logical_not "
    "bitwise_and bitwise_or bitwise_xor bitwise_not isnan isinf isfinite nan_to_num where "
    "masked_fill lerp addcmul addcdiv hypot logaddexp copysign xlogy"
).split()
_FAST_F = "relu relu6 gelu silu mish elu selu celu leaky_relu softplus hardtanh hardswish hardsigmoid logsigmoid tanhshrink softsign".split()


def _fast_callables():
    import torch.nn.functional as F

    seen = set()
    for name in _FAST_NAMES:
        for owner in (torch, torch.Tensor):
            f = getattr(owner, name, None)
            if f is not None and f not in seen:
                seen.add(f)
                yield f
    for name in _FAST_F:
        f = getattr(F, name, None)
        if f is not None and f not in seen:
            seen.add(f)
            yield f


for _f in _fast_callables():
    FAST_POINTWISE[_f] = pointwise_function


# Elementwise ops whose ATen schema lacks the pointwise tag (including several
# backward formulas of tagged activations). Names that a torch build lacks are skipped.
_UNTAGGED_ELEMENTWISE = (
    "masked_fill.Tensor", "masked_fill_.Scalar", "masked_fill_.Tensor",
    "where.ScalarOther", "where.ScalarSelf", "where.Scalar",
    "clamp_.default", "clamp_.Tensor", "clamp_min_.default", "clamp_max_.default",
    "floor_divide.default", "floor_divide.Scalar", "floor_divide_.Tensor", "floor_divide_.Scalar",
    "threshold_.default", "mish_.default", "hardswish_.default", "gelu_.default",
    "elu_backward.default", "hardsigmoid_backward.default", "hardtanh_backward.default",
    "leaky_relu_backward.default", "mish_backward.default", "softplus_backward.default",
    "hardswish_backward.default", "softshrink_backward.default", "hardshrink_backward.default",
    "rrelu_with_noise_backward.default", "frexp.Tensor",
)


def _resolve(names):
    for n in names:
        packet, overload = n.split(".")
        op = getattr(getattr(aten, packet, None), overload, None)
        if op is not None:
            yield op


implements_aten(*_resolve(_UNTAGGED_ELEMENTWISE), accepts="packed, dense or scalar operands")(pointwise_aten)
