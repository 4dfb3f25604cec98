"""The base class of every encoding, and small helpers shared by them.

The contract itself (hooks, optional capabilities, :func:`offers`) lives in
:mod:`posenc.encodings.protocol`; this module holds :class:`PositionalEncoding`, which stores the
sizes every encoding is built with and declares the plain capability attributes, and the helpers
that derive one form of a bias from another (dense from scalar, relative from scalar).

Positions are absolute integer indices, a 1-D ``LongTensor`` of strictly increasing values, usually
consecutive (``torch.arange(start, start + T)``); randomized positions skip values. Relative position is ``r = j - i`` (key minus query): r < 0
means the key is in the past.

Shape legend: B batch, H heads, T / Tq / Tk sequence lengths, D head dim.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import nn

from ..errors import UsageError, check_positive
from .protocol import CAPABILITIES, HOOKS, Scores, members, offers, require

# A hook (or a one-method capability, such as ``score``) by its method name, for scripts and tests:
# derived from the protocol's HOOKS and CAPABILITIES, never a list of its own.
_BY_NAME = {members(p)[0]: p for p in HOOKS + CAPABILITIES if len(members(p)) == 1}


def has_hook(encoding: nn.Module, hook: str) -> bool:
    """``offers(encoding, P)`` for the Protocol ``P`` whose one method is named ``hook``.

    Raises:
        UsageError: ``hook`` names no hook or one-method capability of the protocol.
    """
    if hook not in _BY_NAME:
        raise UsageError(f"hook must be one of {tuple(_BY_NAME)}, got {hook!r}")
    return offers(encoding, _BY_NAME[hook])


class PositionalEncoding(nn.Module):
    """Base class: stores the sizes every encoding is built with and declares capabilities.

    Capabilities are attributes, read by the model and the attention:

    - ``max_positions``: the largest number of positions it can encode (None = unbounded).
    - ``shares_across_layers`` (derived, per instance): the model builds one instance for all
      layers (and the attention computes its bias once per forward); otherwise every layer gets its
      own instance. An encoding without parameters shares; one with learned parameters learns them
      per layer unless its class opts in with ``shares_parameters = True`` (T5's one table, as in
      T5), so a new learned method never ties its layers by accident.
    - ``causal_only``: the method has no bidirectional form.
    - ``extrapolates``: it can run past its training length (for ``posenc list``).
    - ``rotation_depends_on_length``: ``rotate`` uses the current length (largest key position + 1),
      as dynamic NTK scaling does; the attention then keeps keys un-rotated in its KV cache and
      rotates all of them at every step, so cached decoding equals the full pass.
    - ``content_scale``: the factor of the content product q . k the attention uses (None:
      1 / sqrt(head_dim)); DeBERTa's is 1 / sqrt(D * (1 + number of position terms)).
    - ``position_axes``: how many position ids per token ``rotate`` reads: 1 (one position per
      token, every method but the multi-axis rotations), 3 for M-RoPE (temporal, height, width), 2
      for the patch-grid rotations (x, y). ``axis_first`` says where the axis dimension of such
      positions sits: first, (A, T) or (A, B, T), as Qwen2-VL passes them, or last, (T, A) or
      (B, T, A), as a patch grid is written. :class:`posenc.Geometry` checks positions against
      them; an encoding that reads positions with ``position_axes = 1`` refuses positions with an
      axis dimension (see :func:`position_axes_of`).
    - ``shift_invariant``: the model's output does not change when every position of a row is
      shifted by the same amount (attention depends on i - j only, and nothing is absolute):
      NoPE, ALiBi, T5, RoPE (without length-dependent scaling), Shaw, Transformer-XL. Generation
      in batches relies on it: left-padded rows share positions, row b starting at its padding.
      Absolute methods (sinusoidal, learned) are not, but their only hook, ``embed``, takes each
      row's own positions, so they batch too; any other method generates rows of one prompt
      length together (:mod:`posenc.model.generate`).

    Hooks and optional capabilities (``bias_tails``, ``clipped_tables``, ...) are methods a subclass
    defines; :mod:`posenc.encodings.protocol` lists them and :func:`~posenc.encodings.protocol.offers`
    finds them.

    Raises:
        UsageError: (the constructor, for every method: subclasses call it first) ``num_heads`` or
            ``head_dim`` not a positive integer, or ``causal=False`` for a method without a
            bidirectional form; a subclass raises it too for each of its own options, naming it and
            its allowed range.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    extrapolates: ClassVar[bool] = True
    # True: one instance (and one set of learned parameters) for all layers; see shares_across_layers.
    shares_parameters: ClassVar[bool] = False
    causal_only: ClassVar[bool] = False
    # True when positions enter only as differences i - j (see the class docstring).
    shift_invariant: ClassVar[bool] = False

    @property
    def rotation_depends_on_length(self) -> bool:
        """True when ``rotate`` depends on the current length (the largest key position + 1), not
        only on each position: the attention then caches keys un-rotated and rotates them at every
        step. A property, so that a subclass may derive it from its options."""
        return False

    @property
    def content_scale(self) -> float | None:
        """The factor of the content product q . k; None: 1 / sqrt(head_dim). DeBERTa scales it by
        1 / sqrt(D * (1 + its number of position terms)); read through :func:`content_scale`."""
        return None

    # Position ids per token that ``rotate`` reads, and whether their axis dimension comes first
    # ((A, T), (A, B, T)) or last ((T, A), (B, T, A)); see the class docstring.
    position_axes: ClassVar[int] = 1
    axis_first: ClassVar[bool] = True

    @property
    def shares_across_layers(self) -> bool:
        """One instance for all layers: no parameters, or learned ones the class shares by design."""
        return self.shares_parameters or next(iter(self.parameters()), None) is None

    def __init__(self, num_heads: int, head_dim: int, causal: bool = True) -> None:
        super().__init__()
        self.num_heads = check_positive("num_heads", num_heads)
        self.head_dim = check_positive("head_dim", head_dim)
        if self.causal_only and not causal:
            raise UsageError(f"encoding {self.name!r} has no bidirectional form; use causal=True")
        self.causal = bool(causal)
        self.max_positions: int | None = None

    @property
    def dim(self) -> int:
        """Model width: heads x head dim (what ``embed`` adds to)."""
        return self.num_heads * self.head_dim

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}, causal={self.causal}"


def check_bias_positions(encoding: nn.Module, q_positions: torch.Tensor, k_positions: torch.Tensor) -> None:
    """A bias hook takes 1-D positions (Tq,), (Tk,).

    Raises:
        UsageError: other shapes, e.g. (B, T) positions, which ``posenc.attend`` takes instead.
    """
    for label, p in (("q_positions", q_positions), ("k_positions", k_positions)):
        if not isinstance(p, torch.Tensor) or p.dim() != 1:
            shape = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
            raise UsageError(
                f"{getattr(encoding, 'name', type(encoding).__name__)}.bias: {label} must be 1-D (T,), got {shape}; "
                "for positions per row (B, T) call posenc.attend(q, k, v, encoding, positions=...)"
            )


def position_axes_of(encoding: nn.Module | None) -> tuple[int, bool]:
    """(``position_axes``, ``axis_first``) of ``encoding``: (1, True) for None or an object that
    does not declare them (one position per token)."""
    return int(getattr(encoding, "position_axes", 1)), bool(getattr(encoding, "axis_first", True))


def content_scale(encoding: nn.Module | None, head_dim: int) -> float:
    """The factor of q . k for ``encoding``: its ``content_scale`` attribute, or 1 / sqrt(head_dim)."""
    scale = getattr(encoding, "content_scale", None)
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def relative_positions(q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """r = j - i for every (query, key) pair: (Tq, Tk) LongTensor."""
    return k_positions[None, :] - q_positions[:, None]  # (Tq, Tk)


def bias_from_score(encoding: PositionalEncoding, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """Dense (H, Tq, Tk) bias built from an encoding's scalar form ``score(h, i, j)``.

    One definition serves both the dense path and fused kernels, so they cannot disagree.
    """
    check_bias_positions(encoding, q_positions, k_positions)
    heads = torch.arange(encoding.num_heads, device=q_positions.device)[:, None, None]  # (H, 1, 1)
    return require(encoding, Scores).score(heads, q_positions[None, :, None], k_positions[None, None, :])  # (H, Tq, Tk)


def relative_bias_from_score(encoding: PositionalEncoding, relative: torch.Tensor) -> torch.Tensor:
    """``f_h(r) = score(h, 0, r)`` for an encoding whose bias depends on r = j - i alone: (H, *r.shape)."""
    heads = torch.arange(encoding.num_heads, device=relative.device).view(-1, *([1] * relative.dim()))  # (H, 1, ..)
    return require(encoding, Scores).score(heads, torch.zeros_like(relative), relative[None])  # (H, *r.shape)
