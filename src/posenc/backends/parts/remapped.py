"""The attention of a position remap (:class:`~posenc.encodings.protocol.Remaps`: SelfExtend, ReRoPE,
STRING, DCA): each region rotated at its own positions, the regions' softmax parts merged exactly.

Shape legend: B batch, H query heads, Hkv key/value heads, Tq queries, Tk keys, D head dim,
L queries of a block, P keys of a piece.

How one call runs:

1. Each region of the encoding gives, per query, an interval of key positions (the causal mask, a
   layer's window and its chunk narrow it) and the positions q and k are rotated at. Its keys are
   rotated once per call (only the range some query of the region sees), its queries once.
2. The queries are cut into blocks of :data:`BLOCK` (:data:`EAGER_BLOCK` written out; also where a region's interval jumps, at a
   chunk edge). In a block, a region's keys split into at most three *pieces*: the keys every query
   of the block sees (a rectangle: one call of the CPU flash kernel, no mask) and, on either side,
   the keys only some of them see. The ends of every method's intervals move one key per query, so
   those edges are triangles: the kernel's own causal mask runs them, on rows and keys reversed for
   a left edge (:func:`_edge`); an edge of any other shape (a band narrower than a block) is written
   out with its mask. With a logit soft cap (Gemma 2) every piece is written out, the cap applied to
   its content scores.
3. The pieces are disjoint, so their (output, log-sum-exp) pairs fold into each query's softmax
   exactly (``o = sum_p exp(lse_p - lse) o_p``, ``lse = logsumexp_p lse_p``); attention sinks join as
   one more logit with no value.
4. The backward recomputes each piece's probabilities from the merged log-sum-exp,
   ``p = exp(s - lse)``, and ``rowsum(dO * O)`` of the merged output: the gradients of a single
   softmax over all regions (the flash kernel's backward for the rectangles, written out for the
   rest), then through the rotations by autograd.

No (Tq, Tk) tensor is made: a block holds at most L x (P written-out keys) scores.

Decode steps: one query with no gradient skips the blocks and the autograd function (:func:`_step`):
its query is rotated for every region in one call, each region is one rectangle on the kernel, and
the parts fold in one log-sum-exp. With a KV cache's workspace, each region keeps its rotated keys
between calls (:mod:`posenc.backends.parts.remap_keys`), so a step rotates only its new keys.
A left-padded batch
(``starts``, a decode step of a padded cache) runs row by row, each row at its own positions
counted from its first real token, as the row alone; its padding queries get 0.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...call.memo import Workspace
from ...call.spec import ScoreSpec
from ...encodings.protocol import RemapRegion, Remaps, require
from ...encodings.query_scale import scaled_queries
from ...errors import UsageError
from .base import accumulation_dtype
from .denormals import opaque_to_compile
from .regions import apply, grouped_sum, kernel_backward, kernel_forward, repeated_heads, use_kernel
from .remap_keys import Probe, kept_keys
from .windows import Extras

# Queries per block. On the kernel, 1,024: the CPU flash kernel runs a call of 768 queries or more in
# tiles of 256 queries, about 13% faster per score than tiles of 64 (its tile below 768), and a
# triangle edge of 1,024 skips its masked key tiles. Written out (a soft cap, backend="eager"), 256:
# each piece holds (L, P) scores.
BLOCK = 1024
EAGER_BLOCK = 256

# A piece: (region, first key, end key (indices into the region's keys), kind, first row, end row (of
# the block)); only rows first..end-1 of the block see the piece's keys. Its kind says how it runs:
# "full" each of those rows sees every key (the flash kernel, no mask); "causal" the n-th of those rows
# sees the first n + 1 keys (the kernel's top-left causal mask); "flipped" (square) the n-th sees keys
# n.. (the kernel's causal mask with rows and keys reversed); "masked" anything else (written out).
Piece = tuple[int, int, int, str, int, int]


@opaque_to_compile  # plans its pieces from the positions on the host: one graph break per call
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec, extras: Extras | None,
           backend: str) -> tuple[torch.Tensor, str]:
    """(out (B, H, Tq, Dv), "remapped") for un-rotated q (B, H, Tq, D), k, v (B, Hkv, Tk, D).

    Raises:
        UsageError: a bidirectional call, or a backend other than "auto" and "eager".
    """
    enc = require(spec.encoding, Remaps)
    name = type(spec.encoding).__name__
    if not spec.causal:
        raise UsageError(f"{name} remaps causal distances: it needs causal=True")
    if backend not in ("auto", "eager"):
        raise UsageError(f"backend: {name} runs its own merged regions; give backend='auto' or 'eager', got {backend!r}")
    # A soft cap bends every content score: no flash-kernel rectangle, every piece written out.
    eager = backend == "eager" or not use_kernel(q, v) or (extras is not None and extras.softcap is not None)
    kept: tuple[Workspace, object] | None = None
    if spec.workspace is not None:
        kept = (spec.workspace, spec.memo.next_call())
    if spec.starts is None:
        return _attend(q, k, v, spec.q_positions, spec.k_positions, enc, spec.scale, extras, eager, kept), "remapped"
    rows = []
    for b, start in enumerate(spec.starts.tolist()):  # left padding: each row alone, from its first real token
        qi = int(torch.searchsorted(spec.q_positions, start))
        ki = int(torch.searchsorted(spec.k_positions, start))
        o = _attend(q[b:b + 1, :, qi:], k[b:b + 1, :, ki:], v[b:b + 1, :, ki:], spec.q_positions[qi:] - start,
                    spec.k_positions[ki:] - start, enc, spec.scale, extras, eager,
                    None if kept is None else (kept[0], (kept[1], "row", b)))
        rows.append(torch.cat((o.new_zeros(1, q.shape[1], qi, v.shape[-1]), o), dim=2))
    return torch.cat(rows), "remapped"


def _bounds(region: RemapRegion, qp: torch.Tensor, kp: torch.Tensor, extras: Extras | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(first key index, end key index) (Tq,) of each query's keys in ``region``: its interval of key
    positions, under the causal mask and the layer's window or chunk."""
    low, high = region.low, torch.minimum(region.high, qp + 1)
    if extras is not None and extras.window is not None:
        low = torch.maximum(low, qp - extras.window + 1)
    if extras is not None and extras.chunk is not None:
        first = torch.div(qp, extras.chunk, rounding_mode="floor") * extras.chunk
        low, high = torch.maximum(low, first), torch.minimum(high, first + extras.chunk)
    lo = torch.searchsorted(kp, low)
    hi = torch.searchsorted(kp, high)
    return lo, torch.maximum(hi, lo)


def _blocks(tq: int, bounds: list[tuple[torch.Tensor, torch.Tensor]], size: int) -> list[tuple[int, int]]:
    """Query blocks of at most ``size``, also cut where a region's interval jumps by more than
    size // 2 keys from one query to the next (a chunk's edge), so that edge pieces stay narrow."""
    cuts = {0, tq}
    if tq > 1:
        for lo, hi in bounds:
            jump = ((lo[1:] - lo[:-1]).abs() > size // 2) | ((hi[1:] - hi[:-1]).abs() > size // 2)
            cuts.update((jump.nonzero().squeeze(-1) + 1).tolist())
    edges = sorted(cuts)
    out: list[tuple[int, int]] = []
    for a, b in zip(edges, edges[1:]):
        out.extend((s, min(s + size, b)) for s in range(a, b, size))
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qp: torch.Tensor, kp: torch.Tensor, enc: Remaps,
            scale: float, extras: Extras | None, eager: bool, kept: tuple[Workspace, object] | None = None) -> torch.Tensor:
    """One row set at shared positions: the regions' rotations, their pieces, the merged softmax."""
    tq = q.shape[-2]
    if tq == 0 or k.shape[-2] == 0:
        return q.new_zeros(*q.shape[:-1], v.shape[-1])
    if tq == 1 and not eager and not (torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))):
        return _step(q, k, v, qp, kp, enc, scale, extras, kept)
    regions = enc.regions(qp, kp)
    bounds = [_bounds(r, qp, kp, extras) for r in regions]
    qs, ks, firsts, spans = [], [], [], []
    probe = Probe(k, k.shape[-2] - tq)
    for r, (region, (lo, hi)) in enumerate(zip(regions, bounds)):
        seen = hi > lo  # (Tq,) queries with a key in this region
        if not bool(seen.any()):
            continue
        k0, k1 = int(lo[seen].min()), int(hi[seen].max())
        qr = enc.rotate_at(q, region.q_at)  # (B, H, Tq, D)
        if extras is not None and extras.query_scale is not None:
            qr = scaled_queries(qr, extras.query_scale, qp)
        qs.append(qr)
        if kept is not None and not (torch.is_grad_enabled() and k.requires_grad):
            ks.append(kept_keys(enc, k, region.k_at, k1, kp, tq, kept, r, probe)[:, :, k0:])
        else:
            ks.append(enc.rotate_at(k[:, :, k0:k1], region.k_at[k0:k1]))  # (B, Hkv, k1 - k0, D)
        firsts.append(k0)
        spans.append((lo - k0, hi - k0))
    plan = _plan(tq, spans, eager)
    plan["softcap"] = None if extras is None else extras.softcap
    sinks = None if extras is None else extras.sinks
    if sinks is not None and sinks.numel() != q.shape[1]:
        raise UsageError(f"sinks must hold one logit per query head ({q.shape[1]}), got {sinks.numel()}")
    return apply(_Remapped, plan, scale, firsts, v, sinks, *qs, *ks)


def _step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qp: torch.Tensor, kp: torch.Tensor, enc: Remaps,
          scale: float, extras: Extras | None, kept: tuple[Workspace, object] | None) -> torch.Tensor:
    """One query with no gradient (a decode step): the same softmax as :func:`_attend`, with the
    query rotated for every region in one call, one kernel call per region (every key of a region
    is seen: a rectangle) and the parts folded at once, so that a step adds little host work."""
    regions = enc.regions(qp, kp)
    limits = torch.stack([torch.cat(_bounds(r, qp, kp, extras)) for r in regions]).tolist()  # [[lo, hi]] per region
    active = [(r, lo, hi) for r, (lo, hi) in enumerate(limits) if hi > lo]
    if not active:
        return q.new_zeros(*q.shape[:-1], v.shape[-1])
    n = len(active)
    qr = enc.rotate_at(q.expand(-1, -1, n, -1), torch.cat([regions[r].q_at for r, _, _ in active]))  # (B, H, n, D)
    if extras is not None and extras.query_scale is not None:
        qr = scaled_queries(qr, extras.query_scale, qp.expand(n))
    probe = Probe(k, k.shape[-2] - 1)
    outs, lses = [], []
    for i, (r, lo, hi) in enumerate(active):
        if kept is not None:
            keys = kept_keys(enc, k, regions[r].k_at, hi, kp, 1, kept, r, probe)[:, :, lo:hi]
        else:
            keys = enc.rotate_at(k[:, :, lo:hi], regions[r].k_at[lo:hi])  # (B, Hkv, hi - lo, D)
        o, lse = kernel_forward(qr[:, :, i:i + 1], keys, v[:, :, lo:hi], False, scale)
        outs.append(o)
        lses.append(lse)
    acc = accumulation_dtype(q.dtype)
    parts = torch.stack(lses).to(acc)  # (n, B, H, 1): each region's log-sum-exp
    total = torch.logsumexp(parts, 0)  # (B, H, 1)
    sinks = None if extras is None else extras.sinks
    if sinks is not None:  # one more logit per head with no value
        if sinks.numel() != q.shape[1]:
            raise UsageError(f"sinks must hold one logit per query head ({q.shape[1]}), got {sinks.numel()}")
        total = torch.logaddexp(total, sinks.to(acc).view(1, -1, 1))
    weights = torch.exp(parts - total)[..., None]  # (n, B, H, 1, 1)
    return (torch.stack(outs).to(acc) * weights).sum(0).to(q.dtype)  # (B, H, 1, Dv)


def _plan(tq: int, spans: list[tuple[torch.Tensor, torch.Tensor]], eager: bool) -> dict[str, Any]:
    """Blocks and their pieces: for each block of queries (a, b), the pieces of each region. A block
    of :data:`BLOCK` with an edge that is not a triangle (a band narrower than the block) is cut into
    blocks of :data:`EAGER_BLOCK`, so that what is written out stays narrow."""
    lists = [(lo.tolist(), hi.tolist()) for lo, hi in spans]
    plan_blocks: list[tuple[int, int, list[Piece]]] = []
    for a, b in _blocks(tq, spans, EAGER_BLOCK if eager else BLOCK):
        pieces = _pieces(lists, a, b, eager)
        if b - a > EAGER_BLOCK and any(p[3] == "masked" for p in pieces):
            plan_blocks.extend((s, min(s + EAGER_BLOCK, b), _pieces(lists, s, min(s + EAGER_BLOCK, b), eager))
                               for s in range(a, b, EAGER_BLOCK))
        else:
            plan_blocks.append((a, b, pieces))
    return {"blocks": plan_blocks, "spans": spans}


def _pieces(lists: list[tuple[list[int], list[int]]], a: int, b: int, eager: bool) -> list[Piece]:
    """The pieces of each region for the queries a..b-1 (``lists``: each region's (lo, hi) per query)."""
    pieces: list[Piece] = []
    for r, (lo, hi) in enumerate(lists):
        rows = [(x, y) for x, y in zip(lo[a:b], hi[a:b]) if y > x]
        if not rows:
            continue
        first, end = min(x for x, _ in rows), max(y for _, y in rows)
        if len(rows) == b - a:
            inner_lo, inner_hi = max(lo[a:b]), min(hi[a:b])  # keys every query of the block sees
        else:
            inner_lo = inner_hi = end
        if eager:
            pieces.append((r, first, end, "masked", 0, b - a))
            continue
        if inner_hi - inner_lo < 1:
            pieces.append((r, first, end, *_edge(lo[a:b], hi[a:b], first, end)))
            continue
        if first < inner_lo:
            pieces.append((r, first, inner_lo, *_edge(lo[a:b], hi[a:b], first, inner_lo)))
        pieces.append((r, inner_lo, inner_hi, "full", 0, b - a))
        if inner_hi < end:
            pieces.append((r, inner_hi, end, *_edge(lo[a:b], hi[a:b], inner_hi, end)))
    return pieces


def _edge(lo: list[int], hi: list[int], c0: int, c1: int) -> tuple[str, int, int]:
    """(kind, first row, end row) of the piece of keys c0..c1-1 for the rows whose keys are
    lo[n]..hi[n]-1 (see :data:`Piece`). The edges of a band whose ends move one key per query (the
    causal diagonal, SelfExtend's neighbour window, ReRoPE's and STRING's local window, DCA's chunks)
    are triangles: "causal" past the rows that see none of the piece, or "flipped" before them."""
    p, n = c1 - c0, len(lo)
    seen = [(max(x, c0) - c0, min(y, c1) - c0) for x, y in zip(lo, hi)]  # per row: [first, end) in the piece
    skip = 0
    while skip < n and seen[skip][1] <= seen[skip][0]:
        skip += 1
    if skip < n and all(f == 0 and e == min(r + 1, p) for r, (f, e) in enumerate(seen[skip:])):
        return "causal", skip, n
    if p <= n and all(f == r and e == p for r, (f, e) in enumerate(seen[:p])) and all(e <= f for f, e in seen[p:]):
        return "flipped", 0, p
    return "masked", 0, n


def _mask(spans: list[tuple[torch.Tensor, torch.Tensor]], piece: Piece, a: int, b: int) -> torch.Tensor:
    """(L, P) bool: which keys of a written-out piece each query of rows a..b sees."""
    r, c0, c1 = piece[:3]
    lo, hi = spans[r]
    cols = torch.arange(c0, c1, device=lo.device)[None, :]
    return (cols >= lo[a:b, None]) & (cols < hi[a:b, None])


def _grouped(k: torch.Tensor, v: torch.Tensor, h: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (k, v) if k.shape[1] == h else repeated_heads(k, v, h)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scores (B, H, L, P) in the accumulation dtype, tanh of the capped scores or None): q k^T * scale,
    soft-capped as ``softcap * tanh(s / softcap)`` (Gemma 2) when a cap is given."""
    s = torch.matmul(q, k.transpose(-1, -2)).to(accumulation_dtype(q.dtype)) * scale
    if softcap is None:
        return s, None
    t = torch.tanh(s / softcap)
    return t * softcap, t


def _written(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor,
             softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, H, L, Dv), lse (B, H, L)) of one masked piece, in the accumulation dtype; a row with no
    key gets 0 and -inf."""
    acc = accumulation_dtype(q.dtype)
    k, v = _grouped(k, v, q.shape[1])
    s = _scores(q, k, scale, softcap)[0].masked_fill(~mask, float("-inf"))  # (B, H, L, P)
    lse = torch.logsumexp(s, -1)  # (B, H, L)
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    return torch.matmul(p, v.to(acc)), lse


def _fold(o: torch.Tensor, lse: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two disjoint parts of the same softmax rows as one: (out, lse), rows with no key 0 and -inf."""
    new = torch.logaddexp(lse, l2)
    ref = torch.where(torch.isneginf(new), 0.0, new)
    return o * torch.exp(lse - ref)[..., None] + o2 * torch.exp(l2 - ref)[..., None], new


class _Remapped(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, plan: dict[str, Any], scale: float, firsts: list[int], v: torch.Tensor, sinks: torch.Tensor | None,
                *qk: torch.Tensor) -> torch.Tensor:
        n = len(qk) // 2
        qs, ks = qk[:n], qk[n:]
        b, h, tq, _ = qs[0].shape
        acc = accumulation_dtype(qs[0].dtype)
        outs, lses = [], []
        for a, e, pieces in plan["blocks"]:
            o: torch.Tensor | None = None  # (B, H, L, Dv)
            lse: torch.Tensor | None = None  # (B, H, L)
            for piece in pieces:
                r, c0, c1, kind, ra, rb = piece
                qb, kb = qs[r][:, :, a + ra:a + rb], ks[r][:, :, c0:c1]
                vb = v[:, :, firsts[r] + c0:firsts[r] + c1]
                if kind == "masked":
                    po, pl = _written(qb, kb, vb, scale, _mask(plan["spans"], piece, a, e), plan["softcap"])
                elif kind == "flipped":  # the n-th row sees keys n..: the causal mask with rows and keys reversed
                    po, pl = kernel_forward(qb.flip(2), kb.flip(2), vb.flip(2), True, scale)
                    po, pl = po.flip(2), pl.flip(-1)
                else:
                    po, pl = kernel_forward(qb, kb, vb, kind == "causal", scale)
                po, pl = po.to(acc), pl.to(acc)
                if o is None and ra == 0 and rb == e - a:  # the first piece of every row: taken as it is
                    o, lse = po, pl
                    continue
                if o is None or lse is None:  # a row with no key keeps 0, -inf
                    o = qs[0].new_zeros(b, h, e - a, v.shape[-1], dtype=acc)
                    lse = qs[0].new_full((b, h, e - a), -math.inf, dtype=acc)
                o[:, :, ra:rb], lse[:, :, ra:rb] = _fold(o[:, :, ra:rb], lse[:, :, ra:rb], po, pl)
            if o is None or lse is None:  # no key in any region (not for a causal row that sees itself)
                o = qs[0].new_zeros(b, h, e - a, v.shape[-1], dtype=acc)
                lse = qs[0].new_full((b, h, e - a), -math.inf, dtype=acc)
            outs.append(o)
            lses.append(lse)
        out, lse = torch.cat(outs, 2), torch.cat(lses, 2)  # (B, H, Tq, Dv), (B, H, Tq)
        if sinks is not None:  # one more logit per head with no value
            new = torch.logaddexp(lse, sinks.to(acc).view(1, h, 1))
            out, lse = out * torch.exp(lse - new)[..., None], new
        out = out.to(qs[0].dtype)
        ctx.plan, ctx.scale, ctx.firsts, ctx.n, ctx.has_sinks = plan, scale, firsts, n, sinks is not None
        ctx.save_for_backward(v, out, lse, *(() if sinks is None else (sinks,)), *qk)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        v, out, lse, *rest = ctx.saved_tensors
        sinks = rest.pop(0) if ctx.has_sinks else None
        n, scale, plan = ctx.n, ctx.scale, ctx.plan
        qs, ks = rest[:n], rest[n:]
        acc = lse.dtype
        hkv = v.shape[1]
        dout = dout.contiguous()
        delta = (dout.to(acc) * out.to(acc)).sum(-1)  # (B, H, Tq): rowsum(dO * O) of the merged softmax
        lse_b = torch.where(torch.isneginf(lse), math.inf, lse)  # a row with no key: every p is 0
        dqs = [torch.zeros_like(x, dtype=acc) for x in qs]
        dks = [torch.zeros_like(x, dtype=acc) for x in ks]
        dv = torch.zeros_like(v, dtype=acc)
        for a, e, pieces in plan["blocks"]:
            for piece in pieces:
                r, c0, c1, kind, ra, rb = piece
                x0, x1 = a + ra, a + rb  # the piece's query rows
                qb, kb, do = qs[r][:, :, x0:x1], ks[r][:, :, c0:c1], dout[:, :, x0:x1]
                k0 = ctx.firsts[r]
                vb = v[:, :, k0 + c0:k0 + c1]
                if kind == "masked":
                    kg, vg = _grouped(kb, vb, qb.shape[1])
                    s, t = _scores(qb, kg, scale, plan["softcap"])
                    s = s.masked_fill(~_mask(plan["spans"], piece, x0, x1), float("-inf"))
                    p = torch.exp(s - lse_b[:, :, x0:x1, None])  # (B, H, L, P)
                    dp = torch.matmul(do.to(acc), vg.to(acc).transpose(-1, -2))
                    ds = p * (dp - delta[:, :, x0:x1, None])
                    if t is not None:  # through the cap: d(c tanh(x / c)) = 1 - tanh^2
                        ds = ds * (1 - t * t)
                    dq = torch.matmul(ds, kg.to(acc)) * scale
                    dk = grouped_sum(torch.matmul(ds.transpose(-1, -2), qb.to(acc)) * scale, hkv)
                    dvp = grouped_sum(torch.matmul(p.transpose(-1, -2), do.to(acc)), hkv)
                elif kind == "flipped":
                    dq, dk, dvp = kernel_backward(do.flip(2), qb.flip(2), kb.flip(2), vb.flip(2), out[:, :, x0:x1].flip(2),
                                                  lse_b[:, :, x0:x1].flip(-1), True, scale)
                    dq, dk, dvp = dq.flip(2), dk.flip(2), dvp.flip(2)
                else:
                    dq, dk, dvp = kernel_backward(do, qb, kb, vb, out[:, :, x0:x1].contiguous(), lse_b[:, :, x0:x1].contiguous(),
                                                  kind == "causal", scale)
                dqs[r][:, :, x0:x1] += dq
                dks[r][:, :, c0:c1] += dk
                dv[:, :, k0 + c0:k0 + c1] += dvp
        dsinks = None
        if sinks is not None:
            h = out.shape[1]
            dsinks = -(torch.exp(sinks.to(acc).view(1, h, 1) - lse_b) * delta).sum((0, 2)).to(sinks.dtype)
        grads = [g.to(x.dtype) for g, x in zip(dqs + dks, list(qs) + list(ks))]
        return (None, None, None, dv.to(v.dtype), dsinks, *grads)


__all__ = ["BLOCK", "EAGER_BLOCK", "attend"]
