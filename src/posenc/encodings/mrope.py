"""Multimodal RoPE, M-RoPE (Wang et al. 2024, "Qwen2-VL: Enhancing Vision-Language Model's
Perception of the World at Any Resolution", arXiv 2409.12191, §2.1), with Qwen2.5-VL's absolute-time
temporal ids (Bai et al. 2025, arXiv 2502.13923) and Qwen3-VL's interleaved assignment (Qwen Team
2025; the rule as transformers' Qwen3-VL text rotary embedding applies it), and the positions with
an axis dimension it takes.

RoPE (Su et al. 2021, :mod:`.rope`) rotates feature pair f of q and k by ``p * theta_f``,
``theta_f = base^(-2f/D)``, f = 0 .. D/2 - 1. M-RoPE gives every token three position ids,
(temporal, height, width), and gives every frequency f one axis a(f): pair f of token n is rotated
by

    angle_f(n) = p_{a(f)}(n) * theta_f                                             (M-RoPE)

so a query-key score depends on the three differences of the ids. ``mrope_section`` = (s_t, s_h,
s_w), summing to D/2, says how many frequencies each axis gets:

- contiguous (Qwen2-VL, Qwen2.5-VL): a(f) = temporal for f < s_t, height for s_t <= f < s_t + s_h,
  width for the rest: each axis gets one band of the spectrum;
- interleaved (Qwen3-VL, ``mrope_interleaved=True``): a(f) = height if f % 3 == 1 and f < 3 s_h,
  width if f % 3 == 2 and f < 3 s_w, temporal otherwise: each axis gets frequencies from the whole
  range.

Partial rotation (GLM-4.1V, ``partial_rotary_factor``): with ``rotary_dim`` r < D only the first r
features of a head rotate, over F = r/2 frequencies ``theta_f = base^(-2f/r)`` that the sections
split (summing to r/2); the other D - r features pass through, as in RoPE's partial rotary.

A text token has its three ids equal, p_t = p_h = p_w = p, and is then rotated exactly as 1-D RoPE
at p; :meth:`MRoPE.rotate` given 1-D positions (T,) does that, so the model, the KV cache and
generation run it as RoPE. A vision token of a (t, h, w) grid that starts at s has ids
(s + i_t, s + i_h, s + i_w) (Qwen2.5-VL: the temporal id steps by absolute time instead), and the
text after it continues at max(id) + 1, not at its index in the sequence: **a token's position is
not its slot in the KV cache**. :func:`vision_text_positions` builds such ids and
:func:`continue_positions` the ids of the tokens decoded after them (each row continues at its own
max + 1; Hugging Face keeps that offset as ``rope_deltas``).

Positions with an axis dimension, as every multi-axis rotation here takes them (M-RoPE puts the
axis first, as Qwen2-VL passes them; the patch-grid rotations of :mod:`.axial_rope` put it last):
(T,) one id per token, used on every axis; (A, T) one set for every batch row; (A, B, T) per row.
They are non-negative integers; they need not increase, nor be distinct, along T. The encoding
declares them (``position_axes = 3``, ``axis_first = True``), so ``posenc.attend``,
``posenc.Attention`` and ``posenc.LM`` take them as ``positions`` too (:mod:`posenc.call.geometry`):
q and k are rotated at their ids while the masks read the sequence index (the cache slot when
decoding), and a KV cache that has seen such ids continues each row without positions at its own
max(id) + 1 (:meth:`posenc.model.cache.LayerCache.next_positions`).

Precision: as :mod:`.rope`: float32 cos/sin tables of float64 angles (``RotaryTable``), the rotation
in float32, cast back once. Under ``torch.compile`` the ids are not read on the host (no graph
break): they index the table as built (``cache_length`` rows, 2048 by default), as RoPE's compiled
path does.

Shape legend: B batch, H heads, T length, D head dim, r rotated features (``rotary_dim``, D by
default), F = r/2 frequencies, A axes (3 here).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from ..errors import UsageError, check_positive
from .base import PositionalEncoding
from .rope import LAYOUTS, RotaryTable, apply_rotation, position_range
from .rope_scaling import default_frequencies

AXES = ("temporal", "height", "width")


def axis_positions(
    encoding: PositionalEncoding, label: str, positions: torch.Tensor, x: torch.Tensor, num_axes: int | None = None,
    axis_first: bool | None = None,
) -> tuple[torch.Tensor, int | None]:
    """Positions of ``x`` (B, H, T, D) as an (A, B', T) LongTensor, B' = 1 or B, and the largest id
    + 1 (one device sync; None while ``torch.compile`` traces, which reads nothing on the host);
    UsageError otherwise.

    Accepted: (T,) (the same id on every axis), one set for all rows, (A, T) axis-first or (T, A)
    axis-last, and per row (A, B, T) or (B, T, A). ``label`` names the argument in messages;
    ``num_axes`` and ``axis_first`` default to the encoding's ``position_axes`` and ``axis_first``.
    """
    num_axes = encoding.position_axes if num_axes is None else num_axes
    axis_first = encoding.axis_first if axis_first is None else axis_first
    name, batch, length = encoding.name, x.shape[0], x.shape[-2]
    if x.shape[-1] != encoding.head_dim:
        raise UsageError(f"{name}: {label} has {x.shape[-1]} features per head, but the encoding was built for head_dim={encoding.head_dim}")
    if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
        got = positions.dtype if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise UsageError(f"{name}: {label}_positions must be an integer tensor, got {got}")
    forms = f"({length},), ({num_axes}, {length}) or ({num_axes}, B, {length})" if axis_first else \
        f"({length},), ({length}, {num_axes}) or (B, {length}, {num_axes})"
    shape = tuple(positions.shape)
    if positions.dim() == 1 and shape[0] == length:
        out = positions.view(1, 1, length).expand(num_axes, 1, length)
    elif positions.dim() in (2, 3):
        p = positions if axis_first else positions.movedim(-1, 0)  # (A, [B,] T)
        p = p if p.dim() == 3 else p.unsqueeze(1)
        if p.shape[0] != num_axes or p.shape[-1] != length or p.shape[1] not in (1, batch):
            axes = shape[0] if axis_first else shape[-1]
            what = f"{axes} axes, {name} has {num_axes}" if axes != num_axes else f"shape {shape}"
            raise UsageError(f"{name}: {label}_positions must have shape {forms} with B = {batch}; got {what}")
        out = p
    else:
        raise UsageError(f"{name}: {label}_positions must have shape {forms} with B = {batch}; got shape {shape}")
    if torch.compiler.is_compiling():  # no host read in a compiled graph: the table's indexing checks the bounds
        return out.long(), None
    needed = position_range(f"{name}: {label}_positions", out)[1]  # and a UsageError for a negative id
    return out.long(), needed


def select_axes(
    table: RotaryTable, positions: torch.Tensor, needed: int | None, axis_of: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin (B', 1, T, F) with entry f at ``positions[axis_of[f]]`` (positions
    (A, B', T), all < ``needed``): the angles of one set of frequencies, each at its own axis.
    ``needed`` None (compiling): the table as it is, ``cache_length`` rows, as RoPE's compiled path."""
    a, b, t = positions.shape
    flat = positions.reshape(-1)
    if needed is None:
        if table.cos.device != positions.device:
            table.build(table.length, positions.device)
        cos, sin = table.cos[flat], table.sin[flat]  # (A * B' * T, F)
    else:
        cos, sin = table.lookup(flat, max(needed, 1))  # (A * B' * T, F)
    index = axis_of.to(positions.device).view(1, 1, 1, -1).expand(1, b, t, -1)  # (1, B', T, F)
    def pick(c: torch.Tensor) -> torch.Tensor:
        return c.view(a, b, t, -1).gather(0, index).view(b, 1, t, -1)

    return pick(cos), pick(sin)


def mrope_axes(half: int, mrope_section: Sequence[int], interleaved: bool) -> torch.Tensor:
    """The axis of each of the ``half`` = D/2 frequencies, (F,) LongTensor of 0 (temporal), 1
    (height), 2 (width), by the contiguous or interleaved rule of the module docstring."""
    s_t, s_h, s_w = mrope_section
    f = torch.arange(half)
    if not interleaved:
        return (f >= s_t).long() + (f >= s_t + s_h).long()
    axis = torch.zeros(half, dtype=torch.long)
    axis[(f % 3 == 1) & (f < 3 * s_h)] = 1
    axis[(f % 3 == 2) & (f < 3 * s_w)] = 2
    return axis


def default_section(half: int, interleaved: bool) -> list[int]:
    """The Qwen proportions for any F: contiguous as Qwen2-VL's (16, 24, 24) of 64 (F // 4, the rest
    split in two), interleaved as Qwen3-VL's (24, 20, 20) (5F // 16 each for height and width)."""
    if interleaved:
        hw = 5 * half // 16
        return [half - 2 * hw, hw, hw]
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


class AxisTables(Protocol):
    """An encoding whose frequencies each follow one axis of the positions (M-RoPE, axial RoPE):
    ``cos_sin(positions, x, label)`` gives float32 cos and sin (B', 1 or H, T, F) and ``layout``
    pairs the features."""

    layout: str

    def cos_sin(self, positions: torch.Tensor, x: torch.Tensor, label: str = "q") -> tuple[torch.Tensor, torch.Tensor]: ...


def rotate_by_axes(
    encoding: AxisTables, q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, Tq, D) and k (B, H, Tk, D) rotated by ``encoding``'s tables at their positions -> the
    same shapes (RoPE's rotation, Su et al. 2021 eq. 34, one angle per frequency from its axis)."""
    (cq, sq), (ck, sk) = encoding.cos_sin(q_positions, q, "q"), encoding.cos_sin(k_positions, k, "k")
    return apply_rotation(q, cq, sq, encoding.layout), apply_rotation(k, ck, sk, encoding.layout)


class MRoPE(PositionalEncoding):
    """M-RoPE: RoPE whose frequencies are split over three position axes (temporal, height, width).

    Matches Hugging Face ``transformers``' Qwen2-VL / Qwen2.5-VL text rotary embedding
    (contiguous sections) and Qwen3-VL's (``mrope_interleaved=True``) followed by its
    ``apply_rotary_pos_emb``, which use ``layout="half"`` (tests/encodings/test_mrope.py; through
    ``posenc.attend`` and ``posenc.Attention`` with Qwen2-VL's ``get_rope_index`` ids,
    tests/call/test_axes.py). Only the default frequencies (no long-context scaling).

    Positions: (T,) text ids, (3, T) or (3, B, T) ids (temporal, height, width) per token, in
    ``rotate`` and as ``positions`` of ``posenc.attend`` / ``posenc.Attention`` / ``posenc.LM``
    (``position_axes = 3``, axis first).

    Args:
        base: theta base (default 10000; transformers' config defaults: Qwen2-VL 1e6, Qwen3-VL 5e5).
        mrope_section: frequencies per axis (temporal, height, width), three non-negative integers
            summing to rotary_dim / 2; None: Qwen2-VL's proportions, (16, 24, 24) for 128 rotated
            features, or with ``mrope_interleaved`` Qwen3-VL's, (24, 20, 20).
        mrope_interleaved: Qwen3-VL's interleaved assignment instead of contiguous sections.
        layout: "half" (Qwen, feature f pairs with f + r/2) or "interleaved" (2f with 2f + 1: GLM-4V).
        cache_length: initial rows of the cos/sin table (grows as needed).
        rotary_dim: r, the rotated features (even, in [2, head_dim]; None: head_dim): the first r of
            each head rotate, the rest pass through (GLM-4.1V's partial rotary).

    Raises:
        UsageError: an odd or out-of-range ``rotary_dim``, a section that is not 3 non-negative
            integers summing to r/2 (or cannot be interleaved over them), a base <= 1, an unknown layout.
    """

    name = "mrope"
    description = "RoPE with frequencies split over (temporal, height, width) ids (Wang et al. 2024, Qwen2-VL; Qwen3-VL interleaved)"
    extrapolates = True
    shift_invariant = True  # shifting every id of a row by one amount leaves every id difference unchanged
    position_axes = 3  # (temporal, height, width) ids per token,
    axis_first = True  # axis first, (3, T) or (3, B, T), as Qwen2-VL passes them

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        causal: bool = True,
        base: float = 10000.0,
        mrope_section: Sequence[int] | None = None,
        mrope_interleaved: bool = False,
        layout: str = "half",
        cache_length: int = 2048,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__(num_heads, head_dim, causal)
        if head_dim % 2:
            raise UsageError(f"mrope needs an even head_dim, got {head_dim}")
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or not 2 <= rotary_dim <= head_dim or rotary_dim % 2:
            raise UsageError(f"rotary_dim must be an even integer in [2, head_dim={head_dim}], got {rotary_dim!r}")
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 1:
            raise UsageError(f"base must be > 1, got {base!r}")
        if layout not in LAYOUTS:
            raise UsageError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if not isinstance(mrope_interleaved, bool):
            raise UsageError(f"mrope_interleaved must be True or False, got {mrope_interleaved!r}")
        half, width = rotary_dim // 2, "head_dim" if rotary_dim == head_dim else "rotary_dim"
        section = default_section(half, mrope_interleaved) if mrope_section is None else mrope_section
        if (
            isinstance(section, (str, bytes)) or not isinstance(section, Sequence) or len(section) != 3
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in section)
        ):
            raise UsageError(f"mrope_section must be 3 non-negative integers {AXES}, got {section!r}")
        if sum(section) != half:
            raise UsageError(f"mrope_section must sum to {width}/2 = {half}, got {list(section)} (sum {sum(section)})")
        self.mrope_section, self.mrope_interleaved = [int(s) for s in section], mrope_interleaved
        self.axis_of = mrope_axes(half, self.mrope_section, mrope_interleaved)  # (F,)
        if mrope_interleaved:
            counts = torch.bincount(self.axis_of, minlength=3).tolist()
            if counts != self.mrope_section:
                raise UsageError(
                    f"mrope_section {self.mrope_section} cannot be interleaved over {width}/2 = {half} frequencies: "
                    f"height needs 3*{section[1]}-2 < {half} and width 3*{section[2]}-1 < {half} (got {counts} per axis)"
                )
        self.base, self.layout, self.rotary_dim = float(base), layout, rotary_dim
        self._table = RotaryTable(default_frequencies(self.base, rotary_dim).to(torch.float32), check_positive("cache_length", cache_length))

    @property
    def inv_freq(self) -> torch.Tensor:
        """float32 (F,) frequencies theta_f = base^(-2f/r)."""
        return self._table.inv_freq

    def cos_sin(self, positions: torch.Tensor, x: torch.Tensor, label: str = "q") -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin (B', 1, T, F) of ``x`` (B, H, T, D) at ``positions`` (see
        :func:`axis_positions`, axis first), each frequency at its axis' id."""
        pos, needed = axis_positions(self, label, positions, x, 3, axis_first=True)  # (3, B', T)
        return select_axes(self._table, pos, needed, self.axis_of)

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B, H, Tq, D), k (B, H, Tk, D) at positions (T,), (3, T) or (3, B, T) -> the same shapes
        (the first ``rotary_dim`` features rotated)."""
        return rotate_by_axes(self, q, k, q_positions, k_positions)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, base={self.base}, mrope_section={self.mrope_section}, "
                f"mrope_interleaved={self.mrope_interleaved}, layout={self.layout!r}, rotary_dim={self.rotary_dim}")


def vision_text_positions(
    segments: Sequence[int | Sequence[int]], *, temporal_step: float = 1.0, start: int = 0
) -> torch.Tensor:
    """(3, T) M-RoPE ids (temporal, height, width) of a sequence of text runs and vision grids.

    Args:
        segments: in sequence order, an int n (n text tokens) or a (t, h, w) grid of t*h*w vision
            tokens (after any patch merging), flattened in (t, h, w) row-major order.
        temporal_step: id step per temporal index of a grid: 1 for Qwen2-VL; Qwen2.5-VL's absolute
            time is ``second_per_grid_t * tokens_per_second``. Ids are floor(i_t * step).
        start: id of the first token.

    Text tokens get (p, p, p), p counting up; a grid starting at s gets (s + floor(i_t * step),
    s + i_h, s + i_w); the next segment starts at max(id so far) + 1. Stack per-row results with
    ``torch.stack(rows, dim=1)`` for (3, B, T) (rows of one length).
    """
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise UsageError(f"start must be a non-negative integer, got {start!r}")
    if isinstance(temporal_step, bool) or not isinstance(temporal_step, (int, float)) or not temporal_step >= 0:
        raise UsageError(f"temporal_step must be a number >= 0, got {temporal_step!r}")
    parts, s = [], start
    for seg in segments:
        if isinstance(seg, int) and not isinstance(seg, bool) and seg >= 0:
            ids = torch.arange(s, s + seg).expand(3, seg)  # (3, n)
        elif isinstance(seg, Sequence) and len(seg) == 3 and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in seg):
            t, h, w = seg
            it = (torch.arange(t, dtype=torch.float64) * temporal_step).floor().long()
            grid = torch.meshgrid(it, torch.arange(h), torch.arange(w), indexing="ij")  # 3 x (t, h, w)
            ids = torch.stack(grid).reshape(3, -1) + s  # (3, t*h*w)
        else:
            raise UsageError(f"segments: each must be a text length n >= 0 or a (t, h, w) grid of positive sizes, got {seg!r}")
        parts.append(ids)
        if ids.numel():
            s = int(ids.max()) + 1
    return torch.cat(parts, dim=1) if parts else torch.empty(3, 0, dtype=torch.long)


def continue_positions(positions: torch.Tensor, length: int) -> torch.Tensor:
    """Text ids of ``length`` tokens that follow ``positions`` (3, T) or (3, B, T): each row goes on
    at its own max(id) + 1, so (3, length) or (3, B, length). Decoding passes these, not the cache
    slots T, T + 1, ...; the offset max(id) + 1 - T is Hugging Face's ``rope_deltas``."""
    if positions.dim() not in (2, 3) or positions.shape[0] != 3 or positions.shape[-1] == 0:
        raise UsageError(f"positions must be (3, T) or (3, B, T) with T >= 1, got shape {tuple(positions.shape)}")
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise UsageError(f"length must be a non-negative integer, got {length!r}")
    nxt = positions.amax(dim=(0, -1)) + 1  # () or (B,)
    ids = nxt[..., None] + torch.arange(length, device=positions.device)  # ([B,] length)
    return ids.expand(3, *ids.shape)


__all__ = ["AxisTables", "rotate_by_axes", "MRoPE", "axis_positions", "continue_positions", "mrope_axes", "select_axes", "vision_text_positions"]
