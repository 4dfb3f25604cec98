"""Left padding for the fast backends: a padded call is split into unpadded calls, row by row.

Generation in batches left-pads prompts of different lengths: row b's real tokens start at
position ``starts[b]`` and its keys before it are hidden from its real queries (a padding query sees
the padding before it, see :class:`~posenc.backends.parts.base.ScoreSpec`). For one row that is two
ordinary causal calls, each over consecutive positions whose keys end at its last query: the real
queries against the real keys, the padding queries against the padding keys. So every backend
that can run an unpadded causal call runs a padded one exactly, with no (B, Tq, Tk) mask and no new
kernel: this is the path for several queries (a batched prefill); one query (a decode step) takes
the single-query path, where padding is one additive mask per row (``backends/parts/single.py``).
"""

from __future__ import annotations

from typing import Callable

import torch

from .base import ScoreSpec


def supported(spec: ScoreSpec, *, split: bool = True) -> bool:
    """The padding predicate of every backend's ``supports``: True for a call without left padding,
    and for a padded one that the row split (:func:`by_rows`) can run (causal, the queries are the
    last keys: a prefill or a cached step) when the backend splits padded calls (``split``). A
    backend that takes no padded call at all passes ``split=False``. Reads the spec, fills nothing.
    """
    return spec.starts is None or (split and spec.causal and spec.aligned)


def by_rows(
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, ScoreSpec], torch.Tensor],
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec,
) -> torch.Tensor:
    """``attend`` (an unpadded backend function) over each row's padding part and real part: (B, H, Tq, D)."""
    qp, kp = spec.q_positions, spec.k_positions
    if spec.starts is None:  # nothing to split
        return attend(q, k, v, spec)
    rows = []
    for b, start in enumerate(spec.starts.tolist()):
        nq = int((qp < start).sum())  # padding queries come first (positions increase)
        nk = int((kp < start).sum())
        parts = []
        for q_part, k_part in ((slice(0, nq), slice(0, nk)), (slice(nq, None), slice(nk, None))):
            q_row = q[b : b + 1, :, q_part]
            if q_row.shape[-2] == 0:
                continue
            part = spec.part(qp[q_part], kp[k_part])
            parts.append(attend(q_row, k[b : b + 1, :, k_part], v[b : b + 1, :, k_part], part))
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2))
    return torch.cat(rows, dim=0)  # (B, H, Tq, D)


__all__ = ["by_rows", "supported"]
