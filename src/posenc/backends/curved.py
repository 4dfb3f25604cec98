"""Per-query bias curves (the Inkling bias, the ``Curves`` hook) with the far keys on the fused kernel.

Backend name ``curved``. A call with ``spec.curves`` (B, H, Tq, R) adds, to query i and key j,
curves[i, p_i - p_j] when 0 <= p_i - p_j < R and nothing otherwise, so for a block of ``BLOCK``
queries [t0, t1) every key more than R - 1 behind the block's first query carries no bias: those
"far" keys are one call of the CPU flash kernel (no mask: every query of the block sees them), and
the band of the last C + R - 1 keys before the block's last query is a second call with its bias as
the kernel's float mask: the curves of the block's rows are copied into it as one strided view
(keys reversed, padded in front, :class:`_CurveBand`), the rest of it 0 or -inf (the causal mask). The
two parts of each softmax row are merged by their log-sum-exps
(:class:`~posenc.backends.parts.regions.Merge`). Backward: the far call's flash backward given the
merged output and log-sum-exp (:func:`~posenc.backends.parts.regions.region_backward`), and the
band's written out (p = exp(s - lse), dS = p (dO v^T - rowsum(dO o)), with the bias and -lse put
into the score product's buffer first), whose dS read through the same strided view is the curves'
gradient (no gather or scatter by distance). Memory: O(B H BLOCK (BLOCK + R)) per block and the
saved q, k, v, output and log-sum-exp, no (B, H, N, N) tensor; compute: the band is BLOCK + R - 1
keys per block instead of all of them (eager's written-out form).

Runs causal calls with consecutive positions whose queries are the last keys (a full pass, a cached
step, a decode step), without left padding (eager takes padded rows), in float32 or float64 with
one head dim for q, k and v on the CPU flash kernel, and only when the encoding adds nothing else.

A sliding window W and attention sinks (Inkling-2's layers; :mod:`posenc.backends.parts.windows`
hands them over, :func:`attend_extras`) run here too. With a window a block has no far keys: its
band covers every key its first query's window starts at, with the
window's edge as one more mask (the band then spans max(W, R) + BLOCK - 1 keys), so the cost is
O(Tq (max(W, R) + BLOCK)). Sinks, one logit per row
(B or 1, H, Tq), join each row's log-sum-exp after the parts are merged, lse' = logaddexp(lse, s),
and scale its output by exp(lse - lse'); in the backward the parts read lse' and the final output
(a sink has no value), and the sinks' gradient is -exp(s - lse') rowsum(dO o).

Shape legend: B batch, H heads, Tq queries, Tk keys, D head dim, R distances with a curve, C block.
"""

from __future__ import annotations

from typing import Any

import torch

from ..encodings.protocol import Biases, QueryTerms, ValueTerms, offers
from .parts import explicit
from .parts.base import ScoreSpec
from .parts.denormals import flushed, opaque_to_compile
from .parts.regions import Merge, Region, apply, kernel_forward, region_backward, up, use_kernel

BLOCK = 256  # queries per block: the band is BLOCK + R - 1 keys wide
REVERSED: bool | None = None  # reverse the keys (True) or the curves (False); None: whichever copies less (tests set it)
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


def _blocks(tq: int, tk: int, reach: int, block: int) -> list[tuple[int, int, int]]:
    """(t0, t1, lo) per block of queries: rows t0..t1, far keys 0..lo (none with a window: lo = 0;
    the band is the C + reach - 1 keys before each block's last key, see :class:`_CurveBand`)."""
    offset = tk - tq
    return [(t0, min(t0 + block, tq), max(0, t0 + offset - reach + 1)) for t0 in range(0, tq, block)]


class _CurveBand:
    """The band of a call, with the curves read as a strided view of its bias.

    Keys are taken from the first query's band on, padded in front with zero rows where that band
    starts before key 0 (P = reach - 1 keys before each block's first query: ``k``, ``v`` (B, H,
    P + Tq, D)). The band of block [t0, t1) (C rows) is C + P of them, and row a's curve over the
    distances 0..R-1 is a run of R consecutive columns whose start moves by one per row, so the
    curves of the block's rows, (B, H, C, R), are one strided view of the band's (B, H, C, C + P)
    bias (:meth:`view`): written with one strided copy, and in the backward their gradient read back
    the same way (no gather, no scatter). Along the keys the distance falls, so one of the two must
    be reversed: the keys once per call (``reversed``; then column b is at distance b + a - (C - 1)
    from row a, the view starts at C - 1 with strides (C + P - 1, 1)) when that copies less than
    reversing every row's curve (a full pass: Tq R > 2 (P + Tq) D), else each block's curves (a
    decode step; column b at distance a + P - b, the view starts at P - R + 1 with strides (C + P +
    1, 1) over the reversed curve). The rest of the bias is 0 (far keys inside the band) or -inf
    (keys after the query, padding, keys outside the window), one (C, C + P) template per block
    geometry.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, tq: int, reach: int, r: int, window: int | None) -> None:
        self.tq, self.tk, self.pad, self.r, self.window = tq, k.shape[-2], reach - 1, r, window
        offset = self.tk - tq
        self.start, self.front = max(0, offset - self.pad), max(0, self.pad - offset)  # first real key; zero rows before it
        self.reversed = tq * r > 2 * (self.pad + tq) * k.shape[-1] if REVERSED is None else REVERSED
        pad = (0, 0, self.front, 0)
        k, v = k[:, :, self.start :], v[:, :, self.start :]
        if self.front:
            k, v = torch.nn.functional.pad(k, pad), torch.nn.functional.pad(v, pad)
        self.k = k.flip(-2) if self.reversed else k  # (B, H, P + Tq, D)
        self.v = v.flip(-2) if self.reversed else v
        self._templates: dict[tuple[int, int, int], torch.Tensor] = {}
        self._filled: tuple[int, int, torch.Size] | None = None  # (template, buffer, shape) a forward's buffer holds

    def span(self, t0: int, t1: int) -> tuple[int, int]:
        """(P', R') of block [t0, t1): the keys its band reaches before its first query, P' = P or
        fewer where the call starts, and the curve entries it reads, min(R, P' + 1)."""
        p = max(0, min(self.pad, t1 + self.tk - self.tq - 1))
        return p, min(self.r, p + 1)

    def keys(self, t0: int, t1: int) -> slice:
        """The block's band in ``k`` and ``v``: C + P' keys."""
        p, _ = self.span(t0, t1)
        if self.reversed:
            return slice(self.tq - t1, self.tq - t0 + p)
        return slice(t0 + self.pad - p, t1 + self.pad)

    def key_grads(self, g: torch.Tensor) -> tuple[slice, torch.Tensor]:
        """Where a gradient over ``k``'s rows (B, H, P + Tq, D) goes in the call's keys, and its real rows."""
        g = g.flip(-2) if self.reversed else g
        return slice(self.start, None), g[:, :, self.front :]

    def template(self, t0: int, t1: int, dtype: torch.dtype) -> torch.Tensor:
        """(C, C + P'): 0 where row a may see column b and it has no curve entry, -inf where it may
        not (d < 0: after the query; a padding column; d >= W outside the window)."""
        (c, offset), (p, _) = (t1 - t0, self.tk - self.tq), self.span(t0, t1)
        a = torch.arange(c, device=self.k.device)[:, None]
        col = torch.arange(c + p, device=self.k.device)[None, :]
        if self.reversed:  # column b is real key t1 + offset - 1 - b
            edge = min(t1 + offset - 1, c + p - 1)
            d, padding = col + a - (c - 1), col > edge  # (C, C + P')
        else:  # column b is real key t0 + offset - P' + b
            edge = max(0, p - t0 - offset)
            d, padding = a + p - col, col < edge
        hit = self._templates.get((c, p, edge))
        if hit is None or hit.dtype != dtype:
            hidden = (d < 0) | padding
            if self.window is not None:
                hidden = hidden | (d >= self.window)
            hit = torch.zeros(c, c + p, dtype=dtype, device=self.k.device).masked_fill(hidden, float("-inf"))
            self._templates[(c, p, edge)] = hit
        return hit

    def view(self, x: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
        """The curve entries of block [t0, t1)'s band tensor x (B, H, C, C + P'), contiguous: (B, H, C,
        R'), a view (in distance order, or reversed when the keys are not)."""
        b, h, c, w = x.shape
        p, r = self.span(t0, t1)
        if self.reversed:
            return x.as_strided((b, h, c, r), (x.stride(0), x.stride(1), w - 1, 1), x.storage_offset() + c - 1)
        return x.as_strided((b, h, c, r), (x.stride(0), x.stride(1), w + 1, 1), x.storage_offset() + p - r + 1)

    def rows(self, curves: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
        """The block's curves in the order of :meth:`view`, (B, H, C, R')."""
        rows = curves[:, :, t0:t1, : self.span(t0, t1)[1]]
        return rows if self.reversed else rows.flip(-1)

    def curve_grads(self, ds: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
        """The curves' gradient, (B, H, C, R') in distance order, from a block's dS (B, H, C, C + P')."""
        g = self.view(ds, t0, t1)
        return g if self.reversed else g.flip(-1)

    def bias(self, out: torch.Tensor, curves: torch.Tensor, t0: int, t1: int, shift: torch.Tensor | None = None) -> torch.Tensor:
        """The block's band bias written into ``out`` (B, H, C, C + P'), minus ``shift`` (B, H, C) per row if given."""
        tpl = self.template(t0, t1, out.dtype)
        if shift is None and self._filled == (tpl.data_ptr(), out.data_ptr(), out.shape):
            # ``out`` holds this template from the block before (the kernel only reads its mask) and
            # the template has no -inf among the curve entries: only they are written
            self.view(out, t0, t1).copy_(self.rows(curves, t0, t1))
            return out
        if shift is None:
            out.copy_(tpl)
        else:
            torch.sub(tpl, shift[..., None], out=out)
        self.view(out, t0, t1).add_(self.rows(curves, t0, t1))
        clean = shift is None and bool(self.view(tpl[None, None], t0, t1).eq(0).all())
        self._filled = (tpl.data_ptr(), out.data_ptr(), out.shape) if clean else None
        return out


def _used(curves: torch.Tensor, k: torch.Tensor) -> int:
    """The curve entries a call can read: distances below R and below its Tk keys (a call shorter
    than R then pads its band to Tk, not R)."""
    return min(curves.shape[-1], k.shape[-2])


class _Curved(torch.autograd.Function):
    """Far keys on the kernel, the band on the kernel with its bias as the mask, merged by
    log-sum-exp; backward: the far keys' kernel backward, the band written out."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, curves: torch.Tensor, scale: float,
                block: int, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        b, h, tq, d = q.shape
        tk, r = k.shape[-2], _used(curves, k)
        reach = r if window is None else max(r, min(window, tk))
        plan = _blocks(tq, tk, reach, block)
        merged = Merge(b, h, tq, d, q.dtype, q.device)
        band = _CurveBand(k, v, tq, reach, r, window)

        def run() -> None:
            buf = torch.empty(b * h * min(block, tq) * (min(block, tq) + reach - 1), dtype=q.dtype, device=q.device)
            for t0, t1, lo in plan:
                if lo > 0 and window is None:  # far keys: no bias, every row of the block sees them
                    o, lz = kernel_forward(q[:, :, t0:t1], k[:, :, :lo], v[:, :, :lo], False, scale)
                    merged.add((t0, t1), o, lz)
                keys, c, w = band.keys(t0, t1), t1 - t0, t1 - t0 + band.span(t0, t1)[0]
                mask = band.bias(buf[: b * h * c * w].view(b, h, c, w), curves, t0, t1)
                o, lz = kernel_forward(q[:, :, t0:t1], band.k[:, :, keys], band.v[:, :, keys], False, scale, mask)
                merged.add((t0, t1), o, lz)

        flushed(run)
        lse = merged.lse
        if sinks is not None:  # one more logit per row, with no value
            total = torch.logaddexp(lse, up(sinks))  # (B, H, Tq)
            merged.out.mul_(torch.exp(lse - total)[..., None])
            lse = total
        out = merged.out.to(q.dtype)
        ctx.plan, ctx.scale, ctx.window, ctx.reach, ctx.block = plan, scale, window, reach, block
        ctx.save_for_backward(q, k, v, curves, out, lse, *(() if sinks is None else (sinks,)))
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, curves, out, lse, *held = ctx.saved_tensors
        scale, window, reach, tq = ctx.scale, ctx.window, ctx.reach, q.shape[-2]
        b, h = q.shape[:2]
        dout = dout.contiguous()
        acc = up(q).dtype
        dq, dk, dv = torch.zeros_like(up(q)), torch.zeros_like(up(k)), torch.zeros_like(up(v))
        dc = torch.empty_like(curves, dtype=acc)  # (B, H, Tq, R) in the curves' memory layout: no copy on the way back
        band = _CurveBand(up(k), up(v), tq, reach, _used(curves, k), window)
        dkr, dvr = torch.zeros_like(band.k), torch.zeros_like(band.v)  # (B, H, P + Tq, D), ordered as band.k
        dsum = (up(dout) * up(out)).sum(-1)  # (B, H, Tq): D_i = dO_i . O_i
        qs = up(q) * scale  # (B, H, Tq, D)

        def run() -> None:
            width = min(ctx.block, tq) + reach - 1
            # buffers every block reuses (fresh pages per block cost more than filling them): the bias's and dP's
            buf = torch.empty(b * h * min(ctx.block, tq) * width, dtype=acc, device=q.device)
            ws = explicit.BackwardBuffers(buf.numel(), acc, q.device)
            for t0, t1, lo in ctx.plan:
                if lo > 0 and window is None:
                    gq, gk, gv = region_backward(Region((t0, t1), (0, lo), False), dout, q, k, v, out, lse, scale)
                    dq[:, :, t0:t1] += up(gq)
                    dk[:, :, :lo] += up(gk)
                    dv[:, :, :lo] += up(gv)
                (keys, c), (reached, used) = (band.keys(t0, t1), t1 - t0), band.span(t0, t1)
                kb, vb = band.k[:, :, keys], band.v[:, :, keys]  # (B, H, C + P', D)
                bias = band.bias(buf[: b * h * c * (c + reached)].view(b, h, c, c + reached), curves, t0, t1, lse[:, :, t0:t1])
                # p = exp(q k^T scale + bias - lse): the whole row's probabilities, (B, H, C, C + P)
                kt = kb.reshape(b * h, -1, kb.shape[-1]).transpose(1, 2)  # (B H, D, C + P)
                p = bias.view(b * h, c, -1).baddbmm_(qs[:, :, t0:t1].reshape(b * h, c, -1), kt).exp_().view(b, h, c, -1)
                # dv, dS = p (dO v^T - D), dq and dk as the explicit path's blocks
                ds, dq_c = explicit.block_grads(ws, p, up(dout[:, :, t0:t1]), dsum[:, :, t0:t1], up(q[:, :, t0:t1]), kb, vb, scale,
                                                dkr[:, :, keys], dvr[:, :, keys])  # (B, H, C, C + P), (B, H, C, D)
                dq[:, :, t0:t1] += dq_c
                dc[:, :, t0:t1, :used] = band.curve_grads(ds, t0, t1)
                dc[:, :, t0:t1, used:] = 0.0  # distances no key of the call is at

        flushed(run)
        where, g = band.key_grads(dkr)
        dk[:, :, where] += g
        where, g = band.key_grads(dvr)
        dv[:, :, where] += g
        dsinks = None
        if held:  # d lse'/d s = exp(s - lse'), through -rowsum(dO o)
            sinks = held[0]
            ds = -(torch.exp(up(sinks) - lse) * (up(dout) * up(out)).sum(-1))  # (B, H, Tq)
            dsinks = (ds.sum(0, keepdim=True) if sinks.shape[0] == 1 else ds).to(sinks.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dc.to(curves.dtype), None, None, None, dsinks


__all__ = ["attend", "attend_extras", "preferred", "supports"]
