"""Data-parallel training on packed batches: normalising the loss by the global token count.

With padding, every rank's batch has the same shape, so averaging each rank's mean
loss (what DDP's and FSDP's gradient all-reduce does) is the mean over the global
batch. Packed batches differ in token count from rank to rank, so the per-rank mean
weighs a token of a short batch more than a token of a long one. The fix is to sum
the loss over each rank's real tokens and divide by the number of real tokens of the
whole step, on every rank; then the averaged gradient equals the single-process
gradient on the union of the ranks' batches::

    sampler = BudgetBatchSampler(lengths, TokenBudget(8192))     # rank-aware
    for step, batch in enumerate(loader):
        n = sampler.global_tokens(step)                            # no communication
        loss_sum = F.cross_entropy(logits, targets, reduction="sum")
        padless.distributed.global_mean(loss_sum, n).backward()

``sampler.global_tokens(step)`` is computed locally: every rank derives the same global
list of batches from ``(seed, epoch)``. Streams that cannot know the other ranks'
batches use :func:`global_count` (one small all-reduce per step). Gradient
accumulation over micro-batches passes the micro-steps of one update:
``sampler.global_tokens(range(k * accum, (k + 1) * accum))``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _world_size(group=None) -> int:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group)
    return 1


def global_mean(loss_sum: Tensor, global_tokens: int, group=None) -> Tensor:
    """``loss_sum * world_size / global_tokens``: this rank's share of the mean over every rank's tokens.

    DDP and FSDP average gradients over ``world_size`` ranks; multiplying by it undoes
    that average, so the all-reduced gradient is ``d(sum of all token losses) / global_tokens``.
    Outside ``torch.distributed`` (or with one rank) it is ``loss_sum / global_tokens``.

    >>> global_mean(torch.tensor(12.0), 4)
    tensor(3.)
    """
    if isinstance(global_tokens, bool) or not isinstance(global_tokens, int):
        raise TypeError(f"global_mean: global_tokens must be a python int (host metadata), got {type(global_tokens).__name__}")
    if global_tokens < 1:
        raise ValueError(
            f"global_mean: global_tokens is {global_tokens}; a step with no real token has no mean "
            "(skip the step, or check the sampler's sizes)"
        )
    return loss_sum * (_world_size(group) / global_tokens)


def global_count(local: int, group=None, device: torch.device | str | None = None) -> int:
    """Sum of a host count over all ranks (one all-reduce of one int64): for streams.

    ``device`` is where the all-reduce runs: the CPU for gloo (default), the rank's GPU for
    nccl (default when the backend is nccl). Without ``torch.distributed`` it returns ``local``.

    >>> global_count(7)
    7
    """
    if isinstance(local, bool) or not isinstance(local, int):
        raise TypeError(f"global_count: local must be a python int, got {type(local).__name__}")
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return local
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    t = torch.tensor([local], dtype=torch.int64, device=device)
    dist.all_reduce(t, group=group)
    return int(t.item())


__all__ = ["global_count", "global_mean"]
