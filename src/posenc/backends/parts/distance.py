"""Transformer-XL attention without (Tq, Tk) tensors: the ``terms`` backend's path for
:class:`~posenc.encodings.protocol.DistanceKeys` (Dai et al. 2019, "Transformer-XL", §3.3).

Scores are ``q_i . k_j + u . k_j + (q_i + v) . W_R R_{i-j}``. The position term depends on i - j
through one key per distance, a (H, L, D) table, so a block of queries times that table gives
(block, L) scores per *distance*, and a strided view of them is the (block, keys) layout (the
relative shift without a copy). A custom autograd function walks tiles of queries (causal tiles
see only their past): forward, that view is the flash kernel's additive mask (scores, softmax and
p v fused, log-sum-exp returned); backward recomputes each tile's probabilities from the saved
log-sum-exp, as flash attention does, and keeps scores, probabilities and dS in the one
per-distance buffer. Cost: the position term adds 4 products of the size of q k^T to the 7 of fused
attention, and the backward's softmax is not fused (about 2x SDPA at N=4096).
Rejected: appending sin/cos features to q and k so that one SDPA call does everything. R has the
model width, so that adds H*D = 512 features per head at the default sizes, and SDPA's cost grows
with the head dim (v must be padded too, to stay on the fast kernel): several times slower.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from ...encodings.protocol import DistanceKeys, require
from .base import ScoreSpec
from .regions import apply, kernel_forward

XL_BLOCK = 128  # queries per tile
XL_HEADS = 8  # heads per tile: fewer, larger calls (a tile is (B, heads, block, keys))


def _skew(x: torch.Tensor, keys: int) -> torch.Tensor:
    """View of per-distance scores x (..., c, c + keys - 1) in key layout (..., c, keys).

    Column m of x holds distance (largest - m), largest = last query - first key, so row a and key
    t read column t + c - 1 - a: a strided view, stride (L - 1) along rows, no copy.
    """
    *lead, c, length = x.shape
    return x.as_strided((*lead, c, keys), (*x.stride()[:-2], length - 1, 1), x.storage_offset() + c - 1)


class _DistanceKeyAttention(torch.autograd.Function):
    """softmax(qc k^T + shift(qp pk^T) [+ causal mask]) v, in tiles of (heads, query block).

    qc, qp (B, H, Tq, D): content and position queries (scales folded in); k, v (B, H, Tk, D);
    pk (H, L, D): position keys, row m for distance (Tq - 1 + offset) - m; query a is key a + offset.
    Forward: per tile, the per-distance scores viewed in key layout are the flash kernel's additive
    mask (it does q k^T, softmax and p v fused, and returns the log-sum-exp). Backward: per tile,
    recompute the probabilities from the saved log-sum-exp, as flash attention does. Memory: a
    few (B, heads, block, keys) temporaries, never (Tq, Tk).
    """

    @staticmethod
    def forward(
        ctx: Any, qc: torch.Tensor, qp: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        pk: torch.Tensor, offset: int, causal: bool, block: int, heads: int,
    ) -> torch.Tensor:
        tq, tk = qc.shape[-2], k.shape[-2]
        out = qc.new_empty(*qc.shape[:-1], v.shape[-1])  # (B, H, Tq, D)
        lse = qc.new_empty(qc.shape[:-1])  # (B, H, Tq)
        for hs, a0, a1 in _tiles(qc.shape[1], tq, heads, block):
            position, keys = _block_position(qp[:, hs], pk[hs], tk, a0, a1, offset, causal)
            o, lz = kernel_forward(qc[:, hs, a0:a1], k[:, hs, :keys], v[:, hs, :keys], False, 1.0, _skew(position, keys))
            out[:, hs, a0:a1], lse[:, hs, a0:a1] = o, lz
        ctx.offset, ctx.causal, ctx.block, ctx.heads = offset, causal, block, heads
        ctx.save_for_backward(qc, qp, k, v, pk, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        qc, qp, k, v, pk, out, lse = ctx.saved_tensors
        offset, causal = ctx.offset, ctx.causal
        tq, tk = qc.shape[-2], k.shape[-2]
        total = (d_out * out).sum(-1)  # (B, H, Tq): rowsum(dO * O)
        # One extra feature folds "- lse" into q k^T and "- total" into dO v^T: fewer passes.
        ones = k.new_ones(*k.shape[:-1], 1)
        qc_lse, k_one = torch.cat((qc, -lse[..., None]), -1), torch.cat((k, ones), -1)  # (B, H, T, D + 1)
        g_total, v_one = torch.cat((d_out, -total[..., None]), -1), torch.cat((v, ones), -1)
        dqc, dqp = torch.empty_like(qc), torch.empty_like(qp)
        dk, dv, dpk = torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(pk)
        for hs, a0, a1 in _tiles(qc.shape[1], tq, ctx.heads, ctx.block):
            # Everything below lives in one per-distance buffer (B, h, c, L); ``probs`` is its
            # key-layout view, so the scores, probabilities and dS never need a copy between the
            # two layouts. The content product is accumulated into the view by the GEMM itself.
            dist, keys = _block_position(qp[:, hs], pk[hs], tk, a0, a1, offset, causal)  # (B, h, c, L)
            c, m0, length = a1 - a0, tq - a1, dist.shape[-1]
            probs = _skew(dist, keys)  # (B, h, c, keys)
            _skew(dist.view(-1, c, length), keys).baddbmm_(  # the same memory as probs, 3-d for bmm
                _flat(qc_lse[:, hs, a0:a1]), _flat(k_one[:, hs, :keys]).transpose(-1, -2)
            )
            probs.exp_()  # exp(score - lse): the softmax probabilities
            g = d_out[:, hs, a0:a1]
            _add_product(dv[:, hs, :keys], probs.transpose(-1, -2), g)
            probs.mul_(torch.matmul(g_total[:, hs, a0:a1], v_one[:, hs, :keys].transpose(-1, -2)))  # dS = P (dP - total)
            # The c - 1 columns at each end of a row that are not its keys: zero, for the
            # per-distance products below.
            _, keep_left, keep_right = _masks(c, dist.dtype, dist.device)
            dist[..., : c - 1].mul_(keep_left)
            dist[..., keys:].mul_(keep_right)
            d_scores = probs
            dqc[:, hs, a0:a1] = torch.matmul(d_scores, k[:, hs, :keys])
            _add_product(dk[:, hs, :keys], d_scores.transpose(-1, -2), qc[:, hs, a0:a1])
            dqp[:, hs, a0:a1] = torch.matmul(dist, pk[hs, m0 : m0 + length])
            if dist.shape[0] == 1:
                _add_product(dpk[hs, m0 : m0 + length], dist[0].transpose(-1, -2), qp[0, hs, a0:a1])
            else:
                dpk[hs, m0 : m0 + length] += torch.matmul(dist.transpose(-1, -2), qp[:, hs, a0:a1]).sum(0)
        return dqc, dqp, dk, dv, dpk, None, None, None, None


def _flat(x: torch.Tensor) -> torch.Tensor:
    """(B, h, r, c) -> (B*h, r, c) for bmm (a copy when the strides do not allow a view)."""
    return x.reshape(-1, *x.shape[-2:])


def _add_product(target: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """target += a @ b, accumulated by the GEMM itself when target's memory allows a 3-d view."""
    try:
        flat = target.view(-1, *target.shape[-2:])
    except RuntimeError:  # e.g. some heads of a batch > 1: not one stride per batch
        target += torch.matmul(a, b)
        return
    flat.baddbmm_(_flat(a), _flat(b))


@functools.lru_cache(maxsize=16)
def _masks(c: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float masks of a block of c queries, made once: (c, c) -inf where a key among the block's
    last c is ahead of the query, else 0 (to add); (c, c-1) 0 for the columns left of row a's keys
    among its first c - 1 per-distance columns, else 1 (to multiply); (c, c-1) the same right of
    them among the last c - 1. (Arithmetic, not masked_fill_, which is slow on these views.)"""
    rows, cols = torch.arange(c, device=device)[:, None], torch.arange(c, device=device)[None, :]
    future = torch.zeros(c, c, dtype=dtype, device=device).masked_fill_(cols > rows, float("-inf"))
    inner = cols[:, : c - 1]
    return future, (inner >= c - 1 - rows).to(dtype), (inner < c - 1 - rows).to(dtype)


def _tiles(num_heads: int, tq: int, heads: int, block: int) -> Iterator[tuple[slice, int, int]]:
    """(head slice, a0, a1) for every tile of ``heads`` heads x ``block`` queries."""
    for h0 in range(0, num_heads, heads):
        for a0 in range(0, tq, block):
            yield slice(h0, min(h0 + heads, num_heads)), a0, min(a0 + block, tq)


def _block_position(qp: torch.Tensor, pk: torch.Tensor, tk: int, a0: int, a1: int, offset: int, causal: bool) -> tuple[torch.Tensor, int]:
    """Position logits of queries a0:a1 per distance, (B, H, c, c + keys - 1), whose ``_skew``
    view is their (B, H, c, keys) logits against the keys they may see, causal mask included;
    and ``keys``."""
    c = a1 - a0
    keys = min(tk, a1 + offset) if causal else tk
    m0, length = qp.shape[-2] - a1, c + keys - 1  # pk rows of distances a1-1+offset .. a0+offset-keys+1
    per_distance = torch.matmul(qp[..., a0:a1, :], pk[:, m0 : m0 + length, :].transpose(-1, -2))  # (B, H, c, L)
    if causal:
        # Only the last c keys can be ahead of a query of this block: key a0+offset+t vs query a0+a.
        future = _masks(c, per_distance.dtype, qp.device)[0][:, c - min(c, keys) :]
        _skew(per_distance, keys)[..., keys - future.shape[-1] :].add_(future)
    return per_distance, keys


def distance_key_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec) -> torch.Tensor:
    """Transformer-XL (Dai et al. 2019) attention without (Tq, Tk) tensors."""
    enc = require(spec.encoding, DistanceKeys)
    form = enc.distance_key_form()
    u, v_bias, term_scale = form.u, form.v, form.scale
    tq, tk = q.shape[-2], k.shape[-2]
    offset = spec.offset
    # (a) + (c): q.k*scale + u.k*s = (q*scale + u*s).k ; (b) + (d): (q + v).W_R R_{i-j} * s.
    qc = q * spec.scale + (u.to(q.dtype) * term_scale)[:, None, :]  # (B, H, Tq, D)
    qp = (q + v_bias.to(q.dtype)[:, None, :]) * term_scale  # (B, H, Tq, D)
    largest = tq - 1 + offset  # last query minus first key
    block = XL_BLOCK
    if spec.causal:
        # Distances below 0 are masked: zero rows stand in for them (block - 1 of them at most).
        pk = enc.position_keys(largest - torch.arange(largest + 1, device=q.device), q.dtype)  # (H, L, D)
        pk = F.pad(pk, (0, 0, 0, min(block, tq) - 1))
    else:
        pk = enc.position_keys(largest - torch.arange(tq + tk - 1, device=q.device), q.dtype)  # (H, L, D)
    return apply(_DistanceKeyAttention, qc, qp, k, v, pk, offset, spec.causal, block, XL_HEADS)
