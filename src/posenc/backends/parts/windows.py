"""Which keys a query sees beyond the causal mask, and what else its softmax holds: sliding windows,
chunked attention and attention sinks, for one backend call on 1-D positions.

Definitions (i the query's position, j a key's; W the window, C the chunk size):

- **Sliding window** (Beltagy et al. 2020, "Longformer", §3.1; Mistral 7B; Gemma 2/3): a causal
  query sees the keys with ``i - W < j <= i`` (W keys, itself included, as Hugging Face's
  ``sliding_window_overlay`` ``kv_idx > q_idx - W``); a bidirectional query (an encoder,
  ModernBERT's local layers) sees ``|i - j| <= W // 2``, so W is the total width.
- **Chunked attention** (Llama 4): positions are cut into chunks of C, ``[cC, (c + 1)C)``; a query
  sees the keys of its own chunk (causal: up to itself). Positions stay global: a rotation uses i.
- **Logit soft-capping** (Gemma 2, Gemma Team 2024, §2): the content score s = q . k * scale
  becomes ``cap * tanh(s / cap)`` before the position terms and masks are added, so no content
  logit leaves (-cap, cap).
- **Attention sinks** (Xiao et al. 2024, "StreamingLLM"; gpt-oss, OpenAI 2025 model card): one
  learned logit s_h per head joins each softmax row with no value,
  ``p_ij = exp(z_ij) / (exp(s_h) + sum_j exp(z_ij))``; an output is thus the plain output times
  ``sigmoid(lse_i - s_h)``. Per-query sinks (Inkling-2: s_{b,h,i} computed from each token's
  layer input by ``sink_proj``) are the same term with one logit per row.
- **Forget gates** (FoX, ``spec.log_gates``) travel with their keys: a causal block's key range
  holds each of its queries' own key, so the block's gates summed from its first key give the same
  c_i - c_j (Lin et al. 2025, eq. 4) as the call's; a window, chunks, sinks or a soft cap then apply to
  the decayed scores as to any other score term (the block formula, or a plain block's backend call).
- **Bias curves** (the Inkling bias, ``spec.curves``) travel with their queries: each block's
  call gets its queries' rows, so a window, chunks or sinks take them as any other query term. A
  window and/or sinks with curves on a call the ``curved`` backend runs (consecutive, aligned, no
  padding) go to it whole (:func:`posenc.backends.curved.attend_extras`: no (Tq, Tk) tensor).

How one call runs (shape legend: B batch, H heads, Tq queries, Tk keys, D head dim; L a block):

- The queries are cut into blocks; each block gets the contiguous key range its queries can see
  (found by bisection on the positions, so any increasing positions work).
- A block whose every query sees *all* of its range but for the call's own causal mask (a chunk;
  the queries of a window that does not cut yet; a single decode query, whose window is just the
  last W cached keys) is an ordinary backend call on that range: every backend and its fast paths
  apply, decode steps included, at O(L x range).
- Before any of that, a causal window that cuts, on a full pass or a prefill of consecutive
  positions, with no sinks, no query or value terms and at most a relative bias no gradient reaches
  (RoPE, NoPE, ALiBi; float32 or float64 on CPU), under ``backend="auto"``, runs whole through
  :mod:`posenc.backends.parts.sliding`: blocks of C < W queries, each against the W - 1 keys before
  its first (the window's edge as a broadcast mask) and its own C keys (the kernel's causal mask),
  each of the two one flash-kernel call batched over the blocks: O(Tq x W) work, no per-block mask.
- Any other block (a window that cuts, and every block when there are sinks) runs the block formula
  written out: ``softmax(q k^T * scale + bias + query_terms + mask [, sink]) v + value_terms`` with
  the window as one more mask: through SDPA with a bool mask when there are no score terms and no
  sinks; through SDPA with the block's bias as an additive mask, and each sink as one more key of
  zeros whose mask entry is s_h, when there are no query or value terms (float32 and float64);
  else (query or value terms, half precision) through the eager formula. A window block is max(W, 64) queries against at most
  max(W, 64) + W - 1 keys, so the whole call costs O(Tq x W) time and memory; no (Tq, Tk) tensor
  is made unless a block is the whole call.

The result equals the eager formula with the explicit (Tq, Tk) mask, outputs and gradients
(tests/backends/parts/test_windows.py checks it in float64 for every encoding).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ...call.spec import ScoreSpec
from ...encodings.protocol import Biases, ValueTerms, require
from ...encodings.query_scale import QueryScale, check_query_scale
from ...errors import UsageError, check_window_chunk
from .. import curved
from . import sliding
from .base import accumulation_dtype
from .regions import repeated_heads

MIN_BLOCK = 64  # queries per block of a window; more when the window is wider


@dataclass(frozen=True)
class Extras:
    """What one attention layer adds to its calls beyond the encoding.

    Args:
        window: sliding window W (see the module docstring), or None.
        chunk: chunk size C, or None (at most one of window and chunk).
        sinks: (H,) logits, one per query head, or (B, H, Tq) per-query logits (one per softmax
            row, in the call's query order), or None.
        query_scale: a per-query factor (:mod:`posenc.encodings.query_scale`), or None.
        softcap: the logit cap (> 0) of the content scores (see the module docstring), or None.
    """

    window: int | None = None
    chunk: int | None = None
    sinks: torch.Tensor | None = None
    query_scale: QueryScale | None = None
    softcap: float | None = None

    def __post_init__(self) -> None:
        check_window_chunk(self.window, self.chunk)
        if self.sinks is not None and (not isinstance(self.sinks, torch.Tensor) or self.sinks.dim() not in (1, 3)
                                       or not self.sinks.is_floating_point()):
            raise UsageError("sinks must be a float tensor of one logit per query head (H,) or per query (batch, heads, "
                             f"queries), got {getattr(self.sinks, 'shape', self.sinks)!r}")
        if self.softcap is not None and (isinstance(self.softcap, bool) or not isinstance(self.softcap, (int, float))
                                         or not math.isfinite(self.softcap) or self.softcap <= 0):
            raise UsageError(f"softcap must be a finite number > 0 or None, got {self.softcap!r}")
        check_query_scale(self.query_scale)

    @property
    def restricts(self) -> bool:
        """The call needs this module (a window, a chunk, sinks or a soft cap); a query scale alone does not."""
        return self.window is not None or self.chunk is not None or self.sinks is not None or self.softcap is not None

    @property
    def written_out(self) -> bool:
        """Every block runs the formula written out (sinks or a soft cap change the softmax itself)."""
        return self.sinks is not None or self.softcap is not None


def bounds(extras: Extras, causal: bool) -> Callable[[int], tuple[float, float]]:
    """position i -> (lowest, highest) key position it may see (the causal mask included)."""
    inf = float("inf")
    w, c = extras.window, extras.chunk
    if w is not None:
        return (lambda i: (i - w + 1, i)) if causal else (lambda i: (i - w // 2, i + w // 2))
    if c is not None:
        return (lambda i: (i // c * c, i)) if causal else (lambda i: (i // c * c, i // c * c + c - 1))
    return (lambda i: (-inf, i)) if causal else (lambda i: (-inf, inf))


def plan(qv: list[int], kv: list[int], extras: Extras, causal: bool) -> list[tuple[int, int, int, int, bool]]:
    """Blocks (q0, q1, k0, k1, plain): queries q0..q1-1 see at most keys k0..k1-1; ``plain``: each
    of them sees every key of that range allowed by the causal mask alone."""
    see = bounds(extras, causal)
    out = []

    def block(a: int, b: int) -> None:
        lo_a, hi_a = see(qv[a])
        lo_b, hi_b = see(qv[b - 1])
        k0, k1 = bisect.bisect_left(kv, lo_a), bisect.bisect_right(kv, hi_b)
        first, last = (kv[k0] if k0 < k1 else 0), (kv[k1 - 1] if k0 < k1 else 0)
        plain = k0 >= k1 or (lo_b <= first and (causal or hi_a >= last))
        out.append((a, b, k0, k1, plain))

    tq = len(qv)
    if extras.chunk is not None:  # one block per chunk: plain by construction
        a = 0
        for t in range(1, tq + 1):
            if t == tq or qv[t] // extras.chunk != qv[a] // extras.chunk:
                block(a, t)
                a = t
        return out
    if extras.window is None:  # sinks or a soft cap on full attention: blocks bound memory, not keys
        for a in range(0, tq, 256):
            block(a, min(a + 256, tq))
        return out
    if tq == 1:
        block(0, 1)
        return out
    size = max(extras.window, MIN_BLOCK)
    a = 0
    if causal and kv:  # the queries whose window does not cut yet: one plain block
        uncut = bisect.bisect_right(qv, kv[0] + extras.window - 1)
        if uncut:
            block(0, uncut)
            a = uncut
    for t in range(a, tq, size):
        block(t, min(t + size, tq))
    return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec, extras: Extras, backend: str,
           call: Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor, ScoreSpec], tuple[torch.Tensor, str]]) -> tuple[torch.Tensor, str]:
    """(out (B, H, Tq, D), backend name) for q (B, H, Tq, D), k/v (B, Hkv, Tk, D), already rotated.

    ``call(backend, q, k, v, spec)`` is the ordinary backend call, grouped heads included
    (:func:`posenc.backends.attend`), used for the plain blocks.
    """
    tq, h = q.shape[-2], q.shape[1]
    sinks = extras.sinks
    if sinks is not None and sinks.dim() == 1 and sinks.numel() != h:
        raise UsageError(f"sinks must hold one logit per query head ({h}), got {sinks.numel()}")
    if sinks is not None and sinks.dim() == 3 and (sinks.shape[1:] != (h, tq) or sinks.shape[0] not in (1, q.shape[0])):
        raise UsageError(f"per-query sinks must have shape (batch, heads, queries) = {(q.shape[0], h, tq)}, got {tuple(sinks.shape)}")
    if tq == 0:
        return q.new_zeros(*q.shape[:-1], v.shape[-1]), "eager"
    window = extras.window
    if spec.curves is not None and extras.chunk is None and extras.softcap is None and backend in ("auto", "curved") \
            and curved.supports(spec, q):  # bias curves in a window and/or with sinks: the band written out, no blocks here
        if k.shape[1] != h:
            k, v = repeated_heads(k, v, h)
        rows = None if sinks is None else sinks.view(1, h, 1).expand(1, h, tq) if sinks.dim() == 1 else sinks  # (B or 1, H, Tq)
        return curved.attend_extras(q, k, v, spec, window, rows), "curved"
    if backend == "auto" and window is not None and not extras.written_out:
        out = sliding.attend(q, k, v, spec, window)  # batched flash-kernel calls, as blocked's; None: not this path
        if out is not None:
            return out, "blocked"
    qv, kv = spec.q_positions.tolist(), spec.k_positions.tolist()
    group = h // k.shape[1]
    outs, name = [], "eager"
    for q0, q1, k0, k1, plain in plan(qv, kv, extras, spec.causal):
        qp, kp = spec.q_positions[q0:q1], spec.k_positions[k0:k1]
        rows = None if spec.curves is None else spec.curves[:, :, q0:q1]  # (B, H, L, R): these queries' curves
        gates = None if spec.log_gates is None else spec.log_gates[..., k0:k1]  # (B, H, Lk): these keys' gates
        sub = spec.part(qp, kp, padded=True, q_start=qv[q0], k_start=kv[k0] if k1 > k0 else 0, curves=rows, log_gates=gates)
        qb, kb, vb = q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1]
        if plain and not extras.written_out and k1 > k0:
            o, name = call(backend, qb, kb, vb, sub)
        else:
            if group > 1:
                kb, vb = repeated_heads(kb, vb, h)  # (B, H, L, D)
            allowed = visible(qp, kp, extras, spec.causal)  # (Lq, Lk)
            o, name = formula(qb, kb, vb, sub, allowed, sinks if sinks is None or sinks.dim() == 1 else sinks[:, :, q0:q1],
                              extras.softcap)
        outs.append(o)
    return torch.cat(outs, dim=-2), name


def visible(q_positions: torch.Tensor, k_positions: torch.Tensor, extras: Extras, causal: bool) -> torch.Tensor:
    """(Tq, Tk) bool, True where a query may see a key: the causal mask, the window, the chunk."""
    i, j = q_positions[:, None], k_positions[None, :]
    ok = (j <= i) if causal else torch.ones(i.shape[0], j.shape[1], dtype=torch.bool, device=i.device)
    if extras.window is not None:
        ok = ok & ((j > i - extras.window) if causal else ((i - j).abs() <= extras.window // 2))
    if extras.chunk is not None:
        ok = ok & (torch.div(j, extras.chunk, rounding_mode="floor") == torch.div(i, extras.chunk, rounding_mode="floor"))
    return ok


def formula(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec, allowed: torch.Tensor,
            sinks: torch.Tensor | None, softcap: float | None = None) -> tuple[torch.Tensor, str]:
    """The attention of one block written out, ``allowed`` (Lq, Lk) as its mask; q, k, v (B, H, L, D)
    with as many key heads as query heads; ``sinks`` (H,) or these queries' (B or 1, H, Lq).
    (out (B, H, Lq, D), "sdpa" or "eager")."""
    hidden = spec.hidden()  # (B, 1, Lq, Lk) left padding, or None
    if spec.plain and sinks is None and softcap is None:
        mask = allowed if hidden is None else allowed & ~hidden
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=spec.scale), "sdpa"
    enc, qp, kp = spec.encoding, spec.q_positions, spec.k_positions
    if softcap is None and not (spec.has_query_terms or spec.has_value_terms) and q.dtype in (torch.float32, torch.float64):
        # A bias and/or sinks only: the fused kernel with an additive mask (its gradient reaches the
        # bias and the sinks). A sink is one more key of zeros whose mask entry is s_h and whose
        # value is zero: exactly the term the softmax needs. Half precision keeps the eager formula,
        # whose scores are accumulated in float32.
        b, h, lq, _ = q.shape
        mask = require(enc, Biases).bias(qp, kp).to(q.dtype) if spec.has_bias else q.new_zeros(1, lq, kp.numel())  # (H or 1, Lq, Lk)
        mask = mask.masked_fill(~allowed, float("-inf"))[None]  # (1, H or 1, Lq, Lk)
        if hidden is not None:
            mask = mask.masked_fill(hidden, float("-inf"))  # (B, H or 1, Lq, Lk)
        if sinks is not None:
            mask = mask.expand(mask.shape[0], h, lq, kp.numel())
            sink = _sink_column(sinks, h, lq).to(q.dtype)  # (B or 1, H, Lq, 1)
            rows = max(mask.shape[0], sink.shape[0])
            mask = torch.cat((mask.expand(rows, h, lq, -1), sink.expand(rows, h, lq, 1)), dim=-1)  # (B or 1, H, Lq, Lk + 1)
            k = torch.cat((k, k.new_zeros(b, h, 1, k.shape[-1])), dim=-2)
            v = torch.cat((v, v.new_zeros(b, h, 1, v.shape[-1])), dim=-2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=spec.scale), "sdpa"
    acc = accumulation_dtype(q.dtype)
    scores = torch.matmul(q, k.transpose(-1, -2)).to(acc) * spec.scale  # (B, H, Lq, Lk)
    if softcap is not None:  # on the content score only; position terms and masks add after
        scores = torch.tanh(scores / softcap) * softcap
    if spec.has_bias:
        scores = scores + require(enc, Biases).bias(qp, kp).to(acc)
    if spec.has_query_terms:
        scores = scores + spec.query_terms(q, k, qp).to(acc)  # the encoding's terms and the curves
    scores = scores.masked_fill(~allowed, float("-inf"))
    if hidden is not None:
        scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:  # one more logit per head, with no value
        b, h, lq, _ = scores.shape
        sink = _sink_column(sinks, h, lq).to(acc).expand(b, h, lq, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1].to(q.dtype)
    else:
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.matmul(probs, v)  # (B, H, Lq, D)
    if spec.has_value_terms:
        out = out + require(enc, ValueTerms).value_terms(probs, qp, kp).to(out.dtype)
    return out, "eager"


def _sink_column(sinks: torch.Tensor, h: int, lq: int) -> torch.Tensor:
    """The sinks as one more column of logits: (1, H, 1, 1) for (H,) sinks, (B, H, Lq, 1) per query."""
    return sinks.view(1, h, 1, 1) if sinks.dim() == 1 else sinks[..., None]


__all__ = ["Extras", "attend", "bounds", "formula", "plan", "visible"]
