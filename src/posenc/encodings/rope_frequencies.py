"""The frequencies of each ``rope_type``: ``inverse_frequencies(cfg, base, dim, length)`` gives
(theta (dim/2,), attention_factor) for a parsed block (:class:`~posenc.encodings.rope_scaling.RopeScaling`);
the rules, their papers and equations are in :mod:`posenc.encodings.rope_scaling`'s docstring, one
function per type here (:data:`SCHEDULES`)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..errors import UsageError
from .rope_scaling import RopeScaling, default_frequencies, need


def _original(cfg: RopeScaling) -> int:
    """L, the training length the block names (see :attr:`RopeScaling.original_length`).

    Raises:
        UsageError: the block names none.
    """
    length = cfg.original_length
    if length is None:
        raise UsageError(f"rope scaling: rope_type {cfg.rope_type!r} needs original_max_position_embeddings")
    return length


def _default(cfg: RopeScaling, base: float, dim: int, length: int | None) -> tuple[torch.Tensor, float]:
    return default_frequencies(base, dim), 1.0


def _linear(cfg: RopeScaling, base: float, dim: int, length: int | None) -> tuple[torch.Tensor, float]:
    return default_frequencies(base, dim) / need(cfg, "factor"), 1.0


def _ntk(cfg: RopeScaling, base: float, dim: int, length: int | None) -> tuple[torch.Tensor, float]:
    return default_frequencies(base * need(cfg, "factor") ** (dim / (dim - 2)), dim), 1.0


def _dynamic(cfg: RopeScaling, base: float, dim: int, length: int | None) -> tuple[torch.Tensor, float]:
    original = _original(cfg)
    current = max(length or original, original)
    # s l/L - (s - 1), written so that it is exactly 1 at l = L (the difference cancels for large s).
    grown = 1.0 + need(cfg, "factor") * (current - original) / original
    return default_frequencies(base * grown ** (dim / (dim - 2)), dim), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(cfg: RopeScaling, base: float, dim: int, length: int | None) -> tuple[torch.Tensor, float]:
    s, original = cfg.scale, need(cfg, "original_max_position_embeddings")
    if cfg.attention_factor is not None:
        attention = cfg.attention_factor
    elif cfg.mscale and cfg.mscale_all_dim:  # both given and non-zero, as HF tests them
        attention = _yarn_mscale(s, cfg.mscale) / _yarn_mscale(s, cfg.mscale_all_dim)
    else:
        attention = _yarn_mscale(s)

    def pair_turning(rotations: float) -> float:
        # The (fractional) pair index whose wavelength fits `rotations` turns into the original length.
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(cfg.beta_fast or 32.0), pair_turning(cfg.beta_slow or 1.0)
    if cfg.truncate is None or cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)  # HF clamps to dim - 1 (not dim/2 - 1); kept for equality
    if low == high:
        high += 0.001  # a step instead of a ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64, device="cpu") - low) / (high - low)).clamp(0, 1)  # 0: keep, 1: interpolate
    theta = default_frequencies(base, dim)
    return theta * (1 - ramp) + (theta / s) * ramp, attention


def _llama3(cfg: RopeScaling, base: float, dim: int, length: int | None) -> tuple[torch.Tensor, float]:
    theta = default_frequencies(base, dim)
    original, s = need(cfg, "original_max_position_embeddings"), need(cfg, "factor")
    low, high = need(cfg, "low_freq_factor"), need(cfg, "high_freq_factor")
    wavelength = 2 * math.pi / theta
    # 0 at wavelength L/low_freq_factor (fully interpolated), 1 at L/high_freq_factor (kept).
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * theta / s + smooth * theta
    out = torch.where(wavelength > original / low, theta / s, blended)
    return torch.where(wavelength < original / high, theta, out), 1.0


def _longrope(cfg: RopeScaling, base: float, dim: int, length: int | None) -> tuple[torch.Tensor, float]:
    original = need(cfg, "original_max_position_embeddings")
    factors = cfg.long_factor if length is not None and length > original else cfg.short_factor
    if cfg.attention_factor is not None:
        attention = cfg.attention_factor
    else:
        s = cfg.scale
        attention = 1.0 if s <= 1 else math.sqrt(1 + math.log(s) / math.log(original))
    return default_frequencies(base, dim) / torch.tensor(factors, dtype=torch.float64, device="cpu"), attention


def _proportional(cfg: RopeScaling, base: float, dim: int, length: int | None) -> tuple[torch.Tensor, float]:
    kept = int((cfg.partial_rotary_factor or 1.0) * dim // 2)  # HF's rounding of p * dim / 2
    theta = default_frequencies(base, dim)
    theta[kept:] = 0.0  # the lowest frequencies: not rotated at all
    return theta / (cfg.factor or 1.0), 1.0


def _ntk_alpha(cfg: RopeScaling, base: float, dim: int, length: int | None) -> tuple[torch.Tensor, float]:
    return default_frequencies(base * need(cfg, "alpha") ** (dim / (dim - 2)), dim), 1.0


def resonant(theta: torch.Tensor) -> torch.Tensor:
    """Resonance RoPE's rounding (Wang et al. 2024, eq. 5): ``2 pi / round(2 pi / theta)`` for every
    frequency above 0 (float64 in and out); frequency 0 (a pair p-RoPE leaves still) stays 0.

    Raises:
        UsageError: a wavelength that rounds to 0 (a frequency above 4 pi: a factor below 1 on a
            fast pair), which would give an infinite frequency.
    """
    moving = theta > 0
    wavelength = torch.where(moving, 2 * math.pi / theta.where(moving, torch.ones_like(theta)), torch.zeros_like(theta))
    rounded = torch.round(wavelength)  # (r/2,)
    if bool((moving & (rounded < 1)).any()):
        raise UsageError(f"rope scaling: resonance rounds a wavelength of {float(wavelength[moving].min()):.3g} positions "
                         "to 0; every rotated pair needs a wavelength of at least 0.5 positions (a factor >= 1 keeps it)")
    return torch.where(moving, 2 * math.pi / rounded.where(moving, torch.ones_like(rounded)), theta)


SCHEDULES: dict[str, Callable[[RopeScaling, float, int, int | None], tuple[torch.Tensor, float]]] = {
    "default": _default, "linear": _linear, "ntk": _ntk, "dynamic": _dynamic, "yarn": _yarn,
    "llama3": _llama3, "longrope": _longrope, "proportional": _proportional, "ntk_alpha": _ntk_alpha,
    "resonance": _default,  # (the rounding below)
}


def inverse_frequencies(cfg: RopeScaling, base: float, dim: int, length: int | None = None) -> tuple[torch.Tensor, float]:
    """(theta (dim/2,) float32, attention_factor) of ``cfg`` for ``dim`` rotated features at the
    current ``length`` (None: the original length; only ``dynamic`` and ``longrope`` read it)."""
    theta, attention = SCHEDULES[cfg.rope_type](cfg, float(base), dim, length)
    if cfg.rounds_wavelengths:
        theta = resonant(theta)  # after the type's own transform (Resonance YaRN: after YaRN's)
    return theta.to(torch.float32), float(attention)


__all__ = ["SCHEDULES", "inverse_frequencies", "resonant"]
