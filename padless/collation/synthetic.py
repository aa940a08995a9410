"""Synthetic variable-size datasets shared by the collate tests, example and benchmark.

Each is a map-style ``torch.utils.data.Dataset`` of dict samples, deterministic in
``seed``, drawn from a pool made once (so a benchmark measures collation, not
sample generation)::

    TokenDataset     {"input_ids": int64 (L,),             "label": int}   L lognormal in [lo, hi]
    ImageDataset     {"image": uint8 (3, H, W),            "label": int}   H, W uniform in [lo, hi]
                                                                     (channels-last views by default)
    PairDataset      {"single": float32 (N, C), "pair": float32 (N, N, Cp), "label": int}
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


def lognormal_lengths(n: int, lo: int, hi: int, mean: float, std: float, seed: int) -> list[int]:
    """``n`` lengths ``round(exp(N(mean, std)))`` clipped to ``[lo, hi]``."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.empty(n).log_normal_(mean=mean, std=std, generator=g)
    return raw.round().clamp(lo, hi).long().tolist()


def uniform_ints(n: int, lo: int, hi: int, seed: int, k: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (n, k), generator=g).tolist()


class _Pool(Dataset):
    """``length`` samples cycling over a pool of ``len(self.pool)`` distinct ones."""

    pool: list[dict]

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict:
        return self.pool[i % len(self.pool)]


class TokenDataset(_Pool):
    def __init__(self, length: int, *, lo: int = 1, hi: int = 2048, mean: float = 5.0, std: float = 1.0,
                 vocab: int = 32000, pool: int = 256, seed: int = 0) -> None:
        super().__init__(length)
        g = torch.Generator().manual_seed(seed)
        lens = lognormal_lengths(pool, lo, hi, mean, std, seed)
        self.pool = [
            {"input_ids": torch.randint(0, vocab, (n,), generator=g), "label": i % 2} for i, n in enumerate(lens)
        ]


class ImageDataset(_Pool):
    """``channels_last=True``: each image is a ``(3, H, W)`` view of an ``(H, W, 3)`` buffer, what
    decoders produce and the readers return; ``False``: contiguous ``(3, H, W)`` tensors."""

    def __init__(self, length: int, *, lo: int = 64, hi: int = 512, pool: int = 64, seed: int = 0,
                 channels_last: bool = True) -> None:
        super().__init__(length)
        g = torch.Generator().manual_seed(seed)
        hw = uniform_ints(pool, lo, hi, seed, k=2)
        self.pool = []
        for i, (h, w) in enumerate(hw):
            hwc = torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g)
            img = hwc.permute(2, 0, 1) if channels_last else hwc.permute(2, 0, 1).contiguous()
            self.pool.append({"image": img, "label": i % 10})


class PairDataset(_Pool):
    def __init__(self, length: int, *, lo: int = 24, hi: int = 256, c: int = 32, cp: int = 16,
                 pool: int = 32, seed: int = 0) -> None:
        super().__init__(length)
        g = torch.Generator().manual_seed(seed)
        ns = [n for (n,) in uniform_ints(pool, lo, hi, seed)]
        self.pool = [
            {"single": torch.randn(n, c, generator=g), "pair": torch.randn(n, n, cp, generator=g), "label": i % 2}
            for i, n in enumerate(ns)
        ]
