"""Per-key log forget gates (the Forgetting Transformer, Lin et al. 2025) on the fused kernel.

Backend name ``gated``. A call with ``spec.log_gates`` (B, H, Tk) and nothing else adds
c_i - c_j to the logits (c = cumsum of the gates over the keys, :meth:`ScoreSpec.cumulative_gates`),
keys after the query masked. Softmax drops the per-query c_i, so the term is a per-key -c_j, which
rides on the keys as one extra feature: q' = [q, 1], k' = [k, -(c_j - c_ref) / scale], v' = [v, 0],
so that ``q' . k' * scale = q . k * scale - (c_j - c_ref)``, and plain
``scaled_dot_product_attention`` computes the call, forward and backward (its autograd carries the
gradient into c and so into the gates' parameters). c grows with the length (c ~ -T for gates
that forget), so the reference c_ref is taken per block of ``BLOCK`` queries (the block's middle
query): the keys near the block then carry features of at most BLOCK / 2 gates, and only far keys,
whose weights are negligible, carry large ones. In float32 that is as close to the float64 formula
as ``eager`` in float32 (a reference at the block's first query, with blocks of 256, was ~5x
further off on the gates' gradients). Each block sees the keys up to its last query, with a (block, keys)
bool mask for the staircase: memory O(N x block) per block, no (B, H, N, N) tensor.

A decode step (one query, the last key) is one fused call with c_i - c_j as its additive mask
(B, H, 1, Tk). Runs causal calls with consecutive positions whose queries are the last keys (a
full pass, a cached step), without left padding (the eager formula takes padded rows), and only
when the encoding adds no other term.

Shape legend: B batch, H heads, Tq queries, Tk keys, D head dim, C block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..encodings.protocol import Biases, QueryTerms, ValueTerms, offers
from .parts import padding
from .parts.base import ScoreSpec

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
    b, h, tq, d = q.shape
    tk = k.shape[-2]
    offset = tk - tq  # query a is key a + offset
    c = spec.cumulative_gates()  # (B, H, Tk), float32 or float64
    if tq == 1:  # a decode step: c_i - c_j as the mask
        decay = (c[..., -1:] - c)[:, :, None, :].to(q.dtype)  # (B, H, 1, Tk)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=decay, scale=spec.scale)
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
        feature = ((ref - c[..., :end]) / spec.scale).to(k.dtype)[..., None]  # (B, H, end, 1)
        kf = torch.cat([k[:, :, :end], feature], -1)  # (B, H, end, D + 1)
        allowed = keys[None, :end] <= torch.arange(a0 + offset, a1 + offset, device=q.device)[:, None]  # (C, end)
        o = F.scaled_dot_product_attention(qf[:, :, a0:a1], kf, vf[:, :, :end], attn_mask=allowed, scale=spec.scale)
        outs.append(o[..., :d])
    return torch.cat(outs, -2)  # (B, H, Tq, D)
