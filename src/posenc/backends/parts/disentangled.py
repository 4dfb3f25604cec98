"""Disentangled position terms (DeBERTa) without any (B, H, N, N) or (N, N, D) tensor: part of ``terms``.

For an encoding that offers :class:`~posenc.encodings.protocol.DisentangledTables` (He et al. 2020,
"DeBERTa", eq. 4), the score of query i and key j is

    s_ij = q_i . k_j * scale + (q_i . A[t] + k_j . B[t]) * term_scale,     t = rows(j - i)

with A (H, R, D) the position keys (c2p: content-to-position, scored with the query) and B (H, R, D)
the position queries (p2c: position-to-content, scored with the key); either may be absent.
``rows`` is non-increasing in r = j - i and constant far enough out on each side: every key far
enough in the past reads one row t_p, every key far enough in the future one row t_f, as Shaw's
clipped keys do. The ends are found per call from ``relative_rows`` over the call's distances
(r_lo .. r_hi), so nothing about the buckets is assumed: the far past is r <= e_p where the rows
equal rows(r_lo) from r_lo up to e_p, the far future r >= s_f likewise from r_hi down (both kept
off the diagonal: e_p <= -1, s_f >= 1).

- **Far keys** (r <= e_p, or r >= s_f for an encoder): t is fixed, so
  ``s_ij = (q_i + B[t] * term_scale / scale) . k_j * scale + q_i . A[t] * term_scale``: plain
  attention of a shifted query (one per-head vector added to q) plus a per-query constant c_i,
  which only shifts the part's log-sum-exp. The CPU flash kernel runs it on the shifted causal
  regions of :mod:`~posenc.backends.parts.regions` (``lower`` for the past, ``upper`` on reversed
  sequences for the future), with its own causal skip.
- **The band** (e_p < r < s_f; r <= 0 for a decoder): the rows that differ, written out in blocks of
  :data:`BLOCK` queries against their key windows (:mod:`~posenc.backends.parts.band`): the two
  products ``q A^T`` (B, H, Tq, R') and ``k B^T`` (B, H, Tk, R') over the R' rows the band reads,
  gathered per (query, key) of each block (c2p along the query's row, p2c along the key's), so the
  position terms cost two (T x R') products and gathers. Autograd differentiates the band.

The parts are merged through their log-sum-exps; the far regions' backward is the flash backward
given the merged output and log-sum-exp (shifted by c_i), so its probabilities and its
``rowsum(dO * O)`` are the whole row's and its (dq, dk, dv) exactly its share; c_i's gradient is the
far part's share of ``sum_j dS_ij = w_i (dO_i . o_far_i - D_i)``, and the shifted query's gradient
reaches q and B[t] through autograd. Memory: O(B x H x N x (band + R')), never N^2.

:func:`step` is one query against a KV cache (no gradient): the band's keys written out (its rows
of B gathered per key, a fixed number), the far keys one fused call of the shifted query with c as
the log-sum-exp shift, left padding one additive mask; nothing per step grows with the cache but
the kernel's own work.

Shape legend: B batch, H heads, Tq / Tk queries / keys, D head dim, R table rows, R' the band's rows,
C block rows, L block keys.
"""

from __future__ import annotations

import torch

from ...encodings.protocol import DisentangledTables
from . import band
from .base import ScoreSpec, accumulation_dtype
from .regions import Region, call_order, flushed, kernel_forward, keys_of, lower, region_backward, rows_of, upper

BLOCK = 64  # queries per band block
GROUP_ELEMENTS = 1 << 22  # band temporaries per group: at most this many (B x H x blocks x rows x keys)


def _tables(spec: ScoreSpec) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
    enc: DisentangledTables = spec.encoding  # type: ignore[assignment]
    return enc.disentangled_tables()


def ends(spec: ScoreSpec, r_lo: int, r_hi: int, device: torch.device) -> tuple[torch.Tensor, list[int], int, int]:
    """(rows (r_hi - r_lo + 1,) of r = r_lo..r_hi, the same as a list, e_p, s_f): the call's table
    rows, and where the far past (r <= e_p, every row rows(r_lo)) and far future (r >= s_f, every
    row rows(r_hi)) begin. One host read (the list: O(Tq + Tk) integers)."""
    rows = spec.encoding.relative_rows(torch.arange(r_lo, r_hi + 1, device=device))  # (n,)
    listed = rows.tolist()
    same_lo = next((n for n, t in enumerate(listed) if t != listed[0]), len(listed))  # the constant prefix
    same_hi = next((n for n, t in enumerate(reversed(listed)) if t != listed[-1]), len(listed))
    return rows, listed, min(r_lo + same_lo - 1, -1), max(r_hi - same_hi + 1, 1)


# --------------------------------------------------------------------------------------------
# The full pass (and several cached queries): band + far regions


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec) -> torch.Tensor:
    """Disentangled attention, band + far regions (see the module docstring): (B, H, Tq, D)."""
    a_table, b_table, term_scale = _tables(spec)
    tq, tk = q.shape[-2], k.shape[-2]
    offset, causal, scale = spec.offset, spec.causal, spec.scale  # query a is key a + offset
    r_lo = -(offset + tq - 1)  # r = key index - (query index + offset)
    r_hi = 0 if causal else tk - 1 - offset
    rows, listed, e_p, s_f = ends(spec, r_lo, r_hi, q.device)
    top = 0 if causal else min(s_f - 1, r_hi)
    past = -e_p  # the band: -past < r <= top
    # The rows the band reads: the range r0..r1-1 of them (R' rows; every row between, if rows skip).
    in_band = listed[max(e_p + 1, r_lo) - r_lo : top - r_lo + 1]
    r0, r1 = min(in_band), max(in_band) + 1
    dt = q.dtype
    a_band = None if a_table is None else torch.matmul(q, (a_table[:, r0:r1].to(dt) * term_scale).transpose(-1, -2))  # (B, H, Tq, R')
    b_band = None if b_table is None else torch.matmul(k, (b_table[:, r0:r1].to(dt) * term_scale).transpose(-1, -2))  # (B, H, Tk, R')
    o_b, lse_b = _band(q, k, v, a_band, b_band, rows - r0, r_lo, offset, past, top, scale)

    # Far regions: per side, the query shifted by B[t] and the constant q . A[t].
    regions, shifted, consts = [], [], []
    sides = [(0, lower(tq, tk, offset + e_p), listed[0])]
    if not causal:
        sides.append((1, upper(tq, tk, offset + s_f), listed[-1]))
    for side, (_, side_regions, t) in enumerate(sides):
        if not side_regions:
            continue
        regions += [(len(shifted), r) for r in side_regions]
        shifted.append(q if b_table is None else q + (b_table[:, t].to(dt) * (term_scale / scale))[None, :, None, :])  # (B, H, Tq, D)
        c = q.new_zeros(q.shape[:-1]) if a_table is None else torch.matmul(q, a_table[:, t].to(dt)[..., None] * term_scale)[..., 0]
        consts.append(c)  # (B, H, Tq)
    if not regions:
        return o_b.to(dt)
    return _MergeFar.apply(o_b, lse_b, torch.stack(shifted), k, v, torch.stack(consts), tuple(regions), scale)


def _band(q, k, v, a_band, b_band, rows, r_lo: int, offset: int, past: int, top: int, scale: float):
    """Attention restricted to the band -past < r <= top: (output (B, H, Tq, D), log-sum-exp (B, H, Tq)),
    in the accumulation dtype, differentiable (autograd)."""
    b, h, tq, _ = q.shape
    tk = k.shape[-2]
    acc = accumulation_dtype(q.dtype)
    dev = q.device
    outs, lses = [], []
    for whole in band.plan_band(tq, tk, offset, 0, past, top, BLOCK):
        size = max(1, GROUP_ELEMENTS // (b * h * whole.rows * whole.length))
        for group in band.split(whole, size) if whole.count > size else [whole]:
            c, length = group.rows, group.length
            first = group.k0 - offset - group.t0  # r of the block's top-left pair
            rel = first + torch.arange(length, device=dev)[None, :] - torch.arange(c, device=dev)[:, None]  # (C, L)
            inside = (rel > -past) & (rel <= top)
            t = rows[(rel - r_lo).clamp(0, rows.numel() - 1)].clamp(0, None)  # (C, L) band rows (outside: any valid row)
            qc, kc, vc = band.blocks(q, group), band.windows(k, group), band.windows(v, group)  # (B*n, H, C or L, D)
            s = torch.matmul(qc, kc.transpose(-1, -2)).to(acc) * scale  # (B*n, H, C, L)
            n = qc.shape[0]
            if a_band is not None:  # c2p: q_i . A[t_ij], along the query's row
                t_a = t.clamp(max=a_band.shape[-1] - 1)
                s = s + band.blocks(a_band, group).gather(-1, t_a.expand(n, h, c, length)).to(acc)
            if b_band is not None:  # p2c: k_j . B[t_ij], along the key's row
                t_b = t.clamp(max=b_band.shape[-1] - 1).t()  # (L, C)
                s = s + band.windows(b_band, group).gather(-1, t_b.expand(n, h, length, c)).transpose(-1, -2).to(acc)
            s = s.masked_fill(~inside, float("-inf"))
            lse = torch.logsumexp(s, dim=-1)  # (B*n, H, C); every row sees its own key
            o = torch.matmul(torch.exp(s - lse[..., None]).to(v.dtype), vc).to(acc)  # (B*n, H, C, D)
            outs.append(band.unblocks(o, group))
            lses.append(band.unblocks(lse, group))
    return torch.cat(outs, -2), torch.cat(lses, -1)


class _MergeFar(torch.autograd.Function):
    """out = the band (o_b, lse_b) merged with far regions done by the flash kernel.

    A far region of side s computes ``softmax(qs[s] k^T * scale + consts[s])`` over its keys.
    ``regions``: (side, :class:`~posenc.backends.parts.regions.Region`) pairs.
    """

    @staticmethod
    def forward(ctx, o_b, lse_b, qs, k, v, consts, regions: tuple[tuple[int, Region], ...], scale: float):
        out, lse, parts = flushed(_merge_forward, o_b, lse_b, qs, k, v, consts, regions, scale)
        ctx.regions, ctx.scale = regions, scale
        ctx.save_for_backward(o_b, lse_b, qs, k, v, consts, out, lse, *(t for p in parts for t in p))
        return out.to(qs.dtype)

    @staticmethod
    def backward(ctx, d_out):
        o_b, lse_b, qs, k, v, consts, out, lse, *saved = ctx.saved_tensors
        return flushed(_merge_backward, ctx.regions, ctx.scale, d_out, o_b, lse_b, qs, k, v, consts, out, lse, saved)


def _merge_forward(o_b, lse_b, qs, k, v, consts, regions, scale):
    lse = lse_b.clone()  # (B, H, Tq)
    parts = []
    for side, region in regions:
        o, lz = kernel_forward(rows_of(qs[side], region), keys_of(k, region), keys_of(v, region), region.causal, scale)
        o, lz = call_order(o, region).to(lse.dtype), call_order(lz, region, -1).to(lse.dtype)
        rows = slice(*region.rows)
        lse[..., rows] = torch.logaddexp(lse[..., rows], lz + consts[side, ..., rows])
        parts.append((o, lz))
    out = torch.exp(lse_b - lse)[..., None] * o_b  # (B, H, Tq, D)
    for (side, region), (o, lz) in zip(regions, parts):
        rows = slice(*region.rows)
        out[..., rows, :] += torch.exp(lz + consts[side, ..., rows] - lse[..., rows])[..., None] * o
    return out, lse, parts


def _merge_backward(regions, scale, d_out, o_b, lse_b, qs, k, v, consts, out, lse, saved):
    d_out = d_out.contiguous().to(out.dtype)
    total = (d_out * out).sum(-1)  # (B, H, Tq): rowsum(dO * O) of the whole attention
    w_b = torch.exp(lse_b - lse)
    d_ob = w_b[..., None] * d_out
    d_lse_b = w_b * ((d_out * o_b).sum(-1) - total)
    dqs, dk, dv = torch.zeros_like(qs), torch.zeros_like(k), torch.zeros_like(v)
    d_consts = torch.zeros_like(consts)
    out_k = out.to(qs.dtype)  # the kernel's dtype
    g_k = d_out.to(qs.dtype)
    for i, (side, region) in enumerate(regions):
        o, lz = saved[2 * i], saved[2 * i + 1]
        rows, keys = slice(*region.rows), slice(*region.keys)
        c = consts[side, ..., rows]
        weight = torch.exp(lz + c - lse[..., rows])  # the region's share of each row, (B, H, rows)
        d_consts[side, ..., rows] += weight * ((d_out[..., rows, :] * o).sum(-1) - total[..., rows])
        gq, gk, gv = region_backward(region, g_k, qs[side], k, v, out_k, lse.to(c.dtype), scale, lse_shift=c)
        dqs[side, ..., rows, :] += gq
        dk[..., keys, :] += gk
        dv[..., keys, :] += gv
    return d_ob, d_lse_b, dqs, dk, dv, d_consts, None, None


# --------------------------------------------------------------------------------------------
# One query against a KV cache (a decode step)


def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec) -> torch.Tensor:
    """One query at the last key, no gradient: the band's keys written out, the far keys one fused
    call of the shifted query (log-sum-exp shifted by q . A[t_p]), merged; (B, H, 1, D)."""
    from . import single  # single imports padding; a late import keeps this module a leaf

    a_table, b_table, term_scale = _tables(spec)
    tk, acc, dt = k.shape[-2], accumulation_dtype(q.dtype), q.dtype
    rows, listed, e_p, _ = ends(spec, 1 - tk, 0, q.device)  # key index j has r = j - (tk - 1)
    far = max(0, tk + e_p)  # keys 0..far-1: r <= e_p, row rows[0]
    t = rows[far:]  # (w,) the band keys' rows
    pad, _ = single.padding(spec, tk, dt, q.device)
    scores = torch.matmul(q, k[:, :, far:].transpose(-1, -2)).to(acc) * spec.scale  # (B, H, 1, w)
    if a_table is not None:
        scores = scores + torch.matmul(q, a_table[:, t].to(dt).transpose(-1, -2)).to(acc) * term_scale  # (B, H, 1, w)
    if b_table is not None:
        scores = scores + (k[:, :, far:] * b_table[:, t].to(dt)).sum(-1)[:, :, None, :].to(acc) * term_scale
    if pad is not None:
        scores = scores + pad[..., far:]
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, 1); never empty: the query sees itself
    out = torch.matmul(torch.exp(scores - lse[..., None]).to(dt), v[:, :, far:]).to(acc)  # (B, H, 1, D)
    if far == 0:
        return out.to(dt)
    t_p = listed[0]
    shifted = q if b_table is None else q + (b_table[:, t_p].to(dt) * (term_scale / spec.scale))[None, :, None, :]
    o_far, l_far = kernel_forward(shifted, k[:, :, :far], v[:, :, :far], False, spec.scale, None if pad is None else pad[..., :far])
    l_far = l_far.to(acc)
    if a_table is not None:
        l_far = l_far + torch.matmul(q, a_table[:, t_p].to(dt)[..., None])[..., 0].to(acc) * term_scale
    if spec.starts is not None:  # a row whose far keys are all padding has no far part
        empty = spec.starts.to(q.device) > spec.k_start + far - 1  # (B,)
        l_far = l_far.masked_fill(empty[:, None, None], float("-inf"))
    total = torch.logaddexp(lse, l_far)
    out = out * torch.exp(lse - total)[..., None] + o_far.to(acc) * torch.exp(l_far - total)[..., None]
    return out.to(dt)


__all__ = ["BLOCK", "attention", "ends", "step"]
