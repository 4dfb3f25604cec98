"""The checks of one attention call's inputs, made before anything runs (:func:`posenc.attend`):
q, k and v with the encoding's heads and head_dim, and the forget gates and bias curves that only an
encoding with those hooks takes."""

from __future__ import annotations

import math

import torch

from ..encodings.protocol import Curves, Gates, ValueTerms, offers
from ..errors import UsageError


def check_curves(curves, encoding, b: int, h: int, tq: int) -> None:
    """Curves only for an encoding with the Curves hook, as a float (B, H, Tq, R) tensor.

    Raises:
        UsageError: curves missing for an encoding with the Curves hook, or given for one without.
        UsageError: curves not a float (B, H, Tq, R >= 1) tensor.
    """
    curved = encoding is not None and offers(encoding, Curves)
    if curves is None:
        if curved:
            raise UsageError(f"encoding {type(encoding).__name__} has bias curves: pass query_curves=encoding.query_curves(x, positions) "
                             "(batch, heads, queries, distances)")
        return
    if not curved:
        raise UsageError(f"query_curves: encoding {type(encoding).__name__} has no bias curves (the Curves hook); leave query_curves None")
    if not isinstance(curves, torch.Tensor) or not curves.is_floating_point() or curves.dim() != 4 or tuple(curves.shape[:3]) != (b, h, tq) \
            or curves.shape[-1] < 1:
        raise UsageError(f"query_curves must be a float tensor of shape (batch, heads, queries, distances) = {(b, h, tq, 'R >= 1')}, "
                         f"got {getattr(curves, 'shape', type(curves).__name__)}")


def check_gates(log_gates, encoding, b: int, h: int, tk: int) -> None:
    """Gates only for an encoding with the Gates hook, and every gate a finite log forget gate <= 0
    (one host read; not checked while compiling). A gate of -inf is refused too: the backends sum
    the gates, and -inf - (-inf) would be NaN.

    Raises:
        UsageError: gates missing for an encoding with the Gates hook, or given for one without.
        UsageError: gates not a float (B, H, Tk) tensor.
        UsageError: a gate that is not finite and <= 0.
    """
    gated = encoding is not None and offers(encoding, Gates)
    if log_gates is None:
        if gated:
            raise UsageError(f"encoding {type(encoding).__name__} has forget gates: pass log_gates=encoding.log_gates(x) (batch, heads, keys)")
        return
    if not gated:
        name = "None (NoPE)" if encoding is None else type(encoding).__name__
        raise UsageError(f"log_gates: encoding {name} has no forget gates (the Gates hook); gates would change its "
                         "scores, so leave log_gates None (for NoPE with gates computed elsewhere, pass a fox encoding: "
                         "attend reads only the gates given)")
    if not isinstance(log_gates, torch.Tensor) or not log_gates.is_floating_point() or tuple(log_gates.shape) != (b, h, tk):
        raise UsageError(f"log_gates must be a float tensor of shape (batch, heads, keys) = {(b, h, tk)}, "
                         f"got {getattr(log_gates, 'shape', type(log_gates).__name__)}")
    if log_gates.numel() and not torch.compiler.is_compiling():
        g = log_gates.detach()
        top = float(torch.where(g.isfinite(), g, math.inf).max())
        if top > 0:
            bad = ("NaN" if bool(g.isnan().any()) else "-inf" if bool(g.isneginf().any()) else
                   "+inf" if bool(g.isposinf().any()) else f"up to {top:g}")
            raise UsageError(f"log_gates are log forget gates, each finite and <= 0 (log sigmoid), got {bad}")


def check_qkv(q, k, v, encoding) -> tuple[int, int, int, int, int, int]:
    """q (B, H, Tq, D), k and v (B, Hkv, Tk, D) as :func:`posenc.attend` takes them, and ``encoding``
    (or None) built for H heads of D; returns (B, H, Hkv, Tq, Tk, D).

    Raises:
        UsageError: q, k or v not a 4-D tensor.
        UsageError: batch sizes, head_dim, or v's heads and length that do not match.
        UsageError: H not a multiple of Hkv.
        UsageError: an encoding built for other heads or head_dim.
        UsageError: an encoding with relative value vectors and v of another head_dim.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise UsageError(f"{name} must be a 4-D tensor (batch, heads, length, head_dim), got {getattr(x, 'shape', type(x).__name__)}")
    b, h, tq, d = q.shape
    _, hkv, tk, dk = k.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise UsageError(f"q, k and v must have the same batch size, got {b}, {k.shape[0]}, {v.shape[0]}")
    if dk != d:
        raise UsageError(f"k must have q's head_dim ({d}), got {dk}")
    if tuple(v.shape[1:3]) != (hkv, tk):
        raise UsageError(f"v must have k's heads and length {(hkv, tk)}, got {tuple(v.shape[1:3])}")
    if hkv < 1 or h % hkv:
        raise UsageError(f"the query heads ({h}) must be a multiple of the key/value heads ({hkv})")
    if encoding is not None:
        if getattr(encoding, "num_heads", h) != h or getattr(encoding, "head_dim", d) != d:
            raise UsageError(
                f"encoding was built for num_heads={encoding.num_heads}, head_dim={encoding.head_dim}; "
                f"q has {h} heads of head_dim {d}"
            )
        if offers(encoding, ValueTerms) and v.shape[-1] != d:
            raise UsageError(f"v must have q's head_dim ({d}) with {type(encoding).__name__}: its relative value "
                             f"vectors, added to the output, have that width; got {v.shape[-1]}")
    return b, h, hkv, tq, tk, d


__all__ = ["check_curves", "check_gates", "check_qkv"]
