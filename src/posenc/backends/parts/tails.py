"""The plan of the ``blocked`` backend for a bias with affine tails: which kernel calls and which
band blocks cover every (query, key) pair exactly once.

See :mod:`posenc.backends.blocked` for the method. Here: how heads are grouped by slope, how far
blocks and windows are sized (precision and exact zeros), and each far call's per-key term and
per-query constant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ...encodings.protocol import RelativeBias, require
from ...errors import UsageError
from . import band
from .base import ScoreSpec
from .regions import Region, kv_heads_of, lower, up, upper

BAND_BLOCK = 64  # query rows per explicit band block: the band is BAND_BLOCK + P - 1 keys wide
TERM_SPAN = 64.0  # a sloped far block is at most TERM_SPAN / max|slope| queries (blocked.py: Precision)
MIN_GROUP_HEADS = 2  # heads per far call at least (the kernel's backward runs one head, or one key/value head, per thread)
ZERO_LOGIT = 110.0  # exp(-ZERO_LOGIT) is below 2^-150: a probability that rounds to 0 in float32
BAND_WINDOW = 1024  # steep heads whose window is at most this many keys, and at most
BAND_SHARE = 2  # 1 / BAND_SHARE of the queries, run as a written-out band (few batched calls)


def spread(q: torch.Tensor, k: torch.Tensor, scale: float) -> float:
    """A bound on |q_i . k_j| x scale over all pairs (Cauchy-Schwarz): what content can add to a
    logit, so far keys whose bias is lower by more than this (and then some) weigh nothing."""
    with torch.no_grad():
        bound = float(q.detach().float().norm(dim=-1).max() * k.detach().float().norm(dim=-1).max()) * scale
    if not math.isfinite(bound):
        raise UsageError("q and k must be finite: the queries or keys hold inf or NaN (diverged weights or inputs?); "
                         "the blocked and gated backends plan their kernel calls from their size")
    return bound


# ---------------------------------------------------------------------------------------------
# TailPlan: which kernel calls and which band blocks cover every (query, key) pair exactly once


@dataclass
class FarCall:
    region: Region
    side: int  # 0: past (r <= -past), 1: future (r >= future)
    ref: int  # key position the per-key term s (j - ref) is measured from
    heads: slice = field(default_factory=lambda: slice(None))  # the heads it covers (similar slopes)

    @property
    def causal(self) -> bool:
        return self.region.causal

    @property
    def flip(self) -> bool:
        return self.region.flip


@dataclass
class TailPlan:
    far: list[FarCall]
    bands: list[band.BandGroup]
    q_start: int  # absolute position of query 0 and of key 0
    k_start: int
    scale: float
    causal: bool
    past: int  # far past: r <= -past
    future: int  # far future: r >= future (encoders)
    slopes: tuple[torch.Tensor | None, torch.Tensor | None]  # past, future
    r_lo: int  # the rel vector holds f(r) for r = r_lo .. r_hi
    r_hi: int
    cache: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)  # band bias per block geometry


def head_groups(
    slope: torch.Tensor | None, dtype: torch.dtype, tq: int, block: int | None, spread: float | None, past: int,
) -> list[tuple[slice, int | None, int | None]]:
    """(heads, rows per far block, window) per group of heads.

    Rows: all of them for a constant tail or float64, else the largest power of two with |s| x rows
    <= TERM_SPAN (at least 16), so steep heads walk small blocks and gentle ones large blocks.
    Window (a tail that starts at the diagonal, past == 0, when ``spread`` bounds |q.k| x scale):
    keys more than (ZERO_LOGIT + 2 spread) / |s| before the query weigh less than 2^-150 of the
    diagonal key, exactly zero in float32, and are left out. Contiguous heads with the same block
    form a group; groups keep at least MIN_GROUP_HEADS heads, since the CPU kernel's backward runs
    one head per thread.
    """
    if block is not None or slope is None or dtype == torch.float64:
        return [(slice(None), block, None)]
    runs: list[tuple[int, int, int, float]] = []  # (first head, last head + 1, rows, smallest |s|)
    for h, s in enumerate(slope.abs().tolist()):
        rows = 16
        while rows * 2 * s <= TERM_SPAN and rows < tq:
            rows *= 2
        if runs and (runs[-1][2] == rows or runs[-1][1] - runs[-1][0] < MIN_GROUP_HEADS):
            h0, _, r0, s0 = runs[-1]
            runs[-1] = (h0, h + 1, min(r0, rows), min(s0, s))
        else:
            runs.append((h, h + 1, rows, s))
    if len(runs) > 1 and runs[-1][1] - runs[-1][0] < MIN_GROUP_HEADS:  # a lone last head joins the one before
        last = runs.pop()
        h0, _, r0, s0 = runs[-1]
        runs[-1] = (h0, last[1], min(r0, last[2]), min(s0, last[3]))
    groups = []
    for h0, h1, rows, s in runs:
        window = None
        if past == 0 and spread is not None and s > 0:
            window = int((ZERO_LOGIT + 2 * spread) / s) + 1
        groups.append((slice(h0, h1), None if rows >= tq else rows, window))
    return groups


def grouped(plan: TailPlan, h: int, hkv: int) -> bool:
    """The calls of the plan can take the grouped keys and values as they are: every far call and
    band block takes whole groups of query heads (those that share a key/value head, h / hkv of
    them: :func:`~posenc.backends.parts.regions.kv_heads_of`), and every far call at least
    MIN_GROUP_HEADS key/value heads: the kernel's backward runs one key/value head
    per thread when they are grouped, so a far call of one would run on one thread (band blocks are
    batched, which keeps the threads busy)."""
    for heads in [b.heads for b in plan.bands]:
        if kv_heads_of(heads, h, hkv) is None:
            return False
    for call in plan.far:
        kvs = kv_heads_of(call.heads, h, hkv)
        if kvs is None or kvs.stop - kvs.start < MIN_GROUP_HEADS:
            return False
    return True


def make_plan(spec: ScoreSpec, tq: int, tk: int, dtype: torch.dtype = torch.float32, block: int | None = None,
              spread: float | None = None) -> TailPlan:
    tails = require(spec.encoding, RelativeBias).bias_tails()
    slopes = (tails.past_slope, tails.future_slope)
    past = tails.past
    future = max(tails.future, 1 - past)  # r = 0 belongs to one side only
    qs, ks = spec.q_start, spec.k_start
    rows = BAND_BLOCK if block is None else block
    far, bands = [], []
    # Far past: query a sees key b when b <= a + qs - ks - past. ref: the boundary key of the middle row.
    for heads, far_rows, window in head_groups(slopes[0], dtype, tq, block, spread, past):
        if window is not None and window <= BAND_WINDOW and BAND_SHARE * window <= tq and spec.causal:
            # Steep heads: every key that weighs anything is within the window, so their whole
            # attention is a band of window + 1 distances, written out exactly and batched (few
            # calls where far calls would be many; a band of half the queries or more costs more
            # than the windowed far calls, whose mask is one vector, not a block of biases).
            bands += band.plan_band(tq, tk, qs, ks, window + 1, 0, rows, heads)
            continue
        for region in lower(tq, tk, qs - ks - past, far_rows, window):
            far.append(FarCall(region, 0, qs + sum(region.rows) // 2 - past, heads))
    if not spec.causal:  # far future: b >= a + qs - ks + future
        for heads, far_rows, window in head_groups(slopes[1], dtype, tq, block, spread, 1 - future):
            for region in upper(tq, tk, qs - ks + future, far_rows, window):
                far.append(FarCall(region, 1, qs + sum(region.rows) // 2 + future, heads))
    bands += band.plan_band(tq, tk, qs, ks, past, 0 if spec.causal else future - 1, rows)
    reach = max([past, *(g.past for g in bands)])
    width = rows if bands else 1
    return TailPlan(
        far, bands, qs, ks, spec.scale, spec.causal, past, future, slopes,
        r_lo=-(reach + width), r_hi=future + width, cache=spec.memo.table(spec.encoding, "band_bias", (), dict),
    )


def far_terms(plan: TailPlan, rel: torch.Tensor, call: FarCall) -> tuple[torch.Tensor | None, torch.Tensor, int]:
    """A far call's per-key term s (j - ref) (h, L), original key order (None for a constant tail),
    its per-query constant (h, C), original row order, and the rel index of its intercept f(r0)."""
    slope = plan.slopes[call.side]
    r0 = -plan.past if call.side == 0 else plan.future
    i = plan.q_start + torch.arange(*call.region.rows, device=rel.device)  # (C,) query positions
    # f(r) = f(r0) + s (j - i - r0) = [s (j - ref)] + [f(r0) + s (ref - r0 - i)]
    shift = up(rel[call.heads, r0 - plan.r_lo])[:, None].expand(-1, i.numel())  # (h, C)
    term = None
    if slope is not None:
        s = up(slope[call.heads])[:, None]  # (h, 1)
        shift = shift + s * (call.ref - r0 - i)[None, :]
        j = plan.k_start + torch.arange(*call.region.keys, device=rel.device)  # (L,) key positions
        term = s * (j - call.ref)[None, :]  # (h, L)
    return term, shift, r0 - plan.r_lo


