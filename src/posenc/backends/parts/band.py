"""The band near the diagonal, for the ``blocked`` backend: the keys whose bias is written out.

A relative bias that is constant past some distance P (T5's last bucket) leaves, for every query,
the P keys nearest to it (``-P < r <= 0`` for a decoder, ``-P < r < F`` for an encoder). Those are
covered in blocks of ``rows`` queries against their ``rows + width - 1`` keys; every inner block has
the same (H, rows, length) bias, built once per forward from ``f_h(r)`` (the encoding's
``relative_bias``), so ``BAND_GROUP`` blocks go to the kernel as one batched call on overlapping
windows of k and v (views, no copies, at batch size 1): O(H x GROUP x rows x length) memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .regions import up

BAND_GROUP = 16  # band blocks batched into one kernel call (temporaries: H x GROUP x rows x length)
EXPLICIT_GROUP = 4  # band blocks per step of the written-out backward of a learned bias


@dataclass
class BandGroup:
    """``count`` band blocks of ``rows`` queries: block n has queries t0 + n*rows + [0, rows) and
    keys k0 + n*rows + [0, length). Inner blocks (same shape, same bias) run as one batched call."""

    t0: int
    k0: int
    rows: int
    length: int
    count: int = 1
    inner: bool = False
    heads: slice = field(default_factory=lambda: slice(None))  # the heads this band serves
    past: int = 0  # the band is -past < r <= top (r = key position - query position)
    top: int = 0

    @property
    def row_range(self) -> tuple[int, int]:
        return self.t0, self.t0 + self.count * self.rows


def plan_band(tq: int, tk: int, qs: int, ks: int, past: int, top: int, rows: int, heads: slice = slice(None)) -> list[BandGroup]:
    """Groups covering the band ``-past < r <= top`` (r = key position - query position) of queries
    at positions qs.. and keys at ks.., in blocks of ``rows`` queries, for ``heads``."""
    groups: list[BandGroup] = []
    if past + top <= 0:
        return groups
    for t0 in range(0, tq, rows):
        t1 = min(t0 + rows, tq)
        k0 = qs + t0 - past + 1 - ks
        k1 = qs + t1 - 1 + top - ks + 1
        inner = k0 >= 0 and k1 <= tk and t1 - t0 == rows
        k0, k1 = max(k0, 0), min(k1, tk)
        if k1 <= k0:
            continue
        last = groups[-1] if groups else None
        if inner and last is not None and last.inner and last.count < BAND_GROUP:
            last.count += 1
        else:
            groups.append(BandGroup(t0, k0, t1 - t0, k1 - k0, 1, inner, heads, past, top))
    return groups


def band_bias(rel: torch.Tensor, r_lo: int, group: BandGroup, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A band block's bias (h, C, L) for the group's heads with -inf outside its band, and its rel
    index (C * L,). ``rel`` (H, R) holds f(r) for r = r_lo.. ; ``offset`` is r of the block's
    top-left pair."""
    c, length = group.rows, group.length
    relative = offset + torch.arange(length, device=rel.device)[None, :] - torch.arange(c, device=rel.device)[:, None]  # (C, L)
    inside = (relative > -group.past) & (relative <= group.top)
    index = (relative - r_lo).clamp_(0, rel.shape[1] - 1)
    bias = up(rel[group.heads])[:, index].masked_fill_(~inside, float("-inf"))  # (h, C, L)
    return bias, index.reshape(-1)


def split(group: BandGroup, size: int) -> list[BandGroup]:
    """The group as groups of at most ``size`` blocks."""
    return [
        replace(group, t0=group.t0 + n * group.rows, k0=group.k0 + n * group.rows, count=min(size, group.count - n))
        for n in range(0, group.count, size)
    ]


def blocks(x: torch.Tensor, group: BandGroup) -> torch.Tensor:
    """Rows of the group's blocks, (B, H, T, ...) -> (B * count, H, C, ...): a view when B = 1."""
    a, b = group.row_range
    return torch.unflatten(x[:, :, a:b], 2, (group.count, group.rows)).transpose(1, 2).flatten(0, 1)


def unblocks(y: torch.Tensor, group: BandGroup) -> torch.Tensor:
    """Inverse of :func:`blocks`: (B * count, H, C, ...) -> (B, H, count * C, ...)."""
    return torch.unflatten(y, 0, (-1, group.count)).transpose(1, 2).flatten(2, 3)


def windows(x: torch.Tensor, group: BandGroup) -> torch.Tensor:
    """Keys of the group's blocks, overlapping windows: (B, H, Tk, D) -> (B * count, H, L, D)."""
    span = x[:, :, group.k0 : group.k0 + (group.count - 1) * group.rows + group.length]
    unfolded = span.unfold(2, group.length, group.rows)  # (B, H, count, D, L), a view
    return unfolded.permute(0, 2, 1, 4, 3).flatten(0, 1)  # (B * count, H, L, D)


def add_windows(buf: torch.Tensor, group: BandGroup, g: torch.Tensor) -> None:
    """buf[:, :, keys of block n] += g[block n] for overlapping windows, a few strided adds."""
    c, n, tk = group.rows, group.count, buf.shape[2]
    g = torch.unflatten(g, 0, (-1, n)).transpose(1, 2)  # (B, H, count, L, D)
    for s in range(0, group.length, c):
        seg = g[:, :, :, s : s + c]  # (B, H, count, c', D): this segment of every window
        start = group.k0 + s
        whole = n if start + n * c <= tk else n - 1  # the last window's segment may overhang
        if whole:
            torch.unflatten(buf[:, :, start : start + whole * c], 2, (whole, c))[:, :, :, : seg.shape[3]] += seg[:, :, :whole]
        if whole < n:
            at = start + whole * c
            buf[:, :, at : at + seg.shape[3]] += seg[:, :, whole]
