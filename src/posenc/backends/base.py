"""What every attention backend receives: q, k, v and a :class:`ScoreSpec`.

A backend computes ``softmax(q k^T * scale + bias + query_terms + mask) v + value_terms`` for
q (B, H, Tq, D), k and v (B, H, Tk, D), and returns (B, H, Tq, D). The spec says which score
terms the encoding contributes; backends ask it, never the encoding's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..encodings.base import has_hook


@dataclass
class ScoreSpec:
    """Everything besides q, k, v that defines the attention scores of one call."""

    encoding: nn.Module
    q_positions: torch.Tensor  # (Tq,) absolute positions of the queries
    k_positions: torch.Tensor  # (Tk,) absolute positions of the keys
    causal: bool
    scale: float
    # Per-forward memo shared by all layers (for encodings with shares_across_layers).
    shared: dict | None = field(default=None, repr=False)

    @property
    def has_bias(self) -> bool:
        return has_hook(self.encoding, "bias")

    @property
    def has_query_terms(self) -> bool:
        return has_hook(self.encoding, "query_terms")

    @property
    def has_value_terms(self) -> bool:
        return has_hook(self.encoding, "value_terms")

    @property
    def has_score_mod(self) -> bool:
        return has_hook(self.encoding, "score")

    @property
    def plain(self) -> bool:
        """No score terms at all: content attention plus (maybe) the causal mask."""
        return not (self.has_bias or self.has_query_terms or self.has_value_terms)

    @property
    def aligned(self) -> bool:
        """Queries are the last Tq of the keys (full pass, or decoding after a cache)."""
        tq, tk = self.q_positions.numel(), self.k_positions.numel()
        return tq <= tk

    def bias(self, q_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Dense (H, Tq, Tk) bias for these (or the given) queries; memoised per forward."""
        q_positions = self.q_positions if q_positions is None else q_positions
        if self.shared is not None and getattr(self.encoding, "shares_across_layers", False) and q_positions is self.q_positions:
            key = ("bias", id(self.encoding))
            if key not in self.shared:
                self.shared[key] = self.encoding.bias(q_positions, self.k_positions)
            return self.shared[key]
        return self.encoding.bias(q_positions, self.k_positions)

    def allowed(self, q_positions: torch.Tensor | None = None) -> torch.Tensor | None:
        """(Tq, Tk) bool, True where a query may see a key; None when every pair is allowed."""
        if not self.causal:
            return None
        q_positions = self.q_positions if q_positions is None else q_positions
        return self.k_positions[None, :] <= q_positions[:, None]


def additive_mask(allowed: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Bool (Tq, Tk) -> additive float mask: 0 where allowed, -inf elsewhere."""
    if allowed is None:
        return None
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
