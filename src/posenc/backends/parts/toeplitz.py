"""A fixed bias of r = j - i, non-causal: one kernel call whose mask is a strided view of a (H, R) table.

A bias that depends only on the relative position r = j - i (ALiBi's ``-s |r|``, Press et al. 2022,
"Train Short, Test Long", eq. in Sec. 3; T5's bucketed table, Raffel et al. 2020, Sec. 2.1) is a
Toeplitz matrix per head: ``M[i, j] = f(ks + j - qs - i)``. With the keys reversed (j' = Tk - 1 - j)
it becomes a Hankel matrix, ``M'[i, j'] = w[i + j']`` with ``w`` the table of f(r) for r = r_hi down
to r_lo (R = Tq + Tk - 1 values), and a Hankel matrix is a view of ``w`` with strides (1, 1) over
(i, j'): no (H, Tq, Tk) tensor is made, and the CPU flash kernel reads the view as its float mask.

So a non-causal call (an encoder's attention) is one kernel call forward and one backward, over k
and v reversed (dk and dv reversed back), with exactly the scores of SDPA with a dense float bias.
The blocked backend's far calls and bands (:mod:`posenc.backends.blocked`) split the same call
into ~40 kernel calls at 1,024 tokens (each a parallel region of its own).

A learned table (T5 training) takes the same two kernel calls for its output and dq, dk, dv; the
kernel's backward gives no dS to sum per relative position, so the caller hands in ``table_grad``,
which computes the table's gradient alone from the saved output and log-sum-exp (the blocked
backend: its band's dS written out, one kernel forward per far-future region, no dq, dk, dv there).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ...encodings.protocol import RelativeBias, require
from .base import ScoreSpec, accumulation_dtype
from .denormals import flushed
from .regions import apply, kernel_backward, kernel_forward, use_kernel

# table_grad(rel, q, k, v, out, lse, dout) -> rel's gradient; k and v come in their original key order
TableGrad = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def applies(spec: ScoreSpec, q: torch.Tensor, v: torch.Tensor) -> bool:
    """A non-causal call that the CPU flash kernel runs (the caller checks that the keys cover the
    queries' consecutive positions)."""
    return not spec.causal and use_kernel(q, v)


def table(spec: ScoreSpec, tq: int, tk: int, device: torch.device) -> torch.Tensor:
    """The bias f(r) for r = r_hi down to r_lo, r = (ks + j) - (qs + i): (H, Tq + Tk - 1)."""
    r_lo = spec.k_start - (spec.q_start + tq - 1)
    r_hi = spec.k_start + tk - 1 - spec.q_start
    return spec.memo.relative_values(spec.encoding, r_lo, r_hi, device).flip(-1)  # (H, R)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec, w: torch.Tensor,
           rel: torch.Tensor | None = None, table_grad: TableGrad | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + f(j - i)) v over all keys, for the table ``w`` of :func:`table`.

    Args:
        q: (B, H, Tq, D) queries.
        k: (B, Hkv, Tk, D) keys, H a multiple of Hkv.
        v: (B, Hkv, Tk, D) values.
        spec: the call's ScoreSpec (non-causal, consecutive positions).
        w: (H, Tq + Tk - 1) table from :func:`table`; its grad, if any, is not followed.
        rel: a learned table's values as its caller holds them (any shape), or None: it gets the
            gradient ``table_grad(rel, q, k, v, out, lse, dout)`` returns, after the kernel's backward.
        table_grad: required with ``rel``.

    Returns:
        (B, H, Tq, D) output.
    """
    tails = require(spec.encoding, RelativeBias).bias_tails()
    sloped = tails.past_slope is not None or tails.future_slope is not None
    w = w.detach().to(accumulation_dtype(q.dtype)).contiguous()  # (H, R): the kernel adds it to its float32 scores
    return apply(_Toeplitz, q, k, v, w, spec.scale, sloped, rel, table_grad)


def hankel(w: torch.Tensor, rows: int, cols: int, start: int = 0) -> torch.Tensor:
    """(1, H, rows, cols) view of ``w`` (H, R) with ``[0, h, i, j] = w[h, start + i + j]`` (no copy)."""
    return w.as_strided((1, w.shape[0], rows, cols), (0, w.stride(0), 1, 1), w.storage_offset() + start)


class _Toeplitz(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, scale: float, sloped: bool,
                rel: torch.Tensor | None, table_grad: TableGrad | None) -> torch.Tensor:
        kf, vf = k.flip(-2), v.flip(-2)  # (B, Hkv, Tk, D): keys last to first
        mask = hankel(w, q.shape[-2], k.shape[-2])  # (1, H, Tq, Tk)
        out, lse = flushed(kernel_forward, q, kf, vf, False, scale, mask, when=sloped)
        ctx.scale, ctx.sloped, ctx.table_grad = scale, sloped, table_grad
        learned = rel is not None  # (k and v in key order only for the table's gradient)
        ctx.save_for_backward(q, k if learned else None, v if learned else None, kf, vf, w, out, lse, rel)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, kf, vf, w, out, lse, rel = ctx.saved_tensors
        dout = dout.contiguous()
        mask = hankel(w, q.shape[-2], kf.shape[-2])
        dq, dkf, dvf = flushed(kernel_backward, dout, q, kf, vf, out, lse, False, ctx.scale, mask, when=ctx.sloped)
        drel = None
        if ctx.needs_input_grad[6]:  # a learned table: its gradient alone, from the saved output and log-sum-exp
            drel = ctx.table_grad(rel, q, k, v, out, lse, dout)
        return dq, dkf.flip(-2), dvf.flip(-2), None, None, None, drel, None


__all__ = ["applies", "attend", "hankel", "table"]
