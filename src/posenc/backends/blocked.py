"""Blocked attention for score-bias methods (ALiBi, T5): no (H, N, N) tensor, forward or backward.

An encoding that gives its bias as a function of r = j - i (:class:`RelativeBias`: ``relative_bias``
and ``bias_tails``, see :class:`~posenc.encodings.protocol.BiasTails`) splits every query's keys:

- the far past, r <= -P: there ``f(r) = f(-P) + s (r + P)`` is a per-key term ``s (j - ref)``
  plus a per-query constant. The constant only shifts the part's log-sum-exp. The per-key term
  (ALiBi, where P = 0: every key is "far") rides on one extra feature: q gets the constant
  ``1/scale``, k gets ``s (j - ref)``, so the fused kernel's own ``q k^T * scale`` adds it, with no
  mask; q, k and v are padded to a multiple of 8 features, which the CPU kernel runs at nearly the
  speed of 64 (a mask, even a broadcast (1, H, 1, L) one, sends the CPU kernel's backward down a
  path several times slower: measured 1.62 of 2.17 s of an ALiBi step at N=4096). A constant tail
  (T5) needs no feature at all. "Keys with j <= i - P" is the kernel's causal mask on shifted
  slices (:func:`~posenc.backends.regions.lower`), so the far part keeps the causal skip;
- the far future, r >= F (encoders only): the mirror image, on reversed slices;
- the band in between, -P < r < F (T5: the last P keys), written out from ``relative_bias`` in
  batched blocks (:mod:`posenc.backends.band`).

Parts are merged through their log-sum-exps (:class:`~posenc.backends.regions.Merge`), and the
backward is a custom ``autograd.Function`` that saves only q, k, v, the output and the log-sum-exp:
each part's flash backward, given the merged output and log-sum-exp, is exactly its share of the
gradient. A learned bias (T5) gets its gradient from the band, where dS = P (dP - D) is computed
explicitly and summed per relative position, and from each far part, whose constant's gradient is
``sum over its pairs of dS = sum_j v_j . dv_j - sum_i w_i D_i`` (w_i: the part's share of row i,
D_i = dO_i . O_i), with no extra kernel call.

Precision: the kernel sums ``q . k + s (j - ref) / scale`` in float32, which rounds to ~6e-8 of the
largest term. So the far part of a sloped tail walks blocks of queries, each with its own ``ref``
at its middle, of at most ``FEATURE_SPAN / max|s|`` queries: the keys that matter to a query (near
it, where ``exp(-s |i - j|)`` is not negligible) then carry terms of at most ~FEATURE_SPAN/2, and
the result is as close to float64 as SDPA with a dense float32 bias (tests). ALiBi's slopes are
powers of two for power-of-two head counts, so ``s (j - ref)`` itself is exact in float32. In
bfloat16/float16 the term goes in two features (a high and a low part), since one 8-bit mantissa
would round it to ~1/8 of a logit.

Other bias encodings (no affine tails: KERPLE, FIRE, any ``bias``) take the path of
:mod:`posenc.backends.explicit`: per block of queries, the kernel with that block's bias as its
mask, and a written-out backward that also gives the bias its gradient.

A decode step (one query, no gradient) skips all of the above: the bias is one vector per head,
the fused kernel's mask (``backends/single.py``). Left-padded rows are split into unpadded calls
(``backends/padding.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..encodings.protocol import RelativeBias, offers
from ..errors import UsageError
from . import band, explicit, padding, sdpa, single
from .base import ScoreSpec, accumulation_dtype
from .regions import (
    FLASH_OPS, Merge, Region, call_order, flushed, kernel_backward, kernel_forward, keys_of, lower, region_backward, rows_of,
    up, upper,
)

BAND_BLOCK = 64  # query rows per explicit band block: the band is BAND_BLOCK + P - 1 keys wide
FEATURE_SPAN = 32.0  # a sloped far block is at most FEATURE_SPAN / max|slope| queries (see Precision)
FEATURE_MULTIPLE = 8  # q, k, v padded to a multiple of this many features when a feature is added
MIN_GROUP_HEADS = 2  # heads per far call at least (the kernel's backward runs one head per thread)
ZERO_LOGIT = 110.0  # exp(-ZERO_LOGIT) is below 2^-150: a probability that rounds to 0 in float32
BAND_WINDOW = 1024  # heads whose window is at most this run as a written-out band (few batched calls)


def supports(spec: ScoreSpec, q: torch.Tensor) -> bool:
    # Key index = position - first position: both paths below rely on consecutive positions.
    unpadded = spec.starts is None or padding.splittable(spec)
    return spec.consecutive and not (spec.has_query_terms or spec.has_value_terms) and unpadded


def preferred(spec: ScoreSpec, q: torch.Tensor) -> bool:
    # On CPU without the flash ops (old torch), public SDPA with a dense bias is the faster fallback.
    return spec.has_bias and supports(spec, q) and (FLASH_OPS or q.device.type != "cpu")


def fast_path(spec: ScoreSpec, tq: int, tk: int) -> bool:
    """True when the encoding offers :class:`RelativeBias` and the keys cover the queries'
    positions (a full pass, or decoding after a KV cache)."""
    if not offers(spec.encoding, RelativeBias) or tq == 0 or tk == 0:
        return False
    qs, ks = int(spec.q_positions[0]), int(spec.k_positions[0])
    return ks <= qs and qs + tq <= ks + tk


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec, block: int | None = None) -> torch.Tensor:
    """``block`` (tests) sets the band block and, for sloped tails, the far block to one size."""
    if block is not None and block < 1:
        raise UsageError(f"block must be a positive integer, got {block}")
    if single.applies(spec, q, k, v):  # a decode step: the bias is one vector
        return single.attend(q, k, v, spec)
    if spec.starts is not None:
        return padding.by_rows(lambda *a: attend(*a, block=block), q, k, v, spec)
    if not spec.has_bias:
        return sdpa.attend(q, k, v, spec)
    tq, tk = q.shape[-2], k.shape[-2]
    if fast_path(spec, tq, tk):
        plan = make_plan(spec, tq, tk, q.dtype, block, _spread(q, k, spec.scale))
        rel = spec.memo.relative_values(spec.encoding, plan.r_lo, plan.r_hi, q.device)  # (H, R)
        return _TailedBias.apply(q, k, v, rel, plan)
    return explicit.attend(q, k, v, spec, block)


def _spread(q: torch.Tensor, k: torch.Tensor, scale: float) -> float:
    """A bound on |q_i . k_j| x scale over all pairs (Cauchy-Schwarz): what content can add to a
    logit, so far keys whose bias is lower by more than this (and then some) weigh nothing."""
    with torch.no_grad():
        return float(q.detach().float().norm(dim=-1).max() * k.detach().float().norm(dim=-1).max()) * scale


# ---------------------------------------------------------------------------------------------
# Plan: which kernel calls and which band blocks cover every (query, key) pair exactly once


@dataclass
class FarCall:
    region: Region
    side: int  # 0: past (r <= -past), 1: future (r >= future)
    ref: int  # key position the per-key term s (j - ref) is measured from
    heads: slice = field(default_factory=lambda: slice(None))  # the heads it covers (similar slopes)

    @property
    def causal(self) -> bool:
        return self.region.causal

    @property
    def flip(self) -> bool:
        return self.region.flip


@dataclass
class Plan:
    far: list[FarCall]
    bands: list[band.BandGroup]
    q_start: int  # absolute position of query 0 and of key 0
    k_start: int
    scale: float
    causal: bool
    past: int  # far past: r <= -past
    future: int  # far future: r >= future (encoders)
    slopes: tuple[torch.Tensor | None, torch.Tensor | None]  # past, future
    r_lo: int  # the rel vector holds f(r) for r = r_lo .. r_hi
    r_hi: int
    cache: dict = field(default_factory=dict, repr=False)  # band bias per block geometry


def head_groups(slope: torch.Tensor | None, dtype: torch.dtype, tq: int, block: int | None, spread: float | None, past: int):
    """(heads, rows per far block, window) per group of heads.

    Rows: all of them for a constant tail or float64, else the largest power of two with |s| x rows
    <= FEATURE_SPAN (at least 16), so steep heads walk small blocks and gentle ones large blocks.
    Window (a tail that starts at the diagonal, past == 0, when ``spread`` bounds |q.k| x scale):
    keys more than (ZERO_LOGIT + 2 spread) / |s| before the query weigh less than 2^-150 of the
    diagonal key, exactly zero in float32, and are left out. Contiguous heads with the same block
    form a group; groups keep at least MIN_GROUP_HEADS heads, since the CPU kernel's backward runs
    one head per thread.
    """
    if block is not None or slope is None or dtype == torch.float64:
        return [(slice(None), block, None)]
    runs: list[list] = []  # [first head, last head + 1, rows, smallest |s|]
    for h, s in enumerate(slope.abs().tolist()):
        rows = 16
        while rows * 2 * s <= FEATURE_SPAN and rows < tq:
            rows *= 2
        if runs and (runs[-1][2] == rows or runs[-1][1] - runs[-1][0] < MIN_GROUP_HEADS):
            runs[-1][1], runs[-1][2], runs[-1][3] = h + 1, min(runs[-1][2], rows), min(runs[-1][3], s)
        else:
            runs.append([h, h + 1, rows, s])
    if len(runs) > 1 and runs[-1][1] - runs[-1][0] < MIN_GROUP_HEADS:  # a lone last head joins the one before
        last = runs.pop()
        runs[-1][1], runs[-1][2], runs[-1][3] = last[1], min(runs[-1][2], last[2]), min(runs[-1][3], last[3])
    groups = []
    for h0, h1, rows, s in runs:
        window = None
        if past == 0 and spread is not None and s > 0:
            window = int((ZERO_LOGIT + 2 * spread) / s) + 1
        groups.append((slice(h0, h1), None if rows >= tq else rows, window))
    return groups


def make_plan(spec: ScoreSpec, tq: int, tk: int, dtype: torch.dtype = torch.float32, block: int | None = None,
              spread: float | None = None) -> Plan:
    tails = spec.encoding.bias_tails()
    slopes = (tails.past_slope, tails.future_slope)
    past = tails.past
    future = max(tails.future, 1 - past)  # r = 0 belongs to one side only
    qs, ks = int(spec.q_positions[0]), int(spec.k_positions[0])
    rows = BAND_BLOCK if block is None else block
    far, bands = [], []
    # Far past: query a sees key b when b <= a + qs - ks - past. ref: the boundary key of the middle row.
    for heads, far_rows, window in head_groups(slopes[0], dtype, tq, block, spread, past):
        if window is not None and window <= BAND_WINDOW and spec.causal:
            # Steep heads: every key that weighs anything is within the window, so their whole
            # attention is a band of window + 1 distances, written out exactly and batched.
            bands += band.plan_band(tq, tk, qs, ks, window + 1, 0, rows, heads)
            continue
        for region in lower(tq, tk, qs - ks - past, far_rows, window):
            far.append(FarCall(region, 0, qs + sum(region.rows) // 2 - past, heads))
    if not spec.causal:  # far future: b >= a + qs - ks + future
        for heads, far_rows, window in head_groups(slopes[1], dtype, tq, block, spread, 1 - future):
            for region in upper(tq, tk, qs - ks + future, far_rows, window):
                far.append(FarCall(region, 1, qs + sum(region.rows) // 2 + future, heads))
    bands += band.plan_band(tq, tk, qs, ks, past, 0 if spec.causal else future - 1, rows)
    reach = max([past, *(g.past for g in bands)])
    width = rows if bands else 1
    return Plan(
        far, bands, qs, ks, spec.scale, spec.causal, past, future, slopes,
        r_lo=-(reach + width), r_hi=future + width, cache=spec.memo.table(spec.encoding, "band_bias", (), dict),
    )


def _far_terms(plan: Plan, rel: torch.Tensor, call: FarCall):
    """A far call's per-key term s (j - ref) (h, L), original key order (None for a constant tail),
    its per-query constant (h, C), original row order, and the rel index of its intercept f(r0)."""
    slope = plan.slopes[call.side]
    r0 = -plan.past if call.side == 0 else plan.future
    i = plan.q_start + torch.arange(*call.region.rows, device=rel.device)  # (C,) query positions
    # f(r) = f(r0) + s (j - i - r0) = [s (j - ref)] + [f(r0) + s (ref - r0 - i)]
    shift = up(rel[call.heads, r0 - plan.r_lo])[:, None].expand(-1, i.numel())  # (h, C)
    term = None
    if slope is not None:
        s = up(slope[call.heads])[:, None]  # (h, 1)
        shift = shift + s * (call.ref - r0 - i)[None, :]
        j = plan.k_start + torch.arange(*call.region.keys, device=rel.device)  # (L,) key positions
        term = s * (j - call.ref)[None, :]  # (h, L)
    return term, shift, r0 - plan.r_lo


class _Featured:
    """q, k, v padded with the per-key term's feature(s): q's are ``1/scale``, k's carry the term of
    the call at hand (written before each call). One feature in float32/64; a high and a low part
    in 16-bit types. Padded to a multiple of ``FEATURE_MULTIPLE`` (v too: one head dim for all)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *grads: torch.Tensor) -> None:
        self.d = d = q.shape[-1]
        self.parts = 1 if q.dtype in (torch.float32, torch.float64) else 2
        pad = -(d + self.parts) % FEATURE_MULTIPLE + self.parts
        self.q, self.k, self.v = (F.pad(x, (0, pad)) for x in (q, k, v))  # (B, H, T, d + pad)
        self.q[..., d : d + self.parts] = 1.0 / scale
        self.extra = [F.pad(x, (0, pad)) for x in grads]  # dout and out, for the backward

    def set(self, keys: tuple[int, int], term: torch.Tensor, heads: slice) -> None:
        hi = term.to(self.k.dtype)  # (h, L)
        self.k[:, heads, keys[0] : keys[1], self.d] = hi
        if self.parts == 2:
            self.k[:, heads, keys[0] : keys[1], self.d + 1] = (term - hi.to(term.dtype)).to(self.k.dtype)


# ---------------------------------------------------------------------------------------------
# The autograd function


class _TailedBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rel, plan: Plan):
        out, lse, far_lse = flushed(_forward, q, k, v, rel, plan)
        ctx.plan = plan
        ctx.far_lse = far_lse if ctx.needs_input_grad[3] else None
        ctx.save_for_backward(q, k, v, rel, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, rel, out, lse = ctx.saved_tensors
        need_rel = ctx.needs_input_grad[3]
        dq, dk, dv, drel = flushed(_backward, ctx.plan, ctx.far_lse, need_rel, dout, q, k, v, rel, out, lse)
        return dq, dk, dv, drel, None


def _forward(q, k, v, rel, plan: Plan):
    """Output (B, H, Tq, Dv), its log-sum-exp (B, H, Tq) and each far call's log-sum-exp."""
    b, h, tq, d = q.shape
    merged = Merge(b, h, tq, v.shape[-1], q.dtype, q.device)
    feat = _Featured(q, k, v, plan.scale) if any(s is not None for s in plan.slopes) else None
    far_lse = []  # each far call's shifted log-sum-exp: the gradient of its constant needs it
    for call in plan.far:
        term, shift, _ = _far_terms(plan, rel, call)
        r, hs = call.region, call.heads
        qq, kk, vv = (q, k, v) if term is None else (feat.q, feat.k, feat.v)
        if term is not None:
            feat.set(r.keys, term, hs)
        o, l = kernel_forward(*_cut(r, qq[:, hs], kk[:, hs], vv[:, hs]), r.causal, plan.scale)
        l = call_order(l, r, -1) + shift  # (B, h, C): back to the true bias
        merged.add(r.rows, call_order(o, r)[..., : v.shape[-1]], l, hs)
        far_lse.append(l)
    for group in plan.bands:
        bias, _ = _band_bias(plan, rel, group)
        hs = group.heads
        o, l = kernel_forward(band.blocks(q[:, hs], group), band.windows(k[:, hs], group), band.windows(v[:, hs], group),
                              False, plan.scale, bias.to(q.dtype)[None])
        merged.add(group.row_range, band.unblocks(o, group), band.unblocks(l, group), hs)
    return merged.out.to(q.dtype), merged.lse, far_lse


def _backward(plan: Plan, far_lse, need_rel: bool, dout, q, k, v, rel, out, lse):
    dout = dout.contiguous()
    grads = _Grads(q, k, v)
    drel = torch.zeros(rel.shape, dtype=accumulation_dtype(rel.dtype), device=rel.device) if need_rel else None
    dsum = (up(dout) * up(out)).sum(-1)  # (B, H, Tq): D_i = dO_i . O_i
    sloped = any(s is not None for s in plan.slopes)
    feat = _Featured(q, k, v, plan.scale, dout, out) if sloped else None
    for n, call in enumerate(plan.far):
        term, shift, r0 = _far_terms(plan, rel, call)
        r, hs = call.region, call.heads
        if term is None:
            g = list(region_backward(r, dout[:, hs], q[:, hs], k[:, hs], v[:, hs], out[:, hs], lse[:, hs], plan.scale, lse_shift=shift))
        else:
            feat.set(r.keys, term, hs)
            do, o = (x[:, hs] for x in feat.extra)
            g = region_backward(r, do, feat.q[:, hs], feat.k[:, hs], feat.v[:, hs], o, lse[:, hs], plan.scale, lse_shift=shift)
            g = [x[..., : like.shape[-1]] for x, like in zip(g, (q, k, v))]
        rows, keys = slice(*r.rows), slice(*r.keys)
        if need_rel:
            # The constant's gradient: sum over the call's pairs of dS = P (dP - D).
            weight = torch.exp(far_lse[n] - lse[:, hs, rows])  # (B, h, C): the call's share of each row
            drel[hs, r0] += (up(v[:, hs, keys]) * up(g[2])).sum((0, 2, 3)) - (weight * dsum[:, hs, rows]).sum((0, 2))
        for i, where in enumerate((rows, keys, keys)):
            grads.add(i, where, g[i], hs)
            g[i] = None  # free it before the next buffer is allocated
    _band_backward(plan, rel, drel, q, k, v, out, lse, dout, dsum, grads)
    dq, dk, dv = grads.result()
    return dq, dk, dv, (drel.to(rel.dtype) if need_rel else None)


def _cut(region: Region, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """The region's q rows and k, v keys, in call order."""
    return rows_of(q, region), keys_of(k, region), keys_of(v, region)


def _band_bias(plan: Plan, rel: torch.Tensor, group: band.BandGroup):
    """The band block's bias and rel index, built once per forward for each block geometry."""
    offset = (plan.k_start + group.k0) - (plan.q_start + group.t0)  # r of the block's top-left pair
    key = (group.rows, group.length, offset, group.heads.start, group.heads.stop, group.past, group.top, plan.r_lo, rel.dtype)
    hit = plan.cache.get(key)
    if hit is None:
        hit = plan.cache[key] = band.band_bias(rel, plan.r_lo, group, offset)
    return hit


def _band_backward(plan, rel, drel, q, k, v, out, lse, dout, dsum, grads) -> None:
    """The band's gradients: the kernel's backward for a fixed bias, the explicit formula (with the
    bias gradient summed per relative position) for a learned one, in smaller groups."""
    need_rel = drel is not None
    groups = plan.bands if not need_rel else [part for g in plan.bands for part in band.split(g, band.EXPLICIT_GROUP)]
    for group in groups:
        bias, index = _band_bias(plan, rel, group)
        hs = group.heads
        q_, k_, v_, dout_, out_, lse_, dsum_ = (x[:, hs] for x in (q, k, v, dout, out, lse, dsum))
        qc, kc, vc, doc = band.blocks(q_, group), band.windows(k_, group), band.windows(v_, group), band.blocks(dout_, group)
        oc, lc, dc = band.blocks(out_, group), band.blocks(lse_, group), band.blocks(dsum_, group)
        if not need_rel:
            gq, gk, gv = kernel_backward(doc, qc, kc, vc, oc, lc.contiguous(), False, plan.scale, bias.to(q.dtype)[None])
        else:
            s = up(torch.matmul(qc, kc.transpose(-1, -2))).mul_(plan.scale).add_(bias)  # (B*n, H, C, L)
            p = s.sub_(lc[..., None]).exp_()  # probabilities under the merged normaliser
            gv = torch.matmul(p.to(doc.dtype).transpose(-1, -2), doc)
            ds = up(torch.matmul(doc, vc.transpose(-1, -2))).sub_(dc[..., None]).mul_(p)  # dS
            h = ds.shape[1]
            drel[hs].scatter_add_(1, index.expand(h, -1), ds.sum(0).reshape(h, -1))
            ds = ds.to(q.dtype)
            gq = torch.matmul(ds, kc).mul_(plan.scale)
            gk = torch.matmul(ds.transpose(-1, -2), qc).mul_(plan.scale)
        grads.add(0, slice(*group.row_range), band.unblocks(gq, group), hs)
        band.add_windows(grads.get(1)[:, hs], group, gk)
        band.add_windows(grads.get(2)[:, hs], group, gv)


class _Grads:
    """dq, dk, dv, each allocated at its first contribution: a full-size kernel gradient then never
    coexists with all three buffers (peak memory)."""

    def __init__(self, *like: torch.Tensor) -> None:
        self.like = like
        self.bufs: list[torch.Tensor | None] = [None] * len(like)

    def get(self, i: int) -> torch.Tensor:
        if self.bufs[i] is None:
            self.bufs[i] = torch.zeros_like(self.like[i])
        return self.bufs[i]

    def add(self, i: int, where: slice, g: torch.Tensor, heads: slice = slice(None)) -> None:
        self.get(i)[:, heads, where] += g

    def result(self) -> list[torch.Tensor]:
        return [torch.zeros_like(x) if b is None else b for x, b in zip(self.like, self.bufs)]
