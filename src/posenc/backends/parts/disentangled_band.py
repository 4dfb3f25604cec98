"""DeBERTa's band: the disentangled position terms of the distances whose table rows differ,
written out with their backward (:mod:`posenc.backends.parts.disentangled` runs it beside the far
keys, which are plain attention of a shifted query).

The score of query i and key j (r = j - i, t = rows(r)) is ``q_i . k_j * scale + (q_i . A[t] + k_j .
B[t]) * term_scale`` (He et al. 2020, "DeBERTa", eq. 4). The band is the W distances first <= r <=
top whose rows differ (W rounded up to a multiple of :data:`WIDTH_MULTIPLE`; top = 0 for a decoder),
done one head at a time, written out in blocks of :data:`BLOCK` queries against their C + W - 1
window keys. The position terms are one (Tq, W) matrix per head in *distance layout*, one value per
(query, band distance) (:func:`_bias`): c2p ``q A_w^T`` (A_w: the rows of the W distances) is one
GEMM, p2c ``k_(a + w) . B_w[w]`` one batched GEMM over chunks of :data:`SKEW_CHUNK` distances, each
chunk's keys a window (a view), and one skewed copy of its output whose reads stay within a few
cache lines. The content ``q k^T`` is one batched GEMM per group of blocks in *key layout*, and the
band cells of a key-layout block are a strided view of it in distance layout (row stride L + 1:
Transformer-XL's relative shift, Dai et al. 2019, appendix B), onto which the terms are added, both
with unit column stride; the two off-band triangles (and window columns that are no keys) get -inf.
The backward is written out (:class:`Band`): each group's probabilities are recomputed from the
saved log-sum-exp, as flash attention does, and dS's band diagonal, the same view, is the gradient
of the position terms: one GEMM each takes it to q and A_w, and, skewed back into the chunks,
batched and per-chunk GEMMs take it to B_w and k. Every temporary is one head's (a few MB at N =
4096, reused by the allocator from head to head: buffers of all heads at once, tens of MB, are fresh
pages for every call), no (keys x rows) tensor is filled per block, and only q, k, v, the W table
rows, the band's output and log-sum-exp are saved.

Shape legend: B batch, H heads, Tq / Tk queries / keys, D head dim, W band distances, C block rows,
L = C + W - 1 block keys, n blocks in a group, V distances per p2c chunk, Tp keys with the padding
rows before and after them.
"""

from __future__ import annotations

from typing import Any

import torch

from .denormals import flushed

BLOCK = 64  # queries per band block
WIDTH_MULTIPLE = 16  # band widths are rounded up to this
SKEW_CHUNK = 16  # band distances per chunk of the p2c product (divides WIDTH_MULTIPLE)
GROUP_ELEMENTS = 1 << 20  # band temporaries per group: at most this many (blocks x rows x keys) of one head
# The kernel loops run in the caller's thread (denormals.flushed(when=False)): no position term falls
# with distance (the far keys share one table row), so nothing makes the probabilities denormal
# that plain attention's would not, and the hand-off to the flushing worker costs about a third of a
# training step at N = 4096 on a CPU.
FLUSH = False


class BandGeometry:
    """Where the band lies: distances ``first <= r <= top`` (r = key index - query index - offset),
    W = top - first + 1 of them, for Tq queries and Tk keys; ``scale`` the content product's factor.
    p2c's keys get ``pad_l`` rows before them and ``pad_r`` after them, so that every query's
    window exists: query a reads row ``start + a + w`` of the padded keys, w = 0..W-1."""

    def __init__(self, offset: int, first: int, top: int, scale: float, tq: int, tk: int) -> None:
        self.offset, self.first, self.top, self.scale = offset, first, top, scale
        self.width = top - first + 1
        self.pad_l = max(0, -(offset + first))
        self.pad_r = max(0, tq - 1 + offset + top - (tk - 1))
        self.start = offset + first + self.pad_l


def _diagonal(s: torch.Tensor, width: int) -> torch.Tensor:
    """Band cells of key-layout scores s (..., C, C + W - 1), contiguous, as a (..., C, W) view in
    distance layout: [a, w] = s[a, a + w] (row stride L + 1: Transformer-XL's relative shift)."""
    *lead, c, length = s.shape
    return s.as_strided((*lead, c, width), (*s.stride()[:-2], length + 1, 1), s.storage_offset())


Segment = tuple[int, int, int]  # (t0, n, C): n blocks of C queries from query t0


def _segments(tq: int, tk: int, geo: BandGeometry, device: torch.device) -> list[tuple[Segment, torch.Tensor | None]]:
    """The call's segments, each with :func:`_outside`'s mask: n blocks of C = :data:`BLOCK` queries
    from query t0, in groups of at most :data:`GROUP_ELEMENTS` scores of one head; a last block
    shorter than C alone (n = 1). The same for every head (forward and backward)."""
    size = max(1, GROUP_ELEMENTS // (BLOCK * (BLOCK + geo.width - 1)))
    full = tq // BLOCK
    out = [(t0 * BLOCK, min(size, full - t0), BLOCK) for t0 in range(0, full, size)]
    if tq % BLOCK:
        out.append((full * BLOCK, 1, tq % BLOCK))
    return [(segment, _outside(segment, tk, geo, device)) for segment in out]


def _outside(segment: Segment, tk: int, geo: BandGeometry, device: torch.device) -> torch.Tensor | None:
    """Where a segment's window columns are no keys (before key 0 or after the last key): an
    (n, 1, L) bool mask, or None where every column is a key."""
    t0, n, c = segment
    length = c + geo.width - 1
    k0 = geo.start + t0  # padded row of the first window column
    if k0 >= geo.pad_l and k0 + (n - 1) * c + length <= geo.pad_l + tk:
        return None
    rows = k0 + c * torch.arange(n, device=device)[:, None] + torch.arange(length, device=device)  # (n, L)
    return ((rows < geo.pad_l) | (rows >= geo.pad_l + tk))[:, None, :]


def _rows(x: torch.Tensor, t0: int, n: int, c: int) -> torch.Tensor:
    """Queries t0 .. t0 + n*C of one head's x (T, X) as n blocks: an (n, C, X) view."""
    return torch.unflatten(x[t0 : t0 + n * c], 0, (n, c))


def _windows(x: torch.Tensor, k0: int, n: int, c: int, length: int) -> torch.Tensor:
    """The keys of n blocks of one head, x (Tp + C, D) padded (:func:`_padded`): block m reads rows
    k0 + m*C + [0, L); an (n, L, D) view of overlapping windows (no copy: one batched GEMM reads it)."""
    return x[k0 : k0 + (n - 1) * c + length].unfold(0, length, c).transpose(-1, -2)


def _add_windows(buf: torch.Tensor, k0: int, c: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """buf[keys of block m] += x[m]^T y[m] for the overlapping windows of :func:`_windows`:
    x (n, C, L), y (n, C, D), buf (Tp + C, D) (C spare rows: no segment overhangs). One batched
    GEMM per C window columns, accumulating in place (no (n, L, D) temporary to add back)."""
    n, length = x.shape[0], x.shape[2]
    for s0 in range(0, length, c):
        part = x[:, :, s0 : s0 + c]  # (n, C, c'): these window columns of every block
        torch.unflatten(buf[k0 + s0 : k0 + s0 + n * c], 0, (n, c))[:, : part.shape[2]].baddbmm_(part.transpose(-1, -2), y)


def _triangles(c: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(C, C) bool masks of the off-band cells of a block: column < row in its first C columns,
    column >= row + W in its last C (strictly lower / strictly upper triangles)."""
    ones = torch.ones(c, c, dtype=torch.bool, device=device)
    return ones.tril(-1), ones.triu(1)


def _padded(x: torch.Tensor, geo: BandGeometry) -> torch.Tensor:
    """Keys or values (B, H, Tk, D) with ``pad_l`` zero rows before and ``pad_r`` + :data:`BLOCK`
    after them, contiguous: (B, H, Tp + C, D). Every block's window, and every p2c chunk's, is then
    a view (its rows that are no keys are masked in the scores)."""
    b, h, tk, d = x.shape
    out = x.new_zeros(b, h, geo.pad_l + tk + geo.pad_r + BLOCK, d)
    out[:, :, geo.pad_l : geo.pad_l + tk] = x
    return out


def _key_windows(kp: torch.Tensor, tq: int, geo: BandGeometry) -> torch.Tensor:
    """The keys of each chunk of :data:`SKEW_CHUNK` band distances, from one head's padded keys kp
    (Tp + C, D): chunk c reads rows ``start + cV + [0, Tq + V - 1)``; a (W/V, Tq + V - 1, D) view."""
    v = SKEW_CHUNK
    return kp[geo.start : geo.start + geo.width + tq - 1].unfold(0, tq + v - 1, v).transpose(-1, -2)


def _chunks(x: torch.Tensor) -> torch.Tensor:
    """Table rows (W, D) as chunks of V = :data:`SKEW_CHUNK` distances, each chunk's rows in reverse
    order: (W/V, V, D), ``[c, u'] = x[cV + V - 1 - u']`` (a copy of the W table rows)."""
    return x.view(x.shape[0] // SKEW_CHUNK, SKEW_CHUNK, x.shape[1]).flip(1)


def _chunk_skew(g: torch.Tensor, tq: int) -> torch.Tensor:
    """Per-chunk products g (W/V, Tq + V - 1, V), contiguous, with reversed chunks (:func:`_chunks`),
    read per query and distance: a (Tq, W/V, V) view with ``[a, c, u] = g[c, a + u, V - 1 - u]``
    (strides V, (Tq + V - 1) V, V - 1: every stride positive, and the distance's the smallest, so an
    elementwise copy into or out of this view runs along the distances of a row)."""
    n, rows, v = g.shape
    return g.as_strided((tq, n, v), (v, rows * v, v - 1), g.storage_offset() + v - 1)


def _bias(q_s: torch.Tensor, kp: torch.Tensor, a_s: torch.Tensor | None, b_w: torch.Tensor | None, head: int,
          geo: BandGeometry, out: torch.Tensor) -> None:
    """One head's position terms in distance layout, ``q_a . A_w[w] + k_(a + w) . B_w[w]``, into
    ``out`` (Tq, W), contiguous (key index a + w counted from ``start``); q_s (Tq, D) and kp (Tp + C,
    D) are the head's, a_s and b_w (H, W, D) every head's (either may be None).

    c2p is one GEMM (q_s is q * scale and a_s the rows / scale). p2c reads key a + w
    for distance w: the distances are cut into chunks of V = :data:`SKEW_CHUNK`, chunk c's keys are
    one window of Tq + V - 1 keys (a view, :func:`_key_windows`), so one batched GEMM makes the
    chunks' products ``g[c, r, u'] = k_(cV + r) . B_w[cV + V - 1 - u']`` (W/V, Tq + V - 1, V), and
    the term is their skewed view (:func:`_chunk_skew`) copied once: a read of stride V - 1, where
    the same view of the whole ``k B_w^T`` (Tk, W) would read with stride W + 1.
    """
    tq, width = q_s.shape[0], geo.width
    if b_w is not None:
        g = torch.bmm(_key_windows(kp, tq, geo), _chunks(b_w[head]).transpose(-1, -2))  # (W/V, Tq + V - 1, V)
        out.view(tq, width // SKEW_CHUNK, SKEW_CHUNK).copy_(_chunk_skew(g, tq))
        if a_s is not None:
            out.addmm_(q_s, a_s[head].t())
    elif a_s is not None:
        torch.mm(q_s, a_s[head].t(), out=out)


class Band(torch.autograd.Function):
    """Attention restricted to the band: (output (B, H, Tq, D), log-sum-exp (B, H, Tq)).

    One head at a time, per group of blocks of C queries: ``q k^T * scale`` against each block's
    C + W - 1 keys (key layout, one batched GEMM on overlapping key windows, a view) gets the
    head's position terms (:func:`_bias`, (Tq, W) in distance layout, made once per head; A_w, B_w
    are the table rows of the W band distances, term scale folded in) added on its band diagonal,
    a strided view in distance layout; -inf on the two off-band triangles and on padding keys. The
    backward recomputes the terms and each group's probabilities from the saved log-sum-exp (as
    flash attention does); dS's band diagonal is the terms' gradient, which one GEMM each sends to
    q and A_w per head, and, skewed back into chunks of :data:`SKEW_CHUNK` distances, a batched GEMM
    to B_w and per-chunk GEMMs to k. Every temporary is one head's, nothing of size (keys x rows)
    is filled per block, and only q, k, v, the tables, the output and the log-sum-exp are saved.
    """

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a_w: torch.Tensor | None, b_w: torch.Tensor | None, geo: BandGeometry,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = flushed(_band_forward, q, k, v, a_w, b_w, geo, when=FLUSH)
        ctx.geo = geo
        ctx.save_for_backward(q, k, v, a_w, b_w, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor, d_lse: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, a_w, b_w, out, lse = ctx.saved_tensors
        return (*flushed(_band_backward, ctx.geo, d_out, d_lse, q, k, v, a_w, b_w, out, lse, when=FLUSH), None)


def _scores(
    q_s: torch.Tensor, kp: torch.Tensor, bias: torch.Tensor | None, segment: Segment, geo: BandGeometry,
    masks: dict[int, tuple[torch.Tensor, torch.Tensor]], outside: torch.Tensor | None,
) -> torch.Tensor:
    """Scores of one head's segment of n blocks of C queries, key layout (n, C, L): q k^T * scale
    (q_s = q * scale, kp the padded keys), the position terms (``bias``, :func:`_bias`) added on the
    band diagonal, -inf off the band and on the columns that are no keys (``outside``)."""
    t0, n, c = segment
    width, length = geo.width, c + geo.width - 1
    s = q_s.new_empty(n, c, length)  # (n, C, L)
    torch.bmm(_rows(q_s, t0, n, c), _windows(kp, geo.start + t0, n, c, length).transpose(-1, -2), out=s)
    if bias is not None:
        _diagonal(s, width).add_(_rows(bias, t0, n, c))  # (n, C, W), both with unit column stride
    if c not in masks:
        masks[c] = _triangles(c, q_s.device)
    left, right = masks[c]
    s[..., :c].masked_fill_(left, float("-inf"))
    s[..., length - c :].masked_fill_(right, float("-inf"))
    if outside is not None:
        s.masked_fill_(outside, float("-inf"))
    return s


def _prepared(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a_w: torch.Tensor | None, geo: BandGeometry,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """q * scale (contiguous), k and v padded (:func:`_padded`), and the c2p rows / scale (None
    without c2p)."""
    q_s = (q * geo.scale).contiguous()  # the content scale folded into q
    a_s = None if a_w is None else a_w / geo.scale  # (H, W, D): q_s . a_s = q . a_w
    return q_s, _padded(k, geo), _padded(v, geo), a_s


def _band_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a_w: torch.Tensor | None, b_w: torch.Tensor | None, geo: BandGeometry,
) -> tuple[torch.Tensor, torch.Tensor]:
    b, h, tq, _ = q.shape
    tk = k.shape[-2]
    q_s, kp, vp, a_s = _prepared(q, k, v, a_w, geo)
    out = q.new_empty(b, h, tq, v.shape[-1])  # (B, H, Tq, D)
    lse = q.new_empty(b, h, tq, 1)  # (B, H, Tq, 1)
    bias = None if a_w is None and b_w is None else q.new_empty(tq, geo.width)  # (Tq, W): one head's position terms
    masks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    segments = _segments(tq, tk, geo, q.device)
    for i in range(b):
        for j in range(h):
            if bias is not None:
                _bias(q_s[i, j], kp[i, j], a_s, b_w, j, geo, bias)
            for segment, outside in segments:
                t0, n, c = segment
                s = _scores(q_s[i, j], kp[i, j], bias, segment, geo, masks, outside)  # (n, C, L)
                top = s.amax(-1, keepdim=True)  # finite: every query sees its own key
                p = s.sub_(top).exp_()
                total = p.sum(-1, keepdim=True)  # (n, C, 1)
                o = _rows(out[i, j], t0, n, c)  # (n, C, D), written by the GEMM
                torch.bmm(p, _windows(vp[i, j], geo.start + t0, n, c, c + geo.width - 1), out=o)
                o.div_(total)
                _rows(lse[i, j], t0, n, c).copy_(total.log_().add_(top))
    return out, lse[..., 0]


def _band_backward(
    geo: BandGeometry, d_out: torch.Tensor, d_lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    a_w: torch.Tensor | None, b_w: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor,
) -> tuple[torch.Tensor | None, ...]:
    b, h, tq, d = q.shape
    tk, width = k.shape[-2], geo.width
    q_s, kp, vp, a_s = _prepared(q, k, v, a_w, geo)
    d_out = d_out.contiguous()
    # dS = P (dP - rowsum(dO * O) + d lse): the band's output and log-sum-exp both reach the merge.
    total = ((d_out * out).sum(-1) - d_lse)[..., None]  # (B, H, Tq, 1)
    lse = lse[..., None]  # (B, H, Tq, 1)
    dq = torch.empty_like(q_s)  # (B, H, Tq, D)
    dkp, dvp = torch.zeros_like(kp), torch.zeros_like(vp)  # (B, H, Tp + C, D): padded, as kp and vp
    d_a = None if a_w is None else torch.zeros_like(a_w)  # (H, W, D)
    d_b = None if b_w is None else torch.zeros_like(b_w)  # (H, W, D)
    bias = None if a_w is None and b_w is None else q.new_empty(tq, width)  # (Tq, W): one head's position terms
    d_bias = None if bias is None else torch.empty_like(bias)  # (Tq, W): dS on the band, distance layout
    masks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    segments = _segments(tq, tk, geo, q.device)
    for i in range(b):
        for j in range(h):
            kh, vh, qh, dkh, dvh = kp[i, j], vp[i, j], q_s[i, j], dkp[i, j], dvp[i, j]
            if bias is not None:  # recomputed, as the scores are
                _bias(qh, kh, a_s, b_w, j, geo, bias)
            for segment, outside in segments:
                t0, n, c = segment
                k0, length = geo.start + t0, c + width - 1
                p = _scores(qh, kh, bias, segment, geo, masks, outside).sub_(_rows(lse[i, j], t0, n, c)).exp_()  # (n, C, L): P
                g, qb, dqb = _rows(d_out[i, j], t0, n, c), _rows(qh, t0, n, c), _rows(dq[i, j], t0, n, c)
                _add_windows(dvh, k0, c, p, g)
                ds = torch.baddbmm(_rows(total[i, j], t0, n, c), g, _windows(vh, k0, n, c, length).transpose(-1, -2), beta=-1)
                ds.mul_(p)  # dS = P (dP - total) (n, C, L): 0 off the band and on the columns that are no keys
                torch.bmm(ds, _windows(kh, k0, n, c, length), out=dqb)
                _add_windows(dkh, k0, c, ds, qb)
                dqb.mul_(geo.scale)
                if d_bias is not None:
                    _rows(d_bias, t0, n, c).copy_(_diagonal(ds, width))  # the position terms' gradient
            if a_w is not None and d_a is not None and d_bias is not None:  # c2p = q A_w^T: to q and A_w
                dq[i, j].addmm_(d_bias, a_w[j])
                d_a[j].addmm_(d_bias.t(), qh, alpha=1 / geo.scale)  # qh is q * scale
            if b_w is not None and d_b is not None and d_bias is not None:  # p2c: to k and B_w
                windows = _key_windows(kh, tq, geo)  # (W/V, Tq + V - 1, D)
                d_g = k.new_empty(windows.shape[0], windows.shape[1], SKEW_CHUNK)  # (W/V, Tq + V - 1, V)
                d_g[:, : SKEW_CHUNK - 1].zero_()  # the cells no query reads: two triangles of each chunk
                d_g[:, tq:].zero_()
                _chunk_skew(d_g, tq).copy_(d_bias.view(tq, -1, SKEW_CHUNK))
                d_b[j] += torch.bmm(d_g.transpose(-1, -2), windows).flip(1).reshape(width, d)
                for c, rows in enumerate(_chunks(b_w[j])):  # dk: chunk c's keys start + cV + r get d_g[c] B_c
                    dkh[geo.start + c * SKEW_CHUNK : geo.start + c * SKEW_CHUNK + d_g.shape[1]].addmm_(d_g[c], rows)
    keys = slice(geo.pad_l, geo.pad_l + tk)
    return dq, dkp[:, :, keys], dvp[:, :, keys], d_a, d_b


__all__ = ["BLOCK", "FLUSH", "WIDTH_MULTIPLE", "Band", "BandGeometry"]
