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
