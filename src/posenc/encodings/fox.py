"""Forgetting Transformer (Lin, Nikishin, He & Courville, ICLR 2025, "Forgetting Transformer:
Softmax Attention with a Forget Gate", §2, eq. 2-4): a data-dependent decay of the scores.

Every head has a scalar forget gate per token, computed from the attention layer's input x_t:

    f_t = sigmoid(w_h . x_t + b_h)                                                        (eq. 2)
    logit_ij = q_i . k_j / sqrt(D) + sum_{l=j+1..i} log f_l = q_i . k_j / sqrt(D) + c_i - c_j
    c_i = sum_{l<=i} log f_l                                                              (eq. 4)

with the causal mask (keys after the query are hidden). No positions enter at all: the decay is
how much was forgotten between j and i, so a FoX model is NoPE plus the gates (the paper uses no
RoPE). The encoding holds w (H, dim) and b (H,) per layer and offers the :class:`Gates` hook,
``log_gates(x) -> (B, H, T)`` = log sigmoid(x w^T + b); :class:`posenc.Attention` calls it on its
input and keeps the gates in the KV cache beside the keys (a decode step then equals the full
pass), and the backend adds c_i - c_j with c summed over the call's keys in float32 (float64 for
float64 inputs), the difference taken per block of queries. Packed documents restart the sum: the
gates travel with their keys into each document's call. Shape legend: B batch, H heads, T tokens,
dim the model width.

The "Pro" block of the paper (output gate, QK-norm, a shift of the keys and values) is not part
of this encoding: it changes the layer, not the scores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UsageError
from .base import PositionalEncoding


class ForgettingTransformer(PositionalEncoding):
    """A per-head forget gate from the layer input; the scores decay by the gates in between."""

    name = "fox"
    description = "data-dependent forget gate per head, logit_ij += sum of log f between j and i (Lin et al. 2025)"
    extrapolates = True
    causal_only = True  # the decay runs from each key forward to the query
    shift_invariant = True  # no position enters at all
    # not shared across layers (derived from its learned parameters): each layer learns its own gate

    def __init__(self, num_heads: int, head_dim: int, causal: bool = True, input_dim: int | None = None) -> None:
        super().__init__(num_heads, head_dim, causal)
        if input_dim is not None and (isinstance(input_dim, bool) or not isinstance(input_dim, int) or input_dim < 1):
            raise UsageError(f"input_dim must be a positive integer (the layer input's width) or None, got {input_dim!r}")
        # The width of the layer's input x: num_heads * head_dim unless the model's differs (Qwen3,
        # Gemma 2/3, gpt-oss and MLA models have a hidden size other than heads x head_dim).
        self.input_dim = self.dim if input_dim is None else input_dim
        self.gate = nn.Linear(self.input_dim, num_heads)  # w (H, input_dim), b (H,)

    def log_gates(self, x: torch.Tensor) -> torch.Tensor:
        """log f_t = log sigmoid(w_h . x_t + b_h): x (B, T, input_dim) -> (B, H, T), float32 or float64.

        Raises:
            UsageError: ``x`` is not a floating (B, T, input_dim) tensor with the width the gate
                was built for (``input_dim``, num_heads * head_dim by default).
        """
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.input_dim or not x.is_floating_point():
            raise UsageError(f"x: fox's forget gates read the layer input, a float (batch, length, dim) tensor with "
                             f"dim = {'num_heads * head_dim' if self.input_dim == self.dim else 'input_dim'} = {self.input_dim}, "
                             f"got {_described(x)}")
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        logits = F.linear(x.to(dtype), self.gate.weight.to(dtype), self.gate.bias.to(dtype))  # (B, T, H)
        return F.logsigmoid(logits).transpose(1, 2)


def _described(x: object) -> str:
    if not isinstance(x, torch.Tensor):
        return type(x).__name__
    return f"shape {tuple(x.shape)} of {str(x.dtype).removeprefix('torch.')}"


__all__ = ["ForgettingTransformer"]
