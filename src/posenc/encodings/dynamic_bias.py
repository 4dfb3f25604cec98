"""Dynamic position bias: a small MLP of the relative distance gives every head its score bias
(Wang et al. 2022, "CrossFormer: A Versatile Vision Transformer Hinging on Cross-scale Attention",
ICLR 2022, §3.3 "Dynamic position bias"; with the log-spaced input of Liu et al. 2022, "Swin
Transformer V2: Scaling Up Capacity and Resolution", CVPR 2022, §3.3, eq. 4).

In place of a table indexed by distance (T5), the bias is a continuous function of it, so it is
defined at every distance, including those never seen in training::

    x = i - j                                        (query minus key: > 0 for a key in the past)
    x = sign(x) log(1 + |x|)                         (``log_distance=True``, Swin V2's eq. 4)
    b_h(i, j) = MLP(x)_h,   MLP = Linear(1, W) [LN] SiLU, then (depth - 1) x (Linear(W, W) [LN] SiLU), Linear(W, H)

as x-transformers' ``DynamicPositionBias`` builds it (its ``dynamic_pos_bias`` option): SiLU
activations, ``norm=True`` a LayerNorm after each hidden linear (the first one with a gain only,
the later ones with gain and bias, as that module has them), the bias added to the scores after
their 1/sqrt(D) scaling. The causal form (a decoder) is the same function with the future masked,
so only i - j >= 0 is read; the bidirectional form (an encoder) reads both signs, a different
value for a key before and after the query at the same distance.

Parameters: the MLP's weights and biases, plain parameters with ``nn.Linear``'s default
initialisation (uniform in +-1/sqrt(fan_in)), kept out of the model's re-initialisation of linear
layers; one MLP for all layers (``shares_parameters``), as x-transformers shares one module among
its layers. W (``width``) defaults to a quarter of the model width H x D, x-transformers' default.

Evaluation: the bias depends on r = j - i alone (:class:`~posenc.encodings.protocol.DistanceBias`),
so a backend asks for ``relative_bias`` of the call's distinct distances, Tq + Tk - 1 of them, one
MLP evaluation each, and reads each pair's value from that vector: ``blocked``'s explicit path
(strided views, no (H, N, N) tensor) and the decode step's kept vector. ``bias`` (the dense form,
the reference) evaluates the MLP on the distinct distances too and gathers. There is no elementwise
``score`` (a fused kernel's score modifier would run the W x W layer per pair), so ``flex`` leaves
it to ``blocked``.

Shape legend: H heads, Tq / Tk lengths, W the MLP's width, R distances.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UsageError, check_positive
from .base import PositionalEncoding, check_bias_positions, relative_positions


class DynamicPositionBias(PositionalEncoding):
    """An MLP of the (optionally log-spaced) signed distance, one output per head."""

    name = "dpb"
    description = "MLP of the (log-)distance giving each head its bias (dynamic position bias, Wang et al. 2022)"
    extrapolates = True
    shift_invariant = True  # positions enter as i - j only
    shares_parameters = True  # one MLP for all layers, as x-transformers shares it

    def __init__(self, num_heads: int, head_dim: int, causal: bool = True, width: int | None = None, depth: int = 2,
                 log_distance: bool = False, norm: bool = False) -> None:
        """
        Args:
            num_heads: H, the MLP's outputs.
            head_dim: D (the bias does not read it; W's default does).
            causal: decoder (True: the future is masked) or encoder (False).
            width: W, the hidden width; None: max(1, H x D // 4), x-transformers' dim // 4.
            depth: the number of hidden layers (Linear + SiLU), >= 1 (2, as x-transformers).
            log_distance: feed sign(x) log(1 + |x|) in place of x = i - j (Swin V2's log-spaced input).
            norm: a LayerNorm after each hidden linear (x-transformers' ``dynamic_pos_bias_norm``).

        Raises:
            UsageError: ``width`` or ``depth`` not a positive integer, or ``log_distance`` or
                ``norm`` not a bool.
        """
        super().__init__(num_heads, head_dim, causal)
        width = max(1, num_heads * head_dim // 4) if width is None else check_positive("width", width)
        self.width, self.depth = width, check_positive("depth", depth)
        for label, flag in (("log_distance", log_distance), ("norm", norm)):
            if not isinstance(flag, bool):
                raise UsageError(f"{label} must be True or False, got {flag!r}")
        self.log_distance, self.norm = log_distance, norm
        sizes = [1] + [width] * depth + [num_heads]  # layer l maps sizes[l] -> sizes[l + 1]
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList()
        for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
            bound = 1.0 / math.sqrt(fan_in)  # nn.Linear's default: uniform in +-1/sqrt(fan_in)
            self.weights.append(nn.Parameter(torch.empty(fan_out, fan_in).uniform_(-bound, bound)))  # (out, in)
            self.biases.append(nn.Parameter(torch.empty(fan_out).uniform_(-bound, bound)))  # (out,)
        # LayerNorm gains after each hidden linear; biases after the second and later ones (the
        # first of x-transformers' norms has none).
        self.norm_gains = nn.ParameterList(nn.Parameter(torch.ones(width)) for _ in range(depth if norm else 0))
        self.norm_biases = nn.ParameterList(nn.Parameter(torch.zeros(width)) for _ in range(depth - 1 if norm else 0))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP of inputs x (already log-spaced if so): (...) -> (..., H), in the parameters' dtype."""
        hidden = x.to(self.weights[0].dtype)[..., None]  # (..., 1)
        for layer in range(self.depth):
            hidden = F.linear(hidden, self.weights[layer], self.biases[layer])  # (..., W)
            if self.norm:
                bias = self.norm_biases[layer - 1] if layer else None
                hidden = F.layer_norm(hidden, (self.width,), self.norm_gains[layer], bias)
            hidden = F.silu(hidden)
        return F.linear(hidden, self.weights[-1], self.biases[-1])  # (..., H)

    def relative_bias(self, relative: torch.Tensor) -> torch.Tensor:
        """f_h(r), r = j - i: the MLP of each element of r, (H, *r.shape) (callers pass distinct
        distances, as ``arange(r_lo, r_hi + 1)``; ``bias`` gathers the dense form from them)."""
        x = (-relative).to(self.weights[0].dtype)  # i - j, x-transformers' input
        if self.log_distance:
            x = torch.sign(x) * torch.log1p(x.abs())
        return self.mlp(x).movedim(-1, 0)  # (H, *r.shape)

    def bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        """(H, Tq, Tk): the MLP run once per distinct distance of the call, then gathered."""
        check_bias_positions(self, q_positions, k_positions)
        tq, tk = q_positions.numel(), k_positions.numel()
        if tq and tk and _steps_by_one(q_positions) and _steps_by_one(k_positions):
            # Consecutive positions: the distances k[0] - q[-1] .. k[-1] - q[0], Tq + Tk - 1 of them,
            # and pair (a, b) reads entry b - a + Tq - 1.
            r = torch.cat((k_positions[:1] - q_positions.flip(0), k_positions[1:] - q_positions[:1]))  # (Tq + Tk - 1,)
            index = torch.arange(tk, device=r.device)[None, :] - torch.arange(tq, device=r.device)[:, None] + (tq - 1)  # (Tq, Tk)
            return self.relative_bias(r)[:, index]  # (H, Tq, Tk)
        r, index = torch.unique(relative_positions(q_positions, k_positions), return_inverse=True)  # (R,), (Tq, Tk)
        return self.relative_bias(r)[:, index]  # (H, Tq, Tk)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, width={self.width}, depth={self.depth}, log_distance={self.log_distance}, "
                f"norm={self.norm}")


def _steps_by_one(positions: torch.Tensor) -> bool:
    """Increasing positions that skip no value (their ends say so: positions are strictly increasing)."""
    return positions.numel() < 2 or int(positions[-1] - positions[0]) == positions.numel() - 1


__all__ = ["DynamicPositionBias"]
