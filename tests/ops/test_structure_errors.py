"""Every structure error the op layer raises is a StructureError (a ValueError and a RuntimeError).

Code written for ``torch.nested`` catches ``RuntimeError``; padless code has always caught
``ValueError``. The walk below calls every op that takes two NestedTensor operands with two
batches of one batch size, rank and ragged dims whose sample shapes differ, and checks the
error type. An op is first run on two batches of *one* structure: one that does not run on
these inputs at all (a dtype it refuses, a unary op) says nothing about structure and is
skipped; the ops the issue names must all be reached (``REQUIRED``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import padless
from padless.tensor.errors import StructureError
from padless.tensor.registry import FAST_POINTWISE, registered, op_name


def _batch(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return padless.nested.nested_tensor([torch.rand(*s, generator=g) + 0.5 for s in shapes])


SHAPES = [(2, 3), (4, 3)]
OTHER = [(3, 3), (4, 3)]  # same batch size, rank and ragged dim; sample 0 differs


def _a():
    return _batch(SHAPES, 0)


def _same():
    return _batch(SHAPES, 1)


def _b():
    return _batch(OTHER, 2)


def _cond():
    return _a() > 0.9


def _mismatch_positions(fn, arity, make=_a, same=_same, other=_b):
    """Run ``fn`` on ``arity`` operands of one structure; if it runs, return the calls that put a
    batch of another structure at each operand position after the first."""
    try:
        fn(*[make()] + [same() for _ in range(arity - 1)])
    except Exception:
        return None
    calls = []
    for k in range(1, arity):
        calls.append(lambda k=k: fn(*[make()] + [same() if j != k else other() for j in range(1, arity)]))
    return calls


def _assert_structure_error(name, call):
    with pytest.raises(StructureError) as info:
        call()
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, RuntimeError), name
    assert "differ" in str(err) or "structure" in str(err), (name, str(err))


# ------------------------------------------------------------------ pointwise (torch level)


TERNARY = ("where", "addcmul", "addcdiv", "lerp")


def _pointwise_cases():
    cases = {}
    for f in FAST_POINTWISE:
        name = op_name(f)
        for arity in (2, 3) if any(t in name for t in TERNARY) else (2,):
            calls = _mismatch_positions(f, arity)
            if calls is None and arity == 3 and "where" in name:  # where(condition, input, other)
                calls = _mismatch_positions(f, 3, make=_cond)
            if calls:
                cases[f"{name}/{arity}"] = calls
                break
    return cases


POINTWISE = _pointwise_cases()


@pytest.mark.parametrize("name", sorted(POINTWISE))
def test_pointwise_function_level(name):
    for call in POINTWISE[name]:
        _assert_structure_error(name, call)


# ------------------------------------------------------------------ pointwise and registered ATen ops


def _tensor_args(schema):
    return [a for a in schema.arguments if isinstance(a.type, torch.TensorType) and not a.kwarg_only]


NOT_AN_ERROR = {"aten.is_same_size.default": "answers the question (False) instead of raising"}


def _aten_ops():
    """ATen overloads that padless runs on two or more NestedTensor operands: every pointwise
    overload (functional and in-place; ``out=`` forms excluded) and every registered ATen handler."""
    seen = {}
    for h in registered():
        if h.layer == "aten":
            seen[str(h.op)] = h.op
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for ov in packet.overloads():
            op = getattr(packet, ov)
            if torch.Tag.pointwise in op.tags and "out" not in ov:
                seen[str(op)] = op
    out = {}
    for name, op in seen.items():
        if name in NOT_AN_ERROR:
            continue
        args = _tensor_args(op._schema)
        if len(args) < 2 or any(a.is_out for a in op._schema.arguments):
            continue
        out[name] = (op, len(args))
    return out


def _aten_cases():
    cases = {}
    for name, (op, arity) in _aten_ops().items():
        calls = _mismatch_positions(op, arity)
        if calls is None and arity == 3 and "where" in name:  # where(condition, self, other)
            calls = _mismatch_positions(op, 3, make=_cond)
        if calls:
            cases[name] = calls
    aten = torch.ops.aten
    for name, fn in {  # a bool mask operand
        "aten.masked_fill.Tensor": lambda x, m: aten.masked_fill.Tensor(x, m > 0.9, torch.tensor(0.0)),
        "aten.masked_fill_.Tensor": lambda x, m: aten.masked_fill_.Tensor(x, m > 0.9, torch.tensor(0.0)),
        "aten.masked_fill_.Scalar": lambda x, m: aten.masked_fill_.Scalar(x, m > 0.9, 0.0),
        "aten.masked_fill.Scalar": lambda x, m: aten.masked_fill.Scalar(x, m > 0.9, 0.0),
    }.items():
        cases[name] = _mismatch_positions(fn, 2)
    return cases


ATEN = _aten_cases()


@pytest.mark.parametrize("name", sorted(ATEN))
def test_aten_level(name):
    for call in ATEN[name]:
        _assert_structure_error(name, call)


# ------------------------------------------------------------------ function-level handlers with several operands


def _mha(q, k, v):
    m = torch.nn.MultiheadAttention(3, 1, batch_first=True)
    return m(q, k, v, need_weights=False)


def _index(shapes):
    return padless.nested.nested_tensor([torch.zeros(*s, dtype=torch.long) for s in shapes])


# op -> (call with the first structure, batches of the other structure in each operand position)
FUNCTION_CASES = {
    "torch.matmul": lambda a, b: torch.matmul(a.transpose(1, 2), b),  # (3, L_i) @ (L'_i, 3)
    "torch.Tensor.matmul": lambda a, b: a.transpose(1, 2).matmul(b),
    "torch.Tensor.__matmul__": lambda a, b: a.transpose(1, 2) @ b,
    "torch.Tensor.__rmatmul__": lambda a, b: torch.Tensor.__rmatmul__(b, a.transpose(1, 2)),
    "torch.bmm": lambda a, b: torch.bmm(a.transpose(1, 2), b),
    "torch.Tensor.bmm": lambda a, b: a.transpose(1, 2).bmm(b),
    "torch.baddbmm": lambda a, b: torch.baddbmm(torch.ones(3, 3), a.transpose(1, 2), b, alpha=0.5),
    "torch.Tensor.baddbmm": lambda a, b: torch.ones(3, 3).baddbmm(a.transpose(1, 2), b),
    "torch.functional.einsum": lambda a, b: torch.einsum("bji,bjk->bik", a, b),
    "torch.cat": lambda a, b: torch.cat([a, b], dim=2),
    "torch.Tensor.__setitem__": lambda a, b: a.__setitem__((slice(None), slice(None, 3)), b[:, :3]),  # a window written
    "torch.concat": lambda a, b: torch.concat([a, b], dim=2),
    "torch.concatenate": lambda a, b: torch.concatenate([a, b], dim=2),
    "torch.stack": lambda a, b: torch.stack([a, b], dim=1),
    "torch.copysign": lambda a, b: torch.copysign(a, b),
    "torch.Tensor.copysign": lambda a, b: a.copysign(b),
    "torch.nextafter": lambda a, b: torch.nextafter(a, b),
    "torch.Tensor.nextafter": lambda a, b: a.nextafter(b),
    "torch.Tensor.expand_as": lambda a, b: a.expand_as(b),
    "torch.Tensor.reshape_as": lambda a, b: a.reshape_as(b),
    "torch.Tensor.view_as": lambda a, b: a.view_as(b),
    "torch.nn.functional.scaled_dot_product_attention": lambda a, b: F.scaled_dot_product_attention(
        a.unsqueeze(1), a.unsqueeze(1), b.unsqueeze(1)
    ),
    "torch.nn.functional.multi_head_attention_forward": lambda a, b: _mha(a, a, b),
    "torch.nn.functional.mse_loss": lambda a, b: F.mse_loss(a, b),
    "torch.nn.functional.l1_loss": lambda a, b: F.l1_loss(a, b),
    "torch.nn.functional.huber_loss": lambda a, b: F.huber_loss(a, b),
    "torch.nn.functional.smooth_l1_loss": lambda a, b: F.smooth_l1_loss(a, b),
    "torch.nn.functional.binary_cross_entropy": lambda a, b: F.binary_cross_entropy(a / 3, b / 3),
    "torch.nn.functional.binary_cross_entropy_with_logits": lambda a, b: F.binary_cross_entropy_with_logits(a, b),
    "torch.nn.functional.cross_entropy": lambda a, b: F.cross_entropy(a, b.softmax(-1)),
    "torch.nn.functional.nll_loss": lambda a, b: F.nll_loss(a, _index(b.sizes().tolist()).select(-1, 0)),
    "torch.Tensor.add_": lambda a, b: a.add_(b),  # in-place methods (ATen in-place overloads below)
    "torch.Tensor.sub_": lambda a, b: a.sub_(b),
    "torch.Tensor.mul_": lambda a, b: a.mul_(b),
    "torch.Tensor.div_": lambda a, b: a.div_(b),
    "torch.Tensor.pow_": lambda a, b: a.pow_(b),
    "torch.Tensor.copy_": lambda a, b: a.copy_(b),
    "torch.Tensor.masked_fill_": lambda a, b: a.masked_fill_(b > 0.9, 0.0),
    "torch.where (condition)": lambda a, b: torch.where(b > 0.9, a, a),
    "torch.gather": lambda a, b: torch.gather(a, 2, _index(b.sizes().tolist())),
    "torch.Tensor.gather": lambda a, b: a.gather(2, _index(b.sizes().tolist())),
}

# Function-level handlers that take several packed operands but whose second operand is not
# a batch of the first one's kind (so two arbitrary structures are not a "mismatch"):
OTHER_OPERANDS = {
    "torch.nn.functional.embedding_bag": "the second packed operand is per_sample_weights of 1-d id samples",
    "torch.nn.functional.interpolate": "a NestedTensor size gives per-image targets, it need not match",
    "torch.index_put": "indices and values are dense",
    "torch.index_put_": "indices and values are dense",
    "torch.Tensor.index_put": "indices and values are dense",
    "torch.Tensor.index_put_": "indices and values are dense",
    "torch.sgn": "unary",
    "torch.Tensor.sgn": "unary",
}

_SEVERAL = ("operands", "all inputs", "key", "target", "index", "other", "per_sample_weights", "mask", "size:")


def test_every_several_operand_handler_has_a_case():
    names = {op_name(h.op) for h in registered() if h.layer == "function" and any(w in h.accepts for w in _SEVERAL)}
    missing = names - set(FUNCTION_CASES) - set(OTHER_OPERANDS)
    assert not missing, f"give these handlers a mismatched-structure case: {sorted(missing)}"


@pytest.mark.parametrize("name", sorted(FUNCTION_CASES))
def test_function_level(name):
    fn = FUNCTION_CASES[name]
    fn(_a(), _same())  # runs on one structure
    _assert_structure_error(name, lambda: fn(_a(), _b()))


REQUIRED = [
    "torch.Tensor.__add__/2", "torch.add/2", "torch.mul/2", "torch.sub/2", "torch.div/2", "torch.pow/2",
    "torch.maximum/2", "torch.atan2/2", "torch.where/3", "torch.addcmul/3", "torch.lerp/3",
    "aten.add.Tensor", "aten.add_.Tensor", "aten.mul_.Tensor", "aten.sub_.Tensor", "aten.div_.Tensor",
    "aten.where.self", "aten.copy_.default", "aten.masked_fill.Tensor",
]


def test_the_walk_reaches_the_ops_the_issue_names():
    reached = set(POINTWISE) | set(ATEN) | set(FUNCTION_CASES)
    assert not [r for r in REQUIRED if r not in reached]
    assert len(POINTWISE) > 40 and len(ATEN) > 60


def test_issue_examples_are_caught_by_both_except_clauses():
    a, b = _a(), _b()
    c = _a() > 1
    for call in (lambda: a + b, lambda: a.clone().mul_(b), lambda: torch.where(c, a, b)):
        for kind in (ValueError, RuntimeError):
            with pytest.raises(kind, match=r"ragged structures differ: sample 0 has \(2, 3\), other has \(3, 3\)"):
                call()


def test_broadcast_over_static_dims_compares_ragged_sizes_each_call():
    """``x * m[..., None]``: structures that differ in static extents only pass, forward and
    backward, however often they meet; a ragged size that differs is named, sample and sizes."""
    x = padless.from_list([torch.randn(n, n, 4, dtype=torch.float64) for n in (3, 0, 5)]).requires_grad_()
    m = padless.from_list([torch.rand(n, n, dtype=torch.float64) for n in (3, 0, 5)])
    for _ in range(2):
        y = x * m.unsqueeze(-1)
        y.sum().backward()
        for a, b, g in zip(y.unbind(), m.unbind(), x.grad.unbind()):
            assert torch.equal(g, b.unsqueeze(-1).expand_as(g))
        x.grad = None
    bad = padless.from_list([torch.rand(n, n, dtype=torch.float64) for n in (3, 2, 5)])
    for _ in range(2):
        with pytest.raises(StructureError, match=r"sample 1 has \(0, 0, 4\), other has \(2, 2, 1\)"):
            x * bad.unsqueeze(-1)
