"""Named sample variants: the shapes every op is checked on."""

from __future__ import annotations

import dataclasses
import random
from typing import Sequence

import torch
from torch import Tensor

from padless.tensor.construct import from_list
from padless.tensor.core import NestedTensor


@dataclasses.dataclass(frozen=True)
class Variant:
    """A named batch layout: one shape per sample and the declared ragged dims."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    ragged_dims: tuple[int, ...]
    note: str = ""

    @property
    def sample_dim(self) -> int:
        return len(self.shapes[0])


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in [
        Variant("seq", ((3, 4), (5, 4), (1, 4)), (0,), "token sequences (L_i, C)"),
        Variant("seq_1d", ((3,), (6,), (2,)), (0,), "scalars per token (L_i,)"),
        Variant("empty_sample", ((3, 4), (0, 4), (2, 4)), (0,), "a zero-length sample in the middle"),
        Variant("all_empty", ((0, 4), (0, 4)), (0,), "every sample empty"),
        Variant("one_sample", ((5, 4),), (0,), "a batch of one"),
        Variant("all_equal", ((3, 4), (3, 4), (3, 4)), (0,), "declared ragged, sizes agree"),
        Variant("channels_first", ((4, 3), (4, 5), (4, 2)), (1,), "non-leading ragged dim (C, L_i)"),
        Variant("image", ((3, 4, 5), (3, 2, 6), (3, 3, 3)), (1, 2), "images (C, H_i, W_i)"),
        Variant("pair", ((3, 3, 2), (4, 4, 2), (1, 1, 2)), (0, 1), "pair states (N_i, N_i, C)"),
        Variant("rect", ((2, 3, 2), (4, 1, 2), (3, 5, 2)), (0, 1), "rectangular pairs (N_i, M_i, C)"),
        Variant("heads_pair", ((2, 3, 3), (2, 4, 4)), (1, 2), "non-leading pairs (H, N_i, N_i)"),
        Variant("three_ragged", ((2, 3, 2, 2), (1, 2, 3, 2), (3, 1, 1, 2)), (0, 1, 2), "three ragged dims"),
        Variant("static_zero", ((2, 0), (3, 0)), (0,), "a static dim of extent 0"),
    ]
}


def variant(name: str) -> Variant:
    return VARIANTS[name]


def make_batch(
    v: Variant | str,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    requires_grad: bool = False,
    device: str | torch.device = "cpu",
    low: float = -2.0,
    high: float = 2.0,
) -> tuple[NestedTensor, list[Tensor]]:
    """A NestedTensor of variant ``v`` and the dense samples it holds (as separate leaves).

    Values are uniform in ``[low, high)``; integer dtypes get integers in that range.
    """
    if isinstance(v, str):
        v = VARIANTS[v]
    g = torch.Generator().manual_seed(seed)
    samples = []
    for s in v.shapes:
        t = torch.rand(s, generator=g, dtype=torch.float64) * (high - low) + low
        if dtype.is_floating_point:
            t = t.to(dtype)
        elif dtype == torch.bool:
            t = t > (low + high) / 2
        else:
            t = t.floor().to(dtype)
        samples.append(t.to(device))
    nt = from_list(samples, ragged_dims=v.ragged_dims, requires_grad=requires_grad and dtype.is_floating_point)
    dense = [s.clone().requires_grad_(requires_grad and dtype.is_floating_point) for s in samples]
    return nt, dense


def random_shapes(
    rng: random.Random,
    batch: int,
    ragged: Sequence[int],
    ndim: int,
    *,
    max_len: int = 6,
    static: int = 3,
    allow_empty: bool = True,
) -> list[tuple[int, ...]]:
    """Random sample shapes: ragged dims drawn in ``[0 or 1, max_len]``, static dims fixed."""
    lo = 0 if allow_empty else 1
    stat = [rng.randint(1, static) for _ in range(ndim)]
    return [tuple(rng.randint(lo, max_len) if d in ragged else stat[d] for d in range(ndim)) for _ in range(batch)]
