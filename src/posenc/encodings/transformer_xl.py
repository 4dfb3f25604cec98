"""Transformer-XL relative positions (Dai et al. 2019, "Transformer-XL", §3.3).

The score of query i and key j is the sum of four terms,

    (a) q_i . k_j       content          (b) q_i . W_R R_{i-j}   content-dependent position
    (c) u . k_j         global content   (d) v . W_R R_{i-j}     global position

where R is the sinusoidal table of the distance i - j, W_R a key projection for positions separate
from the content one, and u, v learned per head. The attention computes (a); this module returns
``((c) + (b) + (d)) / sqrt(d)``. (b) + (d) is computed once per *distance*, (B, H, Tq, Tq + Tk - 1),
and moved into place with the relative-shift trick (pad one column, reinterpret the rows) instead of
materialising a projected vector per (i, j) pair.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import PositionalEncoding
from .protocol import DistanceKeyForm
from .sinusoidal import sinusoidal_table


def relative_shift(per_distance: torch.Tensor, key_length: int) -> torch.Tensor:
    """Move per-distance scores into (query, key) layout.

    ``per_distance`` (..., Tq, L) with L = Tq + Tk - 1 holds, in column m, the score for the
    distance ``i - j = max_distance - m`` (descending), where the last query is at distance
    ``max_distance`` from the first key. Returns (..., Tq, Tk) with entry [a, c] = per_distance[a,
    c + Tq - 1 - a]: each row shifted left by its distance from the last row, done with one pad and
    views (Dai et al. 2019, appendix B).
    """
    *lead, tq, length = per_distance.shape
    padded = F.pad(per_distance, (0, 1))  # (..., Tq, L + 1)
    flat = padded.reshape(*lead, tq * (length + 1))
    shifted = flat[..., tq - 1 : tq - 1 + tq * length].reshape(*lead, tq, length)
    return shifted[..., :key_length]  # (..., Tq, Tk)


class TransformerXL(PositionalEncoding):
    """Sinusoidal R of i - j, a separate position key projection, global biases u and v."""

    name = "transformer_xl"
    description = "sinusoidal relative R, position key projection, global biases u, v (Dai et al. 2019)"
    extrapolates = True
    shift_invariant = True  # positions enter as i - j only
    # not shared across layers (derived from its learned parameters): W_R and u, v per layer

    def __init__(self, num_heads: int, head_dim: int, causal: bool = True) -> None:
        super().__init__(num_heads, head_dim, causal)
        self.position_key = nn.Linear(self.dim, self.dim, bias=False)  # W_R: R (dim) -> H x D
        nn.init.normal_(self.position_key.weight, std=0.02)
        self.u = nn.Parameter(torch.randn(num_heads, head_dim) * 0.02)  # (H, D) global content bias
        self.v = nn.Parameter(torch.randn(num_heads, head_dim) * 0.02)  # (H, D) global position bias

    def position_keys(self, distances: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """W_R R_d for integer ``distances`` (L,): (H, L, D)."""
        table = sinusoidal_table(distances, self.dim).to(dtype)  # (L, dim)
        keys: torch.Tensor = self.position_key(table.to(self.position_key.weight.dtype)).to(dtype)  # (L, H*D)
        return keys.view(-1, self.num_heads, self.head_dim).transpose(0, 1)  # (H, L, D)

    def distance_key_form(self) -> DistanceKeyForm:
        """What ``query_terms`` is made of, for fast backends: :class:`~posenc.encodings.protocol.DistanceKeyForm`
        (u (H, D), v (H, D), scale) with

            query_terms[i, j] = ((q_i + v) . position_keys(i - j)[h] + u . k_j) * scale.

        The position term depends on i - j alone, through one key per distance, so a backend can
        score query blocks against the distances instead of the pairs (backends/terms.py).
        """
        return DistanceKeyForm(self.u, self.v, 1.0 / math.sqrt(self.head_dim))

    def query_terms(
        self, q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor
    ) -> torch.Tensor:
        tq, tk = q.shape[-2], k.shape[-2]
        # Distances i - j from the largest (last query, first key) down to the smallest.
        largest = q_positions[-1] - k_positions[0]
        consecutive = int(q_positions[-1] - q_positions[0]) == tq - 1 and int(k_positions[-1] - k_positions[0]) == tk - 1
        span = tq + tk - 1 if consecutive else int(largest - (q_positions[0] - k_positions[-1])) + 1
        distances = largest - torch.arange(span, device=q.device)  # (L,)
        keys = self.position_keys(distances, q.dtype)  # (H, L, D)
        per_distance = torch.matmul(q + self.v.to(q.dtype)[:, None, :], keys.transpose(-1, -2))  # (B, H, Tq, L)
        if consecutive:
            position = relative_shift(per_distance, tk)  # (B, H, Tq, Tk): (b) + (d)
        else:  # positions that skip values (randomized): gather each pair's distance column
            column = largest - (q_positions[:, None] - k_positions[None, :])  # (Tq, Tk)
            position = per_distance.gather(-1, column.expand(*per_distance.shape[:2], tq, tk))
        content = torch.matmul(k, self.u.to(k.dtype)[:, :, None]).transpose(-1, -2)  # (B, H, 1, Tk): (c)
        return (position + content) * (1.0 / math.sqrt(self.head_dim))
