"""The textbook formula: the reference for tests, and the path for methods that move values.

``softmax(q k^T * scale + bias + query_terms + mask) v + value_terms``, written out, walked over
blocks of ``BLOCK`` queries so that memory stays O(Tk x block) rather than O(Tq x Tk): each block
gets its bias slice and its score terms from the encoding for those queries only. When a gradient
is needed, every block is checkpointed (recomputed in the backward), otherwise autograd would
keep every block's probabilities and the saving would be lost. A softmax row only ever sees its
own query, so blocking changes nothing in the result. Left padding (``spec.starts``) is one more
mask: a real query never sees a padding key. Per-key log gates (``spec.log_gates``, the Forgetting
Transformer) are summed once per call (float32, or float64) and each block takes its differences
c_i - c_j. Selective attention's penalty (the selection summed over earlier queries) is computed
once per call from all of its queries, (B, Tq, Tk) for the one selecting head, and each block
takes its rows. Eager is the reference: it has no single-query path.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ..encodings.protocol import ValueTerms, require
from ..errors import UsageError
from .parts.base import ScoreSpec, accumulation_dtype, needs_grad

BLOCK = 256  # query rows per block


def supports(spec: ScoreSpec, q: torch.Tensor) -> bool:
    return True


def preferred(spec: ScoreSpec, q: torch.Tensor) -> bool:
    return True  # the last resort: runs everything


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, spec: ScoreSpec,
           cumulative: torch.Tensor | None = None, penalty: torch.Tensor | None = None) -> torch.Tensor:
    """The formula for queries ``q`` (B, H, C, D) at ``q_positions`` (C,) against every key
    (``cumulative``: the summed log gates of a gated call, :meth:`ScoreSpec.cumulative_gates`;
    ``penalty`` (B, C, Tk): these queries' rows of a selective call's :meth:`ScoreSpec.selection_penalty`)."""
    enc, k_positions = spec.encoding, spec.k_positions
    acc = accumulation_dtype(q.dtype)
    scores = torch.matmul(q, k.transpose(-1, -2)).to(acc) * spec.scale  # (B, H, C, Tk)
    if spec.has_bias:
        # The whole query range goes through the spec: T5's bias is then built once for all layers.
        bias = spec.bias(q_positions)  # (H, C, Tk)
        scores = scores + bias.to(acc)
    if spec.has_query_terms:
        scores = scores + spec.query_terms(q, k, q_positions, cumulative, penalty).to(acc)  # (B, H, C, Tk)
    if spec.causal:
        scores = scores.masked_fill(k_positions[None, :] > q_positions[:, None], float("-inf"))
    hidden = spec.hidden(q_positions)  # left padding: a real query never sees a padding key
    if hidden is not None:
        scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)  # (B, H, C, Tk)
    out = torch.matmul(probs, v)  # (B, H, C, D)
    if spec.has_value_terms:
        out = out + require(enc, ValueTerms).value_terms(probs, q_positions, k_positions).to(out.dtype)
    return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec, block: int | None = None) -> torch.Tensor:
    block = BLOCK if block is None else block
    if block < 1:
        raise UsageError(f"block must be a positive integer, got {block}")
    tq = q.shape[-2]
    cumulative = None if spec.log_gates is None else spec.cumulative_gates()  # (B, H, Tk), once for all blocks
    # Selective attention: every query's sum over the queries before it, from all of the call's (B, Tq, Tk).
    penalty = spec.selection_penalty(q, k) if spec.selective else None
    if tq <= block:
        return _block(q, k, v, spec.q_positions, spec, cumulative, penalty)
    grad = needs_grad(spec, q, k, v) or (cumulative is not None and cumulative.requires_grad)
    outs = []
    for t0 in range(0, tq, block):
        rows = None if penalty is None else penalty[:, t0 : t0 + block]
        args = (q[:, :, t0 : t0 + block], k, v, spec.q_positions[t0 : t0 + block], spec, cumulative, rows)
        outs.append(checkpoint(_block, *args, use_reentrant=False) if grad else _block(*args))
    return torch.cat(outs, dim=-2)  # (B, H, Tq, D)
