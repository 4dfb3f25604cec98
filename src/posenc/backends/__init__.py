"""Attention backends: one module each, with ``supports``, ``preferred`` and ``attend``.

- ``supports(spec, q) -> bool``: the backend computes this call exactly (forcing it is allowed);
- ``preferred(spec, q) -> bool``: automatic selection may pick it for this call;
- ``attend(q, k, v, spec) -> out``.

Automatic selection ("auto") walks ``PREFERENCE`` and takes the first backend that prefers the
call, from what the call is (device, dtype, grad mode) and what the encoding offers (its hooks and
capabilities), never from the encoding's name; ``eager`` prefers everything, so it ends the list.
A user can force a backend by name (``Attention(..., backend="blocked")``,
``LMConfig(attention_backend=...)``); one that cannot run the call is a ValueError naming those
that can. A new backend is one module and one :func:`register` line.
"""

from __future__ import annotations

from types import ModuleType

import torch

from . import blocked, eager, flex, relative_terms, sdpa
from .base import ScoreSpec

BACKENDS: dict[str, ModuleType] = {"sdpa": sdpa, "flex": flex, "blocked": blocked, "eager": eager}
# Order of preference for "auto":
# sdpa    no score terms at all: the fused kernel with its causal skip;
# flex    score biases on CUDA (compiled, forward and backward);
# blocked score biases elsewhere (CPU training and inference): no (H, N, N) tensor;
# eager   everything else.
PREFERENCE: list[str] = ["sdpa", "flex", "blocked", "eager"]
AUTO = "auto"


def register(name: str, module: ModuleType, before: str = "eager") -> None:
    """Add a backend module: forced by ``name``, and tried by "auto" just before ``before``."""
    BACKENDS[name] = module
    if name in PREFERENCE:
        PREFERENCE.remove(name)
    PREFERENCE.insert(PREFERENCE.index(before), name)


register("terms", relative_terms)  # query/value-term methods (Shaw, Transformer-XL) on CPU


def names() -> list[str]:
    return [AUTO, *BACKENDS]


def check_name(name: str) -> str:
    if name != AUTO and name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {names()}, got {name!r}")
    return name


def allowed(spec: ScoreSpec, q: torch.Tensor) -> list[str]:
    """Names of the backends that can run this call (``auto`` always can)."""
    return [AUTO] + [name for name, backend in BACKENDS.items() if backend.supports(spec, q)]


def choose(name: str, spec: ScoreSpec, q: torch.Tensor) -> ModuleType:
    """The backend module to run: the forced one (if it can run this call) or the preferred one."""
    check_name(name)
    if name != AUTO:
        backend = BACKENDS[name]
        if not backend.supports(spec, q):
            raise ValueError(
                f"attention backend {name!r} cannot run encoding {type(spec.encoding).__name__} here "
                f"(device {q.device.type}, {str(q.dtype).removeprefix('torch.')}, "
                f"{'with' if torch.is_grad_enabled() else 'without'} grad); allowed: {allowed(spec, q)}"
            )
        return backend
    for candidate in PREFERENCE:
        if BACKENDS[candidate].preferred(spec, q):
            return BACKENDS[candidate]
    return eager


__all__ = ["AUTO", "BACKENDS", "PREFERENCE", "ScoreSpec", "allowed", "choose", "check_name", "names", "register"]
