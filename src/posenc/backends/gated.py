"""Per-key log forget gates (the Forgetting Transformer, Lin et al. 2025) on the fused kernel.

Backend name ``gated``. A call with ``spec.log_gates`` (B, H, Tk) and nothing else adds
c_i - c_j to the logits (c = cumsum of the gates over the keys, :meth:`ScoreSpec.cumulative_gates`),
keys after the query masked. Softmax drops the per-query c_i, so the term is a per-key -c_j: the
CPU flash kernel's additive mask, one (B, H, 1, L) vector broadcast over the queries. c grows with
the length (c ~ -T for gates that forget), so the mask is taken against a reference per block of
``BLOCK`` queries (the block's middle query), ``c_ref - c_j``: the keys near the block then carry
terms of at most BLOCK / 2 gates, and only far keys, whose weights are negligible, carry large
ones. In float32 that is as close to the float64 formula as ``eager`` in float32 (a reference at
the block's first query, with blocks of 256, was ~5x further off on the gates' gradients).

Each block is two kernel calls (:func:`~posenc.backends.parts.regions.lower`): the keys all its
rows see, then its causal staircase, with the kernel's own causal mask; they are merged through
their log-sum-exps, and the backward is each call's flash backward given the merged output and
log-sum-exp (:mod:`~posenc.backends.parts.regions`). The gates' gradient is the mask's,
``sum_i dS_ij`` per key: the kernel's backward gives it as the last feature of dk when q carries
one more feature 1 / scale and k, v a zero one (the scores and outputs do not change). Gates that
forget make most keys weigh nothing: in float32 a block's calls start at the first key some head
of some row can still see (:func:`_first_keys`: the keys whose decay is below the block's first
query's own key by more than ZERO_LOGIT plus twice a bound on |q . k| x scale, the rule
``blocked`` applies to steep ALiBi heads, have probabilities below 2^-150, exactly zero), so the
cost follows how far the slowest head remembers, not N. Memory:
O(N x block) per call, no (B, H, N, N) tensor. Where the CPU flash kernel with its log-sum-exp is
missing (another device, an old torch), the gates ride on the keys as one extra feature of public
``scaled_dot_product_attention`` instead, q' = [q, 1], k' = [k, (c_ref - c_j) / scale], v' = [v, 0],
per block with a (block, keys) bool mask for its staircase.

A decode step (one query, the last key) is one fused call with c_i - c_j as its additive mask
(B, H, 1, Tk). Runs causal calls with consecutive positions whose queries are the last keys (a
full pass, a cached step), without left padding (the eager formula takes padded rows), and only
when the encoding adds no other term.

Shape legend: B batch, H heads, Tq queries, Tk keys, D head dim, C block, L keys of one call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..encodings.protocol import Biases, QueryTerms, ValueTerms, offers
from .parts import padding
from .parts.base import ScoreSpec
from .parts.denormals import flushed, opaque_to_compile
from .parts.regions import Merge, Region, apply, kernel_forward, keys_of, lower, region_backward, rows_of, use_kernel
from .parts.tails import ZERO_LOGIT, spread

BLOCK = 128  # queries per block (the reference of c is the block's middle query)
DTYPES = (torch.float32, torch.float64)


def supports(spec: ScoreSpec, q: torch.Tensor) -> bool:
    enc = spec.encoding
    return (
        spec.log_gates is not None and spec.causal and spec.aligned and spec.consecutive and padding.supported(spec, split=False)
        and q.dtype in DTYPES and not any(offers(enc, p) for p in (Biases, QueryTerms, ValueTerms))
    )


def preferred(spec: ScoreSpec, q: torch.Tensor) -> bool:
    return supports(spec, q)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec, block: int | None = None) -> torch.Tensor:
    block = BLOCK if block is None else block
    tq, tk = q.shape[-2], k.shape[-2]
    c = spec.cumulative_gates()  # (B, H, Tk), float32 or float64
    if tq == 1:  # a decode step: c_i - c_j as the mask
        decay = (c[..., -1:] - c)[:, :, None, :].to(q.dtype)  # (B, H, 1, Tk)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=decay, scale=spec.scale)
    d, dv = q.shape[-1], v.shape[-1]
    if dv != d:  # one head dim for the kernel's q, k, v: zero features change no score and no output
        width = max(d, dv)
        q, k, v = (F.pad(x, (0, width - x.shape[-1])) for x in (q, k, v))
        return (_on_kernel(q, k, v, c, block, spec.scale) if use_kernel(q, v) else
                _features(q, k, v, c, tk - tq, block, spec.scale))[..., :dv]
    if use_kernel(q, v):
        return _on_kernel(q, k, v, c, block, spec.scale)
    return _features(q, k, v, c, tk - tq, block, spec.scale)


@opaque_to_compile  # the forgotten keys per block are read on the host: kept out of compiled frames
def _on_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: torch.Tensor, block: int, scale: float) -> torch.Tensor:
    """The kernel calls of every block (:func:`_blocks`), from the first key a block can see."""
    tq, offset = q.shape[-2], k.shape[-2] - q.shape[-2]
    starts = _first_keys(q, k, c, offset, block, scale) if q.dtype == torch.float32 else None
    return apply(_Gated, q, k, v, c, _blocks(tq, offset, block, starts), scale)


def _first_keys(q: torch.Tensor, k: torch.Tensor, c: torch.Tensor, offset: int, block: int, scale: float) -> list[int]:
    """Per block of queries, the first key that can weigh anything in float32: the keys before it
    are forgotten by every head of every row, their decay below the block's first query's own key
    by more than ZERO_LOGIT + 2 x (a bound on |q . k| x scale), so their probability is below
    2^-150 of that key's, exactly zero in float32, and no call needs them."""
    limit = ZERO_LOGIT + 2 * spread(q, k, scale)
    with torch.no_grad():
        counts = [((c[..., : t0 + offset + 1] - c[..., t0 + offset, None]).amin((0, 1)) > limit).sum()  # (Tk,) -> ()
                  for t0 in range(0, q.shape[-2], block)]
    return [int(n) for n in torch.stack(counts).tolist()]  # c is non-increasing: the forgotten keys lead


def _blocks(tq: int, offset: int, block: int, starts: list[int] | None = None) -> list[tuple[int, Region]]:
    """(the key index of the block's middle query, region) for every kernel call: per block of
    queries, the keys all its rows see (from ``starts[n]`` on for block n), then its causal
    staircase (:func:`regions.lower`)."""
    out = []
    for n, t0 in enumerate(range(0, tq, block)):
        t1 = min(t0 + block, tq)
        middle = (t0 + t1) // 2 + offset
        for r in lower(t1 - t0, t1 + offset, t0 + offset):
            keys = r.keys if r.causal or starts is None else (starts[n], r.keys[1])
            out.append((middle, Region((t0 + r.rows[0], t0 + r.rows[1]), keys, r.causal)))
    return out


def _mask(c: torch.Tensor, middle: int, region: Region, dtype: torch.dtype) -> torch.Tensor:
    """The gates' per-key term of one call, ``c_ref - c_j`` (B, H, 1, L), c_ref the block's middle query's."""
    a, b = region.keys
    return (c[..., middle, None] - c[..., a:b]).to(dtype)[:, :, None, :]


class _Gated(torch.autograd.Function):
    """The kernel with the gates as a per-key mask. The mask's gradient is ``sum_i dS_ij``, which
    the kernel's own backward gives as the last feature of dk when q carries a feature 1 / scale
    and k a zero one (the scores are unchanged): q' = [q, 1/scale], k' = [k, 0], v' = [v, 0]."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: torch.Tensor, plan: list[tuple[int, Region]],
                scale: float) -> torch.Tensor:
        b, h, tq, d = q.shape
        merged = Merge(b, h, tq, d, q.dtype, q.device)

        def run() -> None:
            for middle, r in plan:
                o, lz = kernel_forward(rows_of(q, r), keys_of(k, r), keys_of(v, r), r.causal, scale, _mask(c, middle, r, q.dtype))
                merged.add(r.rows, o, lz)

        flushed(run)
        out = merged.out.to(q.dtype)
        ctx.plan, ctx.scale = plan, scale
        ctx.save_for_backward(q, k, v, c, out, merged.lse)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, c, out, lse = ctx.saved_tensors
        scale, d = ctx.scale, q.shape[-1]

        def one(x: torch.Tensor, value: float) -> torch.Tensor:
            return torch.cat([x, x.new_full((*x.shape[:-1], 1), value)], -1)  # (..., D + 1)

        qf, kf, vf, of, gf = one(q, 1 / scale), one(k, 0.0), one(v, 0.0), one(out, 0.0), one(dout.contiguous(), 0.0)
        grads = [torch.zeros_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)]
        dc = torch.zeros_like(c)

        def run() -> None:
            for middle, r in ctx.plan:
                gq, gk, gv = region_backward(r, gf, qf, kf, vf, of, lse, scale, mask=_mask(c, middle, r, q.dtype))
                keys = slice(*r.keys)
                grads[0][:, :, slice(*r.rows)] += gq
                grads[1][:, :, keys] += gk
                grads[2][:, :, keys] += gv
                dmask = gk[..., d].to(dc.dtype)  # (B, H, L): sum over the call's rows of dS
                dc[:, :, keys] -= dmask
                dc[:, :, middle] += dmask.sum(-1)

        flushed(run)
        dq, dk, dv = (g[..., :d] for g in grads)
        return dq, dk, dv, dc, None, None


def _features(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: torch.Tensor, offset: int, block: int, scale: float) -> torch.Tensor:
    """The gates as one extra key feature on public SDPA, per block of queries with a bool mask for
    its staircase (devices without the CPU flash kernel's log-sum-exp)."""
    b, h, tq, d = q.shape
    tk = k.shape[-2]
    ones = q.new_ones(b, h, tq, 1)
    zeros = v.new_zeros(b, h, tk, 1)
    vf = torch.cat([v, zeros], -1)  # (B, H, Tk, D + 1)
    qf = torch.cat([q, ones], -1)  # (B, H, Tq, D + 1)
    keys = torch.arange(tk, device=q.device)
    outs = []
    for a0 in range(0, tq, block):
        a1 = min(a0 + block, tq)
        end = a1 + offset  # this block sees keys 0..end-1
        ref = c[..., (a0 + a1) // 2 + offset, None]  # (B, H, 1): c of the block's middle query
        feature = ((ref - c[..., :end]) / scale).to(k.dtype)[..., None]  # (B, H, end, 1)
        kf = torch.cat([k[:, :, :end], feature], -1)  # (B, H, end, D + 1)
        allowed = keys[None, :end] <= torch.arange(a0 + offset, a1 + offset, device=q.device)[:, None]  # (C, end)
        o = F.scaled_dot_product_attention(qf[:, :, a0:a1], kf, vf[:, :, :end], attn_mask=allowed, scale=scale)
        outs.append(o[..., :d])
    return torch.cat(outs, -2)  # (B, H, Tq, D)
