"""CoPE: contextual position encoding (Golovneva, Wang, Weston & Sukhbaatar 2024, "Contextual
Position Encoding: Learning to Count What's Important": its gate, position and interpolation
equations).

Positions are counted by the content, not by tokens. Each query decides, with a gate per key, which
keys count; the position of key j seen from query i is the number of counted keys from j to i::

    g_ij = sigmoid(q_i . k_j / sqrt(d))            (0 for keys after the query)
    p_ij = min(sum_{t=j..i} g_it, max_pos - 1)     (fractional)
    term_ij = (1 - w) z_i[floor p_ij] + w z_i[ceil p_ij],   w = p_ij - floor p_ij
    z_i[p] = q_i . e[p]                            (e: max_pos learned vectors of the head dim)

and ``term_ij`` is added to the attention logits. The vectors e[p] are shared by the heads of a
layer, one table per layer, zero-initialised (the authors' code and x-transformers). Positions are
capped at ``max_pos - 1``: every key farther than that many counted keys shares e[max_pos - 1].

Two scalings exist: x-transformers' ``CoPE`` adds q.e[p] as is, while the authors' code, by
default, divides the position logits by sqrt(d) too, like the content logits.
``scale_positions=False`` (the default) is x-transformers'; ``scale_positions=True`` the authors'
default. The gates always use
q.k / sqrt(d), the attention's own logits.

CoPE is defined for decoders (the count runs from the key to the query): ``causal_only``. The term
depends on q and k, so it is a ``query_terms`` hook; the ``contextual`` backend runs it without any
(B, H, N, N) tensor (:meth:`contextual_positions`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import UsageError, check_positive
from .base import PositionalEncoding
from .protocol import ContextualForm


class CoPE(PositionalEncoding):
    """Positions counted by sigmoid gates on q.k; logits q.e[p] interpolated between integers."""

    name = "cope"
    description = "contextual positions: counts of gated keys, interpolated position logits (Golovneva et al. 2024)"
    extrapolates = True
    # not shared across layers (derived from its learned parameters): one table per layer
    causal_only = True

    def __init__(
        self, num_heads: int, head_dim: int, causal: bool = True, max_pos: int = 16, scale_positions: bool = False
    ) -> None:
        super().__init__(num_heads, head_dim, causal)
        self.max_pos = check_positive("max_pos", max_pos)
        if not isinstance(scale_positions, bool):
            raise UsageError(f"scale_positions must be True or False, got {scale_positions!r}")
        self.scale_positions = scale_positions
        self.pos_emb = nn.Parameter(torch.zeros(max_pos, head_dim))  # (P, D) e[p], zero as the authors

    def contextual_positions(self) -> ContextualForm:
        """Capability for fast backends: :class:`~posenc.encodings.protocol.ContextualForm` (table
        e (P, D), gate scale, position-logit scale).

        g_ij = sigmoid(q_i . k_j * gate_scale); z_i[p] = q_i . e[p] * logit_scale; the term is
        z_i interpolated at min(sum_{t=j..i} g_it, P - 1).
        """
        gate_scale = 1.0 / math.sqrt(self.head_dim)
        return ContextualForm(self.pos_emb, gate_scale, gate_scale if self.scale_positions else 1.0)

    def query_terms(self, q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        form = self.contextual_positions()
        table, gate_scale, logit_scale = form.table, form.gate_scale, form.logit_scale
        gates = torch.sigmoid(torch.matmul(q, k.transpose(-1, -2)) * gate_scale)  # (B, H, Tq, Tk)
        future = k_positions[None, :] > q_positions[:, None]  # (Tq, Tk)
        gates = gates.masked_fill(future, 0.0)
        # p_ij = sum over t >= j of g_it (the future's gates are 0): a cumulative sum from the right.
        positions = gates.flip(-1).cumsum(-1).flip(-1).clamp(max=self.max_pos - 1)  # (B, H, Tq, Tk)
        logits = torch.matmul(q, table.to(q.dtype).t()) * logit_scale  # (B, H, Tq, P)
        floor = positions.floor()
        w = positions - floor
        below = logits.gather(-1, floor.long())
        above = logits.gather(-1, positions.ceil().long())
        return below * (1 - w) + above * w  # (B, H, Tq, Tk)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, max_pos={self.max_pos}, scale_positions={self.scale_positions}"


__all__ = ["CoPE"]
