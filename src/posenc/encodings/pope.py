"""PoPE: polar coordinate position embeddings (Gopalakrishnan, Csordás, Schmidhuber & Mozer 2025,
"Decoupling the 'What' and 'Where' With Polar Coordinate Positional Embeddings", arXiv 2509.10534,
§3: the PoPE attention score, with its learned phase bias).

RoPE rotates pairs of features whose own angle comes from the content, so the content and the
position both move the angle a query and a key meet at. PoPE gives every one of the D features its
own complex number: the *magnitude* comes from the content, ``mu = softplus(x_c)`` (so it is > 0),
and the *phase* from the position alone, ``t theta_c`` with ``theta_c = base^(-c/D)``, c = 0..D-1
(one frequency per feature, not per pair). The score of query t and key s is the real part of
their Hermitian product::

    a_ts = sum_c mu(q_tc) mu(k_sc) cos((s - t) theta_c + delta_hc)                    (§3)

with ``delta`` (H, D) a learned phase bias per head and frequency, clamped to [-2 pi, 0] as in the
references. Written as real vectors, q and k each become 2D features, ``[mu cos(phi), mu sin(phi)]``,
and the ordinary dot product of the two is a_ts: the attention then runs q . k of width 2D against
values of width D (``rotate`` returns q and k of head size 2 D; the backends take values of another
width, as for DeepSeek's MLA). The content scale stays 1 / sqrt(D), D the head size of the
projections, as both references use.

Where the phase bias sits: the references add delta to the key's phase; here it is subtracted from
the query's (phase ``t theta - delta``), which gives the same cos((s - t) theta + delta) for every
pair, exactly: the keys then do not depend on the head, so grouped-query keys keep their Hkv heads
and the KV cache stores them rotated once. The score depends on s - t only (``shift_invariant``).

Precision: the angles ``t theta_c`` are float64 products of integer positions, their cos and sin
rounded once to the working dtype (float32, or float64 for float64 inputs); the magnitudes and the
products are computed in that dtype and cast back to the input's once (the references compute in
float32).

References compared in the tests: x-transformers' ``PolarEmbedding`` / ``apply_polar_pos_emb``
and the ``pope-pytorch`` package's ``PoPE`` / ``apply_pope_to_qk`` (tests/encodings/test_pope.py).

Shape legend: B batch, H query heads, Hkv key heads, T length, D head dim (of the projections).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UsageError
from .base import PositionalEncoding

BIAS_INITS = ("zeros", "uniform")
MIN_BIAS = -2.0 * math.pi  # the references clamp the phase bias to [-2 pi, 0]


class PoPE(PositionalEncoding):
    """Softplus magnitudes of the content, phases of the position alone, a learned phase bias per head."""

    name = "pope"
    description = "polar coordinates: softplus magnitudes, position-only phases, learned phase bias (Gopalakrishnan et al. 2025)"
    extrapolates = True
    shift_invariant = True  # the phases meet as (s - t) theta + delta: positions enter as differences only
    # not shared across layers (derived from its learned phase bias): each layer learns its own delta

    def __init__(self, num_heads: int, head_dim: int, causal: bool = True, base: float = 10000.0,
                 bias_init: str = "zeros") -> None:
        """
        Args:
            num_heads: query heads H (the phase bias has one row per head).
            head_dim: D, the head size of the projections; q and k leave ``rotate`` with 2 D features.
            causal: decoder (True) or encoder (False); the score is the same function either way.
            base: theta_c = base^(-c / D); a finite number > 1 (10000, as the references).
            bias_init: "zeros" (x-transformers' and pope-pytorch's default) or "uniform", U(-2 pi, 0)
                (their ``bias_uniform_init``).

        Raises:
            UsageError: ``base`` not a finite number > 1, or ``bias_init`` not one of BIAS_INITS.
        """
        super().__init__(num_heads, head_dim, causal)
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not math.isfinite(base) or base <= 1:
            raise UsageError(f"base must be a finite number > 1, got {base!r}")
        if bias_init not in BIAS_INITS:
            raise UsageError(f"bias_init must be one of {BIAS_INITS}, got {bias_init!r}")
        self.base, self.bias_init = float(base), bias_init
        phase_bias = torch.zeros(num_heads, head_dim)  # (H, D)
        if bias_init == "uniform":
            phase_bias.uniform_(MIN_BIAS, 0.0)
        self.phase_bias = nn.Parameter(phase_bias)

    def frequencies(self, device: torch.device | None = None) -> torch.Tensor:
        """theta_c = base^(-c / D), c = 0..D-1: float64 (D,)."""
        c = torch.arange(self.head_dim, dtype=torch.float64, device=device)
        return self.base ** (-c / self.head_dim)  # (D,)

    def delta(self) -> torch.Tensor:
        """The phase bias in use, clamped to [-2 pi, 0] as the references clamp it: (H, D). The
        gradient passes inside the closed range, its ends included, and stops outside it, on every
        torch (torch 2.15's clamp stops it at the ends too, which would freeze the zero init)."""
        b = self.phase_bias
        inside = (b >= MIN_BIAS) & (b <= 0.0)
        return torch.where(inside, b, b.detach().clamp(MIN_BIAS, 0.0))

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B, H, Tq, D), k (B, Hkv, Tk, D) -> q (B, H, Tq, 2 D), k (B, Hkv, Tk, 2 D), each
        ``[mu cos(phi), mu sin(phi)]`` with mu = softplus of the features and phi the phase: the
        key's ``s theta``, the query's ``t theta - delta_h``, so q . k = a_ts of the module docstring.

        Raises:
            UsageError: positions that are not 1-D integer tensors of the inputs' lengths, or inputs
                whose last dimension is not ``head_dim`` or whose heads do not fit.
        """
        self._check(q, k, q_positions, k_positions)
        work = torch.promote_types(q.dtype, torch.float32)
        theta = self.frequencies(q.device)  # (D,) float64
        q_angles = q_positions.to(torch.float64)[:, None] * theta  # (Tq, D)
        k_angles = k_positions.to(torch.float64)[:, None] * theta  # (Tk, D)
        delta = self.delta().to(work)[:, None, :]  # (H, 1, D)
        qc, qs = q_angles.cos().to(work), q_angles.sin().to(work)  # (Tq, D) each
        # cos and sin of (t theta - delta), by the angle-difference identities: the position's part
        # keeps its float64 angles, the bias enters in the working dtype (and gets its gradient).
        cos_d, sin_d = delta.cos(), delta.sin()  # (H, 1, D)
        q_cos, q_sin = qc * cos_d + qs * sin_d, qs * cos_d - qc * sin_d  # (H, Tq, D) each
        mq, mk = F.softplus(q.to(work)), F.softplus(k.to(work))  # magnitudes > 0
        kc, ks = k_angles.cos().to(work), k_angles.sin().to(work)  # (Tk, D) each
        q2 = torch.cat((mq * q_cos, mq * q_sin), dim=-1)  # (B, H, Tq, 2D)
        k2 = torch.cat((mk * kc, mk * ks), dim=-1)  # (B, Hkv, Tk, 2D)
        return q2.to(q.dtype), k2.to(k.dtype)

    def _check(self, q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor) -> None:
        for label, x in (("q", q), ("k", k)):
            if x.dim() != 4 or x.shape[-1] != self.head_dim:
                raise UsageError(f"pope.rotate: {label} must be (batch, heads, length, {self.head_dim}), got {tuple(x.shape)}")
        if q.shape[1] != self.num_heads:
            raise UsageError(f"pope.rotate: q must have num_heads={self.num_heads} heads, got {q.shape[1]}")
        if k.shape[1] < 1 or self.num_heads % k.shape[1]:
            raise UsageError(f"pope.rotate: k's heads ({k.shape[1]}) must divide num_heads ({self.num_heads})")
        for label, p, x in (("q_positions", q_positions, q), ("k_positions", k_positions, k)):
            if p.dim() != 1 or p.is_floating_point() or p.numel() != x.shape[-2]:
                raise UsageError(f"pope.rotate: {label} must be 1-D integer positions, one per token "
                                 f"({x.shape[-2]}), got {p.dtype} of shape {tuple(p.shape)}")

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, base={self.base:g}, bias_init={self.bias_init!r}"


__all__ = ["BIAS_INITS", "PoPE"]
