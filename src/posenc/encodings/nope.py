"""NoPE: no positional encoding at all, the baseline.

A causal decoder can still infer order from the mask (Haviv et al. 2022, "Transformer Language
Models without Positional Encodings Still Learn Positional Information"); a bidirectional encoder
without positions is permutation-invariant.
"""

from __future__ import annotations

from .base import PositionalEncoding


class NoPE(PositionalEncoding):
    """No hooks: the attention is plain content attention."""

    name = "nope"
    description = "no positional information (baseline; order only through the causal mask)"
    extrapolates = True
    shift_invariant = True  # no positions at all
