"""Blocked attention for score-bias methods (ALiBi, T5): no (H, N, N) tensor, forward or backward.

An encoding that gives its bias as a function of r = j - i (:class:`RelativeBias`: ``relative_bias``
and ``bias_tails``, see :class:`~posenc.encodings.protocol.BiasTails`) splits every query's keys:

- the far past, r <= -P: there ``f(r) = f(-P) + s (r + P)`` is a per-key term ``s (j - ref)``
  plus a per-query constant. The constant only shifts the part's log-sum-exp; the per-key term
  (ALiBi, where P = 0: every key is "far") is the kernel's mask, one (1, h, 1, L) vector broadcast
  over the queries; a constant tail (T5) needs no mask at all. "Keys with j <= i - P" is the
  kernel's causal mask on shifted slices (:func:`~posenc.backends.parts.regions.lower`), so the far part
  keeps the causal skip. Heads are grouped by slope (:func:`head_groups`): a steep head weighs
  nothing beyond a short window, and its whole attention is then a written-out band (below) of
  that window; the gentle ones take the far calls. The kernel loops run in a thread that flushes
  denormals (:func:`~posenc.backends.parts.denormals.flushed`): ALiBi's far keys put many probabilities in
  float32's denormal range, where many x86 CPUs multiply on a slow microcode path, so the kernel's
  backward would spend most of an ALiBi training step on values too small to change the result
  (``benchmarks/attention_table.sh``, ALiBi's train step at N=4096, times it);
- the far future, r >= F (encoders only): the mirror image, on reversed slices;
- the band in between, -P < r < F (T5: the last P keys), written out from ``relative_bias`` in
  batched blocks (:mod:`posenc.backends.parts.band`).

A non-causal call (an encoder's) whose table takes no gradient (ALiBi; T5 frozen or without grad)
skips the split: the bias is a Toeplitz matrix, a strided view of one (H, Tq + Tk - 1) table over the
reversed keys, and one kernel call with it as its mask runs the whole attention, forward and backward
(:mod:`posenc.backends.parts.toeplitz`). A learned table (T5 training) takes the same two kernel calls
for the output and dq, dk, dv; the split then serves only the table's gradient (:func:`_table_grad`):
the band's dS written out, one kernel forward per far-future region, the far past's constant from
the rows' zero sums.

Parts are merged through their log-sum-exps (:class:`~posenc.backends.parts.regions.Merge`), and the
backward is a custom ``autograd.Function`` that saves only q, k, v, the output and the log-sum-exp:
each part's flash backward, given the merged output and log-sum-exp, is exactly its share of the
gradient. A learned bias (T5) gets its gradient from the band, where dS = P (dP - D) is computed
explicitly and summed per relative position, and from each far part, whose constant's gradient is
``sum over its pairs of dS = sum_i w_i (dO_i . o_i - D_i)`` (w_i: the part's share of row i, o_i:
the part's own output, kept from the forward; D_i = dO_i . O_i), with no extra kernel call.

Precision: a score ``q . k * scale + s (j - ref)`` is a float32 number, rounded to ~6e-8 of its
size. So the far part of a sloped tail walks blocks of queries, each with its own ``ref`` at its
middle, of at most ``TERM_SPAN / max|s|`` queries: the keys that matter to a query (near it, where
``exp(-s |i - j|)`` is not negligible) then carry terms of at most ~TERM_SPAN/2, and the result is as
close to float64 as SDPA with a dense float32 bias (tests). ALiBi's slopes are powers of two for
power-of-two head counts, so ``s (j - ref)`` itself is exact in float32, and the mask stays float32
for bfloat16/float16 inputs too (the kernel adds it to float32 scores).

Other bias encodings (no affine tails: KERPLE, FIRE, any ``bias``) take the path of
:mod:`posenc.backends.parts.explicit`: per block of queries, the kernel with that block's bias as its
mask, and a written-out backward that also gives the bias its gradient.

Grouped-query heads (k, v with Hkv heads, H = g x Hkv) are taken as they are where every part of
the plan takes whole groups of g query heads and every far call at least two key/value heads
(:func:`~posenc.backends.parts.tails.grouped`; T5's one part of every head, with two or more
key/value heads): the kernel calls broadcast a group's key/value head, and the written-out backward
folds the group into one batch of rows (:func:`~posenc.backends.parts.regions.fold_heads`), so dk
and dv come out with Hkv heads. Other plans take k and v repeated: ALiBi's slope groups are a few
heads each, so its far calls take part of a group or one key/value head (8 heads with 1, 2 or 4
key/value heads, at every length tried). Aligning the slope groups to the groups instead would give
a steep head the window of the gentlest head of its group, far more keys.

A decode step (one query, no gradient) skips all of the above: the bias is one vector per head,
the fused kernel's mask (``backends/parts/single.py``). Left-padded rows are split into unpadded calls
(``backends/parts/padding.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..encodings.protocol import RelativeBias, offers
from ..errors import UsageError
from . import sdpa
from .parts import band, explicit, padding, single, tails, toeplitz
from .parts.base import ScoreSpec, accumulation_dtype
from .parts.denormals import flushed, opaque_to_compile
from .parts.regions import (
    FLASH_OPS,
    Merge,
    Region,
    apply,
    call_order,
    fold_heads,
    kernel_backward,
    kernel_forward,
    keys_of,
    kv_heads,
    region_backward,
    repeated_heads,
    rows_of,
    rows_ready,
    unfold_heads,
    up,
)


def supports(spec: ScoreSpec, q: torch.Tensor) -> bool:
    # Key index = position - first position: both paths below rely on consecutive positions.
    return spec.consecutive and not (spec.has_query_terms or spec.has_value_terms) and padding.supported(spec)


def preferred(spec: ScoreSpec, q: torch.Tensor) -> bool:
    # On CPU without the flash ops (old torch), public SDPA with a dense bias is the faster fallback.
    return spec.has_bias and supports(spec, q) and (FLASH_OPS or q.device.type != "cpu")


def takes_grouped_heads(spec: ScoreSpec) -> bool:
    """k and v may come with fewer heads than q (grouped-query attention): nothing is repeated."""
    return True


def fast_path(spec: ScoreSpec, tq: int, tk: int) -> bool:
    """True when the encoding offers :class:`RelativeBias` and the keys cover the queries'
    positions (a full pass, or decoding after a KV cache)."""
    if not offers(spec.encoding, RelativeBias) or tq == 0 or tk == 0:
        return False
    qs, ks = spec.q_start, spec.k_start
    return ks <= qs and qs + tq <= ks + tk


@single.steps_and_padding  # a decode step and left-padded rows first (backends/parts/single.py)
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec, block: int | None = None) -> torch.Tensor:
    """``block`` (tests) sets the band block and, for sloped tails, the far block to one size."""
    if block is not None and block < 1:
        raise UsageError(f"block must be a positive integer, got {block}")
    if not spec.has_bias:
        return sdpa.attend(q, k, v, spec)
    tq, tk = q.shape[-2], k.shape[-2]
    if fast_path(spec, tq, tk):
        if block is None and toeplitz.applies(spec, q, v):  # non-causal: one kernel call, its mask a view of a table
            return _one_call(q, k, v, spec)
        return _tailed(q, k, v, spec, block)
    return explicit.attend(q, k, v, spec, block)


@opaque_to_compile  # one opaque call, as _tailed: the table, the flipped keys and the kernel stay out of compiled frames
def _one_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec) -> torch.Tensor:
    """A non-causal call: one kernel call each way with the bias table as its mask
    (backends/parts/toeplitz.py). A table that takes a gradient (T5's, learned) gets it from the
    plan of :func:`_tailed` (:func:`_table_grad`), since the kernel's backward gives no dS."""
    tq, tk = q.shape[-2], k.shape[-2]
    w = toeplitz.table(spec, tq, tk, q.device)  # (H, Tq + Tk - 1)
    if not w.requires_grad:
        return toeplitz.attend(q, k, v, spec, w)
    plan = tails.make_plan(spec, tq, tk, q.dtype, None, tails.spread(q, k, spec.scale))
    rel = spec.memo.relative_values(spec.encoding, plan.r_lo, plan.r_hi, q.device)  # (H, R): the far constants and the band
    return toeplitz.attend(q, k, v, spec, w, rel, lambda *saved: flushed(_table_grad, plan, *saved, when=_sloped(plan)))


@opaque_to_compile  # the plan reads a bound on |q . k| on the host: kept out of compiled frames
def _tailed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec, block: int | None) -> torch.Tensor:
    """The far calls and band blocks of a bias with affine tails, planned from this call's |q . k|."""
    tq, tk = q.shape[-2], k.shape[-2]
    plan = tails.make_plan(spec, tq, tk, q.dtype, block, tails.spread(q, k, spec.scale))
    if k.shape[1] != q.shape[1] and not tails.grouped(plan, q.shape[1], k.shape[1]):
        k, v = repeated_heads(k, v, q.shape[1])  # (B, H, Tk, D)
    rel = spec.memo.relative_values(spec.encoding, plan.r_lo, plan.r_hi, q.device)  # (H, R)
    return apply(_TailedBias, q, k, v, rel, plan)


# ---------------------------------------------------------------------------------------------
# The autograd function


class _TailedBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel: torch.Tensor, plan: tails.TailPlan) -> torch.Tensor:
        keep = ctx.needs_input_grad[3]  # a learned table (T5): its far constants' gradient needs each far call's output
        out, lse, far = flushed(_forward, q, k, v, rel, plan, keep, when=_sloped(plan))
        ctx.plan = plan
        ctx.far = far if keep else None
        ctx.save_for_backward(q, k, v, rel, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, rel, out, lse = ctx.saved_tensors
        need_rel = ctx.needs_input_grad[3]
        dq, dk, dv, drel = flushed(_backward, ctx.plan, ctx.far, need_rel, dout, q, k, v, rel, out, lse, when=_sloped(ctx.plan))
        return dq, dk, dv, drel, None


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel: torch.Tensor, plan: tails.TailPlan, keep: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Output (B, H, Tq, Dv), its log-sum-exp (B, H, Tq) and, with ``keep``, each far call's
    (output, log-sum-exp); otherwise each far output is freed once merged."""
    b, h, tq, d = q.shape
    hkv = k.shape[1]
    merged = Merge(b, h, tq, v.shape[-1], q.dtype, q.device, like=q)  # (in q's memory: see regions.heads_first)
    far: list[tuple[torch.Tensor, torch.Tensor]] = []  # each far call's output and shifted log-sum-exp: its constant's gradient
    for call in plan.far:
        term, shift, _ = tails.far_terms(plan, rel, call)
        r, hs = call.region, call.heads
        kvs = kv_heads(hs, h, hkv)
        o, lz = kernel_forward(*_cut(r, q[:, hs], k[:, kvs], v[:, kvs]), r.causal, plan.scale, _key_mask(term, r))
        lz = call_order(lz, r, -1) + shift  # (B, h, C): back to the true bias
        o = call_order(o, r)
        merged.add(r.rows, o, lz, hs)
        if keep:
            far.append((o, lz))
    for group in plan.bands:
        bias, _ = _band_bias(plan, rel, group)
        hs = group.heads
        kvs = kv_heads(hs, h, hkv)
        o, lz = kernel_forward(band.blocks(q[:, hs], group), band.windows(k[:, kvs], group), band.windows(v[:, kvs], group),
                              False, plan.scale, bias.to(q.dtype)[None])
        merged.add(group.row_range, band.unblocks(o, group), band.unblocks(lz, group), hs)
    return merged.out.to(q.dtype), merged.lse, far


def _backward(
    plan: tails.TailPlan, far: list[tuple[torch.Tensor, torch.Tensor]] | None, need_rel: bool, dout: torch.Tensor, q: torch.Tensor,
    k: torch.Tensor, v: torch.Tensor, rel: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    dout = rows_ready(dout)
    grads = _Grads(q, k, v)  # (in the inputs' layout: a stacked view's gradient needs no copy back)
    q, k, v = rows_ready(q), rows_ready(k), rows_ready(v)  # (each read by several kernel calls)
    drel = torch.zeros(rel.shape, dtype=accumulation_dtype(rel.dtype), device=rel.device) if need_rel else None
    dsum = (up(dout) * up(out)).sum(-1)  # (B, H, Tq): D_i = dO_i . O_i
    h, hkv = q.shape[1], k.shape[1]
    for n, call in enumerate(plan.far):
        term, shift, r0 = tails.far_terms(plan, rel, call)
        r, hs = call.region, call.heads
        kvs = kv_heads(hs, h, hkv)
        gq, gk, gv = region_backward(r, dout[:, hs], q[:, hs], k[:, kvs], v[:, kvs], out[:, hs], lse[:, hs], plan.scale,
                                     lse_shift=shift, mask=_key_mask(term, r))
        rows, keys = slice(*r.rows), slice(*r.keys)
        if drel is not None and far is not None:
            _far_constant_grad(drel, hs, r0, rows, *far[n], lse, dout, dsum)
        # Each gradient is freed before the next buffer is allocated.
        grads.add(0, rows, gq, hs)
        del gq
        grads.add(1, keys, gk, kvs)
        del gk
        grads.add(2, keys, gv, kvs)
        del gv
    _band_backward(plan, rel, drel, q, k, v, out, lse, dout, dsum, grads)
    dq, dk, dv = grads.result()
    return dq, dk, dv, (None if drel is None else drel.to(rel.dtype))


def _far_constant_grad(
    drel: torch.Tensor, hs: slice, r0: int, rows: slice, o_call: torch.Tensor, lz_call: torch.Tensor, lse: torch.Tensor,
    dout: torch.Tensor, dsum: torch.Tensor,
) -> None:
    """Adds a far call's constant's gradient to ``drel[hs, r0]``: the sum over the call's pairs of
    dS = P (dP - D). With w_i the call's share of row i (exp(lz_i - lse_i)) and o_i its own output,
    sum_j P_ij dO_i . v_j = w_i dO_i . o_i, so the sum is sum_i w_i (dO_i . o_i - D_i)."""
    weight = torch.exp(lz_call - lse[:, hs, rows])  # (B, h, C)
    own = (up(dout[:, hs, rows]) * up(o_call)).sum(-1)  # (B, h, C)
    drel[hs, r0] += (weight * (own - dsum[:, hs, rows])).sum((0, 2))


def _table_grad(
    plan: tails.TailPlan, rel: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, dout: torch.Tensor,
) -> torch.Tensor:
    """The gradient of ``rel`` (H, R) alone, given the whole call's output and log-sum-exp (the
    Toeplitz path's dq, dk, dv come from the kernel): the far future's constant from one kernel
    forward of each of its regions (:func:`_far_constant_grad`), the band's from its dS written out,
    and the far past's constant from the rest: every row's dS sums to zero (sum_j P_ij (dP_ij - D_i)
    = D_i - D_i), so for each head the sum over all pairs is zero too."""
    h = q.shape[1]
    if k.shape[1] != h and not tails.grouped(plan, h, k.shape[1]):
        k, v = repeated_heads(k, v, h)  # (B, H, Tk, D)
    dout, q, k, v = rows_ready(dout), rows_ready(q), rows_ready(k), rows_ready(v)
    drel = torch.zeros(rel.shape, dtype=accumulation_dtype(rel.dtype), device=rel.device)
    dsum = (up(dout) * up(out)).sum(-1)  # (B, H, Tq): D_i = dO_i . O_i
    past: dict[tuple[int | None, int | None], tuple[slice, int]] = {}  # heads -> the far past's constant's index
    for call in plan.far:
        term, shift, r0 = tails.far_terms(plan, rel, call)
        r, hs = call.region, call.heads
        if call.side == 0:
            past[hs.start, hs.stop] = hs, r0
            continue
        kvs = kv_heads(hs, h, k.shape[1])
        o, lz = kernel_forward(*_cut(r, q[:, hs], k[:, kvs], v[:, kvs]), r.causal, plan.scale, _key_mask(term, r))
        _far_constant_grad(drel, hs, r0, slice(*r.rows), call_order(o, r), call_order(lz, r, -1) + shift, lse, dout, dsum)
    _band_backward(plan, rel, drel, q, k, v, out, lse, dout, dsum, None)
    for hs, r0 in past.values():  # the far past's pairs: what makes each head's sum zero
        drel[hs, r0] -= drel[hs].sum(1)
    return drel.to(rel.dtype)


def _sloped(plan: tails.TailPlan) -> bool:
    """A tail that falls with distance (ALiBi): far keys' probabilities reach float32's denormals,
    so the kernel loops run with them flushed; a constant tail (T5) runs them in the caller's thread."""
    return any(s is not None for s in plan.slopes)


def _key_mask(term: torch.Tensor | None, region: Region) -> torch.Tensor | None:
    """A far call's per-key term as the kernel's mask, (1, h, 1, L) in call order; float32 whatever
    the input dtype (the kernel takes it so and adds it to float32 scores), or None."""
    return None if term is None else call_order(term, region, -1)[None, :, None, :]


def _cut(region: Region, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The region's q rows and k, v keys, in call order."""
    return rows_of(q, region), keys_of(k, region), keys_of(v, region)


def _band_bias(plan: tails.TailPlan, rel: torch.Tensor, group: band.BandGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """The band block's bias and rel index, built once per forward for each block geometry."""
    offset = (plan.k_start + group.k0) - (plan.q_start + group.t0)  # r of the block's top-left pair
    key = (group.rows, group.length, offset, group.heads.start, group.heads.stop, group.past, group.top, plan.r_lo, rel.dtype)
    hit = plan.cache.get(key)
    if hit is None:
        hit = plan.cache[key] = band.band_bias(rel, plan.r_lo, group, offset)
    return hit


def _band_backward(
    plan: tails.TailPlan, rel: torch.Tensor, drel: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, dsum: torch.Tensor, grads: _Grads | None,
) -> None:
    """The band's gradients: the kernel's backward for a fixed bias, the explicit formula (with the
    bias gradient summed per relative position) for a learned one, in smaller groups; without
    ``grads``, only the learned bias's gradient."""
    groups = plan.bands if drel is None else [part for g in plan.bands for part in band.split(g, band.EXPLICIT_GROUP)]
    ws = explicit.BackwardBuffers(0, accumulation_dtype(q.dtype), q.device)  # the learned band's buffers, reused by every group
    for group in groups:
        bias, index = _band_bias(plan, rel, group)
        hs = group.heads
        kvs = kv_heads(hs, q.shape[1], k.shape[1])
        q_, dout_, out_, lse_, dsum_ = (x[:, hs] for x in (q, dout, out, lse, dsum))
        qc, doc = band.blocks(q_, group), band.blocks(dout_, group)  # (B*n, h, C, D)
        kc, vc = band.windows(k[:, kvs], group), band.windows(v[:, kvs], group)  # (B*n, hkv, L, D)
        oc, lc, dc = band.blocks(out_, group), band.blocks(lse_, group), band.blocks(dsum_, group)
        if drel is None:
            gq, gk, gv = kernel_backward(doc, qc, kc, vc, oc, lc.contiguous(), False, plan.scale, bias.to(q.dtype)[None])
        else:
            blocks = _learned_band(ws, plan.scale, bias, index, qc, doc, kc, vc, lc, dc, drel, hs, grads is not None)
            if blocks is None:
                continue
            gq, gk, gv = blocks
        assert grads is not None  # (a fixed bias's backward always takes its gradients)
        grads.add(0, slice(*group.row_range), band.unblocks(gq, group), hs)
        band.add_windows(grads.get(1)[:, kvs], group, gk)
        band.add_windows(grads.get(2)[:, kvs], group, gv)


def _learned_band(
    ws: explicit.BackwardBuffers, scale: float, bias: torch.Tensor, index: torch.Tensor, qc: torch.Tensor, doc: torch.Tensor,
    kc: torch.Tensor, vc: torch.Tensor, lc: torch.Tensor, dc: torch.Tensor, drel: torch.Tensor, hs: slice, gradients: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """One band group's (dq, dk, dv) blocks for a learned bias (None without ``gradients``), dS =
    P (dP - D) written out and summed per relative position into ``drel``. q, dO (B*n, h, C, D) and the key/value windows (B*n, hkv,
    L, D) are copied once into ``ws`` (q and dO only where they are not contiguous already), and
    every product writes into ``ws``: the groups of one backward reuse the same memory (fresh pages
    per group cost more than the products here, on CPU); the returned blocks live in ``ws`` until
    the next group."""
    h, hkv, dt = qc.shape[1], kc.shape[1], qc.dtype
    q_g = fold_heads(_taken(ws, "q", qc), hkv)  # (B*n, hkv, g C, D): a group's heads as rows
    do_g = fold_heads(_taken(ws, "do", doc), hkv)
    kw, vw = ws.take("k", kc.shape, dt).copy_(kc), ws.take("v", vc.shape, dt).copy_(vc)  # (B*n, hkv, L, D)
    rows = (*q_g.shape[:-1], kw.shape[-2])  # (B*n, hkv, g C, L)
    s = unfold_heads(up(torch.matmul(q_g, kw.transpose(-1, -2), out=ws.take("s", rows, dt))), h)
    p = s.mul_(scale).add_(bias).sub_(lc[..., None]).exp_()  # (B*n, h, C, L): probabilities under the merged normaliser
    ds = unfold_heads(up(torch.matmul(do_g, vw.transpose(-1, -2), out=ws.take("dp", rows, dt))), h)
    ds = ds.sub_(dc[..., None]).mul_(p)  # dS
    drel[hs].scatter_add_(1, index.expand(h, -1), ds.sum(0).reshape(h, -1))
    if not gradients:
        return None
    gv = torch.matmul(fold_heads(p.to(dt), hkv).transpose(-1, -2), do_g, out=ws.take("gv", vw.shape, dt))  # (B*n, hkv, L, D)
    ds_g = fold_heads(ds.to(dt), hkv)
    gq = unfold_heads(torch.matmul(ds_g, kw, out=ws.take("gq", q_g.shape, dt)), h).mul_(scale)  # (B*n, h, C, D)
    gk = torch.matmul(ds_g.transpose(-1, -2), q_g, out=ws.take("gk", kw.shape, dt)).mul_(scale)  # (B*n, hkv, L, D)
    return gq, gk, gv


def _taken(ws: explicit.BackwardBuffers, name: str, x: torch.Tensor) -> torch.Tensor:
    """x itself when contiguous, else its copy in ``ws``'s buffer ``name``."""
    return x if x.is_contiguous() else ws.take(name, tuple(x.shape), x.dtype).copy_(x)


class _Grads:
    """dq, dk, dv, each allocated at its first contribution: a full-size kernel gradient then never
    coexists with all three buffers (peak memory)."""

    def __init__(self, *like: torch.Tensor) -> None:
        self.like = like
        self.bufs: list[torch.Tensor | None] = [None] * len(like)

    def get(self, i: int) -> torch.Tensor:
        buf = self.bufs[i]
        if buf is None:
            buf = self.bufs[i] = torch.zeros_like(self.like[i])
        return buf

    def add(self, i: int, where: slice, g: torch.Tensor, heads: slice = slice(None)) -> None:
        self.get(i)[:, heads, where] += g

    def result(self) -> list[torch.Tensor]:
        return [torch.zeros_like(x) if b is None else b for x, b in zip(self.like, self.bufs)]
