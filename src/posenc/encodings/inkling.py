"""The Inkling bias: learned distance curves mixed per query from the layer input.

Thinking Machines' Inkling and Inkling-2 (2026; no paper: the method is read from the released
models' attention, ``transformers.models.inkling2.modeling_inkling2.Inkling2RelativePositionBias``,
and the same method in x-transformers, ``RelativeProjPositionalBias``) use no rotation. Every
layer holds a bank P (K, R) of K learned curves over the backward distances 0..R-1, and every
token mixes them with its own weights, read from the attention layer's input x_i (dim,):

    w_i = W x_i (+ b)                                        (H, K): K weights per head
    w_i <- clip(s * w_i)  with clip(u) = u * min(1, c / (|u|_2 + 1e-6))   (Inkling-2, c = 8)
    w_i <- w_i * (1 + alpha * log(max((p_i + 1) / n, 1)))   (Inkling-2's full layers: alpha 0.1, n 128,000)
    logit_ij += (w_i P)[p_i - p_j]   for 0 <= p_i - p_j < R, and nothing otherwise

with s (H, K) a learned per-head scale of the weights. So each query chooses its own curve (how
much it looks back, and how) from a small learned family, over the last R positions only; the keys
farther back, and those after the query, get no bias. The encoding offers the :class:`Curves` hook,
``query_curves(x, positions) -> (B, H, T, R)`` = w_i P: :class:`posenc.Attention` calls it on its
input for its queries (a decode step for the new ones only: a KV cache keeps nothing for it), and
the backend reads curve i at p_i - p_j (``posenc.call.spec.curve_bias``). Packed documents need
nothing more: the curves travel with their queries into each document's call, whose keys are that
document's. The curves are computed in float32 (float64 for float64 input), as Inkling-2 clips its
weights in float32.

Options map to the references: Inkling-2's bias is ``clip=8.0`` (``rel_l2_clip_threshold``),
``rank=16`` (``d_rel``), ``distances=1024`` (``rel_extent``), with ``log_scaling=0.1`` and
``log_floor=128000`` on its full layers; x-transformers' ``RelativeProjPositionalBias`` is
``clip=None, linear_bias=True`` (no clip, no scale, a biased projection). Inkling-2's learned
attention sinks and its log scaling of the queries belong to the layer, not to this bias.

Shape legend: B batch, H heads, T tokens, K curves in the bank (``rank``), R distances, dim the
layer input's width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UsageError, check_positive
from .base import PositionalEncoding


class Inkling(PositionalEncoding):
    """A per-query, data-dependent bias over the last ``distances`` backward distances: each token
    mixes a learned bank of ``rank`` curves with weights from the layer input.

    Args:
        num_heads, head_dim, causal: as for every encoding (the bias is zero for keys after the
            query, so a bidirectional call sees it on past keys only, as the references do).
        distances: R, the number of backward distances 0..R-1 with a bias (1,024 in Inkling-2).
        rank: K, the number of learned curves each query mixes (``d_rel``, 16).
        clip: the L2 bound on each head's mixing weights, after a learned per-head scale
            (Inkling-2: 8.0); None: neither clip nor scale (x-transformers).
        linear_bias: the projection of x to the weights has a bias (x-transformers: True).
        log_scaling: alpha of Inkling-2's long-context factor 1 + alpha * log(max((p + 1) / log_floor, 1))
            on the weights of the query at position p; 0: none.
        log_floor: n of that factor: positions below it are unscaled (128,000 in Inkling-2).
        input_dim: the width of the layer input x; None: num_heads * head_dim.

    Raises:
        UsageError: a size that is not a positive integer, a clip that is not a finite number > 0
            (or None), a log_scaling that is not finite and >= 0.
    """

    name = "inkling"
    description = "each token mixes a learned bank of distance curves into its own bias over the last R keys (Inkling)"
    extrapolates = True  # zero bias past R distances: any length runs
    # Positions enter as p_i - p_j, except in the long-context factor (log_scaling), which reads p_i:
    # a class attribute cannot depend on the option, so it stays False (generation then decodes rows
    # of equal prompt length together, exact either way).
    shift_invariant = False
    # not shared across layers (derived from its learned parameters): each layer learns its own bank

    def __init__(self, num_heads: int, head_dim: int, causal: bool = True, *, distances: int = 1024, rank: int = 16,
                 clip: float | None = 8.0, linear_bias: bool = False, log_scaling: float = 0.0, log_floor: int = 128000,
                 input_dim: int | None = None) -> None:
        super().__init__(num_heads, head_dim, causal)
        self.distances = check_positive("distances", distances)
        self.rank = check_positive("rank", rank)
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not math.isfinite(clip) or clip <= 0):
            raise UsageError(f"clip must be a finite number > 0 (the L2 bound of the mixing weights) or None, got {clip!r}")
        if isinstance(log_scaling, bool) or not isinstance(log_scaling, (int, float)) or not math.isfinite(log_scaling) or log_scaling < 0:
            raise UsageError(f"log_scaling must be a finite number >= 0 (alpha of the long-context factor), got {log_scaling!r}")
        self.log_floor = check_positive("log_floor", log_floor)
        if input_dim is not None:
            check_positive("input_dim", input_dim)
        if not isinstance(linear_bias, bool):
            raise UsageError(f"linear_bias must be True or False, got {linear_bias!r}")
        self.clip = None if clip is None else float(clip)
        self.log_scaling = float(log_scaling)
        self.input_dim = self.dim if input_dim is None else input_dim
        self.weights = nn.Linear(self.input_dim, num_heads * rank, bias=linear_bias)  # W (H*K, input_dim)
        self.scale = nn.Parameter(torch.ones(num_heads, rank)) if clip is not None else None  # s (H, K)
        self.bank = nn.Parameter(torch.randn(rank, distances) * 0.02)  # P (K, R)

    def query_curves(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each query's bias over the backward distances 0..R-1: x (B, T, input_dim), positions (T,)
        or (B, T) (read only by the long-context factor) -> (B, H, T, R), float32 or float64.

        Raises:
            UsageError: ``x`` is not a float (B, T, input_dim) tensor, or ``positions`` does not
                have T entries per row.
        """
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.input_dim or not x.is_floating_point():
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise UsageError(f"x: the Inkling curves read the layer input, a float (batch, length, {self.input_dim}) tensor, got {shape}")
        return mixed_curves(self, x, positions, self.weights.weight, self.weights.bias, self.scale, self.bank)


def mixed_curves(enc: Inkling, x: torch.Tensor, positions: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 scale: torch.Tensor | None, bank: torch.Tensor) -> torch.Tensor:
    """The curves w_i P of the module docstring for ``enc``'s options (clip, log scaling) and the
    given parameters: W ``weight`` (H*K, input_dim) with ``bias`` (H*K,) or None, s ``scale`` (H, K)
    or None, P ``bank`` (K, R); x (B, T, input_dim), positions (T,) or (B, T) -> (B, H, T, R).
    (:class:`Inkling` passes its own; posenc.hf an Inkling model layer's, read at each call.)

    Raises:
        UsageError: ``positions`` without T entries per row when the log scaling reads them.
    """
    b, t, _ = x.shape
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)).view(b, t, enc.num_heads, -1)  # (B, T, H, K)
    if scale is not None and enc.clip is not None:
        w = w * scale.to(dtype)
        w = w * (enc.clip / (torch.linalg.vector_norm(w, dim=-1, keepdim=True) + 1e-6)).clamp(max=1.0)
    if enc.log_scaling:
        if positions.shape[-1] != t:
            raise UsageError(f"positions must have {t} entries per row (the length of x), got shape {tuple(positions.shape)}")
        tau = 1.0 + enc.log_scaling * torch.log(((positions + 1).to(dtype) / enc.log_floor).clamp(min=1.0))  # (T,) or (B, T)
        w = w * tau[..., None, None]
    return (w @ bank.to(dtype)).transpose(1, 2)  # (B, H, T, R)


__all__ = ["Inkling", "mixed_curves"]
