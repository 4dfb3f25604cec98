"""KERPLE: kernelized relative positional embedding (Chi, Fan, Ramadge & Rudnicky 2022, "KERPLE:
Kernelized Relative Positional Embedding for Length Extrapolation", NeurIPS 2022: the log and
power variants of its bias).

A conditionally positive definite kernel of the distance |i - j|, with two learned parameters per
head, added to the scores (after the 1/sqrt(d) scaling of q.k, as the authors' code does):

- ``variant="log"`` (the paper's best):  ``b_h(i, j) = -r1_h * log(1 + r2_h * |i - j|)``;
- ``variant="power"``:                   ``b_h(i, j) = -r1_h * |i - j| ** r2_h``, 0 < r2_h <= 2.

Power with r2 = 1 and r1 = ALiBi's slopes is ALiBi (tests). A decoder masks the future, so only
i - j >= 0 matters there; an encoder uses the symmetric |i - j|.

Parameters: r1, r2 (H,) each, shared by every layer (``shares_parameters``), initialised
uniformly as in the authors' code, r1 ~ U(0, 1) and r2 ~ U(0, 2). The values used are clamped
to >= 1e-2 (and r2 <= 2 for power), as in that code, with the gradient passing the clamp unchanged:
the authors clamp the parameter's data in place before each forward and then differentiate the
parameter itself, so a value held at its bound still gets the gradient that can move it back.
Here the clamp is functional (a straight-through clamp: no parameter is written during a forward,
and a compiled score modifier can run it), so the stored value may drift past a bound while the
value in use stays at it.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import UsageError
from .base import PositionalEncoding, bias_from_score, relative_bias_from_score

VARIANTS = ("log", "power")
MIN_VALUE = 1e-2  # both parameters are clamped at this, as in the authors' code
MAX_POWER = 2.0  # power variant: r2 <= 2 keeps the kernel conditionally positive definite


class KERPLE(PositionalEncoding):
    """Learned log (or power) distance penalty per head."""

    name = "kerple"
    shift_invariant = True  # positions enter as |i - j| only
    description = "learned log or power distance penalty per head (Chi et al. 2022)"
    extrapolates = True
    shares_parameters = True  # r1, r2 shared by every layer

    def __init__(self, num_heads: int, head_dim: int, causal: bool = True, variant: str = "log") -> None:
        super().__init__(num_heads, head_dim, causal)
        if variant not in VARIANTS:
            raise UsageError(f"variant must be one of {VARIANTS}, got {variant!r}")
        self.variant = variant
        self.r1 = nn.Parameter(torch.rand(num_heads))  # (H,) ~ U(0, 1)
        self.r2 = nn.Parameter(torch.rand(num_heads) * 2.0)  # (H,) ~ U(0, 2)

    def values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(r1, r2), each (H,), clamped into range; the gradient passes the clamp unchanged."""
        top = MAX_POWER if self.variant == "power" else None
        return _clamp_through(self.r1, MIN_VALUE, None), _clamp_through(self.r2, MIN_VALUE, top)

    def kernel(self, h: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
        """-r1_h k(|distance|), elementwise over broadcastable head indices and distances."""
        r1, r2 = (x[h] for x in self.values())
        d = distance.abs().to(r1.dtype)
        if self.variant == "log":
            return -r1 * torch.log1p(r2 * d)
        # d ** r2 at d = 0 is 0 for r2 > 0; its gradient w.r.t. r2 there is 0 * log 0: made 0.
        return -r1 * torch.where(d > 0, d.clamp(min=1).pow(r2), torch.zeros_like(d))

    def score(self, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        return self.kernel(h, i - j)

    def bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        return bias_from_score(self, q_positions, k_positions)  # (H, Tq, Tk)

    # Capability: the bias depends on r = j - i alone (no affine tail, so no ``bias_tails``).
    def relative_bias(self, relative: torch.Tensor) -> torch.Tensor:
        return relative_bias_from_score(self, relative)  # (H, *r.shape)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, variant={self.variant!r}"


def _clamp_through(p: torch.Tensor, low: float, high: float | None) -> torch.Tensor:
    """p's value clamped to [low, high], with the identity's gradient (straight-through)."""
    return p + (p.clamp(min=low, max=high) - p).detach()


__all__ = ["KERPLE", "VARIANTS"]
