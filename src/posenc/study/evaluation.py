"""Scoring a trained model on the validation bytes in windows of one length.

The same validation targets are scored at every length, each exactly once: non-overlapping windows
(the paper's main setting) or sliding ones whose extra context is not scored twice. A bounded
method (a learned position table) is not run past its table; its row says why.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from . import distributed, recall
from .events import Report, WindowsScored, ignore

# Memory bounds for evaluation batches: tokens per forward, and attention scores per forward
# (batch x heads x L x L), so long windows are scored a few at a time.
EVAL_TOKENS = 16384
EVAL_SCORES = 2**25


class _Heads(Protocol):
    @property
    def num_heads(self) -> int: ...


class Scored(Protocol):
    """What the evaluation reads of a model: posenc's :class:`~posenc.model.lm.LM`, posenc.hf's
    ``StudyModel``, or posenc.study.hf_evaluation's view of a transformers model. Called as
    ``model(ids)`` or ``model(ids, positions=...)``: logits (B, L, vocab)."""

    @property
    def config(self) -> _Heads: ...

    def __call__(self, ids: torch.Tensor, **kwargs: Any) -> torch.Tensor: ...

    def eval(self) -> object: ...


class Bounded(Protocol):
    """A model that may have a bounded position table (``max_length``: its rows, or None)."""

    @property
    def max_length(self) -> int | None: ...


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


def cannot_run(model: Bounded, length: int) -> str | None:
    """Why ``model`` cannot score windows of ``length`` (a bounded position table), or None."""
    limit = model.max_length
    if limit is not None and length > limit:
        return f"cannot run past {limit}: its position table has {limit} rows"
    return None


EVAL_POSITIONS_SEED = 9_001  # the draws of randomized positions at evaluation (fixed: every row sees the same)


def eval_positions(model: Scored, length: int, batch: int, device: torch.device | str) -> torch.Tensor | None:
    """Positions for one evaluation batch of a model trained with randomized positions (Ruoss et al.
    2023): as in training, a sorted draw of ``length`` distinct positions from [0, random_positions),
    shared by the batch. The authors' code applies the randomized encoding at test time too; the
    draw here comes from a generator seeded by the batch's index, so every run scores the same
    windows at the same positions. None for any other model (positions 0..length-1)."""
    limit = getattr(model.config, "random_positions", None)  # a model without the field (posenc.hf's view) has plain positions
    if limit is None:
        return None
    g = torch.Generator().manual_seed(EVAL_POSITIONS_SEED + batch)
    return torch.randperm(limit, generator=g)[:length].sort().values.to(device)  # (length,)


def _forward(model: Scored, ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """``model(ids)``, with ``positions`` only when there are some: a model that takes none (an HF
    model's view, posenc.study.hf_evaluation) is scored at positions 0..L-1."""
    return model(ids) if positions is None else model(ids, positions=positions)


def batch_size_for(length: int, num_heads: int) -> int:
    """Windows per forward: within EVAL_TOKENS tokens and EVAL_SCORES attention scores."""
    return max(1, min(EVAL_TOKENS // length, EVAL_SCORES // (num_heads * length * length)))


@torch.inference_mode()
def evaluate(model: Scored, valid: torch.Tensor, length: int, stride: int | None, ctx: distributed.Context,
             report: Report = ignore) -> dict[str, Any]:
    """Mean NLL of the validation targets scored in windows of ``length``; every target once.

    Returns loss, perplexity, bits_per_byte, tokens, and ``windows``: per window (in order), the
    NLL sum of its scored targets and their count, for the bootstrap (:mod:`.bootstrap`).

    Args:
        valid: (N + 1,) uint8 bytes: inputs, and the N targets they predict.
        length: window length (clipped to N).
        stride: distance between window ends; None: ``length`` (non-overlapping).
        ctx: this process's place; windows are dealt round-robin and the sums all-reduced.
        report: gets a :class:`~.events.WindowsScored` after every batch (this process's windows).
    """
    total = valid.numel() - 1
    length = min(length, total)
    every = windows(total, length, stride or length)
    mine = list(range(len(every)))[ctx.rank :: ctx.world]
    per_batch = batch_size_for(length, model.config.num_heads)
    # Per window: the NLL summed over its scored targets, and their number (the bootstrap's units).
    sums = torch.zeros(2, len(every), dtype=torch.float64, device=ctx.device)
    offsets = torch.arange(length + 1)
    model.eval()
    for i in range(0, len(mine), per_batch):
        index = mine[i : i + per_batch]
        chunk = [every[w] for w in index]
        starts = torch.tensor([b for b, _ in chunk])
        ids = valid[starts[:, None] + offsets].long().to(ctx.device)  # (B, L + 1)
        logits = _forward(model, ids[:, :-1], eval_positions(model, length, i, ctx.device))  # (B, L, 256)
        token_nll = F.cross_entropy(logits.transpose(1, 2).float(), ids[:, 1:], reduction="none")  # (B, L)
        first = torch.tensor([s for _, s in chunk], device=ctx.device)
        keep = torch.arange(length, device=ctx.device)[None, :] >= first[:, None]  # (B, L)
        at = torch.tensor(index, device=ctx.device)
        sums[0, at] = (token_nll.double() * keep).sum(dim=1)
        sums[1, at] = keep.sum(dim=1).double()
        report(WindowsScored(i + len(chunk), len(mine)))
    distributed.all_sum(ctx, sums)  # each window was scored by one process
    nll, count = float(sums[0].sum()), int(sums[1].sum())
    loss = nll / count
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "bits_per_byte": loss / math.log(2),
        "tokens": count,
        "windows": {"nll": sums[0].tolist(), "count": [int(c) for c in sums[1].tolist()]},
    }


@torch.inference_mode()
def evaluate_recall(model: Scored, length: int, train_length: int, count: int, ctx: distributed.Context,
                    report: Report = ignore) -> dict[str, dict[str, Any]]:
    """Exact-match accuracy of the recall answers at ``length``, per distance class.

    Only the answers are scored: the prediction at each query key (the argmax over the whole
    vocabulary) against the value that followed that key in its pair. ``report`` gets a
    :class:`~.events.WindowsScored` after every batch (sequences, this process's share).

    Returns:
        {class: {"accuracy", "queries", "distance_min", "distance_max", "windows": {"correct",
        "count"}}} with one window per sequence (the bootstrap's units).
    """

    out: dict[str, dict[str, Any]] = {}
    per_batch = batch_size_for(length, model.config.num_heads)
    model.eval()
    done, total = 0, len(recall.CLASSES) * len(range(ctx.rank, count, ctx.world))
    for cls in recall.CLASSES:
        tokens, answers, distances = recall.eval_set(length, cls, count, train_length)
        mine = list(range(count))[ctx.rank :: ctx.world]
        correct = torch.zeros(count, dtype=torch.float64, device=ctx.device)
        for i in range(0, len(mine), per_batch):
            index = torch.tensor(mine[i : i + per_batch])
            ids = tokens[index].to(ctx.device)  # (B, T + 1)
            at = answers[index].to(ctx.device)  # (B, Q)
            logits = _forward(model, ids[:, :-1], eval_positions(model, ids.shape[1] - 1, i, ctx.device))  # (B, T, vocab)
            rows = torch.arange(len(index), device=ctx.device)[:, None]
            guess = logits[rows, at].argmax(dim=-1)  # (B, Q)
            correct[index.to(ctx.device)] = (guess == ids[rows, at + 1]).sum(dim=1).double()
            done += len(index)
            report(WindowsScored(done, total))
        distributed.all_sum(ctx, correct)
        queries = answers.shape[1]
        out[cls] = {
            "accuracy": float(correct.sum()) / (count * queries),
            "queries": count * queries,
            "distance_min": int(distances.min()),
            "distance_max": int(distances.max()),
            "windows": {"correct": [int(c) for c in correct.tolist()], "count": [queries] * count},
        }
    return out
