"""Per-sample reference checking of any op on NestedTensors (forward and backward)."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from padless.tensor.construct import from_list
from padless.tensor.convert import unbind_samples
from padless.tensor.core import NestedTensor
from padless.testing.variants import Variant, make_batch


def assert_close_samples(out: Tensor, refs: Sequence[Tensor], *, what: str = "output", **tol) -> None:
    """``out`` (NestedTensor or dense with a batch dim) holds ``refs`` sample by sample.

    NaN equals NaN here (a mean over an empty sample is NaN in both).
    """
    tol.setdefault("equal_nan", True)
    if isinstance(out, NestedTensor):
        got = unbind_samples(out, differentiable=False)
    else:
        got = list(out.detach().unbind(0)) if out.dim() else [out]
    if len(got) != len(refs):
        raise AssertionError(f"{what}: {len(got)} samples, reference has {len(refs)}")
    for i, (g, r) in enumerate(zip(got, refs)):
        r = r.detach()
        if tuple(g.shape) != tuple(r.shape):
            raise AssertionError(f"{what}: sample {i} has shape {tuple(g.shape)}, reference {tuple(r.shape)}")
        if g.dtype != r.dtype:
            raise AssertionError(f"{what}: sample {i} has dtype {g.dtype}, reference {r.dtype}")
        torch.testing.assert_close(g.detach(), r, msg=lambda m: f"{what}: sample {i}: {m}", **tol)


def _default_ref(fn: Callable) -> Callable[[Tensor], Tensor]:
    def ref(sample: Tensor) -> Tensor:
        return fn(sample.unsqueeze(0)).squeeze(0)

    return ref


def check_op(
    fn: Callable[[NestedTensor], Tensor],
    v: Variant | str,
    *,
    ref: Callable[[Tensor], Tensor] | None = None,
    dtype: torch.dtype = torch.float32,
    grad: bool = True,
    seed: int = 0,
    compiled: bool = False,
    **tol,
) -> Tensor:
    """Check ``fn`` on a batch of variant ``v`` against the dense reference on each sample.

    ``ref`` defaults to running ``fn`` on a dense batch of one sample. When ``grad``
    is set, a random cotangent is pushed through both and the gradients of every
    input sample are compared. ``compiled`` runs ``fn`` under
    ``torch.compile(backend="aot_eager", fullgraph=True)``. Returns the output.
    """
    nt, dense = make_batch(v, dtype=dtype, seed=seed, requires_grad=grad)
    ref = ref or _default_ref(fn)
    run = torch.compile(fn, backend="aot_eager", fullgraph=True) if compiled else fn
    out = run(nt)
    refs = [ref(s) for s in dense]
    assert_close_samples(out, refs, **tol)
    if grad and out.requires_grad:
        g = torch.Generator().manual_seed(seed + 1)
        cot = [torch.randn(r.shape, generator=g, dtype=torch.float64).to(r.dtype) for r in refs]
        if isinstance(out, NestedTensor):
            out.backward(from_list(cot, ragged_dims=out.ragged_dims, dtype=out.dtype))
        else:
            out.backward(torch.stack(cot) if cot else torch.zeros_like(out))
        torch.autograd.backward([r for r in refs if r.requires_grad], [c for r, c in zip(refs, cot) if r.requires_grad])
        want = [s.grad if s.grad is not None else torch.zeros_like(s) for s in dense]
        if nt.grad is None:
            if any(bool(w.abs().sum() > 0) for w in want):
                raise AssertionError("gradient: the NestedTensor received no .grad but the reference did")
        else:
            assert_close_samples(nt.grad, want, what="gradient", **tol)
    return out


def leaves(
    shapes: Sequence[tuple[int, ...]],
    seed: int = 0,
    ragged: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[NestedTensor, list[Tensor]]:
    """A leaf NestedTensor of random samples with these shapes, and the same samples as
    separate dense leaves (the reference side of :func:`check_samples`)."""
    g = torch.Generator().manual_seed(seed)
    dense = [torch.randn(s, generator=g, dtype=torch.float64).to(dtype).requires_grad_() for s in shapes]
    nt = from_list([d.detach() for d in dense], ragged_dims=ragged, requires_grad=True)
    return nt, dense


def check_samples(
    fn: Callable[..., Tensor],
    ref: Callable[..., Tensor],
    inputs: Sequence[tuple[NestedTensor, list[Tensor]]],
    **tol,
) -> Tensor:
    """Multi-input version of :func:`check_op`: ``inputs`` are ``(nt, dense samples)`` pairs
    from :func:`leaves`; ``ref`` gets the i-th dense sample of every input. Compares the
    output sample by sample and the gradient of every input. Returns the output."""
    tol.setdefault("atol", 1e-5)
    tol.setdefault("rtol", 1e-5)
    out = fn(*[nt for nt, _ in inputs])
    b = len(inputs[0][1])
    refs = [ref(*[dense[i] for _, dense in inputs]) for i in range(b)]
    assert_close_samples(out, refs, **tol)
    g = torch.Generator().manual_seed(1234)
    cot = [torch.randn(r.shape, generator=g, dtype=torch.float64).to(r.dtype) for r in refs]
    if isinstance(out, NestedTensor):
        out.backward(from_list(cot, ragged_dims=out.ragged_dims, dtype=out.dtype))
    else:
        out.backward(torch.stack(cot))
    torch.autograd.backward(refs, cot)
    for nt, dense in inputs:
        assert_close_samples(nt.grad, [d.grad for d in dense], what="gradient", **tol)
    return out


def graph_nodes(root) -> list:
    """Every autograd node reachable from ``root`` (a ``grad_fn``, or a tensor: its
    ``grad_fn``), each once: what a backward from there runs. ``type(n).__name__`` names them."""
    seen, todo = set(), [getattr(root, "grad_fn", root)]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo.extend(nxt for nxt, _ in node.next_functions)
    return list(seen)
