"""KV caches for incremental decoding: preallocated, grown by doubling, written in place.

A :class:`LayerCache` holds one attention layer's keys and values in buffers of shape
(B, H, capacity, D). Appending writes the new tokens into the free slots, so a decode step costs
O(B x H x D) instead of copying the whole cache (``torch.cat`` at every step); when
the buffers are full they are reallocated at twice the capacity (or what is needed, if more), so T
appended tokens cost O(T) copies in all. ``crop(length)`` forgets the last tokens (speculative or
beam decoding) and ``reset()`` all of them, keeping the memory.

While autograd records (the new keys or values require grad), appends concatenate instead:
the tensors an earlier step saved for its backward must not be overwritten.

A :class:`Cache` is the model's: one LayerCache per layer, the model that made it (a cache fed to
another model is an error), the batch size and, for generation in batches, each row's *left
padding*. With left padding, row b's first ``padding[b]`` slots hold padding tokens; its real tokens
start at position ``starts[b] = padding[b]`` of the positions the batch shares. Padding keys are
hidden from every real query (see :class:`posenc.backends.parts.base.ScoreSpec` ``starts``).

A windowed layer (sliding window W, :mod:`posenc.backends.parts.windows`) keeps O(W) keys, never fewer than a
later query can see: ``LayerCache(window=W)`` has buffers of max(2W, 16) slots (more after a longer
chunk of tokens is appended at once, until the next compaction). When an append would overflow
them, the last W - 1 keys (all a later query can see) move to the front and the older ones are
forgotten: one copy of W - 1 keys about every W steps, O(D) per step amortised. The kept keys are
thus always one contiguous, ordered view: ``start`` is the position of the first kept key,
``length`` still counts every token seen, and memory is O(W) whatever the length.

Positions with an axis dimension (M-RoPE's (3, B, T), a patch grid's (B, T, 2)) are not cache
slots: after an image, M-RoPE's text goes on at max(id) + 1, fewer than the tokens before it. A
layer cache that has been given such ids keeps, per row and slot, the next id after the row's real
tokens so far, 1 + the largest id on any axis (``note_positions``, a (B, C) integer buffer; O(1)
per token); ``next_positions()`` reads it at the current length, so a step without positions
continues every row at its own next id (Hugging Face's ``rope_deltas`` added to the slot), and
``crop`` needs nothing more: the entry at the new length is the prefix's.

Shape legend: B batch, H heads, C capacity, T tokens, D head dim, W window, A position axes.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import torch
from torch import nn

from ..call.memo import Workspace
from ..errors import UsageError

MIN_CAPACITY = 16  # the first allocation holds at least this many tokens


def check_padding(padding, batch_size: int) -> list[int] | None:
    """``padding`` (B non-negative integers, a list or a 1-D tensor) as a list; None when no row is padded."""
    if padding is None:
        return None
    if isinstance(padding, torch.Tensor):
        if padding.dim() != 1 or padding.is_floating_point() or padding.is_complex():
            raise UsageError(f"padding must be a 1-D integer tensor or a list of integers, got shape {tuple(padding.shape)}")
        padding = padding.tolist()
    padding = list(padding)
    if len(padding) != batch_size or any(isinstance(p, bool) or not isinstance(p, int) or p < 0 for p in padding):
        raise UsageError(f"padding must hold one integer >= 0 per row (batch_size={batch_size}), got {padding!r}")
    return padding if any(padding) else None


class LayerCache:
    """Keys and values of one attention layer: (B, H, length, D) views of (B, H, capacity, D) buffers.

    Keys are stored rotated, except for encodings whose rotation depends on the current length
    (``rotation_depends_on_length``): the attention rotates those at every step.

    Args:
        capacity: reserve this many tokens at the first append (e.g. prompt + new tokens, so that
            generation never reallocates); None: what the first append needs, at least MIN_CAPACITY.
        padding: left padding of each row (B integers), or None.
        workspace: buffers the single-query attention paths keep between steps (shared by the
            layers of one model's cache); a new one when None.
        window: the layer's sliding window W: keep O(W) keys, forgetting those no later query can
            see (see the module docstring); None keeps every key.
    """

    def __init__(self, capacity: int | None = None, padding: Sequence[int] | None = None, workspace: Workspace | None = None,
                 window: int | None = None) -> None:
        self.k: torch.Tensor | None = None  # (B, H, C, D) buffer
        self.v: torch.Tensor | None = None
        self.g: torch.Tensor | None = None  # (B, H, C) per-key log forget gates, when the encoding has them
        # (B, length) each key's selection summed over every query so far (selective attention)
        self.selected: torch.Tensor | None = None
        self.length = 0  # tokens seen (padding included)
        self.start = 0  # position of the first kept key (> 0 once a windowed cache forgets)
        self.window = window
        self.reserve = capacity if window is None else 2 * window
        self.padding = None if padding is None else check_padding(padding, len(padding))
        self.workspace = Workspace() if workspace is None else workspace
        self.capacities: list[int] = []  # every capacity allocated, in order (tests read the growth)
        self._positions: torch.Tensor | None = None  # arange(C): key positions, viewed, not rebuilt
        self._starts: torch.Tensor | None = None
        self._owner: weakref.ref | None = None
        # After positions with an axis dimension: entry s - _next_base is 1 + the largest id of the
        # row's real tokens up to slot s (B, C'); valid from slot _axes_start (see note_positions).
        self._next: torch.Tensor | None = None
        self._next_base = 0
        self._axes_start = 0

    @property
    def capacity(self) -> int:
        return 0 if self.k is None else self.k.shape[-2]

    def claim(self, owner: nn.Module) -> None:
        """Record the layer that fills this cache; another one using it is a UsageError."""
        if self._owner is None or self._owner() is None:
            self._owner = weakref.ref(owner)
        elif self._owner() is not owner:
            raise UsageError("this cache belongs to another attention layer (make one cache per layer, or model.new_cache())")

    @property
    def held(self) -> int:
        """Keys in the buffers: positions start..length-1."""
        return self.length - self.start

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add k, v (B, H, T, D) after the cached tokens; returns the kept keys and values
        (B, H, length - start, D): every key, or those a windowed cache still holds (at least the
        last W - 1 before the new ones, and the new ones)."""
        self._check(k, v)
        t = k.shape[-2]
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            # Autograd keeps earlier views for the backward: new tensors, never a write into them.
            drop = self._forgettable()
            if self.k is None or self.v is None:
                self.k, self.v = k, v
            else:
                self.k = torch.cat((self.k[:, :, drop : self.held], k), dim=-2)
                self.v = torch.cat((self.v[:, :, drop : self.held], v), dim=-2)
            self.start += drop
        else:
            if self.held + t > self.capacity and self._forgettable():
                self._compact(t)
            end = self.held + t
            if end > self.capacity or not self._writable():
                self._grow(end, k, v)
            buf_k, buf_v = self._buffers()
            with torch.no_grad():
                buf_k[:, :, self.held : end] = k
                buf_v[:, :, self.held : end] = v
        self.length += t
        buf_k, buf_v = self._buffers()
        return buf_k[:, :, : self.held], buf_v[:, :, : self.held]

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers (B, H, C, D), which exist from the first append on."""
        if self.k is None or self.v is None:
            raise RuntimeError("this layer cache has no buffers before its first append")
        return self.k, self.v

    def _forgettable(self) -> int:
        """Kept keys no later query can see: all but the last W - 1 (0 without a window)."""
        if self.window is None or self.k is None:
            return 0
        return max(0, self.held - (self.window - 1))

    def _compact(self, coming: int) -> None:
        """Move the last W - 1 keys to the front of the buffers and forget the older ones; buffers
        grown past 2W by a long chunk go back to 2W slots when the ``coming`` tokens fit."""
        drop = self._forgettable()
        keep = self.held - drop
        buf_k, buf_v = self._buffers()
        with torch.no_grad():
            if keep:
                buf_k[:, :, :keep] = buf_k[:, :, drop : drop + keep].clone()
                buf_v[:, :, :keep] = buf_v[:, :, drop : drop + keep].clone()
        self.start += drop
        limit = max(self.reserve or 0, MIN_CAPACITY)
        if self.capacity > limit and keep + coming <= limit:
            self.k, self.v = buf_k[:, :, :limit].clone(), buf_v[:, :, :limit].clone()
            self.capacities.append(limit)

    def selected_sums(self, length: int, new: int) -> torch.Tensor | None:
        """Selective attention's kept sums for the ``length`` cached keys (after :meth:`append`): the
        earlier calls' (B, length - new), then 0 for the ``new`` keys; None before the first call."""
        old = self.selected
        if old is None:
            return None
        return torch.cat((old, old.new_zeros(old.shape[0], length - old.shape[-1])), dim=-1)  # (B, length)

    def append_gates(self, g: torch.Tensor) -> torch.Tensor:
        """Keep the log forget gates g (B, H, T) of the keys just appended (call right after
        :meth:`append`); returns every cached key's gate (B, H, length). Grown and written as the
        keys are (concatenated while autograd records)."""
        end, t = self.length, g.shape[-1]
        start = end - t
        old = self.g
        if torch.is_grad_enabled() and g.requires_grad or (old is not None and old.requires_grad):
            kept = g if start == 0 or old is None else torch.cat((old[..., :start], g), dim=-1)
            self.g = kept
            return kept[..., :end]
        capacity = max(self.capacity, end)
        buf = old
        if (buf is None or buf.shape[-1] < capacity or buf.shape[:2] != g.shape[:2]
                or buf.is_inference() and not torch.is_inference_mode_enabled()):
            buf = g.new_empty(*g.shape[:2], capacity)
            if old is not None and start and old.shape[:2] == g.shape[:2]:
                buf[..., :start] = old[..., :start]
            self.g = buf
        with torch.no_grad():
            buf[..., start:end] = g
        return buf[..., :end]

    def note_positions(self, axes: torch.Tensor) -> None:
        """Keep each row's next id after the tokens just appended (call right after :meth:`append`),
        ``axes`` (A, B', T) their ids with an axis dimension (B' = 1 or B): entry s is 1 + the
        largest id, on any axis, of the row's real tokens up to slot s (left padding does not count).
        Tokens before the first noted step were at 1-D positions, their slots: the next id after
        them is the slot after them."""
        end, t = self.length, axes.shape[-1]
        start, batch = end - t, self._buffers()[0].shape[0]
        top = axes.amax(dim=0).expand(batch, t) + 1  # (B, T): next id after each token alone
        starts = self.starts(axes.device)
        if starts is not None:
            slots = torch.arange(start, end, device=axes.device)
            top = top.masked_fill(slots[None, :] < starts[:, None], 0)  # padding: no id
        kept = self._next
        if kept is None or start <= self._axes_start:  # (re)start: the tokens before were at their slots
            self._next, self._next_base, self._axes_start = None, start, start
            before = torch.full((batch,), start, dtype=top.dtype, device=top.device)  # (B,)
        else:
            before = kept[:, start - 1 - self._next_base]
        new = torch.maximum(top, before[:, None]).cummax(dim=-1).values  # (B, T)
        kept = self._keep_next(end, new)
        kept[:, start - self._next_base : end - self._next_base] = new

    def _keep_next(self, end: int, new: torch.Tensor) -> torch.Tensor:
        """The next-id buffer (B, C'), with room for slots up to ``end`` (entries a windowed cache can
        no longer crop back to are dropped when it grows)."""
        have = 0 if self._next is None else self._next.shape[-1]
        if self._next is not None and end - self._next_base <= have and not (self._next.is_inference() and not torch.is_inference_mode_enabled()):
            return self._next
        low = self._next_base if self.window is None else max(self._next_base, self.start - 1, 0)
        keep = end - new.shape[-1] - low  # entries kept: slots low .. end - T - 1
        buffer = new.new_empty(new.shape[0], max(2 * (end - low), MIN_CAPACITY))  # (B, C')
        if self._next is not None and keep > 0:
            buffer[:, :keep] = self._next[:, low - self._next_base : low - self._next_base + keep]
        self._next, self._next_base = buffer, low
        return buffer

    def next_positions(self) -> torch.Tensor | None:
        """(B,) each row's next id after its cached tokens when they were given positions with an
        axis dimension (M-RoPE: max(id) + 1 over the row's real tokens), None otherwise."""
        if self._next is None or self.length <= self._axes_start:
            return None
        return self._next[:, self.length - 1 - self._next_base]

    def _check(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.k is None or self.length == 0:
            if self.padding is not None and len(self.padding) != k.shape[0]:
                raise UsageError(f"cache padding has {len(self.padding)} rows, the batch has {k.shape[0]}")
            if self.k is not None and (self.k.shape[0], self.k.shape[1], self.k.shape[3]) != (k.shape[0], k.shape[1], k.shape[3]):
                self.k = self.v = None  # reset, then another shape: start afresh
            return
        buf_k, buf_v = self._buffers()
        if k.shape[0] != buf_k.shape[0]:
            raise UsageError(f"cache holds batch_size={buf_k.shape[0]} rows, got a batch of {k.shape[0]}")
        if (k.shape[1], k.shape[3], v.shape[3]) != (buf_k.shape[1], buf_k.shape[3], buf_v.shape[3]) or k.device != buf_k.device:
            raise UsageError(
                f"cache holds keys of {buf_k.shape[1]} heads x {buf_k.shape[3]} features on {buf_k.device}, "
                f"got {k.shape[1]} x {k.shape[3]} on {k.device}"
            )

    def _writable(self) -> bool:
        """The buffers may be written in place here (not part of a graph, not an inference tensor
        outside inference mode)."""
        buf_k, buf_v = self._buffers()
        if buf_k.requires_grad or buf_v.requires_grad:
            return False
        return torch.is_inference_mode_enabled() or not (buf_k.is_inference() or buf_v.is_inference())

    def _grow(self, needed: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """New buffers of max(needed, twice the capacity, the reserve), the cached tokens copied."""
        old_k, old_v = self.k, self.v
        first = old_k is None or old_v is None
        doubled = 2 * self.capacity if self.window is None else 0  # a window's buffers need only what is held
        capacity = max(needed, doubled, self.reserve or 0, MIN_CAPACITY if first else 0)
        b, h, _, d = k.shape
        new_k = k.new_empty(b, h, capacity, d)  # (B, H, C, D)
        new_v = v.new_empty(b, h, capacity, v.shape[-1])
        if old_k is not None and old_v is not None and self.held:
            with torch.no_grad():
                new_k[:, :, : self.held] = old_k[:, :, : self.held]
                new_v[:, :, : self.held] = old_v[:, :, : self.held]
        self.k, self.v = new_k, new_v
        self.capacities.append(capacity)
        self.workspace.capacity = max(self.workspace.capacity, capacity)

    def positions(self, device: torch.device) -> torch.Tensor:
        """Positions of the kept keys, start..length-1 (a view of a buffer that grows with the
        cache; a windowed cache's, O(W), made per step)."""
        if self.window is not None:
            return torch.arange(self.start, self.length, device=device)
        size = max(self.capacity, self.length)
        if self._positions is None or self._positions.numel() < size or self._positions.device != device:
            self._positions = torch.arange(max(size, MIN_CAPACITY), device=device)
        return self._positions[: self.length]

    def starts(self, device: torch.device) -> torch.Tensor | None:
        """(B,) position of each row's first real token (its left padding), or None without padding."""
        if self.padding is None:
            return None
        if self._starts is None or self._starts.device != device:
            self._starts = torch.tensor(self.padding, device=device)
        return self._starts

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens (0 <= length <= the cached length)."""
        self.check_crop(length)
        self.length = length

    def check_crop(self, length: int) -> None:
        """UsageError unless ``crop(length)`` can keep what a query at ``length`` sees."""
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self.length:
            raise UsageError(f"crop length must be an integer in [0, {self.length}] (the cached length), got {length!r}")
        if self.window is not None and self.start and length < self.length and length - (self.window - 1) < self.start:
            raise UsageError(f"crop length must be >= {self.start + self.window - 1} here: this windowed cache has forgotten "
                             f"the keys before position {self.start}, which a query at {length} would see")

    def reset(self, padding: Sequence[int] | None = None) -> None:
        """Forget every token (the memory stays for the next sequence); ``padding`` for the new rows."""
        self.length = self.start = 0
        self.padding = None if padding is None else check_padding(padding, len(padding))
        self._starts = None
        self._next, self._next_base, self._axes_start = None, 0, 0


class Cache:
    """The KV cache of one :class:`posenc.LM`: a :class:`LayerCache` per layer (see :meth:`LM.new_cache`).

    Args:
        model: the model it is made for (kept as a weak reference; another model refuses it).
        depth: number of layers.
        batch_size: rows B.
        capacity: tokens to reserve per row (prompt + new tokens); None grows by doubling.
        padding: left padding of each row (B integers >= 0), for prompts of different lengths.
        windows: per layer, its sliding window (a windowed :class:`LayerCache`) or None.
    """

    def __init__(self, model: nn.Module, depth: int, batch_size: int, capacity: int | None = None, padding=None,
                 windows: Sequence[int | None] | None = None) -> None:
        self._owner = weakref.ref(model)
        self.batch_size = batch_size
        self.padding = check_padding(padding, batch_size)
        self.workspace = Workspace()
        windows = [None] * depth if windows is None else list(windows)
        self.layers = [LayerCache(capacity, self.padding, self.workspace, w) for w in windows]

    @property
    def length(self) -> int:
        """Tokens cached per row (padding included)."""
        return self.layers[0].length if self.layers else 0

    @property
    def capacity(self) -> int:
        return self.layers[0].capacity if self.layers else 0

    def owned_by(self, model: nn.Module) -> bool:
        return self._owner() is model

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens of every row, in every layer."""
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self.length:
            raise UsageError(f"crop length must be an integer in [0, {self.length}] (the cached length), got {length!r}")
        for layer in self.layers:  # every layer checked before any is cropped
            layer.check_crop(length)
        for layer in self.layers:
            layer.crop(length)

    def reset(self, padding=None) -> None:
        """Forget every token, keep the memory; ``padding`` for the next rows (None: no padding)."""
        self.padding = check_padding(padding, self.batch_size)
        for layer in self.layers:
            layer.reset(self.padding)

    def starts(self, device: torch.device) -> torch.Tensor | None:
        return self.layers[0].starts(device) if self.layers else None

    def next_positions(self) -> torch.Tensor | None:
        """(B,) each row's next id after positions with an axis dimension (every layer keeps the
        same; :meth:`LayerCache.next_positions`), or None."""
        return self.layers[0].next_positions() if self.layers else None

    def embed_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Positions for ``embed`` (absolute methods): (T,) shared, or (B, T) each row counted from
        its first real token when rows are left-padded (padding gets position 0, never attended)."""
        starts = self.starts(positions.device)
        if starts is None:
            return positions
        return (positions[None, :] - starts[:, None]).clamp(min=0)  # (B, T)


__all__ = ["Cache", "LayerCache", "MIN_CAPACITY", "check_padding"]
