"""Per-query scales: a factor that multiplies each query by a function of its position.

Three forms are in use (shape legend: T queries; positions are absolute, a cache offset included):

- :class:`Temperature`, Llama 4's attention temperature on its NoPE layers (Meta 2025, the Llama 4
  model card; the idea is Scalable-Softmax's, arXiv 2501.19399):
  ``q *= 1 + attn_scale * log1p(floor((pos + 1) / floor_scale))``.
- :class:`LogFloorScale`, Ministral 3's form on every layer (read from ``rope_parameters``:
  ``llama_4_scaling_beta``, ``original_max_position_embeddings``):
  ``q *= 1 + beta * ln(1 + floor(pos / original))``.
- :class:`ScalableSoftmax`, Scalable-Softmax (Nakanishi 2025, arXiv 2501.19399, eq. 3):
  ``softmax((s * log n) * z)`` with n the number of keys the query sees; here n = pos + 1, the keys
  0..pos of a causal query in a full-attention layer, so the scale is ``q *= s * log(pos + 1)``
  (position 0 gets the factor 0: its one key takes all the weight anyway).

Each one is a frozen dataclass with ``factor(positions (T,)) -> (T,) float64``, ``to_text()`` (the
schedule's text form, ``temp=0.1/8192``, ``beta=0.1/16384``, ``ssmax=0.4``) and ``to_dict()``;
:func:`parse_query_scale` reads the text back and :func:`query_scale_from_dict` the dict.
Multiplying q after the rotation or before it is the same (a rotation is linear, the factor a scalar
per position), so :func:`posenc.attend` applies it after the rotation, on the call's positions.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..errors import UsageError


def _positive(name: str, value: Any, integer: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if integer:
        ok = ok and float(value).is_integer()
    if not ok:
        kind = "a positive integer" if integer else "a finite number > 0"
        raise UsageError(f"{name} must be {kind}, got {value!r}")
    return int(value) if integer else float(value)


@dataclass(frozen=True)
class Temperature:
    """Llama 4: ``1 + attn_scale * log1p(floor((pos + 1) / floor_scale))``."""

    attn_scale: float = 0.1
    floor_scale: int = 8192
    kind = "temp"

    def __post_init__(self) -> None:
        object.__setattr__(self, "attn_scale", _positive("attn_scale", self.attn_scale))
        object.__setattr__(self, "floor_scale", _positive("floor_scale", self.floor_scale, integer=True))

    def factor(self, positions: torch.Tensor) -> torch.Tensor:
        p = positions.to(torch.float64)
        return 1.0 + self.attn_scale * torch.log1p(torch.floor((p + 1.0) / self.floor_scale))

    def to_text(self) -> str:
        return f"temp={_num(self.attn_scale)}/{self.floor_scale}"


@dataclass(frozen=True)
class LogFloorScale:
    """Ministral 3: ``1 + beta * ln(1 + floor(pos / original))``."""

    beta: float = 0.1
    original: int = 16384
    kind = "beta"

    def __post_init__(self) -> None:
        object.__setattr__(self, "beta", _positive("beta", self.beta))
        object.__setattr__(self, "original", _positive("original", self.original, integer=True))

    def factor(self, positions: torch.Tensor) -> torch.Tensor:
        p = positions.to(torch.float64)
        return 1.0 + self.beta * torch.log(1.0 + torch.floor(p / self.original))

    def to_text(self) -> str:
        return f"beta={_num(self.beta)}/{self.original}"


@dataclass(frozen=True)
class ScalableSoftmax:
    """Scalable-Softmax: ``s * log(pos + 1)`` (see the module docstring for n)."""

    s: float = 0.43
    kind = "ssmax"

    def __post_init__(self) -> None:
        object.__setattr__(self, "s", _positive("s", self.s))

    def factor(self, positions: torch.Tensor) -> torch.Tensor:
        return self.s * torch.log(positions.to(torch.float64) + 1.0)

    def to_text(self) -> str:
        return f"ssmax={_num(self.s)}"


QueryScale = Temperature | LogFloorScale | ScalableSoftmax
KINDS = {cls.kind: cls for cls in (Temperature, LogFloorScale, ScalableSoftmax)}


def _num(x: float) -> str:
    """x as text that ``float`` reads back exactly (0.1 -> '0.1', not a rounded '%g')."""
    return repr(float(x))


def to_dict(scale: QueryScale) -> dict[str, Any]:
    return {"kind": scale.kind, **asdict(scale)}


def query_scale_from_dict(data: dict[str, Any] | QueryScale | None) -> QueryScale | None:
    """A query scale from :func:`to_dict`'s form (or one as is); None stays None."""
    if data is None or isinstance(data, (Temperature, LogFloorScale, ScalableSoftmax)):
        return data
    if not isinstance(data, dict) or data.get("kind") not in KINDS:
        raise UsageError(f"query_scale must be a dict with kind one of {list(KINDS)}, got {data!r}")
    fields = {k: v for k, v in data.items() if k != "kind"}
    try:
        return KINDS[data["kind"]](**fields)
    except TypeError as err:
        raise UsageError(f"query_scale {data['kind']!r}: {err}") from None


def parse_query_scale(key: str, value: str) -> QueryScale:
    """``temp=A/F``, ``beta=B/L`` or ``ssmax=S`` (the schedule's text form) as a query scale."""
    try:
        if key == "ssmax":
            return ScalableSoftmax(float(value))
        a, sep, b = value.partition("/")
        if not sep:
            raise ValueError
        first, second = float(a), float(b)
    except ValueError:
        form = {"temp": "temp=ATTN_SCALE/FLOOR_SCALE (0.1/8192)", "beta": "beta=BETA/ORIGINAL (0.1/16384)",
                "ssmax": "ssmax=S"}[key]
        raise UsageError(f"schedule: {key}={value!r} is not {form}") from None
    if not second.is_integer():
        raise UsageError(f"schedule: {key}={value!r}: the length after '/' must be an integer")
    return Temperature(first, int(second)) if key == "temp" else LogFloorScale(first, int(second))


def check_query_scale(value: object, name: str = "query_scale") -> QueryScale | None:
    """``value`` if it is a query scale of this module or None.

    Raises:
        UsageError: anything else (a text such as ``"temp"``, a number, a dict), naming ``name``
            and the forms it takes.
    """
    if value is None or isinstance(value, (Temperature, LogFloorScale, ScalableSoftmax)):
        return value
    raise UsageError(f"{name} must be None or a posenc.encodings.query_scale scale (Temperature, LogFloorScale or ScalableSoftmax, "
                     f"e.g. Temperature(0.1, 8192)), got {type(value).__name__} {value!r}")


def scaled_queries(q: torch.Tensor, scale: QueryScale, positions: torch.Tensor) -> torch.Tensor:
    """q (B, H, T, D) times ``scale.factor(positions)`` per query (the factor computed in float64,
    then cast to q's dtype)."""
    f = scale.factor(positions).to(device=q.device, dtype=q.dtype)  # (T,)
    return q * f[:, None]


__all__ = ["KINDS", "LogFloorScale", "QueryScale", "ScalableSoftmax", "Temperature", "check_query_scale", "parse_query_scale",
           "query_scale_from_dict", "scaled_queries", "to_dict"]
