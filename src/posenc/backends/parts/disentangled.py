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
- **The band** (first <= r <= top: the W distances whose rows differ, W rounded up to a multiple
  of :data:`~posenc.backends.parts.disentangled_band.WIDTH_MULTIPLE`; top = 0 for a decoder): the
  position terms and the content written out per head in blocks, with a written-out backward, in
  :mod:`posenc.backends.parts.disentangled_band`.

The parts are merged through their log-sum-exps; the far regions' backward is the flash backward
given the merged output and log-sum-exp (shifted by c_i), so its probabilities and its
``rowsum(dO * O)`` are the whole row's and its (dq, dk, dv) exactly its share; c_i's gradient is the
far part's share of ``sum_j dS_ij = w_i (dO_i . o_far_i - D_i)``, and the shifted query's gradient
reaches q and B[t] through autograd. Memory: O(B x H x N x W), never N^2.

**When it runs** (:func:`worthwhile`, asked by ``terms``' selection): the band costs per (query,
band distance), eager per (query, key), so a short call whose band covers nearly every pair (with
the default buckets: causal below about 300 tokens, encoder below about 600) and any call of fewer
than :data:`MIN_PAIRS` pairs (fixed costs) is left to eager; the cost model is in
:func:`worthwhile`, fitted to CPU timings of forward + backward (``posenc bench --level attention
--methods deberta`` times the chosen path).

Its decode step (one query against a KV cache, no gradient) is
:func:`posenc.backends.parts.single.disentangled`, with the other decode steps.

Shape legend: B batch, H heads, Tq / Tk queries / keys, D head dim, R table rows, W band distances.
"""

from __future__ import annotations

from typing import Any

import torch

from ...encodings.protocol import DisentangledTables, require
from .base import ScoreSpec
from .denormals import flushed
from .disentangled_band import FLUSH, WIDTH_MULTIPLE, Band, BandGeometry
from .regions import Merge, Region, apply, call_order, kernel_forward, keys_of, lower, region_backward, rows_of, upper

MIN_PAIRS = 1 << 16  # calls with fewer (query, key) pairs run eager: fixed costs dominate

Regions = tuple[tuple[int, Region], ...]  # (side, region): side 0 the far past, 1 the far future


def tables(spec: ScoreSpec) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
    form = require(spec.encoding, DisentangledTables).disentangled_tables()
    return form.query_table, form.key_table, form.scale


def ends(spec: ScoreSpec, r_lo: int, r_hi: int) -> tuple[torch.Tensor, list[int], int, int]:
    """(rows (r_hi - r_lo + 1,) of r = r_lo..r_hi on the CPU, the same as a list, e_p, s_f): the
    call's table rows, and where the far past (r <= e_p, every row rows(r_lo)) and far future
    (r >= s_f, every row rows(r_hi)) begin. Integers computed on the host from the shapes alone:
    nothing is read back from the inputs' device."""
    rows = require(spec.encoding, DisentangledTables).relative_rows(torch.arange(r_lo, r_hi + 1))  # (n,)
    listed = rows.tolist()
    same_lo = next((n for n, t in enumerate(listed) if t != listed[0]), len(listed))  # the constant prefix
    same_hi = next((n for n, t in enumerate(reversed(listed)) if t != listed[-1]), len(listed))
    return rows, listed, min(r_lo + same_lo - 1, -1), max(r_hi - same_hi + 1, 1)


# --------------------------------------------------------------------------------------------
# The full pass (and several cached queries): band + far regions


class BandRows:
    """One call's band: its table rows over the call's distances r_lo..r_hi (``rows`` (n,) and
    ``listed``), where the far past (r <= e_p, row ``listed[0]``) and far future (r >= s_f, row
    ``listed[-1]``) begin, and the band ``first <= r <= top`` that :func:`attention` writes out, of
    ``width`` distances, rounded up to a multiple of :data:`WIDTH_MULTIPLE` (GEMMs with W columns
    then run at full speed; the extra distances are far past ones, or before every key, where any
    row does). Made on the CPU (:func:`rows_on` puts ``rows`` on a device)."""

    def __init__(self, spec: ScoreSpec, tq: int, tk: int) -> None:
        self.r_lo = -(spec.offset + tq - 1)  # r = key index - (query index + offset)
        self.r_hi = 0 if spec.causal else tk - 1 - spec.offset
        self.rows, self.listed, self.e_p, self.s_f = ends(spec, self.r_lo, self.r_hi)
        self.top = 0 if spec.causal else min(self.s_f - 1, self.r_hi)
        width = self.top - self.e_p
        self.width = width + (-width % WIDTH_MULTIPLE)
        self.first = self.top - self.width + 1


def plan(spec: ScoreSpec, tq: int, tk: int) -> BandRows:
    """The call's :class:`BandRows`, made once per forward (``spec.memo``: integers only, no parameters)."""
    key = (tq, tk, spec.offset, spec.causal)
    return spec.memo.table(spec.encoding, "disentangled_plan", key, lambda: BandRows(spec, tq, tk))


def rows_on(spec: ScoreSpec, p: BandRows, device: torch.device) -> torch.Tensor:
    """The plan's ``rows`` on ``device``, copied once per forward."""
    key = (p.r_lo, p.r_hi, spec.offset, spec.causal, device)
    return spec.memo.table(spec.encoding, "disentangled_rows", key, lambda: p.rows.to(device))


def _clamped_sum(n: int, c: int, m: int) -> int:
    """sum over a = 0..n-1 of clamp(a + c, 0, m)."""
    def below(x: int) -> int:  # sum over y <= x of clamp(y, 0, m)
        if x <= 0:
            return 0
        return x * (x + 1) // 2 if x <= m else m * (m + 1) // 2 + (x - m) * m
    return below(c + n - 1) - below(c - 1)


def worthwhile(spec: ScoreSpec, tq: int, tk: int) -> bool:
    """Whether the band + far path should run this call: its cost model says it is cheaper than the
    eager formula. Decided from the shapes and the rows the encoding declares (:class:`BandRows`, made
    on the host: choosing reads nothing from the inputs' device), never from its name.

    Cost per (batch, head), in units of one (query, band distance) cell of the position terms
    (a least-squares fit of forward + backward CPU timings, float32, D = 64, N = 192..2048, causal
    and encoder; both paths' times scale with batch x heads, so their ratio does not depend on it):
    band + far path ~ 0.14 per band pair + 1 per (query, band distance) + 0.17 per far pair (the
    flash kernel) + 170 per query + 117,000 (its loops' fixed costs); eager ~ 2.4 per (query, key)
    pair (it writes the whole rectangle, causal or not) + 15,000. The band pays per distance, the
    rectangle per key: with the default buckets (b = 256, M = 512) a causal call of more than about
    300 tokens and an encoder call of more than about 600 take the band (eager's cost jumps near
    300 tokens, which the fit smooths over); below :data:`MIN_PAIRS` pairs eager runs at once.
    """
    if tq * tk < MIN_PAIRS:
        return False
    p = plan(spec, tq, tk)
    off = spec.offset
    band = _clamped_sum(tq, off + p.top + 1, tk) - _clamped_sum(tq, off + p.first, tk)  # pairs with first <= r <= top
    visible = _clamped_sum(tq, off + 1, tk) if spec.causal else tq * tk
    fast = 0.14 * band + tq * p.width + 0.17 * (visible - band) + 170 * tq + 117_000
    slow = 2.4 * tq * tk + 15_000
    return fast < slow


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec) -> torch.Tensor:
    """Disentangled attention, band + far regions (see the module docstring): (B, H, Tq, D)."""
    a_table, b_table, term_scale = tables(spec)
    tq, tk = q.shape[-2], k.shape[-2]
    offset, causal, scale = spec.offset, spec.causal, spec.scale  # query a is key a + offset
    p = plan(spec, tq, tk)
    rows, listed, s_f, first, top = rows_on(spec, p, q.device), p.listed, p.s_f, p.first, p.top
    t = rows[(torch.arange(first, top + 1, device=q.device) - p.r_lo).clamp_(min=0)]  # (W,) the table row of each band distance
    dt = q.dtype
    a_w = None if a_table is None else a_table[:, t].to(dt) * term_scale  # (H, W, D)
    b_w = None if b_table is None else b_table[:, t].to(dt) * term_scale  # (H, W, D)
    band_out: tuple[torch.Tensor, torch.Tensor] = Band.apply(q, k, v, a_w, b_w, BandGeometry(offset, first, top, scale, tq, tk))  # type: ignore[no-untyped-call]  # torch's stub declares no types
    o_b, lse_b = band_out

    # Far regions: per side, the query shifted by B[t] and the constant q . A[t].
    regions: list[tuple[int, Region]] = []
    shifted: list[torch.Tensor] = []
    consts: list[torch.Tensor] = []
    sides = [(0, lower(tq, tk, offset + first - 1), listed[0])]
    if not causal:
        sides.append((1, upper(tq, tk, offset + s_f), listed[-1]))
    for side, (_, side_regions, row) in enumerate(sides):
        if not side_regions:
            continue
        regions += [(len(shifted), r) for r in side_regions]
        shifted.append(q if b_table is None else q + (b_table[:, row].to(dt) * (term_scale / scale))[None, :, None, :])  # (B, H, Tq, D)
        c = q.new_zeros(q.shape[:-1]) if a_table is None else torch.matmul(q, a_table[:, row].to(dt)[..., None] * term_scale)[..., 0]
        consts.append(c)  # (B, H, Tq)
    if not regions:
        return o_b.to(dt)
    return apply(_MergeFarDisentangled, o_b, lse_b, torch.stack(shifted), k, v, torch.stack(consts), tuple(regions), scale)


class _MergeFarDisentangled(torch.autograd.Function):
    """out = the band (o_b, lse_b) merged with far regions done by the flash kernel.

    A far region of side s computes ``softmax(qs[s] k^T * scale + consts[s])`` over its keys.
    ``regions``: (side, :class:`~posenc.backends.parts.regions.Region`) pairs.
    """

    @staticmethod
    def forward(
        ctx: Any, o_b: torch.Tensor, lse_b: torch.Tensor, qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        consts: torch.Tensor, regions: Regions, scale: float,
    ) -> torch.Tensor:
        out, lse, parts = flushed(_merge_forward, o_b, lse_b, qs, k, v, consts, regions, scale, when=FLUSH)
        ctx.regions, ctx.scale = regions, scale
        ctx.save_for_backward(o_b, lse_b, qs, k, v, consts, out, lse, *(t for p in parts for t in p))
        return out.to(qs.dtype)

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        o_b, lse_b, qs, k, v, consts, out, lse, *saved = ctx.saved_tensors
        return flushed(_merge_backward, ctx.regions, ctx.scale, d_out, o_b, lse_b, qs, k, v, consts, out, lse, saved, when=FLUSH)


def _merge_forward(
    o_b: torch.Tensor, lse_b: torch.Tensor, qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, consts: torch.Tensor, regions: Regions, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    b, h, tq, dv = o_b.shape
    merged = Merge(b, h, tq, dv, qs.dtype, qs.device)  # (B, H, Tq, D) and (B, H, Tq), accumulation dtype
    merged.add((0, tq), o_b, lse_b)
    parts = []
    for side, region in regions:
        o, lz = kernel_forward(rows_of(qs[side], region), keys_of(k, region), keys_of(v, region), region.causal, scale)
        o, lz = call_order(o, region).to(lse_b.dtype), call_order(lz, region, -1).to(lse_b.dtype)
        merged.add(region.rows, o, lz + consts[side, ..., slice(*region.rows)])  # the far logits gain c_i
        parts.append((o, lz))
    return merged.out, merged.lse, parts


def _merge_backward(
    regions: Regions, scale: float, d_out: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor, qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    consts: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, saved: list[torch.Tensor],
) -> tuple[torch.Tensor | None, ...]:
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


__all__ = ["BandRows", "attention", "ends", "plan", "tables", "worthwhile"]
