"""Fast attention for encodings with query/value score terms (Shaw, Transformer-XL, DeBERTa).

Backend name ``terms``. The eager formula builds (B, H, Tq, Tk) scores, terms and probabilities;
here nothing of that size exists in forward or backward (memory O(N x block)), and the result
(outputs and gradients of q, k, v and every parameter of the encoding) is the eager formula's, up
to float rounding. Two fast paths, picked from what the encoding offers (never from its name):

- ``clipped_tables()`` (Shaw et al. 2018, "Self-Attention with Relative Position
  Representations": vectors indexed by clip(j - i, -k, k)). Every key farther than k on one side
  uses the same key vector a^K_{-k} and value vector a^V_{-k}. For those keys the score term
  ``q_i . a^K_{-k}`` is a per-row constant c_i and the value term is a^V_{-k} times the far
  probability mass. So attention splits into
  * a band of keys with -k <= j - i <= k (<= 0 if causal), explicit, in chunks of queries;
  * the far past (j - i < -k): plain attention of q[k+1:] on k[:-k-1], a triangle that the CPU
    flash kernel does with its own causal skip, plus c_i;
  * for encoders, the far future (j - i > k): the same on the sequences reversed;
  merged through their log-sum-exps. The flash kernel's backward is called with the *merged*
  output and log-sum-exp (shifted by a^V and c_i), which makes its probabilities and its
  ``rowsum(dO * O)`` those of the whole attention, so its gradients are exact; the band's
  gradients come from autograd. Cost: about one SDPA call plus a band of 2k+1 keys.
- ``distance_key_form()`` (Dai et al. 2019, "Transformer-XL", §3.3): one position key per distance,
  scored per tile of queries against the distances and moved into place by a strided view (the
  relative shift without a copy), with a written-out backward: :mod:`posenc.backends.parts.distance`.
- ``disentangled_tables()`` (He et al. 2020, "DeBERTa", eq. 4: c2p ``q_i . A[t]`` and p2c
  ``k_j . B[t]`` at row t = rows(j - i), constant past the last bucket on each side): far keys are
  plain attention of q + B[t] with the per-query constant q_i . A[t]; the band of distinct rows is
  written out from two (T x R) products and their gathers: :mod:`posenc.backends.parts.disentangled`.

Anything else (another dtype or device, a bias as well, queries outside the keys' positions,
another encoding with query/value terms) runs the eager formula (blocked, checkpointed).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..encodings.protocol import ClippedTables, DisentangledTables, DistanceKeys, offers, require
from . import eager
from .parts import disentangled, distance, padding, single
from .parts.base import ScoreSpec
from .parts.denormals import flushed
from .parts.regions import FLASH_OPS, Merge, Region, apply, call_order, kernel_forward, keys_of, lower, region_backward, rows_of, upper

SHAW_CHUNK = 32  # queries per band chunk (at least the band width)
FAST_DTYPES = (torch.float32, torch.float64)


Path = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, ScoreSpec], torch.Tensor]
Regions = tuple[tuple[int, Region], ...]  # (side, region): side 0 the far past, 1 the far future


def _path(spec: ScoreSpec, q: torch.Tensor) -> Path | None:
    """The fast function for this call, or None (then the eager formula, blocked, runs)."""
    enc = spec.encoding
    if not spec.has_bias and single.applies(spec, q, q, q):  # a decode step (k, v: no grad either)
        if offers(enc, ClippedTables):
            return single.shaw
        if offers(enc, DistanceKeys):
            return single.distance_keys
        if offers(enc, DisentangledTables) and not spec.has_value_terms:
            return single.disentangled
    if spec.starts is not None:
        return None
    if not FLASH_OPS or not spec.consecutive or q.device.type != "cpu" or q.dtype not in FAST_DTYPES or spec.has_bias or not spec.contained:
        return None
    if offers(enc, ClippedTables):
        return shaw_attention
    if offers(enc, DistanceKeys):
        return distance.distance_key_attention
    if offers(enc, DisentangledTables) and not spec.has_value_terms:
        # Only where its cost model beats the eager formula (a short encoder call does not).
        return disentangled.attention if disentangled.worthwhile(spec, q.shape[-2], spec.k_positions.numel()) else None
    return None


def supports(spec: ScoreSpec, q: torch.Tensor) -> bool:
    # Per-key log gates and per-query curves are eager's alone (this backend's row split would drop them).
    return ((spec.has_query_terms or spec.has_value_terms) and spec.log_gates is None and spec.curves is None
            and not spec.selective and padding.supported(spec))


def preferred(spec: ScoreSpec, q: torch.Tensor) -> bool:
    if spec.starts is not None and supports(spec, q):  # split by rows: each row may take a fast path
        enc = spec.encoding
        return offers(enc, ClippedTables) or offers(enc, DistanceKeys) or (offers(enc, DisentangledTables) and not spec.has_value_terms)
    return supports(spec, q) and _path(spec, q) is not None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec) -> torch.Tensor:
    path = _path(spec, q)
    if path is None and spec.starts is not None:
        return padding.by_rows(attend, q, k, v, spec)
    return eager.attend(q, k, v, spec) if path is None else path(q, k, v, spec)


# --------------------------------------------------------------------------------------------
# Shaw: band + far regions merged by log-sum-exp.


class _MergeFarShaw(torch.autograd.Function):
    """out = merge of the band (o_b, lse_b) with far regions done by the flash kernel.

    A far region of side s adds, for its rows, logits ``q k^T * scale + consts[s]`` and values
    ``v + values[s]``. ``regions``: (side, :class:`~posenc.backends.parts.regions.Region`) pairs.
    """

    @staticmethod
    def forward(
        ctx: Any, o_b: torch.Tensor, lse_b: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        consts: torch.Tensor, values: torch.Tensor, regions: Regions, scale: float,
    ) -> torch.Tensor:
        out, lse, parts = flushed(_merge_forward, o_b, lse_b, q, k, v, consts, values, regions, scale)
        ctx.regions, ctx.scale = regions, scale
        ctx.save_for_backward(o_b, lse_b, q, k, v, consts, values, out, lse, *(t for p in parts for t in p))
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        o_b, lse_b, q, k, v, consts, values, out, lse, *saved = ctx.saved_tensors
        return flushed(_merge_backward, ctx.regions, ctx.scale, d_out, o_b, lse_b, q, k, v, consts, values, out, lse, saved)


def _merge_forward(
    o_b: torch.Tensor, lse_b: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    consts: torch.Tensor, values: torch.Tensor, regions: Regions, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    b, h, tq, dv = o_b.shape
    merged = Merge(b, h, tq, dv, q.dtype, q.device)
    merged.add((0, tq), o_b, lse_b)
    parts = []
    for side, region in regions:
        o, lz = kernel_forward(rows_of(q, region), keys_of(k, region), keys_of(v, region), region.causal, scale)
        o, lz = call_order(o, region), call_order(lz, region, -1)
        rows = slice(*region.rows)
        merged.add(region.rows, o + values[side], lz + consts[side, ..., rows])  # the far logits gain c_i, the values a^V
        parts.append((o, lz))
    return merged.out, merged.lse, parts  # (B, H, Tq, D), (B, H, Tq)


def _merge_backward(
    regions: Regions, scale: float, d_out: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor,
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, consts: torch.Tensor, values: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, saved: list[torch.Tensor],
) -> tuple[torch.Tensor | None, ...]:
    d_out = d_out.contiguous()
    total = (d_out * out).sum(-1)  # (B, H, Tq): rowsum(dO * O) of the whole attention
    w_b = torch.exp(lse_b - lse)
    d_ob = w_b[..., None] * d_out
    d_lse_b = w_b * ((d_out * o_b).sum(-1) - total)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    d_consts, d_values = torch.zeros_like(consts), torch.zeros_like(values)
    for i, (side, region) in enumerate(regions):
        o, lz = saved[2 * i], saved[2 * i + 1]
        rows, keys = slice(*region.rows), slice(*region.keys)
        g, c = d_out[..., rows, :], consts[side, ..., rows]
        weight = torch.exp(lz + c - lse[..., rows])  # far mass of each row, (B, H, rows)
        d_consts[side, ..., rows] += weight * ((g * (o + values[side])).sum(-1) - total[..., rows])
        d_values[side] += (weight[..., None] * g).sum((0, 1, 2))
        # The kernel's P and rowsum(dO * O) must be the whole attention's: its logits lack c and
        # its values lack the value vector.
        gq, gk, gv = region_backward(region, d_out, q, k, v, out, lse, scale, lse_shift=c, out_shift=values[side])
        dq[..., rows, :] += gq
        dk[..., keys, :] += gk
        dv[..., keys, :] += gv
    return d_ob, d_lse_b, dq, dk, dv, d_consts, d_values, None, None


def _shaw_band(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, per_distance: torch.Tensor, value_table: torch.Tensor,
    clip: int, offset: int, causal: bool, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention restricted to -clip <= j - i <= clip (<= 0 if causal): (output, logsumexp).

    Query a is at key index a + offset. Queries go in chunks of c; chunk m's band keys all lie in
    a window of c + width - 1 keys starting at key m*c + offset - clip, and the key at column t of
    that window has table row t - (query's row in the chunk), the same for every chunk.
    """
    b, h, tq, d = q.shape
    tk = k.shape[-2]
    width = clip + 1 if causal else 2 * clip + 1  # table rows in the band: 0..width-1
    c = max(SHAW_CHUNK, width)
    n = -(-tq // c)
    span = c + width - 1
    first = offset - clip  # key index of chunk 0's first window column
    front, back = max(0, -first), max(0, first + n * c + width - 1 - tk)
    start = first + front
    kp = F.pad(k, (0, 0, front, back))[..., start : start + n * c + width - 1, :]  # (B, H, n*c + width - 1, D)
    vp = F.pad(v, (0, 0, front, back))[..., start : start + n * c + width - 1, :]
    k_win = kp.unfold(-2, span, c)  # (B, H, n, D, span)
    v_win = vp.unfold(-2, span, c).transpose(-1, -2)  # (B, H, n, span, D)
    pad_q = n * c - tq
    qc = F.pad(q, (0, 0, 0, pad_q)).reshape(b, h, n, c, d)  # (B, H, n, c, D)
    pdc = F.pad(per_distance, (0, 0, 0, pad_q)).reshape(b, h, n, c, -1)  # (B, H, n, c, 2k+1)

    dev = q.device
    cols, rows = torch.arange(span, device=dev), torch.arange(c, device=dev)
    row_of = cols[None, :] - rows[:, None]  # (c, span): table row of each in-band pair
    in_band = (row_of >= 0) & (row_of < width)
    key = first + torch.arange(n, device=dev)[:, None, None] * c + cols  # (n, 1, span) key index
    padded_query = (torch.arange(n, device=dev)[:, None] * c + rows >= tq)[:, :, None]  # (n, c, 1)
    # Padded query rows keep their (zero-padded) band keys so no row is all -inf; they are dropped.
    allowed = in_band & (((key >= 0) & (key < tk)) | padded_query)  # (n, c, span)

    scores = torch.matmul(qc, k_win) * scale  # (B, H, n, c, span)
    terms = pdc.gather(-1, row_of.clamp(0, width - 1).expand(b, h, n, c, span))  # (B, H, n, c, span)
    scores = (scores + terms).masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, n, c)
    probs = torch.exp(scores - lse[..., None])
    out = torch.matmul(probs, v_win)  # (B, H, n, c, D)
    # Value vectors: the probability at each band distance, times the table row.
    at = rows[:, None] + torch.arange(width, device=dev)[None, :]  # (c, width): column of row r
    per_row = probs.gather(-1, at.expand(b, h, n, c, width))  # (B, H, n, c, width)
    out = out + torch.matmul(per_row, value_table[:width])
    return out.reshape(b, h, n * c, d)[..., :tq, :], lse.reshape(b, h, n * c)[..., :tq]


def shaw_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec) -> torch.Tensor:
    """Shaw et al. (2018) relative attention with clipped distance: band + far regions."""
    tables = require(spec.encoding, ClippedTables).clipped_tables()
    clip, key_table, value_table, term_scale = tables.clip, tables.key_table, tables.value_table, tables.scale
    tq, tk = q.shape[-2], k.shape[-2]
    offset = spec.offset  # query a is key a + offset
    per_distance = torch.matmul(q, (key_table.to(q.dtype) * term_scale).t())  # (B, H, Tq, 2k+1) logits
    value_table = value_table.to(q.dtype)
    o_b, lse_b = _shaw_band(q, k, v, per_distance, value_table, clip, offset, spec.causal, spec.scale)
    # Far past: j - i < -clip, i.e. key b <= a + offset - clip - 1; table row 0.
    regions = [(0, r) for r in lower(tq, tk, offset - clip - 1)]
    consts, values = [per_distance[..., 0]], [value_table[0]]
    if not spec.causal:
        # Far future: b >= a + offset + clip + 1, run on the sequences reversed. Table row 2k.
        regions += [(1, r) for r in upper(tq, tk, offset + clip + 1)]
        consts.append(per_distance[..., -1])
        values.append(value_table[-1])
    if not regions:
        return o_b
    return apply(_MergeFarShaw, o_b, lse_b, q, k, v, torch.stack(consts), torch.stack(values), tuple(regions), spec.scale)


# --------------------------------------------------------------------------------------------
# Transformer-XL: position keys per distance, blocked, recomputed in backward.
