"""Sinusoidal absolute positions (Vaswani et al. 2017, "Attention Is All You Need", §3.5).

PE[pos, 2i] = sin(pos / 10000^(2i/dim)), PE[pos, 2i+1] = cos(pos / 10000^(2i/dim)), added to the
token embeddings. Defined for any position, but a model trained on short inputs has never seen the
larger positions (Press et al. 2021 show its perplexity exploding past the training length).

As in the paper (§3.4), the token embeddings are multiplied by sqrt(dim) before the table is
added: with the usual small embedding init (std 0.02) the unit-amplitude table would otherwise
swamp the content, and a small model trains far worse than with no positions at all.
"""

from __future__ import annotations

import math

import torch

from ..errors import UsageError
from .base import PositionalEncoding


def sinusoidal_table(positions: torch.Tensor, dim: int, base: float = 10000.0) -> torch.Tensor:
    """(..., dim) float32 table for integer ``positions`` of any shape, e.g. (T,) or (B, T) (each
    row its own positions); interleaved sin/cos as in the paper."""
    if dim % 2:
        raise UsageError(f"the sinusoidal table needs an even dim, got {dim}")
    # Angles in float32 from integer positions: exact for positions below 2^24.
    inv_freq = torch.exp(
        torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) * (-math.log(base) / dim)
    )  # (dim/2,)
    angles = positions.to(torch.float32)[..., None] * inv_freq  # (..., dim/2)
    table = torch.stack((angles.sin(), angles.cos()), dim=-1)  # (..., dim/2, 2)
    return table.flatten(-2)  # (..., dim)


class Sinusoidal(PositionalEncoding):
    """Adds the fixed sinusoidal table to the token embeddings; no parameters."""

    name = "sinusoidal"
    description = "fixed sin/cos table added to token embeddings (Vaswani et al. 2017)"
    extrapolates = True  # defined at any length, though quality collapses past training

    def __init__(
        self, num_heads: int, head_dim: int, causal: bool = True, base: float = 10000.0, scale_embeddings: bool = True
    ) -> None:
        super().__init__(num_heads, head_dim, causal)
        if self.dim % 2:
            raise UsageError(f"sinusoidal needs an even model dim (num_heads * head_dim), got {self.dim}")
        if base <= 1:
            raise UsageError(f"base must be > 1, got {base}")
        self.base = float(base)
        self.scale_embeddings = bool(scale_embeddings)

    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: (B, T, dim), positions: (T,) shared or (B, T) per row (left-padded generation)
        if self.scale_embeddings:
            x = x * math.sqrt(self.dim)
        return x + sinusoidal_table(positions, self.dim, self.base).to(x.dtype)
