"""The geometry of one attention call: which query sees which key, and at which positions.

Everything a backend needs to know about positions is decided here, once per call (or once per
model forward, for all layers), and carried as plain fields; no backend re-derives it.

Two levels:

- :class:`Geometry` is what a caller describes: a batch of B rows, Tq queries and Tk keys, their
  positions as (T,) (shared by every row) or (B, T) (per row), optional ``document_ids`` (B, T) for
  packed rows, an optional ``key_padding_mask`` (B, Tk) for padded rows, and ``causal``. When every
  row has the same positions, no documents and no padding, the geometry is *uniform*: one backend
  call runs the whole batch. Otherwise it is split into *segments* -- one per (row, document), the
  padding left out -- and segments with identical positions are stacked into one :class:`Segments`, so
  a packed row of eight documents of 512 tokens runs as a batch of eight 512-token calls: the cost
  grows with the sum of the squared document lengths, never with Tq x Tk, and no (N, N) mask exists.
- Each backend call it plans is a :class:`~posenc.call.spec.ScoreSpec` (:mod:`posenc.call.spec`),
  made here (:meth:`Geometry.spec`, :meth:`Geometry.run_spec`).

Definitions (shape legend: B batch, T tokens, Tq queries, Tk keys):

- A *document* is a maximal run of equal ``document_ids`` in a row. Without ``document_ids``,
  positions that do not increase (a restart, as a packed row written with per-document positions
  has) also start a new document: a query never sees a key of another document, so packing can
  never leak attention across documents.
- ``key_padding_mask`` is True on real tokens; a row's real tokens are one contiguous run (left or
  right padding). Padding queries get output 0 and padding keys are seen by no query.
- Without ``positions``: 0..T-1 after the first real token of each row, restarting at every
  document (with a padding mask, HF's ``cumsum(mask) - 1``). Queries of a call with Tq < Tk (a
  cached step) are the last Tq keys; default key positions then end at each row's last query.
- Segments of a causal call are *aligned*: their queries are the last keys of the segment.
- *Positions with an axis dimension* (an encoding with ``position_axes`` A > 1: M-RoPE's
  (3, B, T), a patch grid's (T, 2)) are the ids ``rotate`` reads, and only that: ``q_axes`` /
  ``k_axes`` hold them as (A, B', T), and ``q_positions`` / ``k_positions`` are then the *sequence
  index* (the default positions above: each row's token count, restarting at every document; with a
  KV cache, the cache slot), which every mask reads (causal, documents, padding, windows, chunks).
  A token's ids need not increase, nor be distinct, nor follow its slot: after an image, M-RoPE's
  text continues at max(id) + 1 (:meth:`Geometry.step` carries that per row through decoding).

Invariants the tests check: a packed row equals each document run alone; a padded batch equals
each row run alone; a uniform batch gives the same segments as the same positions given (B, T).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..encodings.base import PositionalEncoding, position_axes_of
from ..errors import UsageError
from .axes import check_axis_positions, in_words, label, one_axis_hint, text_continuation
from .axes import integer_tensor as _integer
from .memo import ForwardMemo, Workspace
from .spec import ScoreSpec


def check_positions(positions: torch.Tensor, length: int, past: int | None = None) -> bool:
    """Validate 1-D ``positions`` for a sequence of ``length`` tokens; True when they are consecutive.

    Positions are ``length`` distinct, increasing, non-negative integers (a randomized-positions
    scheme may skip values; a KV cache needs them consecutive, continuing at ``past``).

    Raises:
        UsageError: not a 1-D integer tensor, a wrong length, a negative value, values that do not
            increase, or (with ``past``) positions that do not continue the cache.
    """
    if not isinstance(positions, torch.Tensor) or positions.dim() != 1 or positions.is_floating_point() or positions.is_complex():
        raise UsageError(f"positions must be a 1-D integer tensor, got {in_words(positions)}")
    if positions.numel() != length:
        raise UsageError(f"positions must hold one position per token ({length}), got {positions.numel()}")
    if length == 0:
        return True
    values = positions.tolist()
    return _check_run(values, past)


def _check_run(values: list[int], past: int | None = None, name: str = "positions") -> bool:
    if values[0] < 0:
        raise UsageError(f"{name} must be >= 0, got {min(values)}")
    if any(b <= a for a, b in zip(values, values[1:])):
        raise UsageError(f"{name} must be strictly increasing within a document (each token after the one before)")
    consecutive = values[-1] - values[0] == len(values) - 1
    if past is not None and (not consecutive or values[0] != past):
        raise UsageError(
            f"with a KV cache, positions must continue the cache: {past}..{past + len(values) - 1}, "
            f"got {values[0]}..{values[-1]}"
        )
    return consecutive


@dataclass(frozen=True)
class Segments:
    """Segments of identical positions, stacked: n segments of Lq queries and Lk keys.

    ``q_index`` (n, Lq) and ``k_index`` (n, Lk) index the flattened (B * Tq) queries and (B * Tk)
    keys; ``q_positions`` (Lq,) and ``k_positions`` (Lk,) are every segment's positions.
    ``q_first`` / ``k_first``: when the n segments tile one contiguous range of the flattened
    queries / keys (segment m starts at ``q_first + m * Lq``, as the equal documents of a packed
    row do), that range's first index, so the stack is a slice (a view, whose backward is no
    scatter); else None.
    """

    q_index: torch.Tensor
    k_index: torch.Tensor
    q_positions: torch.Tensor
    k_positions: torch.Tensor
    consecutive: bool
    aligned: bool
    q_start: int
    k_start: int
    q_first: int | None = None
    k_first: int | None = None


def _tiled(starts: list[int], length: int) -> int | None:
    """starts[0] when the ranges [s, s + length) follow one another without a gap, else None."""
    return starts[0] if all(s == starts[0] + m * length for m, s in enumerate(starts)) else None


@dataclass(frozen=True)
class Geometry:
    """Where every query and key of one call sits (see the module docstring); build with :meth:`of`.

    ``q_positions`` / ``k_positions`` are (T,) when shared by every row, else (B, T); ``runs`` is
    None for a uniform call (one backend call for the whole batch), else the stacked segments.
    ``embed_positions`` are the positions an absolute encoding adds to the token embeddings.
    ``q_axes`` / ``k_axes``: positions with an axis dimension, (A, B', T), the ids a multi-axis
    rotation reads (``q_positions`` / ``k_positions`` are then the sequence index the masks read);
    None for 1-D positions.
    """

    batch: int
    tq: int
    tk: int
    causal: bool
    q_positions: torch.Tensor
    k_positions: torch.Tensor
    consecutive: bool = True
    runs: tuple[Segments, ...] | None = None

    @property
    def uniform(self) -> bool:
        return self.runs is None

    @property
    def embed_positions(self) -> torch.Tensor:
        return self.q_positions

    def spec(self, encoding: PositionalEncoding, scale: float, memo: ForwardMemo | None = None, log_gates: torch.Tensor | None = None,
             curves: torch.Tensor | None = None) -> ScoreSpec:
        """The one backend call of a uniform geometry (``log_gates`` (B, H, Tk), ``curves`` (B, H, Tq, R):
        see :class:`ScoreSpec`)."""
        return ScoreSpec(
            encoding=encoding, q_positions=self.q_positions, k_positions=self.k_positions, causal=self.causal, scale=scale,
            memo=ForwardMemo() if memo is None else memo,
            consecutive=self.consecutive, known_q_start=self._q_start, known_k_start=self._k_start, known_aligned=self._aligned, log_gates=log_gates,
            curves=curves,
        )

    def run_spec(self, run: Segments, encoding: PositionalEncoding, scale: float, memo: ForwardMemo,
                 log_gates: torch.Tensor | None = None, curves: torch.Tensor | None = None) -> ScoreSpec:
        """The backend call of one stacked run of a segmented geometry (``log_gates`` (n, H, Lk): the
        run's keys' gates; ``curves`` (n, H, Lq, R): the run's queries' curves)."""
        return ScoreSpec(encoding=encoding, q_positions=run.q_positions, k_positions=run.k_positions, causal=self.causal,
                         scale=scale, memo=memo, consecutive=run.consecutive, known_q_start=run.q_start,
                         known_k_start=run.k_start, known_aligned=run.aligned, log_gates=log_gates, curves=curves)

    def cached_spec(self, encoding: PositionalEncoding, scale: float, memo: ForwardMemo, *, causal: bool, k_positions: torch.Tensor,
                    k_start: int, starts: torch.Tensor | None, workspace: Workspace | None,
                    log_gates: torch.Tensor | None = None, curves: torch.Tensor | None = None) -> ScoreSpec:
        """The backend call of a step after a KV cache (a geometry of :meth:`step`): its queries, and
        the keys the layer's cache keeps, ``k_positions`` (Tk,) from ``k_start`` (a windowed cache
        forgets its oldest). ``starts`` (B,): each row's first real position (left padding) or None;
        ``workspace``: the buffers the cache keeps between steps; ``log_gates`` (B, H, Tk): every
        cached key's gate; ``curves`` (B, H, Tq, R): the new queries' curves."""
        return ScoreSpec(encoding=encoding, q_positions=self.q_positions, k_positions=k_positions, causal=causal, scale=scale,
                         memo=memo, consecutive=self.consecutive, starts=starts, workspace=workspace,
                         known_q_start=self._q_start, known_k_start=k_start, known_aligned=True, log_gates=log_gates,
                         curves=curves)

    # Filled by ``of`` for a uniform geometry (ints known without reading the device).
    _q_start: int = 0
    _k_start: int = 0
    _aligned: bool = True
    # Positions with an axis dimension (A, B', T), B' = 1 or B: the ids ``rotate`` reads (the masks
    # read q_positions / k_positions, then the sequence index). None: 1-D positions.
    q_axes: torch.Tensor | None = None
    k_axes: torch.Tensor | None = None

    @classmethod
    def of(
        cls,
        batch: int,
        tq: int,
        tk: int,
        device: torch.device | str = "cpu",
        *,
        positions: torch.Tensor | None = None,
        k_positions: torch.Tensor | None = None,
        causal: bool = True,
        document_ids: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        encoding: PositionalEncoding | None = None,
    ) -> Geometry:
        """Validate a call's positions, documents and padding, and plan its backend calls.

        Args:
            batch, tq, tk: rows B, queries Tq and keys Tk (queries are the last Tq keys when Tq < Tk).
            positions: the queries' positions, (Tq,) or (B, Tq); None: see the module docstring. For
                an ``encoding`` with ``position_axes`` A > 1 also with an axis dimension
                (:func:`posenc.call.axes.check_axis_positions`: (A, Tq) or (A, B, Tq) axis first, (Tq, A) or
                (B, Tq, A) axis last): the ids it rotates at; the masks then read the sequence
                index (the positions of a call without ``positions``).
            k_positions: the keys' positions, (Tk,) or (B, Tk); None: the queries' when Tq == Tk,
                else consecutive, ending at each row's last query. With an axis dimension when
                ``positions`` have one (required then when Tq < Tk).
            causal: a query sees only keys at or before its own position.
            document_ids: (B, T) integers, documents of packed rows (only when Tq == Tk).
            key_padding_mask: (B, Tk) bool, True on real tokens (one contiguous run per row).
            encoding: the encoding the positions are for (its ``position_axes`` and ``axis_first``);
                None: one position per token.

        Raises:
            UsageError: a shape, dtype or value outside what is described above, naming the argument.
        """
        if tq > tk:
            raise UsageError(f"queries ({tq}) must not outnumber keys ({tk}): the queries are the last keys")
        if positions is None and k_positions is not None:
            raise UsageError("k_positions needs positions (the queries' positions) as well")
        if position_axes_of(encoding)[0] > 1 and positions is not None:
            q_axes = check_axis_positions(encoding, positions, batch, tq)
            k_axes = None if k_positions is None else check_axis_positions(encoding, k_positions, batch, tk, "k_positions")
            if q_axes is not None or k_axes is not None:
                if k_positions is not None and (q_axes is None) != (k_axes is None):
                    raise UsageError("positions and k_positions must both have the axis dimension, or neither "
                                     f"({label(encoding)}: a 1-D position p is the id p on every axis)")
                if k_axes is None:
                    if tq != tk:
                        raise UsageError(f"k_positions (the keys' ids, with the axis dimension) are needed: positions have an "
                                         f"axis dimension and there are fewer queries ({tq}) than keys ({tk})")
                    k_axes = q_axes
                # The masks read the sequence index: the geometry of the same call without positions.
                frame = cls.of(batch, tq, tk, device, causal=causal, document_ids=document_ids, key_padding_mask=key_padding_mask)
                return replace(frame, q_axes=q_axes, k_axes=k_axes)
        if document_ids is not None:
            document_ids = _integer("document_ids", document_ids, f"(batch, length) = ({batch}, {tk})")
            if tq != tk:
                raise UsageError(f"document_ids needs as many queries as keys (self-attention without a cache), got {tq} and {tk}")
            if tuple(document_ids.shape) != (batch, tk):
                raise UsageError(f"document_ids must have shape (batch, length) = ({batch}, {tk}), got {tuple(document_ids.shape)}")
        if key_padding_mask is not None:
            if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
                raise UsageError(f"key_padding_mask must be a bool tensor (True = real token), got {in_words(key_padding_mask)}")
            if tuple(key_padding_mask.shape) != (batch, tk):
                raise UsageError(f"key_padding_mask must have shape (batch, keys) = ({batch}, {tk}), got {tuple(key_padding_mask.shape)}")
        if positions is not None:
            _integer("positions", positions, f"({tq},) or ({batch}, {tq})")
        if k_positions is not None:
            _integer("k_positions", k_positions, f"({tk},) or ({batch}, {tk})")
        shared = positions is None or positions.dim() == 1
        if positions is not None:
            if positions.shape not in ((tq,), (batch, tq)):
                raise UsageError(f"positions must have shape ({tq},) or (batch, {tq}) = ({batch}, {tq}), got {tuple(positions.shape)}"
                                 + one_axis_hint(encoding, positions))
        if k_positions is not None:
            if k_positions.shape not in ((tk,), (batch, tk)):
                raise UsageError(f"k_positions must have shape ({tk},) or (batch, {tk}) = ({batch}, {tk}), got {tuple(k_positions.shape)}"
                                 + one_axis_hint(encoding, k_positions))
            shared = shared and k_positions.dim() == 1
        if document_ids is None and key_padding_mask is None and shared:
            return cls._uniform(batch, tq, tk, device, positions, k_positions, causal)
        return cls._segmented(batch, tq, tk, device, positions, k_positions, causal, document_ids, key_padding_mask)

    @classmethod
    def step(
        cls,
        batch: int,
        t: int,
        past: int,
        device: torch.device | str = "cpu",
        *,
        positions: torch.Tensor | None = None,
        encoding: PositionalEncoding | None = None,
        next_positions: torch.Tensor | None = None,
    ) -> Geometry:
        """The geometry of a step of ``t`` tokens after a KV cache holding ``past``: the queries at the
        cache slots past..past+t-1 (what every mask reads), the keys at 0..past+t-1 (each layer's
        cache gives the positions of the keys it keeps).

        Args:
            positions: None; 1-D (t,), which must continue the cache (past..past+t-1); or, for an
                ``encoding`` with ``position_axes`` A > 1, ids with an axis dimension (as
                :meth:`of` takes them, e.g. (3, B, t) for M-RoPE): what ``rotate`` reads, free of
                the slots (``q_axes``).
            next_positions: (B,) each row's next id after positions with an axis dimension, as the
                cache recorded it (:meth:`posenc.model.cache.LayerCache.next_positions`), or None. With
                it, ``positions=None`` continues every row at its own next id, the same on every
                axis (M-RoPE's text after an image: max(id) + 1 over the row), and 1-D positions are
                refused: they would be cache slots, and a slot is not that row's position.

        Raises:
            UsageError: positions of another shape, 1-D positions that do not continue the cache,
                or 1-D positions after positions with an axis dimension.
        """
        axes = None
        if positions is not None:
            axes = check_axis_positions(encoding, positions, batch, t)
        elif next_positions is not None:
            axes = text_continuation(next_positions.to(device), t, position_axes_of(encoding)[0])  # (A, B, t)
        if axes is not None or positions is None:
            slots = torch.arange(past, past + t, device=device)  # (t,) cache slots
            return cls(batch, t, past + t, True, slots, slots, True, None, past, 0, True, axes, None)
        if next_positions is not None:
            raise UsageError(
                "positions: this cache continues positions with an axis dimension (each row at its own next id, "
                f"max(id) + 1), so 1-D positions, read as cache slots {past}..{past + t - 1}, would not be the tokens' "
                f"positions; give them with the axis dimension, or none to continue every row at its next id"
            )
        if isinstance(positions, torch.Tensor) and positions.dim() > 1:
            raise UsageError(f"with a KV cache, positions must be 1-D ({t},), continuing the cache at {past}, "
                             f"got shape {tuple(positions.shape)}" + one_axis_hint(encoding, positions))
        consecutive = check_positions(positions, t, past)
        return cls(batch, t, past + t, True, positions, positions, consecutive, None, past, 0, True)

    @classmethod
    def _uniform(cls, batch, tq, tk, device, positions, k_positions, causal) -> Geometry:
        if positions is None:  # the usual call: nothing to read from the device
            kp = torch.arange(tk, device=device)  # (Tk,)
            return cls(batch, tq, tk, causal, kp[tk - tq :], kp, True, None, tk - tq, 0, True)
        qv = positions.tolist()
        if k_positions is None:
            if tq == tk:
                k_positions, kv = positions, qv
            else:
                last = qv[-1] if qv else tk - 1
                kv = list(range(last - tk + 1, last + 1))
                k_positions = torch.tensor(kv, device=positions.device, dtype=positions.dtype)
        else:
            kv = k_positions.tolist()
        if tq == tk and qv and any(b <= a for a, b in zip(qv, qv[1:])):
            # Restarting positions: documents, packed in one row (never attended across).
            return cls._segmented(batch, tq, tk, device, positions, k_positions, causal, None, None)
        consecutive = True
        if qv:
            consecutive = _check_run(qv) and consecutive
        if kv and kv is not qv:  # (the keys' positions are the queries' in a full pass: checked above)
            consecutive = _check_run(kv, name="k_positions") and consecutive
        aligned = (not qv) or (len(qv) <= len(kv) and qv == kv[len(kv) - len(qv) :])
        return cls(batch, tq, tk, causal, positions, k_positions, consecutive, None,
                   qv[0] if qv else 0, kv[0] if kv else 0, aligned)

    @classmethod
    def _segmented(cls, batch, tq, tk, device, positions, k_positions, causal, document_ids, key_padding_mask) -> Geometry:
        shift = tk - tq  # query t is key t + shift
        real = key_padding_mask.tolist() if key_padding_mask is not None else None
        docs = document_ids.tolist() if document_ids is not None else None
        spans = []  # per row: (first real key, end)
        for b in range(batch):
            if real is None:
                spans.append((0, tk))
                continue
            row = real[b]
            idx = [j for j, r in enumerate(row) if r]
            if idx and idx[-1] - idx[0] + 1 != len(idx):
                raise UsageError(f"key_padding_mask row {b} must mark one contiguous run of real tokens (left or right padding)")
            spans.append((idx[0], idx[-1] + 1) if idx else (0, 0))
        # Positions (B, T) on the host: given, or counted from each row's first real token / document.
        if positions is None:
            kv_rows = []
            for b in range(batch):
                s, e = spans[b]
                row = [0] * tk
                count, prev = 0, None
                for j in range(s, e):
                    if docs is not None and prev is not None and docs[b][j] != prev:
                        count = 0
                    row[j] = count
                    count += 1
                    prev = None if docs is None else docs[b][j]
                kv_rows.append(row)
            qv_rows = [row[shift:] for row in kv_rows]
        else:
            qv_rows = positions.tolist()
            if positions.dim() == 1:
                qv_rows = [qv_rows] * batch
            if k_positions is not None:
                kv_rows = k_positions.tolist()
                if k_positions.dim() == 1:
                    kv_rows = [kv_rows] * batch
            elif tq == tk:
                kv_rows = qv_rows
            else:
                kv_rows = [list(range(r[-1] - tk + 1, r[-1] + 1)) if r else list(range(tk)) for r in qv_rows]
        groups: dict[tuple, list] = {}
        for b in range(batch):
            s, e = spans[b]
            for a0, a1 in _documents(qv_rows[b] if tq == tk else None, docs[b] if docs is not None else None, max(s, shift), e, tq == tk):
                # queries a0..a1-1 (key indices); their keys: the document (causal: up to the last query)
                k0 = a0 if tq == tk else s
                q_pos = qv_rows[b][a0 - shift : a1 - shift]
                k_pos = kv_rows[b][k0:a1]
                groups.setdefault((tuple(q_pos), tuple(k_pos)), []).append((b, a0, a1, k0))
        runs = []
        for (q_pos, k_pos), members in groups.items():
            consecutive = _check_run(list(q_pos)) and _check_run(list(k_pos), name="k_positions")
            q_index = torch.tensor([[b * tq + a - shift for a in range(a0, a1)] for b, a0, a1, _ in members], device=device)
            k_index = torch.tensor([[b * tk + j for j in range(k0, a1)] for b, _, a1, k0 in members], device=device)
            q_first = _tiled([b * tq + a0 - shift for b, a0, _, _ in members], len(q_pos))
            k_first = _tiled([b * tk + k0 for b, _, _, k0 in members], len(k_pos))
            runs.append(Segments(q_index, k_index, torch.tensor(q_pos, device=device), torch.tensor(k_pos, device=device), consecutive,
                            q_pos == k_pos[len(k_pos) - len(q_pos) :], q_pos[0], k_pos[0], q_first, k_first))
        q_rows = torch.tensor(qv_rows, device=device).clamp(min=0)  # (B, Tq): for embed (padding reads 0)
        k_rows = torch.tensor(kv_rows, device=device).clamp(min=0)
        return cls(batch, tq, tk, causal, q_rows, k_rows, all(r.consecutive for r in runs), tuple(runs))


def _documents(positions: list[int] | None, docs: list | None, start: int, end: int, self_attention: bool):
    """(a0, a1) key-index ranges of the documents in [start, end): split where the document id
    changes or (self-attention) where the positions do not increase."""
    if start >= end:
        return []
    if not self_attention:
        return [(start, end)]
    out, a0 = [], start
    for j in range(start + 1, end):
        new = (docs is not None and docs[j] != docs[j - 1]) or (positions is not None and positions[j] <= positions[j - 1])
        if new:
            out.append((a0, j))
            a0 = j
    out.append((a0, end))
    return out


__all__ = ["Geometry", "Segments", "check_positions"]
