"""Scoring a trained model on the validation bytes in windows of one length.

The same validation targets are scored at every length, each exactly once: non-overlapping windows
(the paper's main setting) or sliding ones whose extra context is not scored twice. A bounded
method (a learned position table) is not run past its table; its row says why.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from .. import distributed
from ..model import LM

# Memory bounds for evaluation batches: tokens per forward, and attention scores per forward
# (batch x heads x L x L), so long windows are scored a few at a time.
EVAL_TOKENS = 16384
EVAL_SCORES = 2**25

# Called after every evaluation batch as on_batch(windows_done, windows_total) (this process's share).
BatchCallback = Callable[[int, int], None]


def windows(total: int, length: int, stride: int) -> list[tuple[int, int]]:
    """(start, first scored offset) of each window of ``length`` inputs over ``total`` targets.

    Window ends advance by ``stride``; each window scores only the targets no earlier window
    scored, so every target is predicted exactly once, and the last window is moved back to stay
    a full ``length`` long. stride == length: the paper's non-overlapping evaluation.
    """
    out, scored = [], 0
    end = min(length, total)
    while scored < total:
        begin = max(0, end - length)
        out.append((begin, scored - begin))
        scored = end
        end = min(end + stride, total)
    return out


def cannot_run(model: LM, length: int) -> str | None:
    """Why ``model`` cannot score windows of ``length`` (a bounded position table), or None."""
    limit = model.max_length
    if limit is not None and length > limit:
        return f"cannot run past {limit}: its position table has {limit} rows"
    return None


def batch_size_for(length: int, num_heads: int) -> int:
    """Windows per forward: within EVAL_TOKENS tokens and EVAL_SCORES attention scores."""
    return max(1, min(EVAL_TOKENS // length, EVAL_SCORES // (num_heads * length * length)))


@torch.inference_mode()
def evaluate(model: LM, valid: torch.Tensor, length: int, stride: int | None, ctx: distributed.Context,
             on_batch: BatchCallback | None = None) -> dict:
    """Mean NLL of the validation targets scored in windows of ``length``; every target once.

    Args:
        valid: (N + 1,) uint8 bytes: inputs, and the N targets they predict.
        length: window length (clipped to N).
        stride: distance between window ends; None: ``length`` (non-overlapping).
        ctx: this process's place; windows are dealt round-robin and the sums all-reduced.
    """
    total = valid.numel() - 1
    length = min(length, total)
    wins = windows(total, length, stride or length)[ctx.rank :: ctx.world]
    per_batch = batch_size_for(length, model.config.num_heads)
    nll = torch.zeros(2, dtype=torch.float64, device=ctx.device)  # [sum of NLL, scored targets]
    offsets = torch.arange(length + 1)
    model.eval()
    for i in range(0, len(wins), per_batch):
        chunk = wins[i : i + per_batch]
        starts = torch.tensor([b for b, _ in chunk])
        ids = valid[starts[:, None] + offsets].long().to(ctx.device)  # (B, L + 1)
        logits = model(ids[:, :-1])  # (B, L, 256)
        token_nll = F.cross_entropy(logits.transpose(1, 2).float(), ids[:, 1:], reduction="none")  # (B, L)
        first = torch.tensor([s for _, s in chunk], device=ctx.device)
        keep = torch.arange(length, device=ctx.device)[None, :] >= first[:, None]  # (B, L)
        nll[0] += token_nll[keep].double().sum()
        nll[1] += keep.sum()
        if on_batch is not None:
            on_batch(i + len(chunk), len(wins))
    distributed.all_sum(ctx, nll)
    loss = float(nll[0] / nll[1])
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "bits_per_byte": loss / math.log(2),
        "tokens": int(nll[1]),
    }
