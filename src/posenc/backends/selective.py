"""Selective attention in blocks of queries on the fused kernel, with no (B, Tq, Tk) selection tensor.

Backend name ``selective``. Selective attention (Leviathan, Kalman & Matias 2024, "Selective
Attention Improves Transformer", arXiv 2410.02703, §3, eq. 1-3; :mod:`posenc.encodings.selective`)
subtracts from every head's logits F_ij = sum_{t < i} S_tj, the selection S of the queries before
query i. eager computes F once per call, a (B, Tq, Tk) tensor. Here the queries go in blocks of
``BLOCK`` rows [t0, t1) in order, and a running column sum ``carry`` (B, Tk) holds sum_{t < t0} S_tj,
so the block's F is ``carry`` plus the exclusive cumulative sum of its own rows of S, (B, C, L) for
the L = t1 + offset keys it may see; then one call of the CPU flash kernel over those keys with
-F (and -inf on the causal staircase) as its float mask, (B, 1, C, L), broadcast over the heads, and
``carry`` takes the block's column sums of S. A KV cache's sums of earlier calls (``spec.selected``)
are the carry's start.

Backward, blocks in reverse order. Each block's carry is kept from the forward ((B, Tk) a block),
so its F is rebuilt exactly; the block's probabilities p = exp(q k^T scale - F - lse) and dS = p (dO
v^T - D) are written out as in flash attention's backward, giving dq, dk, dv. The selection's
gradient: logit_ij gets -F_ij, so dL/dF = -G with G_ij = sum over heads of dS_hij, and S_tj enters
F_ij of every later query i > t: dL/dS_tj = -sum_{i > t} G_ij, the block's reverse exclusive
cumulative sum of G plus a second running sum (B, Tk) over the blocks after it. Through the relu
and the masks (S_tj > 0) it reaches the encoding's ``selection_scores`` (the selecting head's q and
k), differentiated by autograd per block. Memory: O(B H C Tk) per block, no (B, Tq, Tk) tensor.

Runs causal calls with consecutive positions whose queries are the last keys (a full pass, a
cached chunk, a decode step), without left padding (eager takes padded rows), in float32 or
float64 on the CPU flash kernel, when the encoding adds nothing else (no bias, query or value terms,
gates or curves); automatic selection leaves a single query (a decode step) to eager, faster there.

Shape legend: B batch, H heads, Tq queries, Tk keys, D head dim, C queries of a block, L its keys.
"""

from __future__ import annotations

from typing import Any

import torch

from ..encodings.protocol import Biases, QueryTerms, Selects, ValueTerms, offers, require
from .parts import explicit
from .parts.base import ScoreSpec
from .parts.denormals import flushed, opaque_to_compile
from .parts.regions import apply, kernel_forward, up, use_kernel

BLOCK = 128  # queries per block: the fastest of 128, 256 and 512 in training at 4,096 tokens on the CPUs tried
DTYPES = (torch.float32, torch.float64)


def supports(spec: ScoreSpec, q: torch.Tensor) -> bool:
    enc = spec.encoding
    return (
        spec.selective and spec.causal and spec.aligned and spec.consecutive and spec.starts is None
        and spec.log_gates is None and spec.curves is None and q.dtype in DTYPES and use_kernel(q, q)
        and not any(offers(enc, p) for p in (Biases, QueryTerms, ValueTerms))
    )


def preferred(spec: ScoreSpec, q: torch.Tensor) -> bool:
    # A single query (a decode step) reads one row of F: eager's written-out row costs less than a
    # kernel call with a float mask there (posenc bench's decode level).
    return supports(spec, q) and q.shape[-2] > 1


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec, block: int | None = None) -> torch.Tensor:
    """Selective attention for q (B, H, Tq, D), k, v (B, H, Tk, D) (see the module docstring)."""
    if v.shape[-1] != q.shape[-1] or k.shape[1] != q.shape[1] or not spec.selective:
        raise TypeError("the selective backend runs selective calls with one head dim and head count (ask supports first)")
    tq, tk = q.shape[-2], k.shape[-2]
    acc = torch.promote_types(q.dtype, torch.float32)
    start = torch.zeros(q.shape[0], tk, dtype=acc, device=q.device) if spec.selected is None else up(spec.selected).to(acc)  # (B, Tk)
    return _run(q, k, v, spec, start, BLOCK if block is None else block, tk - tq)


@opaque_to_compile  # the kernel loop runs on the denormal-flushing worker thread
def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec, start: torch.Tensor, block: int, offset: int) -> torch.Tensor:
    return apply(_Selective, q, k, v, spec, start, block, offset)


def _selection(spec: ScoreSpec, q: torch.Tensor, k: torch.Tensor, t0: int, offset: int) -> torch.Tensor:
    """S of a block's queries q (B, H, C, D), the queries t0..t0+C-1 of the call, against its keys k
    (B, H, L, D), keys 0..L-1: (B, C, L) in float32 at least, relu of the selecting head's scores,
    0 for the query's own key, later keys and the first key."""
    scores = require(spec.encoding, Selects).selection_scores(q, k)  # (B, C, L)
    s = torch.relu(scores.to(torch.promote_types(scores.dtype, torch.float32)))
    rows = torch.arange(t0 + offset, t0 + q.shape[-2] + offset, device=q.device)[:, None]  # (C, 1) each query's own key
    keys = torch.arange(k.shape[-2], device=q.device)[None, :]  # (1, L)
    return s.masked_fill((keys >= rows) | (keys == 0), 0.0)


def _penalty(s: torch.Tensor, carry: torch.Tensor) -> torch.Tensor:
    """F of a block, (B, C, L): the carry (sums over the queries before it) plus the exclusive
    cumulative sum of its own rows of S."""
    return carry[:, None, : s.shape[-1]] + (s.cumsum(1) - s)


def _mask(f: torch.Tensor, t0: int, t1: int, offset: int, dtype: torch.dtype) -> torch.Tensor:
    """-F with -inf on the causal staircase, (B, 1, C, L): the kernel's float mask for every head."""
    length = f.shape[-1]
    rows = torch.arange(t0 + offset, t1 + offset, device=f.device)[:, None]  # (C, 1)
    later = torch.arange(length, device=f.device)[None, :] > rows  # (C, L)
    return (-f).masked_fill(later, float("-inf")).to(dtype)[:, None]


class _Selective(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec, start: torch.Tensor,
                block: int, offset: int) -> torch.Tensor:
        tq = q.shape[-2]
        out = torch.empty_like(q)  # (B, H, Tq, D)
        lse = torch.empty(q.shape[:3], dtype=up(q).dtype, device=q.device)  # (B, H, Tq)
        carries: list[torch.Tensor] = []  # each block's carry, for the backward

        def run() -> None:
            carry = start.clone()  # (B, Tk)
            for t0 in range(0, tq, block):
                t1 = min(t0 + block, tq)
                length = t1 + offset
                s = _selection(spec, q[:, :, t0:t1], k[:, :, :length], t0, offset)  # (B, C, L)
                carries.append(carry.clone())
                mask = _mask(_penalty(s, carry), t0, t1, offset, q.dtype)
                o, lz = kernel_forward(q[:, :, t0:t1], k[:, :, :length], v[:, :, :length], False, spec.scale, mask)
                out[:, :, t0:t1], lse[:, :, t0:t1] = o, lz
                carry[:, :length] += s.sum(1)

        with torch.no_grad():
            flushed(run)
        ctx.spec, ctx.block, ctx.offset, ctx.carries = spec, block, offset, carries
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        spec, block, offset = ctx.spec, ctx.block, ctx.offset
        tq, b = q.shape[-2], q.shape[0]
        dout = dout.contiguous()
        acc = up(q).dtype
        dq, dk, dv = torch.zeros_like(up(q)), torch.zeros_like(up(k)), torch.zeros_like(up(v))
        dsum = (up(dout) * up(out)).sum(-1)  # (B, H, Tq): D_i = dO_i . O_i
        later = torch.zeros(b, k.shape[-2], dtype=ctx.carries[0].dtype, device=q.device)  # (B, Tk): G summed over later blocks
        ws = explicit.BackwardBuffers(q.shape[0] * q.shape[1] * min(block, tq) * k.shape[-2], acc, q.device)  # every block's buffers

        def run() -> None:
            for n, t0 in reversed(list(enumerate(range(0, tq, block)))):
                t1 = min(t0 + block, tq)
                length = t1 + offset
                qb, kb, vb, do = up(q[:, :, t0:t1]), up(k[:, :, :length]), up(v[:, :, :length]), up(dout[:, :, t0:t1])
                qd, kd = q[:, :, t0:t1].detach().requires_grad_(), k[:, :, :length].detach().requires_grad_()
                with torch.enable_grad():
                    s = _selection(spec, qd, kd, t0, offset)  # (B, C, L), with its graph to the block's q and k
                mask = _mask(_penalty(s.detach(), ctx.carries[n]), t0, t1, offset, acc)  # (B, 1, C, L)
                # p = exp(q k^T scale - F - lse) and dS = p (dO v^T - D), as the explicit path's blocks
                p = explicit.block_probabilities(ws, qb, kb, spec.scale, mask, lse[:, :, t0:t1], staircase_only=True)
                ds, dq_c = explicit.block_grads(ws, p, do, dsum[:, :, t0:t1], qb, kb, vb, spec.scale,
                                                dk[:, :, :length], dv[:, :, :length])  # (B, H, C, L), (B, H, C, D)
                dq[:, :, t0:t1] += dq_c
                g = ds.sum(1)  # (B, C, L): dL/dF = -g
                # dL/dS_tj = -(sum over the block's later rows of g, and over later blocks)
                #          = (sum over its rows up to t) - (sum over all its rows and later blocks)
                total = g.sum(1).add_(later[:, :length])  # (B, L)
                dsel = g.cumsum(1).sub_(total[:, None])
                later[:, :length] = total
                if s.requires_grad:
                    gq, gk = torch.autograd.grad(s, (qd, kd), dsel.to(s.dtype), allow_unused=True)
                    if gq is not None:
                        dq[:, :, t0:t1] += up(gq)
                    if gk is not None:
                        dk[:, :, :length] += up(gk)

        flushed(run)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


__all__ = ["attend", "preferred", "supports"]
