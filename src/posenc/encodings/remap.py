"""Training-free position remaps of RoPE: SelfExtend, ReRoPE, STRING and dual chunk attention (DCA).

Each method keeps a model's own RoPE and changes only the relative position a query-key pair is
rotated at, as a function of (i, j) chosen by *region*. A region is a set of keys per query, given
as an interval of key positions ``low(i) <= j < high(i)``, and a pair of position maps: the query
is rotated at ``q_at(i)`` and the key at ``k_at(j)``, so the pair's RoPE distance is
``q_at(i) - k_at(j)``. The regions of a method are disjoint and together hold every causal key
(j <= i), so one softmax over all regions' scores is the method exactly; the attention computes
each region's part on the fast kernels and merges the parts by their log-sum-exp
(:mod:`posenc.backends.parts.remapped`). Shape legend: Tq queries, Tk keys; positions are 1-D
integer tensors.

The maps (i the query's position, j the key's, r = i - j >= 0 the true distance):

- **SelfExtend** (Jin et al. 2024, "LLM Maybe LongLM: Self-Extend LLM Context Window Without
  Tuning", §3, eq. 3-4): neighbour window W, group size G. Keys with r < W keep their positions;
  farther keys are rotated at ``j // G`` and their queries at ``i // G + W - W // G``, the shift
  that makes the grouped distance meet the neighbour distance at r = W. G = 1, or W >= the length,
  is plain RoPE.
- **ReRoPE** (Su 2023, "Rectified Rotary Position Embeddings", the blog post of 2023-07-31): the
  distance is clamped, ``min(r, w)``: keys with r < w exact, farther keys all at distance w
  (the query at w, the key at 0).
- **STRING** (An et al. 2024, "Why Does the Effective Context Length of LLMs Fall Short?",
  arXiv 2410.18745, §4, eq. 5): distances at or past the shift S reuse well-trained ones,
  ``r - S + W`` for r >= S, with a local window W (so that the largest distances, the least trained,
  are dropped). Distances below S are exact.
- **DCA** (An et al. 2024, "Training-Free Long-Context Scaling of Large Language Models", §3,
  arXiv 2402.17463): a pre-training length c (``chunk_size``) and a local window w (``local_size``);
  positions are cut into chunks of s = c - w and every key is rotated at ``j mod s``. Keys of the
  query's own chunk (intra-chunk) keep the true distance; keys of the chunk before it
  (successive-chunk) see the query at ``s + min(i mod s, w - 1)``, the true distance for the first w
  queries of a chunk and at least w after; keys of earlier chunks (inter-chunk) see the query at
  ``c - 1``. Every distance stays below c.

Invariants (tests/encodings/test_remap.py, against a dense reference written from these
equations): the regions partition the causal keys; G = 1 or W >= T gives plain RoPE; a packed row
equals its documents alone; cached decoding equals the full pass (the KV cache keeps un-rotated
keys: a remap offers no ``rotate`` hook, so the attention appends keys as they come and rotates
them per region at each call).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UsageError
from .base import PositionalEncoding
from .protocol import RemapRegion
from .rope import RoPE


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UsageError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


class PositionRemap(PositionalEncoding):
    """A model's RoPE under a training-free remap of its relative positions (the module docstring).

    Args:
        base, layout, rotary_dim, scaling, cache_length: the RoPE the remap rotates with
            (:class:`~posenc.encodings.rope.RoPE`); a scaling whose rotation depends on the length
            (``dynamic``, ``longrope``) is refused.

    Raises:
        UsageError: a length-dependent scaling, a bidirectional build, or an option out of range.
    """

    name = "remap"
    description = "RoPE with relative positions remapped by region (training-free context extension)"
    extrapolates = True
    causal_only = True
    shift_invariant = False  # grouped or chunked positions depend on i and j, not on i - j alone

    def __init__(self, num_heads: int, head_dim: int, causal: bool = True, base: float | None = None, layout: str = "half",
                 rotary_dim: int | None = None, scaling: dict[str, Any] | None = None, cache_length: int = 2048) -> None:
        super().__init__(num_heads, head_dim, causal)
        self.rope = RoPE(num_heads, head_dim, causal, base=base, layout=layout, rotary_dim=rotary_dim, scaling=scaling,
                         cache_length=cache_length)
        if self.rope.rotation_depends_on_length:
            raise UsageError(f"scaling: {self.name} remaps the positions of a fixed rotation; a {self.rope.scaling.rope_type!r} "
                             "scaling changes the rotation with the length (use linear, ntk, yarn, llama3 or none)")

    @property
    def base(self) -> float:
        return self.rope.base

    @property
    def layout(self) -> str:
        return self.rope.layout

    @property
    def rotary_dim(self) -> int:
        return self.rope.rotary_dim

    def rotate_at(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (B, H, T, D) rotated by RoPE at integer ``positions`` (T,) >= 0."""
        return self.rope.rotate_one(x, positions)

    def regions(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> list[RemapRegion]:
        """The method's regions for queries at ``q_positions`` (Tq,) and keys at ``k_positions`` (Tk,)."""
        raise NotImplementedError

    @staticmethod
    def _exact(q_positions: torch.Tensor, k_positions: torch.Tensor, low: torch.Tensor) -> RemapRegion:
        """Keys from ``low(i)`` up to the query itself at their own positions."""
        return RemapRegion(q_positions, k_positions, low, q_positions + 1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, base={self.base}, layout={self.layout!r}, rotary_dim={self.rotary_dim}"


_FAR = -(2**62)  # "every key before": a lower bound below any position


class SelfExtend(PositionRemap):
    """SelfExtend (Jin et al. 2024): neighbour keys (distance < ``window``) exact, farther ones at
    grouped positions ``floor(pos / group)``, the query shifted by ``window - window // group``."""

    name = "selfextend"
    description = "SelfExtend (Jin et al. 2024): a neighbour window exact, grouped positions beyond it; no training"

    def __init__(self, num_heads: int, head_dim: int, causal: bool = True, group: int = 4, window: int = 512,
                 base: float | None = None, layout: str = "half", rotary_dim: int | None = None,
                 scaling: dict[str, Any] | None = None, cache_length: int = 2048) -> None:
        super().__init__(num_heads, head_dim, causal, base, layout, rotary_dim, scaling, cache_length)
        self.group = _check_int("group", group, 1)
        self.window = _check_int("window", window, 1)

    def regions(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> list[RemapRegion]:
        g, w = self.group, self.window
        edge = q_positions - w + 1  # (Tq,) the first neighbour key
        near = self._exact(q_positions, k_positions, edge)
        far = RemapRegion(torch.div(q_positions, g, rounding_mode="floor") + (w - w // g),
                          torch.div(k_positions, g, rounding_mode="floor"), torch.full_like(q_positions, _FAR), edge)
        return [near, far]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group={self.group}, window={self.window}"


class ReRoPE(PositionRemap):
    """ReRoPE (Su 2023): the relative distance clamped at ``window``; nearer keys exact."""

    name = "rerope"
    description = "ReRoPE (Su 2023): distances clamped at a window, nearer keys exact; no training"

    def __init__(self, num_heads: int, head_dim: int, causal: bool = True, window: int = 512,
                 base: float | None = None, layout: str = "half", rotary_dim: int | None = None,
                 scaling: dict[str, Any] | None = None, cache_length: int = 2048) -> None:
        super().__init__(num_heads, head_dim, causal, base, layout, rotary_dim, scaling, cache_length)
        self.window = _check_int("window", window, 1)

    def regions(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> list[RemapRegion]:
        w = self.window
        edge = q_positions - w + 1
        near = self._exact(q_positions, k_positions, edge)
        far = RemapRegion(torch.full_like(q_positions, w), torch.zeros_like(k_positions), torch.full_like(q_positions, _FAR), edge)
        return [near, far]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, window={self.window}"


class STRING(PositionRemap):
    """STRING (An et al. 2024): distances r >= ``shift`` become ``r - shift + local``; nearer keys exact."""

    name = "string"
    description = "STRING (An et al. 2024): far distances shifted onto well-trained ones, a local window kept; no training"

    def __init__(self, num_heads: int, head_dim: int, causal: bool = True, shift: int = 2048, local: int = 128,
                 base: float | None = None, layout: str = "half", rotary_dim: int | None = None,
                 scaling: dict[str, Any] | None = None, cache_length: int = 2048) -> None:
        super().__init__(num_heads, head_dim, causal, base, layout, rotary_dim, scaling, cache_length)
        self.shift = _check_int("shift", shift, 1)
        self.local = _check_int("local", local, 0)
        if self.local > self.shift:
            raise UsageError(f"local must be in [0, shift={self.shift}] (the shifted distances start at local), got {local}")

    def regions(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> list[RemapRegion]:
        s = self.shift
        edge = q_positions - s + 1
        near = self._exact(q_positions, k_positions, edge)
        # (i + local) - (j + shift) = r - shift + local; both maps stay >= 0.
        far = RemapRegion(q_positions + self.local, k_positions + s, torch.full_like(q_positions, _FAR), edge)
        return [near, far]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, shift={self.shift}, local={self.local}"


class DualChunk(PositionRemap):
    """Dual chunk attention (An et al. 2024): intra-chunk, successive-chunk and inter-chunk maps over
    chunks of ``chunk_size - local_size`` positions; every distance below ``chunk_size``."""

    name = "dca"
    description = "dual chunk attention (An et al. 2024): intra, successive and inter-chunk position maps; no training"

    def __init__(self, num_heads: int, head_dim: int, causal: bool = True, chunk_size: int = 4096, local_size: int = 1024,
                 base: float | None = None, layout: str = "half", rotary_dim: int | None = None,
                 scaling: dict[str, Any] | None = None, cache_length: int = 2048) -> None:
        super().__init__(num_heads, head_dim, causal, base, layout, rotary_dim, scaling, cache_length)
        self.chunk_size = _check_int("chunk_size", chunk_size, 2)
        self.local_size = _check_int("local_size", local_size, 1)
        if self.local_size >= self.chunk_size:
            raise UsageError(f"local_size must be in [1, chunk_size={self.chunk_size}), got {local_size}")

    @property
    def chunk(self) -> int:
        """s = chunk_size - local_size, the positions of one chunk."""
        return self.chunk_size - self.local_size

    def regions(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> list[RemapRegion]:
        s, w, c = self.chunk, self.local_size, self.chunk_size
        start = torch.div(q_positions, s, rounding_mode="floor") * s  # (Tq,) the query's chunk's first position
        inner = q_positions - start  # i mod s
        k_at = k_positions - torch.div(k_positions, s, rounding_mode="floor") * s  # j mod s
        intra = self._exact(q_positions, k_positions, start)
        successive = RemapRegion(s + inner.clamp(max=w - 1), k_at, start - s, start)
        inter = RemapRegion(torch.full_like(q_positions, c - 1), k_at, torch.full_like(q_positions, _FAR), start - s)
        return [intra, successive, inter]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunk_size={self.chunk_size}, local_size={self.local_size}"


__all__ = ["DualChunk", "PositionRemap", "ReRoPE", "STRING", "SelfExtend"]
