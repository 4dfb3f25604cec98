"""Positions on a subset of heads: any encoding on ``position_heads`` of the heads, NoPE on the rest.

The form of x-transformers' ``alibi_num_heads`` (ALiBi on the first heads, its slopes those of that
many heads, a zero bias on the others) and ``rotate_num_heads`` (the rotation on the last heads, the
others left as they are). One option for every method, handled once: :func:`posenc.build` takes
``position_heads`` (a count in 1 .. num_heads) and ``position_heads_at`` ("first" or "last") beside
a method's own options, builds the method for that many heads, and wraps it in :class:`PartialHeads`,
which offers exactly the hooks the method offers, each acting on the chosen heads:

- ``rotate``: the chosen heads of q and of k turned, the others as given (with grouped-query keys
  the chosen query heads must be whole groups, and their key heads are turned);
- ``bias``, ``score``, ``relative_bias``, ``bias_tails``: the method's on the chosen heads, 0 (and
  a slope of 0) on the others;
- ``query_terms``, ``value_terms``: the method's on the chosen heads' slice, 0 on the others;
- ``log_gates``: the method's on the chosen heads, 0 (no decay) on the others.

Other hooks (``embed``: an absolute embedding adds to the whole width, not to heads; ``Remaps``;
``Curves``; ``Selects``) are refused with a UsageError, and so is a rotation that changes the head
width (PoPE). The fused capabilities (``ClippedTables``, ``DistanceKeys``, ...) are not passed on:
the backends take the hooks' general paths, which are exact. The wrapped method sees its own heads
only; its plain attributes (sharing, causality, length-dependence, position axes) are its own.

Shape legend: B batch, H heads, Hkv key heads, P the positioned heads, T length, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import UsageError
from .base import PositionalEncoding
from .protocol import (
    Biases,
    BiasTails,
    Curves,
    DistanceBias,
    Embeds,
    Gates,
    QueryTerms,
    RelativeBias,
    Remaps,
    Rotates,
    Scores,
    Selects,
    ValueTerms,
    offers,
    require,
)

PLACES = ("first", "last")
OPTIONS = ("position_heads", "position_heads_at")  # the options every method takes (posenc.build)
REFUSED: tuple[tuple[type, str], ...] = (
    (Embeds, "embed adds to the whole width, not to heads"), (Remaps, "remaps the rotation of every head"),
    (Curves, "its curves are not per head alone"), (Selects, "its selection is shared by the heads"),
)


def check_heads(count: Any, num_heads: int, at: Any) -> tuple[int, str]:
    """(count, place), checked.

    Raises:
        UsageError: ``position_heads`` not an integer in [1, num_heads], or ``position_heads_at``
            not "first" or "last".
    """
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= num_heads:
        raise UsageError(f"position_heads must be an integer in [1, num_heads={num_heads}], got {count!r}")
    if at not in PLACES:
        raise UsageError(f"position_heads_at must be one of {PLACES}, got {at!r}")
    return count, at


class PartialHeads(PositionalEncoding):
    """``inner`` (built for ``position_heads`` heads) on those heads of ``num_heads``; NoPE elsewhere.

    Args:
        inner: the method, built with num_heads = the positioned count.
        num_heads: all heads of the attention.
        position_heads_at: "first" (x-transformers' ALiBi) or "last" (its rotation) heads.

    Raises:
        UsageError: a count outside [1, num_heads], an unknown place, or a method with a hook that
            cannot act on some heads (see the module docstring).
    """

    name = "partial_heads"
    description = "any encoding on a subset of heads, NoPE on the others (x-transformers' alibi_num_heads, rotate_num_heads)"

    def __init__(self, inner: PositionalEncoding, num_heads: int, position_heads_at: str = "first") -> None:
        count, at = check_heads(inner.num_heads, num_heads, position_heads_at)
        super().__init__(num_heads, inner.head_dim, inner.causal)
        for hook, why in REFUSED:
            if offers(inner, hook):
                raise UsageError(f"position_heads: {inner.name} cannot act on a subset of heads ({why})")
        self.inner = inner
        self.position_heads, self.position_heads_at = count, at
        self.start = 0 if at == "first" else num_heads - count  # the first positioned head
        self.max_positions = inner.max_positions

    # -- the method's own attributes --------------------------------------------------------------

    @property
    def shares_across_layers(self) -> bool:
        return self.inner.shares_across_layers

    @property
    def rotation_depends_on_length(self) -> bool:
        return self.inner.rotation_depends_on_length

    @property
    def content_scale(self) -> float | None:
        return self.inner.content_scale

    # (causal_only needs no copy: the method, built with the same causal, has refused already)
    @property
    def extrapolates(self) -> bool:  # type: ignore[override]  # (a ClassVar of the classes; the method's here)
        return self.inner.extrapolates

    @property
    def shift_invariant(self) -> bool:  # type: ignore[override]  # (as extrapolates)
        return self.inner.shift_invariant

    @property
    def position_axes(self) -> int:  # type: ignore[override]  # (as extrapolates)
        return self.inner.position_axes

    @property
    def axis_first(self) -> bool:  # type: ignore[override]  # (as extrapolates)
        return self.inner.axis_first

    # -- heads ------------------------------------------------------------------------------------

    def chosen(self, x: torch.Tensor, label: str) -> slice:
        """The slice of ``x``'s head dimension (dim 1) the method acts on: H heads, or Hkv key heads
        whose groups are all chosen.

        Raises:
            UsageError: a head count that does not divide num_heads, or chosen query heads that are not
                whole groups of the key heads.
        """
        heads = x.shape[1]
        if heads == self.num_heads:
            return slice(self.start, self.start + self.position_heads)
        group = self.num_heads // heads if heads and self.num_heads % heads == 0 else 0
        if not group or self.start % group or self.position_heads % group:
            raise UsageError(f"position_heads: {label} has {heads} heads; with num_heads={self.num_heads} the "
                             f"{self.position_heads_at} {self.position_heads} positioned heads must be whole groups of them")
        return slice(self.start // group, (self.start + self.position_heads) // group)

    def padded(self, part: torch.Tensor, dim: int) -> torch.Tensor:
        """``part`` with P entries along ``dim`` (the head dimension) placed among H, zeros elsewhere."""
        before, after = self.start, self.num_heads - self.start - self.position_heads
        shape = list(part.shape)
        pieces = []
        for n in (before, after):
            shape[dim] = n
            pieces.append(part.new_zeros(shape))
        return torch.cat((pieces[0], part, pieces[1]), dim=dim)

    # -- the hooks, present when the method has them --------------------------------------------------

    @property
    def rotate(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
        return self._rotate if offers(self.inner, Rotates) else None

    def _rotate(self, q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        sq, sk = self.chosen(q, "q"), self.chosen(k, "k")
        rq, rk = require(self.inner, Rotates).rotate(q[:, sq], k[:, sk], q_positions, k_positions)
        if rq.shape[-1] != q.shape[-1] or rk.shape[-1] != k.shape[-1]:
            raise UsageError(f"position_heads: {self.inner.name}'s rotation changes the head width "
                             f"({q.shape[-1]} -> {rq.shape[-1]}); the other heads cannot keep theirs")
        q, k = q.clone(), k.clone()  # (B, H, Tq, D), (B, Hkv, Tk, D): the others as given
        q[:, sq], k[:, sk] = rq, rk
        return q, k

    @property
    def bias(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        return self._bias if offers(self.inner, Biases) else None

    def _bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        return self.padded(require(self.inner, Biases).bias(q_positions, k_positions), 0)  # (H, Tq, Tk)

    @property
    def score(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
        return self._score if offers(self.inner, Scores) else None

    def _score(self, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        own = h - self.start
        inside = (own >= 0) & (own < self.position_heads)
        value = require(self.inner, Scores).score(own.clamp(0, self.position_heads - 1), i, j)
        return torch.where(inside, value, torch.zeros_like(value))  # elementwise: flex's score modifier

    @property
    def relative_bias(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return self._relative_bias if offers(self.inner, DistanceBias) else None

    def _relative_bias(self, relative: torch.Tensor) -> torch.Tensor:
        return self.padded(require(self.inner, DistanceBias).relative_bias(relative), 0)  # (H, *r.shape)

    @property
    def bias_tails(self) -> Callable[[], BiasTails] | None:
        return self._bias_tails if offers(self.inner, RelativeBias) else None

    def _bias_tails(self) -> BiasTails:
        tails = require(self.inner, RelativeBias).bias_tails()
        past = None if tails.past_slope is None else self.padded(tails.past_slope, 0)  # (H,): slope 0 on the others
        future = None if tails.future_slope is None else self.padded(tails.future_slope, 0)
        return BiasTails(tails.past, past, tails.future, future)

    @property
    def query_terms(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
        return self._query_terms if offers(self.inner, QueryTerms) else None

    def _query_terms(self, q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        terms = require(self.inner, QueryTerms).query_terms(q[:, self.chosen(q, "q")], k[:, self.chosen(k, "k")], q_positions, k_positions)
        return self.padded(terms, 1)  # (B, H, Tq, Tk)

    @property
    def value_terms(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
        return self._value_terms if offers(self.inner, ValueTerms) else None

    def _value_terms(self, probs: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        return self.padded(require(self.inner, ValueTerms).value_terms(probs[:, self.chosen(probs, "probs")], q_positions, k_positions), 1)

    @property
    def log_gates(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return self._log_gates if offers(self.inner, Gates) else None

    def _log_gates(self, x: torch.Tensor) -> torch.Tensor:
        return self.padded(require(self.inner, Gates).log_gates(x), 1)  # (B, H, T): log 1 = 0 on the others

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, position_heads={self.position_heads}, position_heads_at={self.position_heads_at!r}"


__all__ = ["OPTIONS", "PLACES", "PartialHeads", "check_heads"]
