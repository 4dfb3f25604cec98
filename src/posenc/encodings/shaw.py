"""Relative position representations (Shaw, Uszkoreit & Vaswani 2018, "Self-Attention with Relative
Position Representations", §3).

Two tables of 2k+1 learned vectors, a^K for keys and a^V for values, indexed by the relative
distance clipped to [-k, k]: index = clip(j - i, -k, k) + k. Scores become
``q_i . (k_j + a^K_ij) / sqrt(d)`` and outputs ``sum_j p_ij (v_j + a^V_ij)``. As in the paper, the
vectors are shared across heads and have the head dim.

The (Tq, Tk, d) tensor of a_ij is never built: q is multiplied with the 2k+1 key vectors once
(B, H, Tq, 2k+1) and the result gathered per pair, and probabilities are summed per clipped
distance before multiplying with the 2k+1 value vectors.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import check_positive
from .base import PositionalEncoding
from .protocol import ClipTables


class Shaw(PositionalEncoding):
    """Learned relative key and value vectors with clipped distance."""

    name = "shaw"
    description = "learned relative vectors on keys and values, clipped distance (Shaw et al. 2018)"
    extrapolates = True  # distances past k share the clipped vector
    shift_invariant = True  # positions enter as i - j only
    # not shared across layers (derived from its learned parameters): each layer learns its own tables, as in the paper

    def __init__(self, num_heads: int, head_dim: int, causal: bool = True, max_relative_position: int = 16) -> None:
        super().__init__(num_heads, head_dim, causal)
        self.max_relative_position = check_positive("max_relative_position", max_relative_position)
        size = 2 * self.max_relative_position + 1
        self.key_table = nn.Parameter(torch.randn(size, head_dim) * 0.02)  # (2k+1, D)
        self.value_table = nn.Parameter(torch.randn(size, head_dim) * 0.02)  # (2k+1, D)

    def index(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        """(Tq, Tk) table rows: clip(j - i, -k, k) + k."""
        k = self.max_relative_position
        return (k_positions[None, :] - q_positions[:, None]).clamp(-k, k) + k

    def query_terms(
        self, q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor
    ) -> torch.Tensor:
        index = self.index(q_positions, k_positions)  # (Tq, Tk)
        per_distance = torch.matmul(q, self.key_table.to(q.dtype).t())  # (B, H, Tq, 2k+1)
        b, h, tq, _ = per_distance.shape
        terms = per_distance.gather(-1, index.expand(b, h, tq, index.shape[-1]))  # (B, H, Tq, Tk)
        return terms * (1.0 / math.sqrt(self.head_dim))

    def value_terms(self, probs: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        index = self.index(q_positions, k_positions)  # (Tq, Tk)
        b, h, tq, tk = probs.shape
        size = self.value_table.shape[0]
        per_distance = probs.new_zeros(b, h, tq, size).scatter_add_(-1, index.expand(b, h, tq, tk), probs)  # (B, H, Tq, 2k+1)
        return torch.matmul(per_distance, self.value_table.to(probs.dtype))  # (B, H, Tq, D)

    def clipped_tables(self) -> ClipTables:
        """What ``query_terms`` and ``value_terms`` are made of, for fast backends.

        Returns :class:`~posenc.encodings.protocol.ClipTables` (clip k, key table (2k+1, D), value
        table (2k+1, D), scale): the pair (i, j) uses row clip(j - i, -k, k) + k, its score term is
        ``q_i . key_row * scale`` and its value term ``p_ij * value_row``. Every key farther than k on one side uses the same row, which lets a
        backend treat far keys as plain attention (backends/terms.py).
        """
        return ClipTables(self.max_relative_position, self.key_table, self.value_table, 1.0 / math.sqrt(self.head_dim))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, max_relative_position={self.max_relative_position}"
