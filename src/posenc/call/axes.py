"""Positions with an axis dimension: the ids a multi-axis rotation reads, checked once per call.

An encoding declares how many position ids per token its ``rotate`` reads, ``position_axes`` A (1
for every method but the multi-axis rotations: M-RoPE 3, axial RoPE and RoPE-Mixed 2), and where
their axis dimension sits, ``axis_first`` (:mod:`posenc.encodings.base`). This module checks such
positions as :class:`posenc.Geometry` receives them (naming the argument and every allowed shape),
holds them in one form, (A, B', T) with B' = 1 or B, hands them back in the form the encoding's
``rotate`` takes, refuses them for an encoding that reads positions of another kind, and gives the
ids of text that continues after them (M-RoPE's rule: each row at its own max(id) + 1, the same id
on every axis; Wang et al. 2024, "Qwen2-VL", arXiv 2409.12191, §2.1).

Such ids are what a rotation reads, and nothing else: the masks of a call (causal order,
documents, padding, windows, chunks) read the sequence index (:mod:`posenc.call.geometry`), and a KV
cache keeps each row's next id (:meth:`posenc.model.cache.LayerCache.note_positions`).

Shape legend: A axes, B batch, T tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from ..encodings.base import position_axes_of
from ..encodings.protocol import Biases, Embeds, QueryTerms, Rotates, ValueTerms, offers
from ..errors import UsageError


def in_words(x) -> str:
    """A value as a message names it: a tensor's dims, dtype and shape, else its type."""
    if isinstance(x, torch.Tensor):
        return f"a {x.dim()}-D {str(x.dtype).removeprefix('torch.')} tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def integer_tensor(name: str, x, shapes: str) -> torch.Tensor:
    """``x`` if it is an integer tensor, else a UsageError naming ``name`` and the ``shapes`` allowed."""
    if not isinstance(x, torch.Tensor) or x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise UsageError(f"{name} must be an integer tensor of shape {shapes}, got {in_words(x)}")
    return x


def label(encoding: nn.Module | None) -> str:
    """An encoding's registered name (its class name without one), for messages."""
    return getattr(encoding, "name", "") or type(encoding).__name__


def check_axis_positions(encoding: nn.Module | None, positions: torch.Tensor, batch: int, length: int,
                         name: str = "positions") -> torch.Tensor | None:
    """Positions with an axis dimension for ``encoding`` as an (A, B', T) LongTensor (B' = 1 or B),
    or None when they have a 1-D form, (T,) or (B, T) (checked by the caller, as before).

    The forms, for an encoding with ``position_axes`` A > 1 (:mod:`posenc.encodings.base`):
    axis first (M-RoPE) (A, T) for every row or (A, B', T); axis last (a patch grid) (T, A) or
    (B', T, A). An encoding with A = 1 takes none of them (None is returned for every tensor).

    Raises:
        UsageError: not an integer tensor, a shape that is none of the forms (naming ``name`` and
            every allowed shape), a 2-D shape that reads both as (B, T) and as (A, T) / (T, A)
            (ambiguous), or a negative id.
    """
    axes, first = position_axes_of(encoding)
    if axes == 1:
        return None
    one = f"({length},) or ({batch}, {length})"
    shared, per_row = ((f"({axes}, {length})", f"({axes}, B, {length})") if first else
                       (f"({length}, {axes})", f"(B, {length}, {axes})"))
    forms = (f"{one} (one position per token) or {shared}, {per_row} with B = 1 or {batch} "
             f"({axes} ids per token for {label(encoding)}, axis {'first' if first else 'last'})")
    integer_tensor(name, positions, forms)
    shape = tuple(positions.shape)
    flat = shape in ((length,), (batch, length))
    if positions.dim() == 2:
        axis_form = shape == ((axes, length) if first else (length, axes))
        if axis_form and flat:
            raise UsageError(f"{name} of shape {shape} is ambiguous for {label(encoding)}: {batch} rows of one position per "
                             f"token, or {axes} ids per token for every row; give them per row, shape {per_row} with B = {batch} "
                             "(a 1-D position p is the id p on every axis)")
        if not axis_form:
            if flat:
                return None
            raise UsageError(f"{name} must have shape {forms}, got {shape}")
        out = (positions if first else positions.t()).unsqueeze(1)  # (A, 1, T)
    elif positions.dim() == 3:
        out = positions if first else positions.movedim(-1, 0)  # (A, B', T)
        if out.shape[0] != axes or out.shape[1] not in (1, batch) or out.shape[2] != length:
            raise UsageError(f"{name} must have shape {forms}, got {shape}")
    elif flat:
        return None
    else:
        raise UsageError(f"{name} must have shape {forms}, got {shape}")
    if out.numel() and not torch.compiler.is_compiling():  # (a compiled graph reads nothing on the host)
        low = int(out.min())
        if low < 0:
            raise UsageError(f"{name} must be >= 0, got {low}")
    return out.long()


def check_takes_axes(encoding: nn.Module | None, axes: torch.Tensor | None) -> None:
    """UsageError when positions with an axis dimension (A, B', T) reach an encoding that reads
    positions and declares another number of axes (a 1-D RoPE, a bias or relative method, an
    absolute table); an encoding that reads no positions (NoPE) ignores them (its masks read the
    sequence index)."""
    if axes is None:
        return
    count, (mine, _) = axes.shape[0], position_axes_of(encoding)
    if mine != count and any(offers(encoding, hook) for hook in (Embeds, Rotates, Biases, QueryTerms, ValueTerms)):
        what = "one position per token" if mine == 1 else f"{mine} ids per token"
        raise UsageError(f"positions with an axis dimension ({count} ids per token) cannot be read by {label(encoding)}, "
                         f"which reads {what} (position_axes = {mine}): give it positions (T,) or (B, T)")


def as_taken(encoding: nn.Module, axes: torch.Tensor) -> torch.Tensor:
    """(A, B', T) ids in the form ``encoding.rotate`` takes them: as they are (axis first), or
    (B', T, A) (axis last)."""
    return axes if position_axes_of(encoding)[1] else axes.movedim(0, -1)


def text_continuation(next_positions: torch.Tensor, length: int, axes: int) -> torch.Tensor:
    """(A, B, length) ids of ``length`` tokens after ``next_positions`` (B,): row b's tokens at
    next_positions[b], next_positions[b] + 1, ... on every axis (M-RoPE's text after an image)."""
    ids = next_positions[:, None] + torch.arange(length, device=next_positions.device)  # (B, T)
    return ids.expand(axes, *ids.shape)


def one_axis_hint(encoding: nn.Module | None, positions: torch.Tensor) -> str:
    """The hint of a shape error for an encoding that reads one position per token."""
    if encoding is None or positions.dim() < 2 or position_axes_of(encoding)[0] > 1:
        return ""
    return (f" ({label(encoding)} reads one position per token: positions with an axis dimension are for an "
            "encoding with position_axes > 1)")


__all__ = ["as_taken", "check_axis_positions", "check_takes_axes", "in_words", "integer_tensor", "label", "one_axis_hint",
           "text_continuation"]
