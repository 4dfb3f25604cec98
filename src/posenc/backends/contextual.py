"""Contextual positions (CoPE) without any (B, H, N, N) tensor: a band written out, far keys fused.

Backend name ``contextual``, for encodings that offer
:class:`~posenc.encodings.protocol.ContextualPositions` (CoPE, Golovneva et al. 2024). The score of
query i and key j is ``q_i . k_j * scale + term_ij``, where the term interpolates the position
logits ``z_i[p] = q_i . e[p] * logit_scale`` at ``p_ij = min(sum_{t=j..i} g_it, P - 1)``, with gates
``g_it = sigmoid(q_i . k_t * gate_scale)``. The eager formula builds several (B, H, N, N) tensors
(logits, gates, their cumulative sums, positions, terms) and keeps them for the backward.

The position p_ij only grows as j moves away from i, and once it reaches P - 1 it is capped: from
there on the term is the per-query constant ``c_i = z_i[P - 1]``, and nothing flows back into the
gates. So, for a band width W such that every query's count over its W nearest keys reaches P - 1,

- the band, keys with 0 <= i - j < W, is written out in blocks of queries (gates, their count from
  the diagonal, interpolated terms, softmax part), with O(N x W) memory: the blocks and key windows
  of :mod:`posenc.backends.parts.band`;
- the far keys, i - j >= W, are plain attention plus c_i: the CPU flash kernel on a shifted causal
  region (:func:`~posenc.backends.parts.regions.lower`), c_i shifting its log-sum-exp;

merged through their log-sum-exps. W is found per call: the counts are computed over a guess of W
(the width the last call of this encoding needed, or 2P), and if a query with far keys has not
reached P - 1 within it, W doubles and the band is computed again, up to the whole sequence (then
there is no far part). The result is exact whatever the gates are; the speed depends on them (at
initialisation, gates near 1/2, W is about 2P to 3P).

Backward (a custom autograd function saving q, k, v, the output, its log-sum-exp and the far
part's output and log-sum-exp): the far part's q, k, v gradients come from the kernel's backward
given the merged output and log-sum-exp (shifted by c_i), as in the other backends; c_i's gradient
is ``sum_far dS_ij = w_i (dO_i . o_far_i - D_i)`` (w_i the far part's share of the row,
D_i = dO_i . O_i). The band is recomputed per block and differentiated by hand: dS = P (dP - D)
reaches the content logits, the position logits (scattered to floor and ceil with weights 1 - w
and w) and, through dp_ij = dS_ij (z_i[ceil] - z_i[floor]), the gates: dg_it = sum_{j <= t} dp_ij
(a cumulative sum, the transpose of the count), times g (1 - g) gate_scale. A capped position has
floor = ceil, so it passes nothing back, as the formula's clamp does.

Anything else (an encoder, positions that skip values, queries outside the keys, another dtype)
runs the eager formula (blocked, checkpointed).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..encodings.protocol import ContextualPositions, offers, require
from . import eager
from .parts import band, padding
from .parts.base import ScoreSpec, accumulation_dtype
from .parts.denormals import flushed
from .parts.regions import Merge, Region, apply, kernel_forward, keys_of, lower, region_backward, rows_of, up

BLOCK = 64  # queries per band block
GROUP_ELEMENTS = 1 << 21  # band temporaries per step: at most this many (B x H x blocks x rows x keys)
WIDTH_MULTIPLE = 8  # band widths are rounded up to this
FAST_DTYPES = (torch.float32, torch.float64)
# The band width the last call of each encoding needed (plus a margin): the next call's first guess.
_WIDTHS: "weakref.WeakKeyDictionary[torch.nn.Module, int]" = weakref.WeakKeyDictionary()


def _fast(spec: ScoreSpec, q: torch.Tensor) -> bool:
    """The band + far path runs this call (otherwise the eager formula): a decoder, consecutive
    positions, every query among the keys (a full pass, or decoding after a KV cache)."""
    return spec.causal and spec.consecutive and q.dtype in FAST_DTYPES and spec.contained


def supports(spec: ScoreSpec, q: torch.Tensor) -> bool:
    # Left-padded rows are split into unpadded calls (padding.by_rows in attend).
    return (offers(spec.encoding, ContextualPositions) and spec.has_query_terms and not (spec.has_bias or spec.has_value_terms)
            and spec.log_gates is None and spec.curves is None and padding.supported(spec))


def preferred(spec: ScoreSpec, q: torch.Tensor) -> bool:
    return supports(spec, q) and _fast(spec, q)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec) -> torch.Tensor:
    if spec.starts is not None:  # the band path knows no padding: two unpadded calls per row
        return padding.by_rows(attend, q, k, v, spec)
    if not _fast(spec, q):
        return eager.attend(q, k, v, spec)
    form = require(spec.encoding, ContextualPositions).contextual_positions()
    call = _Call(spec.offset, spec.scale, form.gate_scale, form.logit_scale, form.table.shape[0])
    call.width = _WIDTHS.get(spec.encoding, 0)
    out = apply(_Contextual, q, k, v, form.table.to(q.dtype), call)
    _WIDTHS[spec.encoding] = call.hint
    return out


class _Call:
    """The geometry and scales of one call; ``width`` (W) is settled by the forward."""

    def __init__(self, offset: int, scale: float, gate_scale: float, logit_scale: float, positions: int) -> None:
        self.offset = offset  # query a is key a + offset
        self.scale, self.gate_scale, self.logit_scale = scale, gate_scale, logit_scale
        self.cap = positions - 1  # P - 1: positions are capped there
        self.width = 0
        self.hint = 0


class _Contextual(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, call: _Call) -> torch.Tensor:
        out, lse, far_out, far_lse = flushed(_forward, q, k, v, table, call)
        ctx.call = call
        ctx.save_for_backward(q, k, v, table, out, lse, far_out, far_lse)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads = flushed(_backward, ctx.call, dout, *ctx.saved_tensors)
        return (*grads, None)


# ---------------------------------------------------------------------------------------------
# Geometry


def _round_up(n: int) -> int:
    return n + (-n % WIDTH_MULTIPLE)


def _groups(call: _Call, b: int, h: int, tq: int, tk: int) -> list[band.BandGroup]:
    """Band blocks (keys with -W < r <= 0), batched in groups of bounded size."""
    groups = band.plan_band(tq, tk, call.offset, 0, call.width, 0, BLOCK)
    out = []
    for group in groups:
        size = max(1, GROUP_ELEMENTS // (b * h * group.rows * group.length))
        out += band.split(group, size) if group.count > size else [group]
    return out


def _far(call: _Call, tq: int, tk: int) -> list[Region]:
    """Kernel regions of the far keys, i - j >= W (key index <= query index + offset - W)."""
    return lower(tq, tk, call.offset - call.width)


# ---------------------------------------------------------------------------------------------
# One band group: the formula on blocks of queries against their key windows


class _ContextBand:
    """Everything the formula computes for one group of band blocks, (B*n, H, C, L) each."""

    def __init__(self, call: _Call, group: band.BandGroup, q: torch.Tensor, k: torch.Tensor, z: torch.Tensor) -> None:
        self.group = group
        c, length = group.rows, group.length
        dev = q.device
        first = group.k0 - call.offset - group.t0  # r = key position - query position, top-left pair
        rel = first + torch.arange(length, device=dev)[None, :] - torch.arange(c, device=dev)[:, None]  # (C, L)
        self.inside = (rel <= 0) & (rel > -call.width)  # (C, L): the band; the future and far keys out
        self.qc, self.kc = band.blocks(q, group), band.windows(k, group)  # (B*n, H, C, D), (B*n, H, L, D)
        self.s = up(torch.matmul(self.qc, self.kc.transpose(-1, -2)))  # (B*n, H, C, L) q.k
        self.g = torch.sigmoid(self.s * call.gate_scale) * self.inside  # gates, 0 outside the band
        self.raw = self.g.flip(-1).cumsum(-1).flip(-1)  # sum_{t >= j} g_it: the count from key j to the query
        pos = self.raw.clamp(max=call.cap)
        floor = pos.floor()
        self.w = pos - floor
        self.floor, self.ceil = floor.long(), pos.ceil().long()
        zc = up(band.blocks(z, group))  # (B*n, H, C, P)
        self.z_floor, self.z_ceil = zc.gather(-1, self.floor), zc.gather(-1, self.ceil)
        logits = self.s * call.scale + self.z_floor * (1 - self.w) + self.z_ceil * self.w
        self.logits = logits.masked_fill_(~self.inside, float("-inf"))

    def needed(self, call: _Call, tq: int) -> int:
        """The band width every query of the group with far keys needs (its count reaches P - 1
        within it); W + 1 when some query does not reach it within W."""
        query = self.group.t0 + torch.arange(self.group.count * self.group.rows, device=self.s.device)  # query indices
        has_far = (query + call.offset - call.width >= 0).view(self.group.count, self.group.rows)  # (n, C)
        if not bool(has_far.any()):
            return 0
        short = ((self.raw < call.cap) & self.inside).sum(-1)  # (B*n, H, C): distances 0.. still below P - 1
        short = torch.unflatten(short, 0, (-1, self.group.count))  # (B, n, H, C)
        return int(short.masked_fill(~has_far[None, :, None, :], 0).max()) + 1


# ---------------------------------------------------------------------------------------------
# Forward and backward


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, call: _Call,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    b, h, tq, _ = q.shape
    tk = k.shape[-2]
    acc = accumulation_dtype(q.dtype)
    z = torch.matmul(q, table.t()) * call.logit_scale  # (B, H, Tq, P) position logits
    longest = call.offset + tq  # W at least this: no far keys at all
    width = min(max(call.width or 2 * (call.cap + 1), call.cap + 1, WIDTH_MULTIPLE), longest)
    while True:
        call.width = width = _round_up(width) if width < longest else longest
        o_band = torch.empty(b, h, tq, v.shape[-1], dtype=acc, device=q.device)
        lse_band = torch.empty(b, h, tq, dtype=acc, device=q.device)
        needed = 0
        for group in _groups(call, b, h, tq, tk):
            part = _ContextBand(call, group, q, k, z)
            needed = max(needed, part.needed(call, tq))
            if needed > width:
                break
            lse = torch.logsumexp(part.logits, -1)  # (B*n, H, C)
            o = torch.matmul(torch.exp(part.logits - lse[..., None]).to(v.dtype), band.windows(v, group))
            rows = slice(*group.row_range)
            o_band[:, :, rows], lse_band[:, :, rows] = band.unblocks(o, group), band.unblocks(lse, group)
        if needed <= width:
            break
        width *= 2  # some query's count did not reach P - 1 within the band: widen it
    call.hint = _round_up(needed) + WIDTH_MULTIPLE if needed else width
    # Far keys: plain attention, plus the capped term c_i = z_i[P - 1] on the log-sum-exp.
    far = Merge(b, h, tq, v.shape[-1], q.dtype, q.device)  # rows without far keys keep lse -inf
    c = up(z[..., call.cap])  # (B, H, Tq)
    for region in _far(call, tq, tk):
        rows = slice(*region.rows)
        o, lz = kernel_forward(rows_of(q, region), keys_of(k, region), keys_of(v, region), region.causal, call.scale)
        far.add(region.rows, o, up(lz) + c[..., rows])
    whole = Merge(b, h, tq, v.shape[-1], q.dtype, q.device)
    whole.add((0, tq), o_band, lse_band)
    whole.add((0, tq), far.out, far.lse)
    return whole.out.to(q.dtype), whole.lse, far.out, far.lse


def _backward(
    call: _Call, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, far_out: torch.Tensor, far_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    b, h, tq, _ = q.shape
    tk = k.shape[-2]
    dout = dout.contiguous()
    total = (up(dout) * up(out)).sum(-1)  # (B, H, Tq): D_i = dO_i . O_i
    z = torch.matmul(q, table.t()) * call.logit_scale  # (B, H, Tq, P)
    dz = torch.zeros(z.shape, dtype=up(z).dtype, device=z.device)  # (B, H, Tq, P)
    dq, dk, dv = (torch.zeros_like(x) for x in (q, k, v))
    # Far keys: the kernel's share of dq, dk, dv; c_i's gradient, the far part's sum of dS.
    c = up(z[..., call.cap])
    for region in _far(call, tq, tk):
        rows, keys = slice(*region.rows), slice(*region.keys)
        gq, gk, gv = region_backward(region, dout, q, k, v, out, lse, call.scale, lse_shift=c[..., rows])
        dq[..., rows, :] += gq
        dk[..., keys, :] += gk
        dv[..., keys, :] += gv
    share = torch.exp(far_lse - lse)  # (B, H, Tq): 0 for queries without far keys
    dz[..., call.cap] += share * ((up(dout) * far_out).sum(-1) - total)
    # The band, recomputed per group and differentiated by hand (see the module docstring).
    for group in _groups(call, b, h, tq, tk):
        part = _ContextBand(call, group, q, k, z)
        rows = slice(*group.row_range)
        doc = up(band.blocks(dout, group))  # (B*n, H, C, D)
        p = torch.exp(part.logits - up(band.blocks(lse, group))[..., None])  # (B*n, H, C, L)
        band.add_windows(dv, group, torch.matmul(p.transpose(-1, -2), doc).to(v.dtype))
        vc = up(band.windows(v, group))
        ds = p.mul_(torch.matmul(doc, vc.transpose(-1, -2)).sub_(up(band.blocks(total, group))[..., None]))  # dS
        dzc = torch.zeros(*ds.shape[:-1], z.shape[-1], dtype=ds.dtype, device=ds.device)  # (B*n, H, C, P)
        dzc.scatter_add_(-1, part.floor, ds * (1 - part.w)).scatter_add_(-1, part.ceil, ds * part.w)
        dz[:, :, rows] += band.unblocks(dzc, group)
        dgate = (ds * (part.z_ceil - part.z_floor)).cumsum(-1)  # dp_ij summed over j <= t: d/dg_it
        dlogit = ds.mul_(call.scale).add_(dgate.mul_(part.g * (1 - part.g)).mul_(call.gate_scale))  # d/d(q.k)
        dq[:, :, rows] += band.unblocks(torch.matmul(dlogit, up(part.kc)), group).to(q.dtype)
        band.add_windows(dk, group, torch.matmul(dlogit.transpose(-1, -2), up(part.qc)).to(k.dtype))
    dz = dz * call.logit_scale
    dq += torch.matmul(dz, up(table)).to(q.dtype)
    dtable = torch.einsum("bhtp,bhtd->pd", dz, up(q)).to(table.dtype)
    return dq, dk, dv, dtable
