"""Attention backends: one module each, with ``supports(spec, q)`` and ``attend(q, k, v, spec)``.

``choose`` picks the default from the device, grad mode and the encoding's hooks; a user can force
a backend by name (``Attention(..., backend="eager")``).
"""

from __future__ import annotations

from types import ModuleType

import torch

from . import eager, sdpa
from .base import ScoreSpec

BACKENDS: dict[str, ModuleType] = {"sdpa": sdpa, "eager": eager}
AUTO = "auto"


def names() -> list[str]:
    return [AUTO, *BACKENDS]


def check_name(name: str) -> str:
    if name != AUTO and name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {names()}, got {name!r}")
    return name


def choose(name: str, spec: ScoreSpec, q: torch.Tensor) -> ModuleType:
    """The backend module to run: the forced one (if it supports this call) or the default."""
    check_name(name)
    if name != AUTO:
        backend = BACKENDS[name]
        if not backend.supports(spec, q):
            raise ValueError(
                f"attention backend {name!r} cannot run encoding {type(spec.encoding).__name__} "
                f"(it needs query/value terms); use 'auto' or 'eager'"
            )
        return backend
    if sdpa.supports(spec, q):
        return sdpa
    return eager


__all__ = ["BACKENDS", "ScoreSpec", "choose", "names", "check_name"]
