"""Small models shared by examples, benchmarks and tests (one definition, one reference)."""

from __future__ import annotations

import torch.nn as nn


class TokenMLP(nn.Module):
    """A pre-LN residual MLP over the last dim: ``x + down(gelu(up(norm(x))))``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class SequenceClassifier(nn.Module):
    """A pre-LN Transformer encoder (``nn.TransformerEncoderLayer`` stack, GELU, FFN 4x, no
    dropout), a final LayerNorm, a mean over each sample's tokens and a linear head.

    ``forward(x)`` takes a NestedTensor ``(B, L_i, dim)``; ``forward(x, keep)`` a padded
    ``(B, L, dim)`` batch with ``keep`` ``(B, L)`` True at real tokens (the key padding mask, and
    the mean over real tokens). Both give ``(B, classes)`` logits, equal up to rounding.
    """

    def __init__(self, dim: int, heads: int, layers: int, classes: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu", batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x, keep=None):
        for layer in self.layers:
            x = layer(x) if keep is None else layer(x, src_key_padding_mask=~keep)
        x = self.norm(x)
        if keep is None:
            return self.head(x.mean(dim=1))
        k = keep[..., None].to(x.dtype)
        return self.head((x * k).sum(dim=1) / k.sum(dim=1))
