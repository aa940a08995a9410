"""Test and benchmark builders for sparse features, and the padded reference pooling.

Shared by ``tests/jagged`` and ``benchmarks/jagged.py`` so both use one reference
(they belong in ``padless/testing`` once that package takes them).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence


def random_sparse_samples(
    batch: int,
    keys: Sequence[str],
    *,
    max_len: int = 20,
    num_embeddings: int = 1000,
    empty_prob: float = 0.1,
    weighted: bool = False,
    seed: int = 0,
) -> list[dict[str, list[int] | tuple[list[int], list[float]]]]:
    """Per-sample ``{feature: ids}`` dicts (python lists, as a dataset yields them); a
    feature is left out of a sample with probability ``empty_prob``; lengths are long-tailed."""
    g = torch.Generator().manual_seed(seed)
    out: list[dict[str, list[int] | tuple[list[int], list[float]]]] = []
    for _ in range(batch):
        s: dict[str, list[int] | tuple[list[int], list[float]]] = {}
        for k in keys:
            if float(torch.rand((), generator=g)) < empty_prob:
                continue
            n = min(max_len, int(torch.empty(()).exponential_(generator=g) * max_len / 3))
            ids = torch.randint(0, num_embeddings, (n,), generator=g).tolist()
            s[k] = (ids, torch.rand(n, generator=g).tolist()) if weighted else ids
        out.append(s)
    return out


def pad_sparse(
    samples: Sequence[Mapping[str, object]], keys: Sequence[str], pad_id: int = 0
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The padded baseline's collation (unweighted features), as usually written: per key,
    ``pad_sequence`` of the samples' ids into ``(B, L_max)`` with ``pad_id``, and a boolean
    mask of real ids."""
    ids: dict[str, Tensor] = {}
    masks: dict[str, Tensor] = {}
    for k in keys:
        rows = [torch.as_tensor(s.get(k, []), dtype=torch.int64) for s in samples]  # type: ignore[arg-type]
        lengths = torch.tensor([r.numel() for r in rows], dtype=torch.int64)
        t = pad_sequence(rows, batch_first=True, padding_value=pad_id) if rows else torch.zeros(0, 0, dtype=torch.int64)
        ids[k] = t
        masks[k] = torch.arange(t.shape[1])[None, :] < lengths[:, None]
    return ids, masks


def padded_pool(ids: Tensor, mask: Tensor, table: Tensor, mode: str = "sum", weights: Tensor | None = None) -> Tensor:
    """The naive twin of ``embedding_bag``: embed padded ids ``(B, L)``, mask, reduce over L.
    Empty rows pool to zeros (as ``F.embedding_bag`` does)."""
    e = F.embedding(ids, table)  # (B, L, D)
    m = mask.unsqueeze(-1).to(e.dtype)
    if weights is not None:
        m = m * weights.unsqueeze(-1)
    if mode == "sum":
        return (e * m).sum(1)
    if mode == "mean":
        return (e * m).sum(1) / mask.sum(1, keepdim=True).clamp(min=1).to(e.dtype)
    if mode == "max":
        out = e.masked_fill(~mask.unsqueeze(-1), float("-inf")).amax(1) if e.shape[1] else e.new_zeros(e.shape[0], e.shape[2])
        return torch.where(mask.any(1, keepdim=True), out, torch.zeros_like(out))
    raise ValueError(f"padded_pool: unknown mode {mode!r}")
