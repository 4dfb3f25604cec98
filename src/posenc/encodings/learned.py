"""Learned absolute positions (BERT, Devlin et al. 2019; GPT, Radford et al. 2018).

A table of ``max_positions`` learned vectors added to the token embeddings. It cannot encode a
position it has no row for, so a longer input is a user error, reported as such.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import UsageError, check_positive
from .base import PositionalEncoding


class Learned(PositionalEncoding):
    """A learned (max_positions, dim) table; positions past the table (or negative) raise UsageError."""

    name = "learned"
    description = "learned table of absolute position vectors (BERT/GPT); bounded by its size"
    shares_parameters = True  # one table, added to the token embeddings once
    extrapolates = False

    def __init__(self, num_heads: int, head_dim: int, causal: bool = True, max_positions: int = 1024) -> None:
        super().__init__(num_heads, head_dim, causal)
        self.rows = check_positive("max_positions", max_positions)
        self.max_positions = self.rows
        self.table = nn.Parameter(torch.randn(self.rows, self.dim) * 0.02)  # (P, dim)

    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: (B, T, dim), positions: (T,) shared or (B, T) per row (padded or packed rows)
        if torch.compiler.is_compiling():  # reading positions would break the graph; compiled indexing checks bounds
            return x + self.table[positions].to(x.dtype)
        needed = int(positions.max()) + 1 if positions.numel() else 0
        if positions.numel() and int(positions.min()) < 0:  # a negative index would wrap to the table's end
            raise UsageError(f"learned positions: positions must be >= 0, got {int(positions.min())}")
        if needed > self.rows:
            raise UsageError(
                f"learned positions: the table has max_positions={self.max_positions} rows, "
                f"but the input needs position {needed - 1} (length {needed}); "
                f"lengths up to {self.max_positions} are allowed"
            )
        return x + self.table[positions].to(x.dtype)
