"""One step of a user's model run to record the plans it builds, leaving no trace.

Plan recipes (:func:`padless.vision.plan_recipe` for spatial plans,
:func:`padless.pair_plan_recipe` for pair bucket plans) run one forward (and backward) of the
model on an example batch and record what it builds. The model must come out as it went in:
:func:`traceless` restores the parameters' gradients and the buffers (batch-norm running
statistics), and runs the step under a forked random number generator (dropout draws leave
the user's stream as it was).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from padless.tensor.core import NestedTensor, values_of

__all__ = ["model_step", "traceless"]


def _tensors(out: Any) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    return []


def model_step(model: Callable, backward: bool, *inputs: Any, **kwargs: Any) -> Callable[[], None]:
    """A step: ``model(*inputs, **kwargs)``, and with ``backward`` the backward of the float sum
    of every output that requires grad (NestedTensors through their rows)."""

    def run() -> None:
        with torch.set_grad_enabled(backward):
            out = model(*inputs, **kwargs)
            if backward:
                parts = [(values_of(t) if isinstance(t, NestedTensor) else t).float().sum()
                         for t in _tensors(out) if t.requires_grad]
                if parts:
                    sum(parts).backward()

    return run


def traceless(model: Any, device: torch.device, fn: Callable[[], Any]) -> Any:
    """``fn()``, with ``model``'s gradients and buffers restored afterwards and its random draws
    taken from a forked generator."""
    params = list(model.parameters()) if isinstance(model, torch.nn.Module) else []
    buffers = list(model.buffers()) if isinstance(model, torch.nn.Module) else []
    grads = [p.grad for p in params]
    saved = [b.detach().clone() for b in buffers]
    try:
        for p in params:
            p.grad = None
        cuda = device.type == "cuda"
        with torch.random.fork_rng(devices=[device] if cuda else [], device_type=device.type if cuda else "cuda"):
            return fn()
    finally:
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.grad = g
            for b, v in zip(buffers, saved):
                b.copy_(v)
