"""Selective attention (Leviathan, Kalman & Matias, 2024, "Selective Attention Improves
Transformer", arXiv 2410.02703, §3, eq. 1-3): a token can mask an earlier token from every token
after it.

One head's scores decide what each token selects (masks out of the future): with the scores
s_ij = q_i . k_j / sqrt(D) of that head (the paper's and x-transformers' head 0),

    S_ij = relu(s_ij), except S_ij = 0 for j = i (a token does not mask itself), for the first
           token j (it is never masked, the paper's <BOS>) and for keys after i        (eq. 1-2)
    F_ij = sum_{t < i} S_tj                      (the selection accumulated before query i)
    logit_ij = q_i . k_j / sqrt(D) - F_ij        for every head, then the causal softmax   (eq. 3)

No positions enter: the content decides what is masked, the order only through the causal mask (a
selective model is NoPE plus the selection, as the paper trains it; x-transformers' ``selective``
flag applies the same subtraction to whatever scores its attention has). The encoding offers the
:class:`~posenc.encodings.protocol.Selects` hook, ``selection_scores(q, k) -> (B, Tq, Tk)``, the
selecting head's scores; the backend turns them into S with the masks above: ``selective`` per
block of queries, carrying F's column sums from block to block (no (B, N, N) tensor), ``eager``
(the written-out reference, and the calls ``selective`` does not take: left padding, bfloat16)
once per call, an exclusive cumulative sum over the call's queries, then each block of queries
its rows of it. A KV cache keeps each key's sum of S over every query so far (``LayerCache.selected``),
so a decode step's F is that sum: cached decoding equals the full pass. Packed documents are calls
of their own, so the first token of each document is its own unmaskable first token. Memory: on ``eager``
one (B, N, N) tensor for the selecting head (F) per call, as the paper's and x-transformers' dense
form; on ``selective`` O(B H C N) per block of C queries.

Causal only: the paper and x-transformers define it for decoders (a bidirectional call would let a
token mask what earlier tokens see). No learned parameters.

Shape legend: B batch, H heads, Tq / Tk queries / keys, D head dim.
"""

from __future__ import annotations

import math

import torch

from ..errors import check_int
from .base import PositionalEncoding


class SelectiveAttention(PositionalEncoding):
    """NoPE plus selective attention: the selecting head's relu scores, summed over earlier
    queries, subtracted from every head's logits.

    Args:
        num_heads, head_dim, causal: as for every encoding (causal only).
        head: the head whose scores select (0, as the paper and x-transformers).

    Raises:
        UsageError: ``head`` outside [0, num_heads - 1]; ``causal=False``.
    """

    name = "selective"
    description = "selective attention: one head's relu scores, summed over earlier queries, masked from all heads (Leviathan et al. 2024)"
    extrapolates = True
    causal_only = True  # a token masks keys from the queries after it
    # The first key of a call is unmaskable (the paper's <BOS>): a row's first real token, so the
    # model's output does not change when a row's positions shift, but leave it to the generator
    # to decode rows of equal prompt length together (exact either way).
    shift_invariant = False

    def __init__(self, num_heads: int, head_dim: int, causal: bool = True, *, head: int = 0) -> None:
        super().__init__(num_heads, head_dim, causal)
        self.head = check_int("head", head, 0, num_heads - 1, " (the head whose scores select)")

    def selection_scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The selecting head's content scores q_h . k_h / sqrt(D): q (B, H, Tq, D), k (B, Hkv, Tk, D)
        -> (B, Tq, Tk) in logits (grouped heads: the key head of the query head ``head``)."""
        kv = self.head * k.shape[1] // q.shape[1]  # the key head serving query head `head`
        return torch.matmul(q[:, self.head], k[:, kv].transpose(-1, -2)) / math.sqrt(q.shape[-1])  # (B, Tq, Tk)


__all__ = ["SelectiveAttention"]
