"""Sandwich (Chi, Fan, Rudnicky & Ramadge 2023, "Dissecting Transformer Length Extrapolation via
the Lens of Receptive Field Analysis", ACL 2023: the Sandwich equation).

A parameter-free bias: the inner product of the sinusoidal position embeddings of the query and
the key (Vaswani et al. 2017, with d' features), minus its value at distance 0 so that it is 0 on
the diagonal and negative elsewhere, shrunk per head::

    b_h(i, j) = ( sum_{k=1..d'/2} cos((i - j) w_k)  -  d'/2 ) / s_h,    w_k = 10000 ** (-2k / d')

(k runs from 1, as in the paper's equation and NeMo's implementation; ``p_i . p_j`` of the
sinusoidal table is exactly that sum, since cos a cos b + sin a sin b = cos(a - b)). The paper
divides by a factor that grows with the head index; the schedule used here, s_h = 8 h / H
for h = 1..H (head 1 most local, head H least: 8/H .. 8), is the one of NVIDIA NeMo's Sandwich
implementation (``SandwichRelativePositionEmbedding``). It is linear in h where ALiBi's slopes are
geometric. The bias is symmetric in i - j, so the same formula serves decoders and encoders.

d' (``sinusoid_dim``): NeMo sets d' to the model's hidden size; here the default is 16 (8
frequencies), for speed: the bias is exactly low-rank, ``b = qf . kf - d'/(2 s_h)`` with
``qf_i = [cos(i w_k), sin(i w_k)]_k / s_h`` and ``kf_j = [cos(j w_k), sin(j w_k)]_k``
(:meth:`bias_features`), so the ``features`` backend runs it as plain SDPA with d' extra features
on q and k, and every extra feature costs time (q, k and v grow together). The per-query constant
-d'/(2 s_h) is dropped there: a softmax does not see it.

Angles are computed in float64 (i w_k reaches thousands of radians, where float32 would lose
~1e-4), then rounded to the bias's dtype.
"""

from __future__ import annotations

import torch

from ..errors import UsageError, check_positive
from .base import PositionalEncoding, bias_from_score, relative_bias_from_score

BASE = 10000.0


class Sandwich(PositionalEncoding):
    """Parameter-free bias: the dot product of sinusoidal position vectors, shrunk per head."""

    name = "sandwich"
    shift_invariant = True  # positions enter as i - j only
    description = "parameter-free bias from the dot product of sinusoidal positions (Chi et al. 2023)"
    extrapolates = True

    head_scale: torch.Tensor  # (H,) 1 / s_h, a buffer

    def __init__(self, num_heads: int, head_dim: int, causal: bool = True, sinusoid_dim: int = 16) -> None:
        super().__init__(num_heads, head_dim, causal)
        check_positive("sinusoid_dim", sinusoid_dim)
        if sinusoid_dim % 2:
            raise UsageError(f"sinusoid_dim must be an even positive integer (cos and sin per frequency), got {sinusoid_dim}")
        self.sinusoid_dim = sinusoid_dim
        # 1 / s_h; a buffer, so it follows .to(dtype/device) and sets the bias's dtype (the values
        # used are recomputed in float64). Not saved: a pure function of num_heads.
        self.register_buffer("head_scale", self.head_scales(torch.device("cpu")).float(), persistent=False)  # (H,)

    def head_scales(self, device: torch.device) -> torch.Tensor:
        """1 / s_h = H / (8 h) for h = 1..H, float64: (H,)."""
        return self.num_heads / (8.0 * torch.arange(1, self.num_heads + 1, dtype=torch.float64, device=device))

    def frequencies(self, device: torch.device) -> torch.Tensor:
        """w_k = 10000^(-2k/d') for k = 1..d'/2, float64: (d'/2,)."""
        k = torch.arange(1, self.sinusoid_dim // 2 + 1, dtype=torch.float64, device=device)
        return BASE ** (-2.0 * k / self.sinusoid_dim)

    def score(self, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        # Elementwise only (no new tensors but from the inputs), so a fused kernel can run it.
        distance = (i - j).to(torch.float64)
        total = torch.full_like(distance, -self.sinusoid_dim / 2)
        for k in range(1, self.sinusoid_dim // 2 + 1):
            total = total + torch.cos(distance * BASE ** (-2.0 * k / self.sinusoid_dim))
        scale = self.num_heads / (8.0 * (h + 1).to(torch.float64))  # 1 / s_h
        return (total * scale).to(self.head_scale.dtype)

    def bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        return bias_from_score(self, q_positions, k_positions)  # (H, Tq, Tk)

    def relative_bias(self, relative: torch.Tensor) -> torch.Tensor:
        return relative_bias_from_score(self, relative)  # (H, *r.shape)

    # Capability: the exactly low-rank form (see the module docstring).
    def bias_features(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(qf (H, Tq, d'), kf (H, Tk, d')) with ``qf @ kf^T = bias + d' / (2 s_h)``."""
        w = self.frequencies(q_positions.device)  # (d'/2,)
        dtype = self.head_scale.dtype

        def table(positions: torch.Tensor) -> torch.Tensor:
            angles = positions.to(torch.float64)[:, None] * w  # (T, d'/2)
            return torch.cat((torch.cos(angles), torch.sin(angles)), -1)  # (T, d') float64

        qf = table(q_positions)[None] * self.head_scales(q_positions.device)[:, None, None]  # (H, Tq, d')
        kf = table(k_positions)[None].expand(self.num_heads, -1, -1)  # (H, Tk, d')
        return qf.to(dtype), kf.to(dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, sinusoid_dim={self.sinusoid_dim}"


__all__ = ["Sandwich"]
