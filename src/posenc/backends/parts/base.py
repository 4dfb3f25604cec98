"""What every attention backend receives: q, k, v and a :class:`ScoreSpec`.

A backend computes ``softmax(q k^T * scale + bias + query_terms + mask) v + value_terms`` for
q (B, H, Tq, D), k and v (B, H, Tk, D), and returns (B, H, Tq, D). The spec says which score
terms the encoding contributes; backends ask it, never the encoding's name. ``ScoreSpec`` is
defined in :mod:`posenc.call.spec` and made by a call's :class:`~posenc.call.geometry.Geometry`.
"""

from __future__ import annotations

import torch

from ...call.spec import ScoreSpec


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


__all__ = ["ScoreSpec", "accumulation_dtype", "additive_mask", "needs_grad"]
