"""The rotated keys a position remap keeps between the calls of a KV cache
(:mod:`posenc.backends.parts.remapped`), so that a decode step rotates only its new keys.

Shape legend: B batch, Hkv key/value heads, Tk keys, D head dim.

Each region keeps its rotated keys (from the first key on) in the KV cache's workspace (one slot per
layer: the layer's call number in the forward, :meth:`~posenc.call.memo.ForwardMemo.next_call`).
The kept rows are used only when they are still the cache's rows: the same first key position, the
same number of rows or fewer before this call's queries, and the same per-row sums of the raw keys
on every :data:`PROBE`-th kept row and the last 16 (one strided read, shared by the regions). Another
cache in the same slot differs almost everywhere; reordered beams differ in every row after they
part, so in the last 16; a cache cropped and refilled is caught by its rows before the queries.
Anything else rotates every key again.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from ...call.memo import Workspace
from ...encodings.protocol import Remaps

PROBE = 64  # kept keys: every PROBE-th row's sum is checked against the cache on each call


class Probe:
    """Per-row sums of the raw keys before this call's queries, on every :data:`PROBE` th row (read
    once per call through a strided view, shared by the regions) and on the last 16 of a prefix."""

    def __init__(self, k: torch.Tensor, before: int):
        self.k, self.before = k, before
        self._strided: torch.Tensor | None = None

    def matches(self, sums: torch.Tensor, valid: int) -> bool:
        """True when the kept ``sums`` (B, Hkv, >= valid) agree with the keys' rows 0..valid-1 at the probes."""
        if self._strided is None:
            self._strided = self.k[:, :, :self.before:PROBE].sum(-1)  # (B, Hkv, ceil(before / PROBE))
        n = -(-valid // PROBE)
        tail = max(0, valid - 16)
        return (torch.equal(sums[..., :valid:PROBE], self._strided[..., :n])
                and torch.equal(sums[..., tail:valid], self.k[:, :, tail:valid].sum(-1)))


def kept_keys(enc: Remaps, k: torch.Tensor, k_at: torch.Tensor, k1: int, kp: torch.Tensor, tq: int,
               kept: tuple[Workspace, object], region: int, probe: Probe) -> torch.Tensor:
    """Keys 0..k1-1 rotated at ``k_at``, (B, Hkv, k1, D): the rows kept from the slot's last call
    that are still the cache's (see the module docstring), the others rotated now and kept."""
    workspace, slot = kept
    b, hkv, tk, d = k.shape
    entry: dict[str, Any] = workspace.get(("remap-keys", workspace.hold(cast(nn.Module, enc)), slot, region),
                                          (b, hkv, d, k.dtype, k.device), dict)
    rows, valid = entry.get("rows"), 0
    if rows is not None and entry["first"] == int(kp[0]):
        valid = min(entry["n"], tk - tq, k1)
        if valid and not probe.matches(entry["sums"], valid):
            valid = 0
    if rows is None or rows.shape[2] < k1:
        grown = k.new_empty(b, hkv, max(k1, 2 * (0 if rows is None else rows.shape[2]), 16), d)  # (B, Hkv, capacity, D)
        if valid and rows is not None:
            grown[:, :, :valid] = rows[:, :, :valid]
        rows = grown
        sums_kept = k.new_empty(b, hkv, rows.shape[2])
        if valid:
            sums_kept[..., :valid] = entry["sums"][..., :valid]
        entry["sums"] = sums_kept
    assert rows is not None
    if valid < k1:
        rows[:, :, valid:k1] = enc.rotate_at(k[:, :, valid:k1], k_at[valid:k1])
        entry["sums"][..., valid:k1] = k[:, :, valid:k1].sum(-1)  # (B, Hkv, new rows): what later calls check
    entry.update(rows=rows, n=k1, first=int(kp[0]))
    return rows[:, :, :k1]


__all__ = ["PROBE", "Probe", "kept_keys"]
