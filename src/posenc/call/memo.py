"""What is kept between attention calls: per model forward (:class:`ForwardMemo`), and between
decode steps (:class:`Workspace`, owned by a KV cache).

ForwardMemo: what one model forward computes once and every layer reuses.

T5's bias table is one set of parameters shared by all layers, and ALiBi's slopes are fixed: their
(H, Tq, Tk) bias, their per-distance values and the band biases the blocked backend builds are the
same in every layer of one forward. The model makes one :class:`ForwardMemo` per forward and hands
it to every attention layer; backends ask it by name. A memo is never kept across forwards, so a
parameter update can never leave a stale value behind, and autograd sees the one computation from
which all layers' gradients flow.

Entries are keyed by the encoding object (held, so its id cannot be reused while the memo lives)
and the geometry of the call.
"""

from __future__ import annotations

from typing import Callable, TypeVar, cast

import torch
from torch import nn

from ..encodings.protocol import Biases, DistanceBias, require

T = TypeVar("T")


class ForwardMemo:
    """Per-forward cache of position-only tensors, shared by the layers of one model forward.

    ``workspace``: the decode-step buffers of a caller whose KV cache is not posenc's (posenc.hf:
    a ``transformers`` cache), kept by that caller across forwards and handed to every call of this
    forward that has none of its own (see :class:`Workspace`); None: each call's own.
    """

    def __init__(self, workspace: Workspace | None = None) -> None:
        self._values: dict[tuple[object, ...], object] = {}
        self._held: dict[int, nn.Module] = {}
        self.workspace = workspace
        self._calls = 0

    def next_call(self) -> int:
        """0, 1, 2, ... for the calls of this forward that ask: the layers of a model forward call in
        the same order every forward, so the number names a layer's slot in a :class:`Workspace`."""
        self._calls += 1
        return self._calls - 1

    def _get(self, encoding: nn.Module, key: tuple[object, ...], make: Callable[[], T]) -> T:
        full = (id(encoding), *key)
        if full not in self._values:
            self._held[id(encoding)] = encoding
            self._values[full] = make()
        return cast(T, self._values[full])  # made by `make` for this key

    def dense_bias(self, encoding: nn.Module, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        """``encoding.bias(q_positions, k_positions)`` (H, Tq, Tk), computed once per forward when the
        encoding is shared across layers (one instance for all of them), else every time."""
        biases = require(encoding, Biases)
        if not getattr(encoding, "shares_across_layers", False):
            return biases.bias(q_positions, k_positions)
        key = ("dense_bias", *_geometry(q_positions, k_positions))
        return self._get(encoding, key, lambda: biases.bias(q_positions, k_positions))

    def relative_values(self, encoding: nn.Module, r_lo: int, r_hi: int, device: torch.device) -> torch.Tensor:
        """``encoding.relative_bias(r)`` for r = r_lo..r_hi: (H, R)."""
        relative = require(encoding, DistanceBias)
        make = lambda: relative.relative_bias(torch.arange(r_lo, r_hi + 1, device=device))  # noqa: E731  (H, R)
        return self._get(encoding, ("relative_values", r_lo, r_hi, device), make)

    def table(self, encoding: nn.Module, name: str, key: tuple[object, ...], make: Callable[[], T]) -> T:
        """Any other per-forward value a backend derives from positions alone (``name`` says what,
        ``key`` its geometry), e.g. the blocked backend's band biases."""
        return self._get(encoding, (name, *key), make)


def _geometry(q_positions: torch.Tensor, k_positions: torch.Tensor) -> tuple[object, ...]:
    """What fixes a position-only value: (Tq, Tk, first query position, first key position, device)
    for consecutive positions; the positions themselves when they skip values."""
    tq, tk = q_positions.numel(), k_positions.numel()
    key: tuple[object, ...] = (tq, tk, int(q_positions[0]) if tq else 0, int(k_positions[0]) if tk else 0, q_positions.device)
    if (tq > 1 and int(q_positions[-1] - q_positions[0]) != tq - 1) or (tk > 1 and int(k_positions[-1] - k_positions[0]) != tk - 1):
        key += (tuple(q_positions.tolist()), tuple(k_positions.tolist()))
    return key


class Workspace:
    """Buffers the single-query paths keep between decode steps, each rebuilt when its key changes.

    ``capacity`` follows the KV cache that owns the workspace (the largest number of keys a step
    can have until the cache grows); a call with more keys raises it to the next power of two.
    """

    def __init__(self, capacity: int = 0) -> None:
        self.capacity = capacity
        self._entries: dict[tuple[object, ...], tuple[tuple[object, ...], object]] = {}
        self._held: dict[int, nn.Module] = {}  # encodings whose id keys an entry (ids stay unique)

    def fit(self, keys: int) -> int:
        """The capacity, raised to hold ``keys`` keys if needed."""
        if keys > self.capacity:
            self.capacity = 1 << max(keys - 1, 1).bit_length()
        return self.capacity

    def get(self, name: tuple[object, ...], key: tuple[object, ...], make: Callable[[], T]) -> T:
        """The entry ``name``, made again when ``key`` differs from the one it was made with."""
        hit = self._entries.get(name)
        if hit is None or hit[0] != key:
            with torch.no_grad():
                hit = self._entries[name] = (key, make())
        return cast(T, hit[1])  # made by `make` (entries are named by what they hold)

    def hold(self, encoding: nn.Module) -> int:
        self._held[id(encoding)] = encoding
        return id(encoding)

    def scratch(self, b: int, h: int, tk: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A (B, H, 1, Tk) view, to be written in place, of a contiguous (H, B, Tk) prefix of a flat
        buffer of H x B x C (a kernel writing into a strided output may take a slow path)."""
        c = self.fit(tk)
        buf = self.get(("scratch",), (b, h, c, dtype, device), lambda: torch.empty(h * b * c, dtype=dtype, device=device))
        return buf[: h * b * tk].view(h, b, tk).permute(1, 0, 2)[:, :, None, :]  # (B, H, 1, Tk)


__all__ = ["ForwardMemo", "Workspace"]
