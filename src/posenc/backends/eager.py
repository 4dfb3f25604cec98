"""The textbook formula: the reference for tests, and the path for methods that move values."""

from __future__ import annotations

import torch

from .base import ScoreSpec


def supports(spec: ScoreSpec, q: torch.Tensor) -> bool:
    return True


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec) -> torch.Tensor:
    enc = spec.encoding
    scores = torch.matmul(q, k.transpose(-1, -2)) * spec.scale  # (B, H, Tq, Tk)
    if spec.has_bias:
        scores = scores + spec.bias().to(scores.dtype)
    if spec.has_query_terms:
        scores = scores + enc.query_terms(q, k, spec.q_positions, spec.k_positions).to(scores.dtype)
    allowed = spec.allowed()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)  # (B, H, Tq, Tk)
    out = torch.matmul(probs, v)  # (B, H, Tq, D)
    if spec.has_value_terms:
        out = out + enc.value_terms(probs, spec.q_positions, spec.k_positions).to(out.dtype)
    return out
