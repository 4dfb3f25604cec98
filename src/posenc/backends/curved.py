"""Per-query bias curves (the Inkling bias, the ``Curves`` hook) with the far keys on the fused kernel.

Backend name ``curved``. A call with ``spec.curves`` (B, H, Tq, R) adds, to query i and key j,
curves[i, p_i - p_j] when 0 <= p_i - p_j < R and nothing otherwise, so for a block of ``BLOCK``
queries [t0, t1) every key more than R - 1 behind the block's first query carries no bias: those
"far" keys are one call of the CPU flash kernel (no mask: every query of the block sees them), and
only the band [t0 + offset - R + 1, t1 + offset) is written out, with the curves read by distance
and the causal mask. The two parts of each softmax row are merged by their log-sum-exps
(:class:`~posenc.backends.parts.regions.Merge`). Backward: the far call's flash backward given the
merged output and log-sum-exp (:func:`~posenc.backends.parts.regions.region_backward`), and the
band's written out (p = exp(s - lse), dS = p (dO v^T - rowsum(dO o))), whose dS summed per
distance is the curves' gradient. Memory: O(B H BLOCK (BLOCK + R)) per block and the saved q, k, v,
output and log-sum-exp, no (B, H, N, N) tensor; compute: the band is BLOCK + R keys per block
instead of all of them (eager's written-out form).

Runs causal calls with consecutive positions whose queries are the last keys (a full pass, a cached
step, a decode step), without left padding (eager takes padded rows), in float32 or float64 with
one head dim for q, k and v on the CPU flash kernel, and only when the encoding adds nothing else.

A sliding window W and attention sinks (Inkling-2's layers; :mod:`posenc.backends.parts.windows`
hands them over, :func:`attend_extras`) run here too. With a window a block has no far keys: its
band is every key its first query's window starts at, [t0 + offset - W + 1, t1 + offset), with the
window's edge as one more mask, so the cost is O(Tq (W + BLOCK)). Sinks, one logit per row
(B or 1, H, Tq), join each row's log-sum-exp after the parts are merged, lse' = logaddexp(lse, s),
and scale its output by exp(lse - lse'); in the backward the parts read lse' and the final output
(a sink has no value), and the sinks' gradient is -exp(s - lse') rowsum(dO o).

Shape legend: B batch, H heads, Tq queries, Tk keys, D head dim, R distances with a curve, C block.
"""

from __future__ import annotations

from typing import Any

import torch

from ..call.spec import curve_bias
from ..encodings.protocol import Biases, QueryTerms, ValueTerms, offers
from .parts.base import ScoreSpec
from .parts.denormals import flushed, opaque_to_compile
from .parts.regions import Merge, Region, apply, kernel_forward, region_backward, up, use_kernel

BLOCK = 256  # queries per block: the band is BLOCK + R - 1 keys wide
DTYPES = (torch.float32, torch.float64)


def supports(spec: ScoreSpec, q: torch.Tensor) -> bool:
    enc = spec.encoding
    return (
        spec.curves is not None and spec.causal and spec.aligned and spec.consecutive and spec.starts is None
        and spec.log_gates is None and not spec.selective and q.dtype in DTYPES and use_kernel(q, q)
        and not any(offers(enc, p) for p in (Biases, QueryTerms, ValueTerms))
    )


def preferred(spec: ScoreSpec, q: torch.Tensor) -> bool:
    return supports(spec, q)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec, block: int | None = None) -> torch.Tensor:
    return attend_extras(q, k, v, spec, None, None, block)


def attend_extras(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec, window: int | None,
                  sinks: torch.Tensor | None, block: int | None = None) -> torch.Tensor:
    """The call with a sliding ``window`` (or None) and ``sinks`` (B or 1, H, Tq) (or None); q, k, v
    with as many heads (see the module docstring)."""
    curves = spec.curves
    if curves is None or v.shape[-1] != q.shape[-1] or k.shape[1] != q.shape[1]:
        raise TypeError("the curved backend runs calls with curves and one head dim (ask supports first)")
    return _run(q, k, v, curves.to(torch.promote_types(curves.dtype, q.dtype)), spec.scale, BLOCK if block is None else block,
                window, sinks)


@opaque_to_compile  # the kernel loop runs on the denormal-flushing worker thread
def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, curves: torch.Tensor, scale: float, block: int,
         window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    return apply(_Curved, q, k, v, curves, scale, block, window, sinks)


def _blocks(tq: int, tk: int, r: int, block: int, window: int | None = None) -> list[tuple[int, int, int, int]]:
    """(t0, t1, lo, hi) per block of queries: rows t0..t1, far keys 0..lo, band keys lo..hi (with a
    window: no far keys, the band from the first row's window)."""
    offset = tk - tq
    reach = r if window is None else window
    return [(t0, min(t0 + block, tq), max(0, t0 + offset - reach + 1), min(t0 + block, tq) + offset) for t0 in range(0, tq, block)]


def _band_scores(q: torch.Tensor, k: torch.Tensor, curves: torch.Tensor, t0: int, t1: int, lo: int, hi: int, offset: int,
                 scale: float, window: int | None = None) -> torch.Tensor:
    """The band's logits (B, H, C, L) in the accumulation dtype: content, curves by distance, causal
    mask (and the window's edge)."""
    s = up(torch.matmul(q[:, :, t0:t1], k[:, :, lo:hi].transpose(-1, -2))) * scale
    qp = torch.arange(t0 + offset, t1 + offset, device=q.device)  # (C,) query positions as key indices
    kp = torch.arange(lo, hi, device=q.device)  # (L,)
    s = s + curve_bias(curves[:, :, t0:t1], qp, kp).to(s.dtype)
    hidden = kp[None, :] > qp[:, None]  # (C, L)
    if window is not None:
        hidden = hidden | (kp[None, :] <= qp[:, None] - window)
    return s.masked_fill(hidden, float("-inf"))


class _Curved(torch.autograd.Function):
    """Far keys on the kernel, the band written out, merged by log-sum-exp; backward as above."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, curves: torch.Tensor, scale: float,
                block: int, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        b, h, tq, d = q.shape
        tk, r = k.shape[-2], curves.shape[-1]
        plan = _blocks(tq, tk, r, block, window)
        merged = Merge(b, h, tq, d, q.dtype, q.device)

        def run() -> None:
            for t0, t1, lo, hi in plan:
                if lo > 0 and window is None:  # far keys: no bias, every row of the block sees them
                    o, lz = kernel_forward(q[:, :, t0:t1], k[:, :, :lo], v[:, :, :lo], False, scale)
                    merged.add((t0, t1), o, lz)
                s = _band_scores(q, k, curves, t0, t1, lo, hi, tk - tq, scale, window)  # (B, H, C, L)
                lz = torch.logsumexp(s, -1)  # (B, H, C)
                merged.add((t0, t1), torch.matmul(torch.exp(s - lz[..., None]).to(v.dtype), v[:, :, lo:hi]), lz)

        flushed(run)
        lse = merged.lse
        if sinks is not None:  # one more logit per row, with no value
            total = torch.logaddexp(lse, up(sinks))  # (B, H, Tq)
            merged.out.mul_(torch.exp(lse - total)[..., None])
            lse = total
        out = merged.out.to(q.dtype)
        ctx.plan, ctx.scale, ctx.window = plan, scale, window
        ctx.save_for_backward(q, k, v, curves, out, lse, *(() if sinks is None else (sinks,)))
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, curves, out, lse, *held = ctx.saved_tensors
        scale, (tq, tk), r, window = ctx.scale, (q.shape[-2], k.shape[-2]), curves.shape[-1], ctx.window
        dout = dout.contiguous()
        dq, dk, dv = torch.zeros_like(up(q)), torch.zeros_like(up(k)), torch.zeros_like(up(v))
        dc = torch.zeros_like(up(curves))

        def run() -> None:
            for t0, t1, lo, hi in ctx.plan:
                if lo > 0 and window is None:
                    gq, gk, gv = region_backward(Region((t0, t1), (0, lo), False), dout, q, k, v, out, lse, scale)
                    dq[:, :, t0:t1] += up(gq)
                    dk[:, :, :lo] += up(gk)
                    dv[:, :, :lo] += up(gv)
                s = _band_scores(q, k, curves, t0, t1, lo, hi, tk - tq, scale, window)
                p = torch.exp(s - lse[:, :, t0:t1, None])  # (B, H, C, L): the whole row's probabilities
                do = up(dout[:, :, t0:t1])
                rowsum = (do * up(out[:, :, t0:t1])).sum(-1, keepdim=True)  # (B, H, C, 1)
                ds = p * (torch.matmul(do, up(v[:, :, lo:hi]).transpose(-1, -2)) - rowsum)  # (B, H, C, L)
                dq[:, :, t0:t1] += torch.matmul(ds, up(k[:, :, lo:hi])) * scale
                dk[:, :, lo:hi] += torch.matmul(ds.transpose(-1, -2), up(q[:, :, t0:t1])) * scale
                dv[:, :, lo:hi] += torch.matmul(p.transpose(-1, -2), do)
                distance = torch.arange(t0 + tk - tq, t1 + tk - tq, device=q.device)[:, None] - torch.arange(lo, hi, device=q.device)
                inside = (distance >= 0) & (distance < r)  # (C, L)
                index = distance.clamp(0, r - 1).expand(*ds.shape[:2], -1, -1)  # (B, H, C, L)
                dc[:, :, t0:t1].scatter_add_(-1, index, ds.masked_fill(~inside, 0.0))

        flushed(run)
        dsinks = None
        if held:  # d lse'/d s = exp(s - lse'), through -rowsum(dO o)
            sinks = held[0]
            ds = -(torch.exp(up(sinks) - lse) * (up(dout) * up(out)).sum(-1))  # (B, H, Tq)
            dsinks = (ds.sum(0, keepdim=True) if sinks.shape[0] == 1 else ds).to(sinks.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dc.to(curves.dtype), None, None, None, dsinks


__all__ = ["attend", "attend_extras", "preferred", "supports"]
