"""Position parameters a model uses at an evaluation length but never trained.

A learned position parameter that no training sequence reached keeps its initial value: T5's buckets
for distances beyond the training length (with ``max_distance`` above it), the rows of a learned table
past the training length, Shaw's rows for clipped distances the training length never spans. When an
evaluation length reaches them, the model's output depends on random numbers from its
initialization, and the study would be measuring its set-up rather than the method.

The check, for any encoding (no list of names): an element of an encoding's parameter is

- *used* at length L when one forward and backward pass over a sequence of L tokens gives it a
  non-zero gradient (masked entries, such as a causal model's future distances, get none), and
- *untrained* when it still equals its value at initialization (the initial model is rebuilt from the
  seed; AdamW with no weight decay on encoding parameters leaves an element without gradient
  exactly unchanged).

The report lists, per parameter, the rows (first index: bucket, position, clipped distance) holding
an element that is both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..encodings.base import PositionalEncoding
from .studied import StudiedModel


def position_parameters(model: StudiedModel) -> dict[str, torch.nn.Parameter]:
    """name -> parameter, for the parameters of the model's encodings (each shared one once)."""
    owned = {id(p) for m in model.modules() if isinstance(m, PositionalEncoding) for p in m.parameters()}
    return {name: p for name, p in model.named_parameters() if id(p) in owned}


def ranges(values: list[int]) -> str:
    """'3, 5-9, 12' for [3, 5, 6, 7, 8, 9, 12]."""
    out: list[str] = []
    start: int | None = None
    prev: int | None = None
    for v in sorted(values):
        if start is None or prev is None:  # (set together)
            start = prev = v
        elif v == prev + 1:
            prev = v
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = v
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ", ".join(out)


def untrained_used(model: StudiedModel, initial: StudiedModel, tokens: torch.Tensor) -> list[dict] | None:
    """The position parameters ``model`` uses on ``tokens`` and never trained; None when it has none.

    Args:
        model: the trained model (its gradients are cleared again afterwards).
        initial: the same model at initialization (same parameter names and shapes).
        tokens: (1, L + 1) token ids: the inputs and their next tokens.
    Returns:
        [{"parameter", "rows" ('27-31'), "count" (rows), "of" (rows in the parameter)}], empty when
        every used element was trained.
    """
    params = position_parameters(model)
    if not params:
        return None
    start = dict(initial.named_parameters())
    was_training = model.training
    model.eval()
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        logits = model(tokens[:, :-1])  # (1, L, vocab)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1)).backward()
    out = []
    for name, p in params.items():
        if p.grad is None:
            continue
        used = p.grad != 0
        same = p.detach() == start[name].detach().to(p.device)
        idle = (used & same).reshape(p.shape[0], -1).any(dim=1) if p.dim() else (used & same).reshape(1)
        rows = torch.nonzero(idle).flatten().tolist()
        if rows:
            out.append({"parameter": name, "rows": ranges(rows), "count": len(rows), "of": p.shape[0] if p.dim() else 1})
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    return out


__all__ = ["position_parameters", "ranges", "untrained_used"]
