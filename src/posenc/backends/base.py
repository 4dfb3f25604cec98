"""What every attention backend receives: q, k, v and a :class:`ScoreSpec`.

A backend computes ``softmax(q k^T * scale + bias + query_terms + mask) v + value_terms`` for
q (B, H, Tq, D), k and v (B, H, Tk, D), and returns (B, H, Tq, D). The spec says which score
terms the encoding contributes; backends ask it, never the encoding's name.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..encodings.protocol import Biases, QueryTerms, Scores, ValueTerms, offers
from ..memo import ForwardMemo

if TYPE_CHECKING:
    from .single import Workspace


@dataclass
class ScoreSpec:
    """Everything besides q, k, v that defines the attention scores of one call."""

    encoding: nn.Module
    q_positions: torch.Tensor  # (Tq,) absolute positions of the queries
    k_positions: torch.Tensor  # (Tk,) absolute positions of the keys
    causal: bool
    scale: float
    # What this model forward computes once for all its layers (a fresh one for a lone call).
    memo: ForwardMemo = field(default_factory=ForwardMemo, repr=False)
    # Positions step by one (the usual case). Randomized positions skip values: then only backends
    # that read every position (eager, sdpa with a dense bias) may run the call.
    consecutive: bool = True
    # Left padding (generation in batches): row b's real tokens start at position starts[b] (B,);
    # keys before it are hidden from the row's real queries. A padding query sees the padding
    # before it (so no softmax row is empty); its output is never used. None: no padding.
    starts: torch.Tensor | None = None
    # Buffers kept between decode steps by the KV cache (see backends/single.py); None for a lone call.
    workspace: Workspace | None = field(default=None, repr=False)

    # What the encoding offers, asked once per spec (a decode step asks each several times).
    @functools.cached_property
    def has_bias(self) -> bool:
        return offers(self.encoding, Biases)

    @functools.cached_property
    def has_query_terms(self) -> bool:
        return offers(self.encoding, QueryTerms)

    @functools.cached_property
    def has_value_terms(self) -> bool:
        return offers(self.encoding, ValueTerms)

    @functools.cached_property
    def has_score_mod(self) -> bool:
        return offers(self.encoding, Scores)

    @property
    def plain(self) -> bool:
        """No score terms at all: content attention plus (maybe) the causal mask."""
        return not (self.has_bias or self.has_query_terms or self.has_value_terms)

    @property
    def aligned(self) -> bool:
        """Queries are the last Tq of the keys, position for position (a full pass, or decoding
        after a KV cache): positions are consecutive, so the ends decide."""
        tq, tk = self.q_positions.numel(), self.k_positions.numel()
        if tq == 0 or tq > tk:
            return tq == 0
        return bool(self.q_positions[0] == self.k_positions[tk - tq]) and bool(self.q_positions[-1] == self.k_positions[-1])

    def bias(self, q_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Dense (H, Tq, Tk) bias for these (or the given) queries; the whole call's is memoised
        per forward for encodings shared across layers."""
        if q_positions is None or q_positions is self.q_positions:
            return self.memo.dense_bias(self.encoding, self.q_positions, self.k_positions)
        return self.encoding.bias(q_positions, self.k_positions)

    def allowed(self, q_positions: torch.Tensor | None = None) -> torch.Tensor | None:
        """(Tq, Tk) bool, True where a query may see a key; None when every pair is allowed."""
        if not self.causal:
            return None
        q_positions = self.q_positions if q_positions is None else q_positions
        return self.k_positions[None, :] <= q_positions[:, None]

    def hidden(self, q_positions: torch.Tensor | None = None) -> torch.Tensor | None:
        """(B, 1, Tq, Tk) bool, True where left padding hides a key from a query (a padding key,
        a real query); None without padding."""
        if self.starts is None:
            return None
        q_positions = self.q_positions if q_positions is None else q_positions
        starts = self.starts[:, None, None, None]  # (B, 1, 1, 1)
        return (self.k_positions[None, None, None, :] < starts) & (q_positions[None, None, :, None] >= starts)


def additive_mask(allowed: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Bool (Tq, Tk) -> additive float mask: 0 where allowed, -inf elsewhere."""
    if allowed is None:
        return None
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores, log-sum-exps and merges: float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def needs_grad(spec: ScoreSpec, *tensors: torch.Tensor) -> bool:
    """A backward will follow: grad mode is on and an input or an encoding parameter needs it."""
    return torch.is_grad_enabled() and (
        any(t.requires_grad for t in tensors) or any(p.requires_grad for p in spec.encoding.parameters())
    )
