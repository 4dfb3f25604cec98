"""2-D RoPE for patch grids: axial RoPE and RoPE-Mixed (Heo et al. 2024, "Rotary Position
Embedding for Vision Transformer", ECCV 2024, arXiv 2403.13298, §3).

A patch n of an image has two positions (x_n, y_n) (column, row). Feature pair f of q and k is
rotated by an angle linear in both:

    axial:  angle_f(n) = x_n * theta_f          for f <  D/4,                       (RoPE-Axial)
            angle_f(n) = y_n * theta_{f - D/4}  for f >= D/4,   theta_k = base^(-4k/D)
    mixed:  angle_{h,f}(n) = x_n * theta^x_{h,f} + y_n * theta^y_{h,f}               (RoPE-Mixed)

Axial RoPE splits the frequencies over the two axes (the x pairs first, then the y pairs, the order
of the authors' code and of timm); a score then depends on (x_i - x_j, y_i - y_j), one axis per
band, so it cannot represent a diagonal direction. RoPE-Mixed learns both frequencies of every pair,
per head and per layer (learned parameters: ``shares_across_layers`` is False), so each pair rotates along its own
direction of the plane. Its initialisation is the paper's: theta^x_{h,k} = m_k cos(a_h),
theta^y_{h,k} = m_k sin(a_h) for k < D/4 and the same at a_h + pi/2 for k >= D/4, with
m_k = base^(-4k/D) and one random angle a_h ~ U[0, 2 pi) per head; axial RoPE is the special case
theta^x = (theta, 0), theta^y = (0, theta) (tests/encodings/test_axial_rope.py checks it). The paper's bases:
100 for axial, 10 for mixed (the defaults here).

One file for both: they share the positions, the grid helper and the frequency magnitudes, and
differ only in whether the frequencies are fixed and shared or learned per head.

Positions with an axis dimension, axis last (see :mod:`.mrope` for the forms): (T, 2) for every
row or (B, T, 2) per row, ``[..., 0]`` the x (column) and ``[..., 1]`` the y (row) index, non-negative
integers; :func:`patch_positions` gives them for an (height x width) grid flattened row by row.
1-D positions (T,) are the diagonal points (p, p), as M-RoPE does for text, so a model, the KV
cache and generation run both encodings on a sequence unchanged. Both declare their ids
(``position_axes = 2``, ``axis_first = False``), so ``posenc.attend``, ``posenc.Attention`` and
``posenc.LM`` take (T, 2) and (B, T, 2) as ``positions`` too; the masks (padding, documents, the
causal order if any) read the sequence index (:mod:`posenc.call.geometry`).

What they match (tests/encodings/test_axial_rope.py, against ``timm.layers.pos_embed_sincos``):

- :class:`AxialRoPE`, ``layout="interleaved"``: ``RotaryEmbeddingCat(dim=D, in_pixels=False,
  temperature=base, grid_indexing="xy")`` applied with ``apply_rot_embed_cat`` (timm's "index"
  grid of integer patch positions, EVA-02's setting); ``layout="half"`` is its
  ``rotate_half=True``, and timm's default ``grid_indexing="ij"`` puts y first (positions (y, x)).
  timm's pixel mode (``in_pixels=True``: coordinates in [-1, 1] and linear pixel bands) is not a
  form of this class.
- :class:`RoPEMixed`, ``layout="interleaved"``: ``RotaryEmbeddingMixed(dim=H*D, depth, num_heads,
  temperature=base)`` (``grid_indexing="xy"``), layer l's frequencies copied as
  ``frequencies = freqs[:, l]``, applied with ``apply_rot_embed_cat``.

Precision: the angles in float64 (integer positions times float32 frequencies: exact products,
rounded once to float32 cos/sin), the rotation in float32, cast back once, as :mod:`.rope`. Under
``torch.compile`` nothing is read on the host (no graph break): axial RoPE's ids index its table as
built (``cache_length`` rows), RoPE-Mixed computes its angles from them directly.

Shape legend: B batch, H heads, T patches (tokens), D head dim, F = D/2 frequencies.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import UsageError, check_positive
from .base import PositionalEncoding
from .mrope import axis_positions, rotate_by_axes, select_axes
from .rope import LAYOUTS, RotaryTable, apply_rotation
from .rope_scaling import default_frequencies


def patch_positions(height: int, width: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(height * width, 2) LongTensor of (x, y) = (column, row) for a grid flattened row by row
    (patch n = y * width + x)."""
    check_positive("height", height), check_positive("width", width)
    y, x = torch.meshgrid(torch.arange(height, device=device), torch.arange(width, device=device), indexing="ij")
    return torch.stack((x.flatten(), y.flatten()), dim=-1)  # (T, 2)


def _check_common(encoding: PositionalEncoding, base: object, layout: str) -> None:
    if encoding.head_dim % 4:
        raise UsageError(f"{encoding.name} needs head_dim divisible by 4 (two axes of feature pairs), got {encoding.head_dim}")
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 1:
        raise UsageError(f"base must be > 1, got {base!r}")
    if layout not in LAYOUTS:
        raise UsageError(f"layout must be one of {LAYOUTS}, got {layout!r}")


class AxialRoPE(PositionalEncoding):
    """2-D axial RoPE: the first D/4 feature pairs rotate with x, the next D/4 with y.

    Positions: (T,) the diagonal, (T, 2) or (B, T, 2) (x, y) per patch, in ``rotate`` and as
    ``positions`` of ``posenc.attend`` / ``posenc.Attention`` / ``posenc.LM``.

    Args:
        base: theta base (the paper's 100; timm's ``temperature``, EVA-02 uses 10000).
        layout: "interleaved" (pairs 2f, 2f + 1: the authors' code, timm's default) or "half".
        cache_length: initial rows of the cos/sin table (grows with the largest coordinate).
    """

    name = "axial_rope"
    description = "2-D RoPE for patch grids, frequencies split over x and y (Heo et al. 2024, RoPE-Axial)"
    extrapolates = True
    shift_invariant = True  # moving every patch by the same (dx, dy) leaves every difference
    position_axes, axis_first = 2, False  # (x, y) per patch, axis last: (T, 2) or (B, T, 2)

    def __init__(
        self, num_heads: int, head_dim: int, causal: bool = True, base: float = 100.0, layout: str = "interleaved",
        cache_length: int = 2048,
    ) -> None:
        super().__init__(num_heads, head_dim, causal)
        _check_common(self, base, layout)
        self.base, self.layout = float(base), layout
        theta = default_frequencies(self.base, head_dim // 2).to(torch.float32)  # (D/4,) base^(-4k/D)
        self._table = RotaryTable(torch.cat((theta, theta)), check_positive("cache_length", cache_length))  # (F,)
        self.axis_of = torch.arange(2).repeat_interleave(head_dim // 4)  # (F,): x for f < D/4, then y

    @property
    def inv_freq(self) -> torch.Tensor:
        """float32 (F,) frequency of each pair: (theta, theta), the x band then the y band."""
        return self._table.inv_freq

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B, H, Tq, D), k (B, H, Tk, D) at positions (T,), (T, 2) or (B, T, 2) -> the same shapes."""
        out = []
        for label, x, positions in (("q", q, q_positions), ("k", k, k_positions)):
            pos, needed = axis_positions(self, label, positions, x, 2, axis_first=False)  # (2, B', T)
            cos, sin = select_axes(self._table, pos, needed, self.axis_of)  # (B', 1, T, F)
            out.append(apply_rotation(x, cos, sin, self.layout))
        return out[0], out[1]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, base={self.base}, layout={self.layout!r}"


def mixed_init(num_heads: int, head_dim: int, base: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """The paper's initial RoPE-Mixed frequencies, (2, H, F) float32 on the CPU (as
    ``default_frequencies``, also inside a ``torch.device("meta")`` block): [0] multiplies x, [1] y
    (the module docstring's formula; one angle per head from ``generator``, torch's global one by
    default)."""
    mag = default_frequencies(base, head_dim // 2)  # (D/4,) float64
    angle = torch.rand(num_heads, 1, generator=generator, dtype=torch.float64, device="cpu") * (2 * math.pi)  # (H, 1), beside mag
    quarter = angle + math.pi / 2
    fx = torch.cat((mag * angle.cos(), mag * quarter.cos()), dim=-1)  # (H, F)
    fy = torch.cat((mag * angle.sin(), mag * quarter.sin()), dim=-1)
    return torch.stack((fx, fy)).to(torch.float32)


class RoPEMixed(PositionalEncoding):
    """RoPE-Mixed: learned per-head frequencies over both axes, angle = x theta^x + y theta^y.

    Args:
        base: base of the initial magnitudes m_k = base^(-4k/D) (the paper's 10).
        layout: "interleaved" (the authors' code, timm) or "half".
        num_kv_heads: key heads of grouped-query attention (default num_heads). A query and the key
            it scores must turn with the same frequencies, so the frequencies are learned per key
            head and the query heads of a group share their key head's; keys with num_heads heads
            (repeated) are rotated as their group. Keys with another head count are a UsageError.

    ``frequencies`` (2, num_kv_heads, D/2), a parameter: ``[0]`` multiplies x (positions[..., 0]),
    ``[1]`` y. Positions as :class:`AxialRoPE`'s: (T,), (T, 2) or (B, T, 2), also through
    ``posenc.attend`` / ``posenc.Attention`` / ``posenc.LM``.
    """

    name = "rope_mixed"
    description = "2-D RoPE with learned per-head frequencies over x and y (Heo et al. 2024, RoPE-Mixed)"
    extrapolates = True
    # not shared across layers (derived from its learned parameters): every layer learns its own frequencies
    shift_invariant = True  # angles are linear in the positions: a common shift cancels in every score
    position_axes, axis_first = 2, False  # (x, y) per patch, axis last: (T, 2) or (B, T, 2)

    def __init__(
        self, num_heads: int, head_dim: int, causal: bool = True, base: float = 10.0, layout: str = "interleaved",
        num_kv_heads: int | None = None,
    ) -> None:
        super().__init__(num_heads, head_dim, causal)
        _check_common(self, base, layout)
        kv = num_heads if num_kv_heads is None else check_positive("num_kv_heads", num_kv_heads)
        if num_heads % kv:
            raise UsageError(f"num_kv_heads must divide num_heads={num_heads}, got {kv}")
        self.base, self.layout, self.num_kv_heads = float(base), layout, kv
        self.frequencies = nn.Parameter(mixed_init(kv, head_dim, self.base))  # (2, Hkv, F)

    def cos_sin(self, positions: torch.Tensor, x: torch.Tensor, label: str = "q") -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin (B', H', T, F) of ``x`` (B, H', T, D) at ``positions``; H' is
        num_kv_heads, or num_heads (each head at its key head's frequencies)."""
        pos, _ = axis_positions(self, label, positions, x, 2, axis_first=False)  # (2, B', T)
        heads = x.shape[1]
        if heads not in (self.num_heads, self.num_kv_heads):
            raise UsageError(
                f"rope_mixed: {label} has {heads} heads, but the encoding was built for num_heads={self.num_heads} "
                f"and num_kv_heads={self.num_kv_heads} (build it with num_kv_heads={heads} for grouped-query keys)"
            )
        freqs = self.frequencies.to(torch.float64)  # (2, Hkv, F)
        if heads != self.num_kv_heads:
            freqs = freqs.repeat_interleave(heads // self.num_kv_heads, dim=1)  # (2, H, F): a group shares its key head's
        p = pos.to(device=freqs.device, dtype=torch.float64)
        angle = p[0, :, None, :, None] * freqs[0, None, :, None, :] + p[1, :, None, :, None] * freqs[1, None, :, None, :]  # (B', H, T, F)
        return angle.cos().to(torch.float32), angle.sin().to(torch.float32)

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B, H, Tq, D), k (B, H, Tk, D) at positions (T,), (T, 2) or (B, T, 2) -> the same shapes."""
        return rotate_by_axes(self, q, k, q_positions, k_positions)

    def extra_repr(self) -> str:
        kv = "" if self.num_kv_heads == self.num_heads else f", num_kv_heads={self.num_kv_heads}"
        return f"{super().extra_repr()}, base={self.base}, layout={self.layout!r}{kv}"


__all__ = ["AxialRoPE", "RoPEMixed", "mixed_init", "patch_positions"]
