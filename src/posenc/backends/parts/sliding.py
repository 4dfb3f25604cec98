"""A causal sliding window as batched flash-kernel calls without a bool mask: O(N x W) work.

Query a (key index a + offset, consecutive positions) sees the keys ``a + offset - W < b <= a +
offset`` (:mod:`posenc.backends.parts.windows`). The queries are cut into blocks of C < W rows, and the keys of a
block into two parts (:func:`plan`): the W - 1 keys before the block, whose edge is one (C, W - 1)
mask broadcast over the blocks, and the block's own C keys, drawn by the kernel's top-left causal
mask. The blocks whose keys all exist have the same shapes, so each part is one kernel call batched
over the blocks, on overlapping windows of k and v (views, :mod:`~posenc.backends.parts.band`);
the few other blocks (the window's start, a short last block) are single calls, the kernel's
staircase on the reversed block drawing their edge.

A block thus costs C x (W + C - 1) pairs, all visible but the C (C - 1) of the two triangles, and
the whole call about N x (W + C) against the full causal call's N^2 / 2; the block formula of
:mod:`posenc.backends.parts.windows` gives the kernel max(W, 64)-row blocks against up to max(W, 64) + W - 1 keys
with a bool mask. The parts of a row are merged through their log-sum-exps
(:class:`~posenc.backends.parts.regions.Merge`), and the backward is each call's flash backward
given the merged output and log-sum-exp (see :mod:`~posenc.backends.parts.regions`), so only q,
k, v, the output and the log-sum-exp are saved.

A relative bias (ALiBi; KERPLE under no grad) is added to each call's mask, its (H, C, L) slice in
call order, the same for every inner block, when no gradient has to reach it (an encoding without
trainable parameters, or no grad): a learned bias keeps the block formula of :mod:`posenc.backends.parts.windows`,
which gives it its gradient.

Shape legend: B batch, H heads, T queries (and keys: a full pass or a prefill after a cache), D
head dim, W window, C rows per block, L keys per block of one part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import band
from .base import ScoreSpec
from .denormals import flushed
from .regions import FLASH_OPS, Merge, Region, apply, call_order, kernel_backward, kernel_forward, keys_of, region_backward, rows_of, upper


def _applies(spec: ScoreSpec, q: torch.Tensor, window: int) -> bool:
    """This path runs a causal window of ``window`` keys on these queries: consecutive positions,
    every query a key (a full pass or a prefill), no padding, no query or value terms, a bias only
    if it is relative (the same for every block) and no gradient reaches it, float32 or float64 on
    a CPU with the flash ops, and a window that cuts (more keys than W)."""
    if not (FLASH_OPS and q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)):
        return False
    if not (spec.causal and spec.contained and spec.starts is None and spec.log_gates is None and spec.curves is None):
        return False
    if spec.has_query_terms or spec.has_value_terms or q.shape[-2] < 2 or window < 2 or spec.k_positions.numel() <= window:
        return False
    if spec.has_bias and not spec.relative_bias:
        return False
    return not (spec.has_bias and torch.is_grad_enabled() and any(p.requires_grad for p in spec.encoding.parameters()))


BLOCK = 64  # rows per block of an inner group (fewer when the window is narrower)


@dataclass(frozen=True)
class Part:
    """One batched kernel call: the inner blocks of ``group`` against a key window each, with the
    kernel's causal mask (``causal``) or the window's edge as its mask (the earlier keys)."""

    group: band.BandGroup
    causal: bool


def plan(tq: int, tk: int, offset: int, window: int, block: int | None = None) -> tuple[list[Part], list[Region]]:
    """(batched parts, lone regions) covering ``{(a, b): a + offset - window < b <= a + offset}`` of
    a (tq, tk) grid, each pair once (``offset >= 0``, ``tk >= tq + offset``, ``window >= 2``).

    Blocks of C < W rows. Block [t0, t0 + C), e = t0 + offset: row t0 + i sees keys
    [e + i - W + 1, e + i], which is two parts:

    - ``earlier``, the W - 1 keys [e - W + 1, e): row i sees those from e - W + 1 + i on (the
      window's edge, the call's mask: a (C, W - 1) triangle of -inf, broadcast over the blocks);
    - ``own``, [e, e + C): the kernel's causal staircase.

    A block is *inner* when it has C rows and all its keys exist; consecutive inner blocks are one
    group of each part (views on overlapping windows, :mod:`~posenc.backends.parts.band`). The first
    blocks (their window starts before key 0) and a short last block are lone regions, the kernel's
    staircase on the reversed block drawing their window's edge.
    """
    c = min(block or BLOCK, window - 1)
    parts: list[Part] = []
    lone: list[Region] = []
    inner: list[int] = []
    for t0 in range(0, tq, c):
        t1, e = min(t0 + c, tq), t0 + offset
        if t1 - t0 == c and e - window + 1 >= 0:
            inner.append(t0)
            continue
        lone.append(Region((t0, t1), (e, e + t1 - t0), True))  # own staircase
        k0 = max(0, e - window + 1)
        if k0 < e:  # row t0 + i sees keys b >= e - window + 1 + i of [k0, e)
            lone += [Region((t0 + r.rows[0], t0 + r.rows[1]), (k0 + r.keys[0], k0 + r.keys[1]), r.causal, r.flip)
                     for r in upper(t1 - t0, e - k0, e - window + 1 - k0)]
    runs: list[list[int]] = []
    for t0 in inner:
        if runs and runs[-1][-1] + c == t0:
            runs[-1].append(t0)
        else:
            runs.append([t0])
    for run in runs:
        t0, n, e = run[0], len(run), run[0] + offset
        parts.append(Part(band.BandGroup(t0, e - window + 1, c, window - 1, n, True), False))
        parts.append(Part(band.BandGroup(t0, e, c, c, n, True), True))
    return parts, lone


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec, window: int, block: int | None = None) -> torch.Tensor | None:
    """Windowed causal attention (B, H, T, D) for rotated q (B, H, T, D) and k, v (B, Hkv, Tk, D)
    (grouped heads as they are: the kernel broadcasts each key/value head over its group, and dk, dv
    come back with Hkv heads), or None when this path does not run the call (:func:`_applies`).
    ``block`` (tests): rows per block."""
    if not _applies(spec, q, window):
        return None
    parts, lone = plan(q.shape[-2], k.shape[-2], spec.offset, window, block)
    part_masks = [_part_mask(spec, p, q.dtype) for p in parts]
    lone_masks = [_mask(spec, r, q.dtype) if spec.has_bias else None for r in lone]
    return apply(_Window, q, k, v, parts, part_masks, lone, lone_masks, spec.scale, spec.has_bias)


def _part_mask(spec: ScoreSpec, part: Part, dtype: torch.dtype) -> torch.Tensor | None:
    """A part's mask for all its blocks, (1, H or 1, C, L): the bias of its first block (a relative
    bias is the same for every block), and for the earlier keys the window's edge, -inf where
    row i would see key b < i."""
    g = part.group
    mask = _bias(spec, (g.t0, g.t0 + g.rows), (g.k0, g.k0 + g.length), dtype) if spec.has_bias else None  # (H or 1, C, L)
    if not part.causal:
        rows = torch.arange(g.rows, device=spec.k_positions.device)
        edge = torch.zeros(g.rows, g.length, dtype=dtype, device=rows.device)
        edge.masked_fill_(torch.arange(g.length, device=rows.device)[None, :] < rows[:, None], float("-inf"))  # (C, L)
        mask = edge[None] if mask is None else mask + edge
    return None if mask is None else mask[None].contiguous()


def _mask(spec: ScoreSpec, region: Region, dtype: torch.dtype) -> torch.Tensor:
    """The bias of one region as its kernel mask, (1, H, Lq, Lk) in call order."""
    bias = _bias(spec, region.rows, region.keys, dtype)  # (H or 1, Lq, Lk)
    return call_order(call_order(bias, region, -1), region, -2)[None].contiguous()


def _bias(spec: ScoreSpec, rows: tuple[int, int], keys: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The encoding's bias (H or 1, Lq, Lk) of queries ``rows`` and keys ``keys`` (index ranges),
    detached: no gradient reaches it on this path (:func:`_applies`)."""
    return spec.bias(spec.q_positions[slice(*rows)], spec.k_positions[slice(*keys)]).detach().to(dtype)


class _Window(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, parts: list[Part], part_masks: list[torch.Tensor | None],
                lone: list[Region], lone_masks: list[torch.Tensor | None], scale: float, biased: bool) -> torch.Tensor:
        # Denormals flushed where a bias falls with distance (ALiBi's far keys); plain windows run here.
        out, lse = flushed(_forward, q, k, v, parts, part_masks, lone, lone_masks, scale, when=biased)
        ctx.plan = parts, part_masks, lone, lone_masks, scale
        ctx.biased = biased
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flushed(_backward, dout.contiguous(), q, k, v, out, lse, *ctx.plan, when=ctx.biased)
        return dq, dk, dv, None, None, None, None, None, None


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, parts: list[Part], part_masks: list[torch.Tensor | None],
             lone: list[Region], lone_masks: list[torch.Tensor | None], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (B, H, T, D) in q's dtype and its log-sum-exp (B, H, T)."""
    b, h, tq, _ = q.shape
    merged = Merge(b, h, tq, v.shape[-1], q.dtype, q.device)
    for p, mask in zip(parts, part_masks):
        g = p.group
        o, lz = kernel_forward(band.blocks(q, g), band.windows(k, g), band.windows(v, g), p.causal, scale, mask)  # (B*n, H, C, D), (B*n, H, C)
        merged.add(g.row_range, band.unblocks(o, g), band.unblocks(lz, g))
    for r, mask in zip(lone, lone_masks):
        o, lz = kernel_forward(rows_of(q, r), keys_of(k, r), keys_of(v, r), r.causal, scale, mask)
        merged.add(r.rows, call_order(o, r), call_order(lz, r, -1))
    return merged.out.to(q.dtype), merged.lse


def _backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
              parts: list[Part], part_masks: list[torch.Tensor | None], lone: list[Region], lone_masks: list[torch.Tensor | None],
              scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv): each call's flash backward given the merged output and log-sum-exp."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for p, mask in zip(parts, part_masks):
        g = p.group
        gq, gk, gv = kernel_backward(band.blocks(dout, g), band.blocks(q, g), band.windows(k, g), band.windows(v, g),
                                     band.blocks(out, g), band.blocks(lse, g).contiguous(), p.causal, scale, mask)
        dq[:, :, slice(*g.row_range)] += band.unblocks(gq, g)
        band.add_windows(dk, g, gk)
        band.add_windows(dv, g, gv)
    for r, mask in zip(lone, lone_masks):
        gq, gk, gv = region_backward(r, dout, q, k, v, out, lse, scale, mask=mask)
        dq[:, :, slice(*r.rows)] += gq
        dk[:, :, slice(*r.keys)] += gk
        dv[:, :, slice(*r.keys)] += gv
    return dq, dk, dv


__all__ = ["attend", "plan"]
