"""Attention backends: one module each, registered in :data:`BACKENDS` under its file name.

A backend satisfies the :class:`Backend` protocol:

- ``supports(spec, q) -> bool``: the backend computes this call exactly (forcing it is allowed);
- ``preferred(spec, q) -> bool``: automatic selection may pick it for this call;
- ``attend(q, k, v, spec) -> out``;
- optionally ``takes_grouped_heads(spec) -> bool``: ``attend`` takes k and v with fewer heads than q
  (grouped-query attention) as they are; otherwise the caller repeats them to q's heads.

Automatic selection ("auto") walks :data:`BACKENDS` in order and takes the first backend that
prefers the call, from what the call is (device, dtype, grad mode) and what the encoding offers (its
hooks and capabilities, :func:`posenc.encodings.protocol.offers`), never from the encoding's name;
``eager`` prefers everything, so it ends the list. A user can force a backend by name
(``Attention(..., backend="blocked")``, ``LMConfig(attention_backend=...)``); one that cannot run
the call is a :class:`~posenc.errors.UsageError` naming those that can. A new backend is one module
(``backends/NAME.py``) and one entry in :data:`BACKENDS`; this folder holds registered backends
only, and what they share (masks, kernel regions, decode steps, padding, ``blocked``'s and
``terms``'s parts) lives in :mod:`posenc.backends.parts`.
"""

from __future__ import annotations

from types import ModuleType
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from ..errors import UsageError
from . import blocked, contextual, curved, eager, features, flex, gated, sdpa, selective, terms
from .parts import single
from .parts.base import ScoreSpec
from .parts.regions import FLASH_OPS, repeated_heads


@runtime_checkable
class Backend(Protocol):
    """What the attention needs of a backend (a module, or any object with these functions)."""

    def supports(self, spec: ScoreSpec, q: torch.Tensor) -> bool: ...

    def preferred(self, spec: ScoreSpec, q: torch.Tensor) -> bool: ...

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec) -> torch.Tensor: ...


# Every backend, in the order "auto" tries them:
# sdpa     no score terms at all: the fused kernel with its causal skip;
# features an exactly low-rank bias (Sandwich) as extra q/k features: the same kernel, same skip;
# flex     score biases on CUDA (compiled, forward and backward);
# blocked  score biases elsewhere (CPU training and inference): no (H, N, N) tensor;
# terms    query/value terms (Shaw, Transformer-XL) on CPU: no (H, N, N) tensor;
# contextual CoPE's contextual positions: a band written out, far keys fused; no (H, N, N) tensor;
# gated    per-key log forget gates (FoX) as one extra key feature on the fused kernel, per query block;
# curved   per-query bias curves (the Inkling bias): far keys on the fused kernel, the band of R distances written out;
# selective selective attention: blocks of queries on the fused kernel, the selection carried as a running column sum;
# eager    everything else: the textbook formula, the reference for tests.
BACKENDS: dict[str, Backend] = {
    m.__name__.rsplit(".", 1)[-1]: m for m in (sdpa, features, flex, blocked, terms, contextual, gated, curved, selective, eager)
}
AUTO = "auto"

for _name, _backend in BACKENDS.items():  # the contract, checked once at import
    assert isinstance(_backend, Backend), f"backend {_name} lacks supports/preferred/attend"


def takes_grouped_heads(backend: Backend, spec: ScoreSpec) -> bool:
    """The backend runs this call on k and v with fewer heads than q (grouped-query attention)
    without their being repeated: it says so with a ``takes_grouped_heads(spec)`` of its own."""
    says = getattr(backend, "takes_grouped_heads", None)
    return bool(says(spec)) if callable(says) else False


def name_of(backend: Backend | ModuleType) -> str:
    """The registered name of a backend (its file name)."""
    for name, candidate in BACKENDS.items():
        if candidate is backend:
            return name
    raise KeyError(f"{backend!r} is not a registered backend")


def names() -> list[str]:
    """``auto`` and every registered backend name."""
    return [AUTO, *BACKENDS]


def check_name(name: str) -> str:
    if name != AUTO and name not in BACKENDS:
        raise UsageError(f"attention backend must be one of {names()}, got {name!r}")
    return name


def allowed(spec: ScoreSpec, q: torch.Tensor) -> list[str]:
    """Names of the backends that can run this call (``auto`` always can)."""
    return [AUTO] + [name for name, backend in BACKENDS.items() if backend.supports(spec, q)]


def choose(name: str, spec: ScoreSpec, q: torch.Tensor) -> tuple[str, Backend]:
    """(registered name, backend) to run: the forced one (if it can run this call) or the first
    one in :data:`BACKENDS` that prefers it."""
    check_name(name)
    if name != AUTO:
        backend = BACKENDS[name]
        if not backend.supports(spec, q):
            raise UsageError(
                f"attention backend {name!r} cannot run encoding {type(spec.encoding).__name__} here "
                f"(device {q.device.type}, {str(q.dtype).removeprefix('torch.')}, "
                f"{'with' if torch.is_grad_enabled() else 'without'} grad); allowed: {allowed(spec, q)}"
            )
        return name, backend
    for candidate, backend in BACKENDS.items():
        if backend.preferred(spec, q):
            return candidate, backend
    return "eager", eager



def attend(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec) -> tuple[torch.Tensor, str]:
    """The one door into the backends: the call run by the backend :func:`choose` picks, on rotated
    q (B, H, Tq, D) and k, v (B, Hkv, Tk, D); returns (output (B, H, Tq, Dv), the backend's name).

    Grouped key/value heads (Hkv < H) go as they are to a backend that takes them (sdpa's kernel,
    blocked: each key/value head read for its group); a decode step without query or value terms
    runs the query heads of a group as its queries (:mod:`.parts.single`); any other call gets k
    and v repeated to H heads.

    Values narrower or wider than queries and keys (Dv != D: DeepSeek's MLA) go to the CPU flash
    kernel, which takes one head dim, with zero features on the narrower side (:func:`_padded`)."""
    chosen_name, chosen = choose(name, spec, q)
    d, dv = q.shape[-1], v.shape[-1]
    if dv != d and _pads(chosen_name, q, v, spec):
        width = max(d, dv)
        q, k, v = (_padded(x, width) for x in (q, k, v))  # (.., width) each
        return _attend(chosen_name, chosen, q, k, v, spec)[..., :dv], chosen_name
    return _attend(chosen_name, chosen, q, k, v, spec), chosen_name


def _pads(name: str, q: torch.Tensor, v: torch.Tensor, spec: ScoreSpec) -> bool:
    """A call with Dv != D runs on the CPU flash kernel with one head dim: zero features added to v
    change no output column kept, zero features added to q and k change no score. Not where the
    added features would meet a term of the encoding's (value terms of width Dv, query terms of
    width D), nor in ``eager`` (the reference formula, as written), nor for one query."""
    if name == "eager" or not FLASH_OPS or q.device.type != "cpu" or q.shape[-2] == 1:  # (a decode step: the
        return False  # formula reads k and v once, as a padded copy of v would)
    return not spec.has_value_terms if q.shape[-1] > v.shape[-1] else not spec.has_query_terms


def _padded(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def _attend(name: str, chosen: Backend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec) -> torch.Tensor:
    if q.shape[1] // k.shape[1] > 1:
        if takes_grouped_heads(chosen, spec):
            return chosen.attend(q, k, v, spec)
        if name != "eager" and not (spec.has_query_terms or spec.has_value_terms) and single.applies(spec, q, k, v):
            return single.attend(q, k, v, spec)
        k, v = repeated_heads(k, v, q.shape[1])  # (B, H, Tk, D)
    return chosen.attend(q, k, v, spec)


__all__ = ["AUTO", "BACKENDS", "Backend", "ScoreSpec", "allowed", "attend", "check_name", "choose", "name_of", "names",
           "takes_grouped_heads"]
