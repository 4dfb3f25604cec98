"""XD-RoPE: Hunyuan-VL's four-axis rotary embedding (Tencent Hunyuan team 2025, HunyuanOCR /
Hunyuan-VL; the rule as transformers' ``HunYuanVLRotaryEmbedding`` and its ``apply_rotary_pos_emb``
apply it, ``xdrope_section`` / ``mrope_section`` in the text config's RoPE block).

A multi-axis RoPE (:mod:`.mrope`) over four ids per token, (position, width, height, image index):
text tokens carry their sequence position on every axis; an image's tokens keep the sequence
position on axis 0 and get their column, row and the image's ordinal on axes 1-3
(transformers' ``get_rope_index``).

Unlike M-RoPE, the axes are assigned to the **features** of the half layout, not to frequency pairs.
With ``F = D/2`` frequencies ``theta_f = base^(-2f/D)`` and ``xdrope_section`` (s_0, .., s_3) summing
to F, feature m of 0 .. D-1 reads the axis a(m) of the block of ``2 s_i`` features it falls in
(blocks laid end to end over the D features), at the frequency ``theta_(m mod F)``:

    phi_m(n)  = p_{a(m)}(n) * theta_(m mod F)
    y_f       = x_f cos phi_f - x_(f+F) sin phi_f                                  f < F
    y_(f+F)   = x_(f+F) cos phi_(f+F) + x_f sin phi_(f+F)

(the ``x * cos + rotate_half(x) * sin`` of transformers with cos, sin of the doubled angles split in
blocks of ``2 s_i``). With (16, 16, 16, 16) at D = 128 the first halves of the pairs read position
and width, the second halves height and image index. When a token's ids are equal on every axis
(text), phi_f = phi_(f+F) and this is 1-D RoPE exactly; with ids that differ the two features of a
pair turn by different angles, so the map is not a rotation and a score is not a function of id
differences alone (``shift_invariant`` is False, unlike M-RoPE).

Frequencies: the default schedule, or a static scaling block (:mod:`.rope_scaling`), e.g. Hunyuan's
``ntk_alpha`` (their checkpoints: ``"type": "xdrope"`` or ``"dynamic"`` with ``alpha``); the
length-dependent types (dynamic with a factor, LongRoPE) and partial rotary are refused.

Positions: (T,) (every axis the same id: RoPE), (4, T) or (4, B, T), axis first, as transformers
passes them (``position_axes = 4``); see :func:`.mrope.axis_positions`.

Shape legend: B batch, H heads, T length, D head dim, F = D/2 frequencies, A = 4 axes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import UsageError, check_positive
from .base import PositionalEncoding
from .mrope import axis_positions
from .rope import RotaryTable
from .rope_frequencies import inverse_frequencies
from .rope_scaling import RopeScaling, check_table, parse_scaling

AXES = ("position", "width", "height", "image")


def feature_axes(head_dim: int, section: Sequence[int]) -> torch.Tensor:
    """The axis of each of the D features, (D,) LongTensor: blocks of ``2 s_i`` features, axis i."""
    counts = torch.tensor([2 * s for s in section], device="cpu")  # an index, made on the CPU even under a meta device
    return torch.repeat_interleave(torch.arange(len(section), device="cpu"), counts, output_size=head_dim)  # (D,)


class XDRoPE(PositionalEncoding):
    """XD-RoPE: RoPE in the half layout whose features read four position axes.

    Equals transformers' Hunyuan-VL text rotary embedding followed by its ``apply_rotary_pos_emb``
    (tests/encodings/test_xdrope.py).

    Args:
        base: theta base (default 10000; the block's ``rope_theta`` if it names one).
        xdrope_section: frequencies per axis (position, width, height, image), four non-negative
            integers summing to head_dim / 2; None: D/8 each (Hunyuan-VL's (16, 16, 16, 16) at 128).
        scaling: a static RoPE scaling block (``ntk_alpha``, ``linear``, ``ntk``, ``yarn``,
            ``llama3``, ``resonance``, ...); None: the default frequencies.
        cache_length: initial rows of the cos/sin table (grows as needed).

    Raises:
        UsageError: an odd head_dim, a base outside (1, 1e12], a section that is not four
            non-negative integers summing to head_dim / 2, a length-dependent scaling or one with
            ``partial_rotary_factor``.
    """

    name = "xdrope"
    description = "RoPE whose half-layout features read (position, width, height, image) ids (Hunyuan-VL's XD-RoPE)"
    extrapolates = True
    shift_invariant = False  # with ids that differ between axes the two features of a pair turn apart
    position_axes = 4  # (position, width, height, image index) ids per token,
    axis_first = True  # axis first, (4, T) or (4, B, T), as transformers passes them

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        causal: bool = True,
        base: float | None = None,
        xdrope_section: Sequence[int] | None = None,
        scaling: dict[str, Any] | RopeScaling | None = None,
        cache_length: int = 2048,
    ) -> None:
        super().__init__(num_heads, head_dim, causal)
        if head_dim % 2:
            raise UsageError(f"xdrope needs an even head_dim, got {head_dim}")
        half = head_dim // 2
        section = [half // 4] * 3 + [half - 3 * (half // 4)] if xdrope_section is None else xdrope_section
        if (
            isinstance(section, (str, bytes)) or not isinstance(section, Sequence) or len(section) != 4
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in section)
        ):
            raise UsageError(f"xdrope_section must be 4 non-negative integers {AXES}, got {section!r}")
        if sum(section) != half:
            raise UsageError(f"xdrope_section must sum to head_dim/2 = {half}, got {list(section)} (sum {sum(section)})")
        cfg = parse_scaling(scaling)
        if cfg.depends_on_length or cfg.partial_rotary_factor is not None:
            raise UsageError(f"xdrope: scaling {cfg.rope_type!r} is not supported (static frequency schedules over the "
                             "whole head only: no dynamic, longrope or partial_rotary_factor)")
        if base is not None and cfg.rope_theta is not None and float(base) != cfg.rope_theta:
            raise UsageError(f"base={base} disagrees with the scaling block's rope_theta={cfg.rope_theta}; give one of them")
        chosen: Any = cfg.rope_theta if base is None else base
        chosen = 10000.0 if chosen is None else chosen
        if isinstance(chosen, bool) or not isinstance(chosen, (int, float)) or not 1 < chosen <= 1e12:
            raise UsageError(f"base must be a finite number in (1, 1e12], got {chosen!r}")
        if cfg.rope_type in ("ntk", "ntk_alpha") and head_dim < 4:
            raise UsageError(f"rope scaling: {cfg.rope_type} needs head_dim >= 4, got {head_dim}")
        inv_freq, attention = inverse_frequencies(cfg, float(chosen), head_dim)  # (F,) float32
        check_table(cfg, float(chosen), head_dim, inv_freq, attention)
        self.base, self.scaling, self.attention_factor = float(chosen), cfg, attention
        self.xdrope_section = [int(s) for s in section]
        self.axis_of_feature = feature_axes(head_dim, self.xdrope_section)  # (D,)
        self._table = RotaryTable(inv_freq, check_positive("cache_length", cache_length))

    @property
    def inv_freq(self) -> torch.Tensor:
        """float32 (F,) frequencies."""
        return self._table.inv_freq

    def cos_sin(self, positions: torch.Tensor, x: torch.Tensor, label: str = "q") -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin (B', 1, T, D) of ``x`` (B, H, T, D) at ``positions`` ((T,), (4, T) or
        (4, B, T)): feature m at its axis' id and frequency ``theta_(m mod F)``."""
        pos, needed = axis_positions(self, label, positions, x)  # (4, B', T)
        a, b, t = pos.shape
        table = self._table
        if needed is None:  # compiling: the table as built, as RoPE's compiled path
            if table.cos.device != pos.device:
                table.build(table.length, pos.device)
            cos, sin = table.cos[pos.reshape(-1)], table.sin[pos.reshape(-1)]  # (A * B' * T, F)
        else:
            cos, sin = table.lookup(pos.reshape(-1), max(needed, 1))  # (A * B' * T, F)
        index = self.axis_of_feature.to(pos.device).view(1, 1, 1, -1).expand(1, b, t, -1)  # (1, B', T, D)

        def pick(c: torch.Tensor) -> torch.Tensor:
            doubled = torch.cat((c, c), dim=-1).view(a, b, t, -1)  # (A, B', T, D): theta_(m mod F)
            return doubled.gather(0, index).view(b, 1, t, -1)  # (B', 1, T, D)

        return pick(cos), pick(sin)

    def rotate_one(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (B, H, T, D) by the doubled cos, sin (B', 1, T, D): the formula of the module docstring,
        in float32, cast back once."""
        f = self.head_dim // 2
        xf = x.to(torch.float32)
        x1, x2 = xf[..., :f], xf[..., f:]
        y1 = x1 * cos[..., :f] - x2 * sin[..., :f]  # (B, H, T, F)
        y2 = x2 * cos[..., f:] + x1 * sin[..., f:]  # (B, H, T, F)
        out = torch.cat((y1, y2), dim=-1)
        if self.attention_factor != 1.0:
            out = out * self.attention_factor
        return out.to(x.dtype)

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B, H, Tq, D), k (B, H, Tk, D) at positions (T,), (4, T) or (4, B, T) -> the same shapes."""
        return self.rotate_one(q, *self.cos_sin(q_positions, q, "q")), self.rotate_one(k, *self.cos_sin(k_positions, k, "k"))

    def extra_repr(self) -> str:
        scaling = "" if self.scaling.rope_type == "default" else f", scaling={self.scaling.rope_type!r}"
        return f"{super().extra_repr()}, base={self.base}, xdrope_section={self.xdrope_section}{scaling}"


__all__ = ["XDRoPE", "feature_axes"]
