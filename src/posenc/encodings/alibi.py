"""ALiBi: attention with linear biases (Press et al. 2021, "Train Short, Test Long", §3).

No position embeddings at all: every score gets a penalty proportional to the query-key distance,
``-m_h * (i - j)`` for a causal decoder. Head slopes m_h are fixed, a geometric sequence: for n
heads (a power of two) it starts at 2^(-8/n) with that same ratio. For other head counts the paper's
code takes the slopes of the closest lower power of two, then every other slope of the next power
of two. A bidirectional encoder uses the symmetric ``-m_h * |i - j|``.
"""

from __future__ import annotations

import math

import torch

from ..errors import check_positive
from .base import PositionalEncoding, bias_from_score, relative_bias_from_score
from .protocol import BiasTails


def _geometric_slopes(n: int) -> list[float]:
    # n is a power of two: start = ratio = 2^(-8/n)
    start = 2.0 ** (-8.0 / n)
    return [start ** (k + 1) for k in range(n)]


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """Head slopes m_h, (num_heads,) float32, as defined by the ALiBi paper's official code."""
    check_positive("num_heads", num_heads)
    lower = 2 ** math.floor(math.log2(num_heads))
    slopes = _geometric_slopes(lower)
    if lower != num_heads:
        # Not a power of two: fill with every other slope of the next power of two.
        slopes += _geometric_slopes(2 * lower)[0::2][: num_heads - lower]
    return torch.tensor(slopes, dtype=torch.float32)


class ALiBi(PositionalEncoding):
    """Fixed linear distance penalty per head; no parameters; extrapolates by construction."""

    name = "alibi"
    description = "fixed per-head linear distance penalty on scores (Press et al. 2021)"
    extrapolates = True
    shift_invariant = True  # positions enter as i - j only

    slopes: torch.Tensor  # (H,) m_h, a buffer

    def __init__(self, num_heads: int, head_dim: int, causal: bool = True) -> None:
        super().__init__(num_heads, head_dim, causal)
        # A buffer, so it follows .to(device); not saved: it is a pure function of num_heads.
        self.register_buffer("slopes", alibi_slopes(num_heads), persistent=False)  # (H,)

    def score(self, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        distance = (i - j).to(self.slopes.dtype)
        if not self.causal:
            distance = distance.abs()
        return -self.slopes[h] * distance

    def bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        return bias_from_score(self, q_positions, k_positions)  # (H, Tq, Tk)

    # Capabilities for the fast backends (see PositionalEncoding): the bias depends on r = j - i
    # alone and is linear in r on each side, so once the per-query constant is dropped it is a
    # per-key term, m_h * j, and the far keys need no (H, N, N) bias at all.
    def relative_bias(self, relative: torch.Tensor) -> torch.Tensor:
        return relative_bias_from_score(self, relative)  # (H, *r.shape)

    def bias_tails(self) -> BiasTails:
        # Causal: f(r) = m r for every r (the future is masked anyway); encoder: -m |r|.
        return BiasTails(past=0, past_slope=self.slopes, future=0, future_slope=self.slopes if self.causal else -self.slopes)
