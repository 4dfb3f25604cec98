"""RoPE scaling for long context: the frequency schedules that stretch a RoPE model past its
training length, as the block of a Hugging Face ``config.json`` spells them (the reader of a whole
config is :mod:`posenc.hf.rope_config`).

Every method changes only the inverse frequencies ``theta_k`` (k = 0 .. r/2 - 1 over the ``r``
rotated features) and, for two of them, multiplies the rotated q and k by an *attention factor*
(cos and sin both scaled, so the logits scale by its square, as Hugging Face applies it). With
``s`` the scale factor, ``L`` the original (training) length and ``theta_k = base^(-2k/r)``:

- ``linear``: Position Interpolation (Chen et al. 2023, §2.3): ``theta_k / s``.
- ``ntk``: static NTK-aware scaling (bloc97 2023; Peng et al. 2023, "YaRN", §3.1): the base grows
  to ``base * s^(r/(r-2))``, so the slowest pair is interpolated by ``s`` and the fastest kept.
- ``dynamic``: dynamic NTK (YaRN §3.3): the same with ``s`` replaced, at the current length ``l``,
  by ``s * max(l, L)/L - (s - 1)``; it depends on the length, so a KV cache must not keep keys
  rotated with an older base (see :attr:`RopeScaling.depends_on_length`).
- ``yarn``: NTK-by-parts (YaRN §3.2): pairs turning more than ``beta_fast`` times over ``L`` keep
  ``theta_k``, pairs turning fewer than ``beta_slow`` times get ``theta_k / s``, a linear ramp over
  the dimension index in between; attention factor ``0.1 ln s + 1`` (YaRN §3.4), or the ratio of
  that formula at ``mscale`` and ``mscale_all_dim`` (DeepSeek), or an explicit ``attention_factor``.
- ``llama3``: Meta's Llama 3.1 rule: wavelengths below ``L / high_freq_factor`` kept, above
  ``L / low_freq_factor`` divided by ``s``, interpolated smoothly in between.
- ``longrope``: LongRoPE (Ding et al. 2024, §3): one rescale factor per pair, ``theta_k /
  factor_k``, from ``short_factor`` while the length is at most ``L`` and ``long_factor`` beyond;
  attention factor ``sqrt(1 + ln s / ln L)``. The switch depends on the length, like ``dynamic``.
- ``proportional``: p-RoPE (Barbero et al. 2024, §6): the lowest-frequency ``1 - p`` fraction of
  the pairs gets ``theta_k = 0`` (not rotated) and the others keep the full-width schedule
  (``p = partial_rotary_factor``). This is NOT partial rotary: with the other types
  ``partial_rotary_factor`` rotates only the first ``p * head_dim`` features but spreads the whole
  frequency range over them (GPT-NeoX, Phi); p-RoPE keeps every rotated pair's original frequency.
- ``ntk_alpha``: Hunyuan's NTK-alpha, as vLLM serves it (``DynamicNTKAlphaRotaryEmbedding``) and
  transformers' Hunyuan models compute it (``compute_ntk_alpha_rope_parameters``): the base grows to
  ``base * alpha^(r/(r-2))``, a fixed ``alpha`` (the static NTK formula with ``alpha`` for ``s``).
  Hunyuan's checkpoints label it ``"type": "dynamic"`` with an ``alpha`` key; such a block is read as
  ``ntk_alpha``, and the keys those checkpoints carry beside ``alpha`` (``factor``, ``beta_fast``,
  ``beta_slow``, ``mscale``, ``mscale_all_dim``, the lengths), which neither engine reads, are dropped.
- ``resonance``: Resonance RoPE (Wang et al. 2024, "Resonance RoPE: Improving Context Length
  Generalization of Large Language Models", §3, eq. 5 and Algorithm 1): every wavelength
  ``lambda_k = 2 pi / theta_k`` is rounded to the nearest integer, ``theta_k' = 2 pi / round(lambda_k)``,
  so each pair's angle repeats exactly at integer positions. ``"resonance": true`` in a block of any
  other type applies the same rounding after that type's schedule (Resonance YaRN, the paper's §4:
  ``{"rope_type": "yarn", ..., "resonance": true}``); a pair with frequency 0 (p-RoPE) stays 0.

Each schedule is computed in float64 and rounded once to float32 (the frequencies a checkpoint
uses). The formulas, including the places where a parameter may be left out, follow Hugging Face
``transformers.modeling_rope_utils`` (5.24), so a pasted ``rope_scaling`` / ``rope_parameters``
block means the same thing here; the tests compare against it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UsageError

# Bounds on the numbers a user gives (a block, a config, an option): wide enough for every released
# model (bases up to ~1e7, factors up to ~64) and narrow enough that every schedule's float32 table is
# finite and every rotated pair still turns (see :func:`check_table`).
MAX_BASE = 1e12
FACTOR_RANGE = (1e-4, 1e6)


# Keys every type accepts besides its own (rope_type / type name the type).
COMMON_KEYS = ("rope_theta", "partial_rotary_factor", "resonance")
# The keys each type reads (optional or required); any other key is a UsageError.
TYPE_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "ntk": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings", "max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "max_position_embeddings", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim", "attention_factor", "truncate"),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "factor",
                 "max_position_embeddings", "attention_factor"),
    "proportional": ("factor",),
    "ntk_alpha": ("alpha",),
    "resonance": (),
}
ROPE_TYPES = tuple(TYPE_KEYS)
REQUIRED: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "ntk": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("original_max_position_embeddings",),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    "ntk_alpha": ("alpha",),
}
# Keys a Hunyuan checkpoint's ``"type": "dynamic"`` block carries beside ``alpha``; transformers and
# vLLM read only ``alpha`` (and ``rope_theta``) for it, so :func:`parse_scaling` drops them.
HUNYUAN_IGNORED = ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "original_max_position_embeddings",
                   "max_position_embeddings")


def _number(key: str, value: Any, low: float = 0.0, strict: bool = True, high: float | None = None) -> float:
    """A finite real number above ``low`` (or at least ``low`` when not strict) and at most
    ``high``, as float."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value <= low if strict else value < low) or (high is not None and value > high):
        bound = f"> {low:g}" if strict else f">= {low:g}"
        if high is not None:
            bound = f"in {'(' if strict else '['}{low:g}, {high:g}]"
        raise UsageError(f"rope scaling: {key} must be a finite number {bound}, got {value!r}")
    return float(value)


def _factor(key: str, value: Any) -> float:
    """A scale factor: in FACTOR_RANGE, so that every schedule's table stays in float32's range."""
    low, high = FACTOR_RANGE
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not low <= value <= high:
        raise UsageError(f"rope scaling: {key} must be a finite number in [{low:g}, {high:g}], got {value!r}")
    return float(value)


def _alpha(key: str, value: Any) -> float:
    """NTK-alpha's alpha: in [1, FACTOR_RANGE's top] (1: plain RoPE; below 1 would shrink the base)."""
    return _number(key, value, 1.0, strict=False, high=FACTOR_RANGE[1])


def _length(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise UsageError(f"rope scaling: {key} must be a positive integer, got {value!r}")
    return int(value)


def _factors(key: str, value: Any) -> tuple[float, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, torch.Tensor)) or len(value) == 0:
        low, high = FACTOR_RANGE
        raise UsageError(f"rope scaling: {key} must be a list of numbers in [{low:g}, {high:g}] (one per frequency pair), "
                         f"got {value!r}")
    return tuple(_factor(f"{key}[{i}]", float(v) if isinstance(v, torch.Tensor) else v) for i, v in enumerate(value))


@dataclass(frozen=True)
class RopeScaling:
    """A parsed, validated scaling block. Fields left None take Hugging Face's defaults when used
    (``beta_fast`` 32, ``beta_slow`` 1, ``truncate`` True, a factor derived from
    ``max_position_embeddings / original_max_position_embeddings`` where HF derives it).

    ``max_position_embeddings`` is not part of an HF block (it sits next to it in the config); it is
    accepted here so a block whose factor HF derives from it (Phi-3's LongRoPE) can be pasted with it.
    """

    rope_type: str = "default"
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    partial_rotary_factor: float | None = None
    rope_theta: float | None = None
    alpha: float | None = None
    resonance: bool | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in TYPE_KEYS:
            raise UsageError(f"rope scaling: rope_type must be one of {list(ROPE_TYPES)}, got {self.rope_type!r}")
        allowed = set(TYPE_KEYS[self.rope_type]) | set(COMMON_KEYS)
        given = {f.name for f in dataclasses.fields(self) if f.name != "rope_type" and getattr(self, f.name) is not None}
        unused = sorted(given - allowed)
        if unused:
            raise UsageError(
                f"rope scaling: rope_type {self.rope_type!r} does not use {unused}; "
                f"its keys: {sorted(set(TYPE_KEYS[self.rope_type]) | set(COMMON_KEYS))}"
            )
        missing = [key for key in REQUIRED.get(self.rope_type, ()) if getattr(self, key) is None]
        if missing:
            raise UsageError(f"rope scaling: rope_type {self.rope_type!r} needs {missing}")
        convert = {"factor": _factor, "beta_fast": _number, "beta_slow": _number,
                   "attention_factor": lambda k, v: _number(k, v, high=FACTOR_RANGE[1]),
                   "low_freq_factor": _number, "high_freq_factor": _number,
                   "rope_theta": lambda k, v: _number(k, v, 1.0, high=MAX_BASE),
                   "mscale": lambda k, v: _number(k, v, strict=False), "mscale_all_dim": lambda k, v: _number(k, v, strict=False),
                   "original_max_position_embeddings": _length, "max_position_embeddings": _length,
                   "short_factor": _factors, "long_factor": _factors, "alpha": _alpha}
        for key, check in convert.items():
            if getattr(self, key) is not None:
                object.__setattr__(self, key, check(key, getattr(self, key)))
        if self.truncate is not None and not isinstance(self.truncate, bool):
            raise UsageError(f"rope scaling: truncate must be true or false, got {self.truncate!r}")
        if self.resonance is not None and not isinstance(self.resonance, bool):
            raise UsageError(f"rope scaling: resonance must be true or false, got {self.resonance!r}")
        p = self.partial_rotary_factor
        if p is not None and not 0 < _number("partial_rotary_factor", p) <= 1:
            raise UsageError(f"rope scaling: partial_rotary_factor must be in (0, 1], got {p!r}")
        if (self.beta_fast or 32.0) <= (self.beta_slow or 1.0):
            raise UsageError(f"rope scaling: beta_fast ({self.beta_fast or 32.0:g}) must be greater than beta_slow ({self.beta_slow or 1.0:g})")
        if self.rope_type == "llama3" and need(self, "high_freq_factor") <= need(self, "low_freq_factor"):
            raise UsageError(
                f"rope scaling: high_freq_factor ({self.high_freq_factor:g}) must be greater than low_freq_factor ({self.low_freq_factor:g})"
            )
        if self.rope_type == "dynamic":
            ours, theirs = self.original_max_position_embeddings, self.max_position_embeddings
            if ours is None and theirs is None:
                raise UsageError("rope scaling: rope_type 'dynamic' needs original_max_position_embeddings (the training length)")
            if ours is not None and theirs is not None and ours != theirs:
                raise UsageError(
                    f"rope scaling: for 'dynamic', original_max_position_embeddings ({ours}) and "
                    f"max_position_embeddings ({theirs}) both name the training length; give one"
                )
        if self.rope_type == "yarn" and self.factor is None and self.max_position_embeddings is None:
            raise UsageError("rope scaling: rope_type 'yarn' needs factor (or max_position_embeddings to derive it)")
        derivable = (self.factor, self.max_position_embeddings, self.attention_factor)
        if self.rope_type == "longrope" and all(v is None for v in derivable):
            raise UsageError(
                "rope scaling: rope_type 'longrope' needs factor (or max_position_embeddings to derive it, "
                "or an explicit attention_factor)"
            )

    # -- derived values -------------------------------------------------------------------------

    @property
    def rounds_wavelengths(self) -> bool:
        """Resonance RoPE's rounding applies: ``rope_type`` ``resonance``, or ``resonance: true``."""
        return self.rope_type == "resonance" or bool(self.resonance)

    @property
    def depends_on_length(self) -> bool:
        """The frequencies depend on the current length (dynamic NTK, LongRoPE's short/long switch)."""
        return self.rope_type in ("dynamic", "longrope")

    @property
    def original_length(self) -> int | None:
        """L, the length the model was trained at (dynamic: HF's ``max_position_embeddings``)."""
        return self.original_max_position_embeddings or self.max_position_embeddings

    @property
    def scale(self) -> float:
        """s: the explicit factor, or the one HF derives from the two lengths, or 1."""
        if self.factor is not None:
            return self.factor
        if self.max_position_embeddings and self.original_max_position_embeddings:
            return self.max_position_embeddings / self.original_max_position_embeddings
        return 1.0

    def to_dict(self) -> dict[str, Any]:
        """The block back as a plain dict (only the keys given), e.g. for a JSON config."""
        out: dict[str, Any] = {"rope_type": self.rope_type}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "rope_type" and value is not None:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def check_rotary_dim(self, rotary_dim: int) -> None:
        """LongRoPE's lists need one factor per rotated pair."""
        for key in ("short_factor", "long_factor"):
            values = getattr(self, key)
            if values is not None and len(values) != rotary_dim // 2:
                raise UsageError(
                    f"rope scaling: {key} has {len(values)} entries; rotary_dim={rotary_dim} needs "
                    f"{rotary_dim // 2} (one per pair of rotated features)"
                )


def parse_scaling(scaling: Mapping[str, Any] | RopeScaling | None) -> RopeScaling:
    """A Hugging Face style block (``rope_scaling`` / ``rope_parameters``) as a :class:`RopeScaling`.

    Accepts ``rope_type`` or its older name ``type`` (both, if equal); None means no scaling. A
    ``dynamic`` block with an ``alpha`` key (Hunyuan's checkpoints) is ``ntk_alpha``, as transformers
    and vLLM read it: its other keys (:data:`HUNYUAN_IGNORED`), which they do not read, are dropped.
    """
    if scaling is None:
        return RopeScaling()
    if isinstance(scaling, RopeScaling):
        return scaling
    if not isinstance(scaling, Mapping):
        raise UsageError(f"scaling must be a dict such as a config's rope_scaling block, got {type(scaling).__name__}")
    block = dict(scaling)
    given = [block.pop(key) for key in ("rope_type", "type") if key in block]
    for name in given:
        if not isinstance(name, str):
            raise UsageError(f"rope scaling: rope_type must be one of {list(ROPE_TYPES)}, got {name!r}")
    names = set(given)
    if len(names) > 1:
        raise UsageError(f"rope scaling: rope_type and type disagree: {sorted(map(str, names))}")
    if names == {"dynamic"} and block.get("alpha") is not None:
        names = {"ntk_alpha"}
        block = {k: v for k, v in block.items() if k not in HUNYUAN_IGNORED}
    fields = {f.name for f in dataclasses.fields(RopeScaling)}
    unknown = sorted(set(block) - fields)
    if unknown:
        raise UsageError(f"rope scaling: unknown key(s) {unknown}; accepted: {sorted(fields | {'type'})}")
    return RopeScaling(rope_type=names.pop() if names else "default", **block)


# ---- what the rules read (the rules, one per type: posenc.encodings.rope_frequencies) ------------


def need(cfg: RopeScaling, key: str) -> float:
    """A number the block's ``rope_type`` requires (``TYPE_KEYS``, checked when the block was made).

    Raises:
        UsageError: the block lacks it.
    """
    value = getattr(cfg, key)
    if value is None:
        raise UsageError(f"rope scaling: rope_type {cfg.rope_type!r} needs {key}")
    return float(value)


def default_frequencies(base: float, dim: int) -> torch.Tensor:
    """theta_k = base^(-2k/dim), k = 0 .. dim/2 - 1: (dim/2,) float64, on the CPU (also inside a
    ``torch.device("meta")`` block: the schedule is checked, and moved where the positions are)."""
    return base ** -(torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim)


def rotary_dim_of(cfg: RopeScaling, head_dim: int, rotary_dim: int | None) -> int:
    """The number of rotated features: ``rotary_dim``, or ``int(head_dim * partial_rotary_factor)``
    for every type but ``proportional`` (whose factor is p-RoPE's fraction, not partial rotary)."""
    if cfg.partial_rotary_factor is None or cfg.rope_type == "proportional":
        return head_dim if rotary_dim is None else rotary_dim
    implied = int(head_dim * cfg.partial_rotary_factor)
    if rotary_dim is not None and rotary_dim != implied:
        raise UsageError(
            f"rotary_dim={rotary_dim} disagrees with partial_rotary_factor={cfg.partial_rotary_factor:g} "
            f"(head_dim={head_dim} -> {implied} rotated features); give one of them"
        )
    return implied


def check_table(cfg: RopeScaling, base: float, dim: int, theta: torch.Tensor, attention: float) -> None:
    """UsageError unless the float32 frequencies ``theta`` (dim/2,) of ``cfg`` are finite, and every
    pair the schedule rotates turns at a normal float32 rate (an underflow to 0 would silently stop
    its rotation, an overflow gives NaN angles)."""
    kept = theta if cfg.rope_type != "proportional" else theta[: max(int((cfg.partial_rotary_factor or 1.0) * dim // 2), 1)]
    tiny = torch.finfo(torch.float32).tiny
    if bool(torch.isfinite(theta).all()) and bool((kept >= tiny).all()) and math.isfinite(attention) and attention > 0:
        return
    given = ", ".join(f"{k}={v:g}" for k, v in (("base", base), ("factor", cfg.factor)) if v is not None)
    raise UsageError(
        f"rope scaling: {cfg.rope_type} with {given} gives frequencies outside float32's range (rotary_dim={dim}); "
        f"base must be in (1, {MAX_BASE:g}] and factors in [{FACTOR_RANGE[0]:g}, {FACTOR_RANGE[1]:g}]"
    )


__all__ = [
    "FACTOR_RANGE", "HUNYUAN_IGNORED", "MAX_BASE", "ROPE_TYPES", "RopeScaling", "check_table", "default_frequencies",
    "need", "parse_scaling", "rotary_dim_of",
]
