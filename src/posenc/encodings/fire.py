"""FIRE: functional interpolation for relative positions (Li, Zaheer, Kumar et al. 2023,
"Functional Interpolation for Relative Positions Improves Long Context Transformers", ICLR 2024:
the FIRE bias with its progressive interpolation and log transform).

A learned function of the query-key distance, normalised by the query's position so that every
query sees distances in [0, 1] whatever the length (progressive interpolation), with a threshold L
below which the normaliser is fixed (short sequences are not stretched)::

    b_h(i, j) = f_h( psi(i - j) / psi(max(L, i)) ),    psi(x) = log(|c x| + 1)

f is an MLP 1 -> 32 -> H with a ReLU (``mlp_width``), c a learned scalar (initially 0.1), and
L = |L_mult * 512| with L_mult learned (initially 1; ``threshold`` sets the 512). The normaliser
gets a small eps (1e-6) added, as the published implementations do, so a query at position 0 with
c x = 0 does not divide by zero. i is the query's absolute position (0-based), so the bias depends
on i, not only on i - j: for queries below L it is a function of i - j alone, beyond L it is the
normalised form above (tests). FIRE is defined for decoders (``causal_only``).

Evaluation: a ReLU unit whose switch point x = -b1/w1 lies outside the range of x of a call is
either on for every pair (a linear function of x) or off for every pair (zero); :meth:`bias` keeps
the hidden units explicit only for the units that switch inside that range and folds the others
into one linear term, so f is two matrix products (of the units that switch, and of x): the same
function and gradients as the 32-wide layer (exactly; at initialisation about a quarter of the
units switch within [0, 1]), at a fraction of the work, with no scatter in its backward.
:meth:`mlp` is the plain layer, and :meth:`score` the elementwise form, for fused kernels.

The MLP's weights are plain parameters with ``nn.Linear``'s default initialisation (uniform in
+-1/sqrt(fan_in)), kept out of the model's GPT-2 style re-initialisation of linear layers, which
would start every head's bias near 0.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import UsageError, check_positive
from .base import PositionalEncoding, check_bias_positions

EPS = 1e-6


class FIRE(PositionalEncoding):
    """Learned MLP of the log distance, normalised by the log of the query position."""

    name = "fire"
    description = "learned MLP of the log distance normalised by the query position (Li et al. 2023)"
    extrapolates = True
    # not shared across layers (derived from its learned parameters): each layer learns its own f, c and L
    causal_only = True

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        causal: bool = True,
        mlp_width: int = 32,
        init_c: float = 0.1,
        threshold: float = 512.0,
    ) -> None:
        super().__init__(num_heads, head_dim, causal)
        self.mlp_width = check_positive("mlp_width", mlp_width)
        for name, value in (("init_c", init_c), ("threshold", threshold)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise UsageError(f"{name} must be a positive number, got {value!r}")
        self.threshold = float(threshold)
        bound = 1.0 / math.sqrt(mlp_width)
        self.w1 = nn.Parameter(torch.empty(mlp_width).uniform_(-1.0, 1.0))  # (W,) fan_in 1
        self.b1 = nn.Parameter(torch.empty(mlp_width).uniform_(-1.0, 1.0))  # (W,)
        self.w2 = nn.Parameter(torch.empty(num_heads, mlp_width).uniform_(-bound, bound))  # (H, W)
        self.b2 = nn.Parameter(torch.empty(num_heads).uniform_(-bound, bound))  # (H,)
        self.c = nn.Parameter(torch.tensor(float(init_c)))  # ()
        self.threshold_scale = nn.Parameter(torch.tensor(1.0))  # () L_mult

    def psi(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log1p(torch.abs(self.c * x))

    def normalizer(self, q_positions: torch.Tensor) -> torch.Tensor:
        """psi(max(L, i)) + eps per query: (Tq,) (any shape of positions)."""
        big_l = torch.abs(self.threshold_scale * self.threshold)
        i = q_positions.to(self.c.dtype)
        return self.psi(torch.maximum(i, big_l)) + EPS

    def normalized_distance(self, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """psi(i - j) / (psi(max(L, i)) + eps), elementwise over broadcastable positions."""
        return self.psi((i - j).to(self.c.dtype)) / self.normalizer(i)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """f(x): (...) -> (..., H)."""
        hidden = torch.relu(x[..., None] * self.w1 + self.b1)  # (..., W)
        return hidden @ self.w2.t() + self.b2  # (..., H)

    def score(self, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        # Elementwise (a fused kernel's score modifier): the MLP unrolled over its hidden units.
        x = self.normalized_distance(i, j)
        out = self.b2[h]
        for unit in range(self.mlp_width):
            out = out + self.w2[h, unit] * torch.relu(self.w1[unit] * x + self.b1[unit])
        return out

    def bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        check_bias_positions(self, q_positions, k_positions)
        x = self.normalized_distance(q_positions[:, None], k_positions[None, :])  # (Tq, Tk)
        flat = x.reshape(1, -1)  # (1, Tq * Tk)
        with torch.no_grad():  # which units switch within [min x, max x]; the others are fixed
            lo, hi = (flat.min(), flat.max()) if flat.numel() else (flat.new_zeros(()), flat.new_zeros(()))
            point = -self.b1 / torch.where(self.w1 == 0, torch.ones_like(self.w1), self.w1)
            switches = (self.w1 != 0) & (point > lo) & (point < hi)  # (W,)
            on = ~switches & ((lo + hi) / 2 * self.w1 + self.b1 > 0)  # on for every pair of the call
        w2_on = self.w2[:, on]  # (H, units on)
        slope, intercept = w2_on @ self.w1[on], w2_on @ self.b1[on] + self.b2  # (H,) each
        out = torch.addmm(intercept[:, None], slope[:, None], flat)  # (H, Tq * Tk): the units always on
        if bool(switches.any()):
            units = torch.addmm(self.b1[switches, None], self.w1[switches, None], flat).relu_()  # (K, Tq * Tk)
            out = out.addmm_(self.w2[:, switches], units)
        return out.view(-1, *x.shape)  # (H, Tq, Tk)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mlp_width={self.mlp_width}, threshold={self.threshold}"


__all__ = ["FIRE"]
