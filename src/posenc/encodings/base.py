"""The encoding protocol: the small set of hooks the attention calls.

An encoding is an ``nn.Module`` that implements any subset of the hooks below. The attention
looks for them with :func:`has_hook` and never asks an encoding for its name, so a new method is
one new file plus one registry line.

Hooks, in the order a model calls them:

1. ``embed(x, positions) -> x``: add absolute position information to the token embeddings
   ``x`` (B, T, dim). Called once by the model, on the input, not by every attention layer.
2. ``rotate(q, k, q_positions, k_positions) -> (q, k)``: transform queries and keys before the
   content product (RoPE). Keys are transformed *before* they enter a KV cache.
3. ``bias(q_positions, k_positions) -> (H, Tq, Tk)``: an additive score bias, the same for every
   item of the batch (T5, ALiBi). Methods with a bias also give the scalar form
   ``score(h, i, j)``: elementwise over broadcastable integer tensors of head index, query position
   and key position, usable as a fused kernel's score modifier.
4. ``query_terms(q, k, q_positions, k_positions) -> (B, H, Tq, Tk)``: query- or key-dependent score
   terms (Shaw, Transformer-XL), and ``value_terms(probs, q_positions, k_positions) -> (B, H, Tq, D)``
   for methods that also move values (Shaw). ``k`` is passed too because Transformer-XL's global
   content bias ``u`` scores every key.

Every score term is returned in *logit units*: the attention computes
``softmax(q k^T * scale + bias + query_terms)``, with ``scale = 1/sqrt(head_dim)``; a method whose
paper scales its own terms (Shaw, Transformer-XL) applies the scale itself.

Optional capabilities that fast backends look for (again by presence, never by name); the hooks
above stay the reference that every backend is tested against:

- ``relative_bias(r) -> (H, *r.shape)`` and ``bias_tails() -> BiasTails``: a bias that depends on
  r = j - i alone and, past some distance, is constant or linear in r (T5's last buckets, ALiBi), so
  far keys can go through a fused kernel and only a band near the diagonal is written out.
- ``clipped_tables()`` (Shaw): clip k, key and value tables, scale.
- ``distance_key_form()`` (Transformer-XL): u, v, scale, with ``position_keys(distances)``.

Positions are absolute integer indices, 1-D ``LongTensor`` of consecutive values
(``torch.arange(start, start + T)``). Relative position is ``r = j - i`` (key minus query): r < 0
means the key is in the past.

Shape legend: B batch, H heads, T / Tq / Tk sequence lengths, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

HOOKS = ("embed", "rotate", "bias", "score", "query_terms", "value_terms")


def has_hook(encoding: nn.Module, hook: str) -> bool:
    """True when ``encoding`` implements ``hook`` (a method of its class, not None)."""
    if hook not in HOOKS:
        raise ValueError(f"hook must be one of {HOOKS}, got {hook!r}")
    return callable(getattr(encoding, hook, None))


def check_positive(name: str, value: int) -> int:
    """Raise a ValueError naming the parameter unless ``value`` is a positive integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer (>= 1), got {value!r}")
    return value


class PositionalEncoding(nn.Module):
    """Base class: stores the sizes every encoding is built with and declares capabilities.

    Capabilities are attributes, read by the model and the attention:

    - ``max_positions``: the largest number of positions it can encode (None = unbounded).
    - ``shares_across_layers``: the model builds one instance for all layers (and the attention
      computes its bias once per forward); otherwise every layer gets its own instance.
    - ``causal_only``: the method has no bidirectional form.
    - ``extrapolates``: it can run past its training length (for ``posenc list``).
    - ``rotation_depends_on_length``: ``rotate`` uses the current length (largest key position + 1),
      as dynamic NTK scaling does; the attention then keeps keys un-rotated in its KV cache and
      rotates all of them at every step, so cached decoding equals the full pass.

    Optional capabilities of bias methods, read by the fast attention backends (never required):

    - ``relative_bias(r) -> (H, *r.shape)``: the bias as a function of r = j - i alone,
      ``f_h(r) = score(h, i, i + r)``, differentiable in the encoding's parameters.
    - ``bias_tails() -> BiasTails``: past which distances f is affine in r (ALiBi: everywhere;
      T5: constant beyond its last bucket's first distance). A backend then treats the far keys as
      plain attention plus a per-key term and a per-query constant, and only a band near the
      diagonal needs the explicit bias.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    extrapolates: ClassVar[bool] = True
    shares_across_layers: ClassVar[bool] = True
    causal_only: ClassVar[bool] = False
    # True when ``rotate`` depends on the current length (the largest key position + 1), not only
    # on each position: the attention then caches keys un-rotated and rotates them at every step.
    rotation_depends_on_length: bool = False

    def __init__(self, num_heads: int, head_dim: int, causal: bool = True) -> None:
        super().__init__()
        self.num_heads = check_positive("num_heads", num_heads)
        self.head_dim = check_positive("head_dim", head_dim)
        if self.causal_only and not causal:
            raise ValueError(f"encoding {self.name!r} has no bidirectional form; use causal=True")
        self.causal = bool(causal)
        self.max_positions: int | None = None

    @property
    def dim(self) -> int:
        """Model width: heads x head dim (what ``embed`` adds to)."""
        return self.num_heads * self.head_dim

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}, causal={self.causal}"


def relative_positions(q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """r = j - i for every (query, key) pair: (Tq, Tk) LongTensor."""
    return k_positions[None, :] - q_positions[:, None]  # (Tq, Tk)


def bias_from_score(encoding: nn.Module, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """Dense (H, Tq, Tk) bias built from an encoding's scalar form ``score(h, i, j)``.

    One definition serves both the dense path and fused kernels, so they cannot disagree.
    """
    heads = torch.arange(encoding.num_heads, device=q_positions.device)[:, None, None]  # (H, 1, 1)
    return encoding.score(heads, q_positions[None, :, None], k_positions[None, None, :])  # (H, Tq, Tk)


@dataclass(frozen=True)
class BiasTails:
    """Where a relative bias ``f_h(r)`` (r = j - i) is affine in r, one description per side.

    For ``r <= -past``:   ``f_h(r) = f_h(-past) + past_slope[h] * (r + past)``;
    for ``r >= future``:  ``f_h(r) = f_h(future) + future_slope[h] * (r - future)``.
    A slope of None means the tail is constant (slope 0). Slopes are fixed tensors (H,), never
    learned; the intercepts f_h(-past), f_h(future) may be learned (they come from ``relative_bias``).
    Example: causal ALiBi has past = 0 with slopes m_h; T5 with 32 buckets and max distance 128 has
    past = 113 (the first distance of the last bucket) and no slope.
    """

    past: int
    past_slope: torch.Tensor | None
    future: int
    future_slope: torch.Tensor | None


def relative_bias_from_score(encoding: nn.Module, relative: torch.Tensor) -> torch.Tensor:
    """``f_h(r) = score(h, 0, r)`` for an encoding whose bias depends on r = j - i alone: (H, *r.shape)."""
    heads = torch.arange(encoding.num_heads, device=relative.device).view(-1, *([1] * relative.dim()))  # (H, 1, ..)
    return encoding.score(heads, torch.zeros_like(relative), relative[None])  # (H, *r.shape)
