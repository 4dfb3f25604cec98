"""One backend call's scores: :class:`ScoreSpec`, what a backend receives besides q, k, v.

1-D positions (the queries' (Tq,) and the keys' (Tk,)), the encoding, ``causal``, ``scale``, and
the derived facts the backends' fast paths rely on (``consecutive``, ``q_start`` / ``k_start``,
``aligned``), plus the score terms a backend asks for through it (the encoding's biases, query and
value terms, scores, and FoX's gates: :func:`gate_decay`). A :class:`~posenc.call.geometry.Geometry`
makes them, once per call or per model forward; a backend never re-derives positions.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field

import torch

from ..encodings.base import PositionalEncoding
from ..encodings.protocol import Biases, QueryTerms, RelativeBias, Scores, Selects, ValueTerms, offers, require
from .memo import ForwardMemo, Workspace


@dataclass(kw_only=True)
class ScoreSpec:
    """Everything besides q, k, v that defines the scores of one backend call (1-D positions).

    ``consecutive``, ``q_start``, ``k_start`` and ``aligned`` are derived from the positions when
    not given (one host read); :class:`Geometry` gives them, so a model forward reads positions once.
    """

    encoding: PositionalEncoding
    q_positions: torch.Tensor  # (Tq,) absolute positions of the queries
    k_positions: torch.Tensor  # (Tk,) absolute positions of the keys
    causal: bool
    scale: float
    # What this model forward computes once for all its layers (a fresh one for a lone call).
    memo: ForwardMemo = field(default_factory=ForwardMemo, repr=False)
    # Positions step by one (the usual case). Randomized positions skip values: then only backends
    # that read every position (eager, sdpa with a dense bias) may run the call.
    consecutive: bool = True
    # Left padding (generation in batches): row b's real tokens start at position starts[b] (B,);
    # keys before it are hidden from the row's real queries. A padding query sees the padding
    # before it (so no softmax row is empty); its output is never used. None: no padding.
    starts: torch.Tensor | None = None
    # Buffers kept between decode steps by the KV cache; None for a lone call.
    workspace: Workspace | None = field(default=None, repr=False)
    # First query / key position (consecutive positions: query a is key a + q_start - k_start),
    # and whether the queries are the last Tq keys, position for position (a full pass, or a cached
    # step): derived from the positions, or given as known_* by a caller that knows them already.
    q_start: int = field(init=False)
    k_start: int = field(init=False)
    aligned: bool = field(init=False)
    # Per-key log forget gates (B, H, Tk) of the keys, in key order (:class:`Gates`, the Forgetting
    # Transformer): the score of query i and key j gains sum of log f_l over the keys l after j up
    # to i. None: no gates. Only backends that know them run such a call (``gated``, ``eager``):
    # they make ``has_query_terms`` true, so every fast path without them steps aside.
    log_gates: torch.Tensor | None = field(default=None, repr=False)
    # Per-query bias curves over backward distance (B, H, Tq, R) of the queries, in query order
    # (:class:`Curves`, the Inkling bias): query i and key j gain curves[i, p_i - p_j] for
    # 0 <= p_i - p_j < R. None: no curves. Like the gates, they make ``has_query_terms`` true, so
    # only backends that read them (``curved``, ``eager``) run such a call.
    curves: torch.Tensor | None = field(default=None, repr=False)
    # Selective attention (:class:`Selects`): each key's sum of the selection S over the queries of
    # earlier calls (B, Tk), kept by the KV cache; None: no earlier queries (a full pass, the first
    # step). A selective call makes ``has_query_terms`` true: ``selective`` (blocks of queries) and ``eager`` run it.
    selected: torch.Tensor | None = field(default=None, repr=False)
    known_q_start: InitVar[int | None] = None
    known_k_start: InitVar[int | None] = None
    known_aligned: InitVar[bool | None] = None

    def __post_init__(self, known_q_start: int | None, known_k_start: int | None, known_aligned: bool | None) -> None:
        tq, tk = self.q_positions.numel(), self.k_positions.numel()
        if self.workspace is None:
            self.workspace = self.memo.workspace  # a caller's cache outside posenc (posenc.hf), or None
        if known_q_start is None:
            known_q_start = int(self.q_positions[0]) if tq else 0
        if known_k_start is None:
            known_k_start = int(self.k_positions[0]) if tk else 0
        if known_aligned is None:
            if tq == 0 or tq > tk:
                known_aligned = tq == 0
            else:
                known_aligned = bool(self.q_positions[0] == self.k_positions[tk - tq]) and bool(self.q_positions[-1] == self.k_positions[-1])
        self.q_start, self.k_start, self.aligned = known_q_start, known_k_start, known_aligned
        # What the encoding offers, asked once per spec (plain attributes: nothing for a compiler to trace).
        self.has_bias = offers(self.encoding, Biases)
        self.selective = offers(self.encoding, Selects)
        self.has_query_terms = offers(self.encoding, QueryTerms) or self.log_gates is not None or self.curves is not None or self.selective
        self.has_value_terms = offers(self.encoding, ValueTerms)
        self.has_score_mod = offers(self.encoding, Scores)
        self.relative_bias = offers(self.encoding, RelativeBias)  # a bias of i - j alone

    @property
    def contained(self) -> bool:
        """Consecutive positions, and every query position is also a key position (so every
        causal row sees itself)."""
        tq, tk = self.q_positions.numel(), self.k_positions.numel()
        return self.consecutive and tq > 0 and tk > 0 and self.q_start >= self.k_start and self.q_start + tq <= self.k_start + tk

    @property
    def offset(self) -> int:
        """Query a is key a + offset (consecutive positions)."""
        return self.q_start - self.k_start

    @property
    def plain(self) -> bool:
        """No score terms at all: content attention plus (maybe) the causal mask."""
        return not (self.has_bias or self.has_query_terms or self.has_value_terms)

    def bias(self, q_positions: torch.Tensor | None = None, k_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Dense (H, Tq, Tk) bias for these (or the given) queries and keys; the whole call's is
        memoised per forward for encodings shared across layers."""
        whole_q = q_positions is None or q_positions is self.q_positions
        whole_k = k_positions is None or k_positions is self.k_positions
        if whole_q and whole_k:
            return self.memo.dense_bias(self.encoding, self.q_positions, self.k_positions)
        return require(self.encoding, Biases).bias(self.q_positions if q_positions is None else q_positions,
                                                   self.k_positions if k_positions is None else k_positions)

    def allowed(self, q_positions: torch.Tensor | None = None) -> torch.Tensor | None:
        """(Tq, Tk) bool, True where a query may see a key; None when every pair is allowed."""
        if not self.causal:
            return None
        q_positions = self.q_positions if q_positions is None else q_positions
        return self.k_positions[None, :] <= q_positions[:, None]

    def hidden(self, q_positions: torch.Tensor | None = None) -> torch.Tensor | None:
        """(B, 1, Tq, Tk) bool, True where left padding hides a key from a query (a padding key,
        a real query); None without padding."""
        if self.starts is None:
            return None
        q_positions = self.q_positions if q_positions is None else q_positions
        starts = self.starts[:, None, None, None]  # (B, 1, 1, 1)
        return (self.k_positions[None, None, None, :] < starts) & (q_positions[None, None, :, None] >= starts)

    def query_terms(self, q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor, cumulative: torch.Tensor | None = None,
                    penalty: torch.Tensor | None = None) -> torch.Tensor:
        """Every query-dependent score term of these queries, (B, H, C, Tk) in logits: the
        encoding's ``query_terms``, the gates' decay (``cumulative``: :meth:`cumulative_gates`), the
        curves, and minus the selection (``penalty`` (B, C, Tk): these queries' rows of
        :meth:`selection_penalty`, computed once per call from all of its queries). Only for a call
        that has them (``has_query_terms``).

        Raises:
            TypeError: the call has no query terms (a backend's bug, not a user's).
        """
        enc = self.encoding
        terms = enc.query_terms(q, k, q_positions, self.k_positions) if offers(enc, QueryTerms) else None
        if self.log_gates is not None:
            decay = gate_decay(self.cumulative_gates() if cumulative is None else cumulative, q_positions, self.k_positions)
            terms = decay if terms is None else terms.to(decay.dtype) + decay
        if self.curves is not None:
            rows = self.curves
            if q_positions is not self.q_positions:  # a block of the queries: their rows (positions increase)
                rows = rows[:, :, torch.searchsorted(self.q_positions, q_positions)]  # (B, H, C, R)
            bias = curve_bias(rows, q_positions, self.k_positions)
            terms = bias if terms is None else terms + bias.to(terms.dtype)
        if self.selective:
            if penalty is None:
                raise TypeError("a selective call's query terms need its penalty rows (selection_penalty, once per call)")
            minus = -penalty[:, None]  # (B, 1, C, Tk): the same for every head
            terms = minus if terms is None else terms + minus.to(terms.dtype)
        if terms is None:
            raise TypeError(f"{type(enc).__name__} has no query terms here (ask has_query_terms first)")
        return terms

    def cumulative_gates(self) -> torch.Tensor:
        """c = cumsum of the log gates over the keys, (B, H, Tk), in float32 (float64 for float64)."""
        g = self.log_gates
        if g is None:
            raise TypeError("cumulative_gates of a call without log gates (ask log_gates first)")
        return g.cumsum(-1, dtype=torch.float64 if g.dtype == torch.float64 else torch.float32)

    def selection(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """S (B, Tq, Tk) of selective attention (Leviathan et al. 2024, §3): relu of the selecting
        head's scores, 0 where a query does not select a key: the key itself (the diagonal), the first
        key (each row's first real one with left padding), a key after the query or hidden from it.
        In the scores' dtype (float32 at least)."""
        scores = require(self.encoding, Selects).selection_scores(q, k)  # (B, Tq, Tk)
        s = torch.relu(scores.to(torch.promote_types(scores.dtype, torch.float32)))
        qp, kp = self.q_positions[:, None], self.k_positions[None, :]  # (Tq, 1), (1, Tk)
        off = (kp >= qp) if self.causal else (kp == qp)  # (Tq, Tk): later keys and the key itself
        if self.starts is None:
            s = s.masked_fill(off | (kp == self.k_positions[:1]), 0.0)
        else:  # left padding: padding keys, and each row's first real key, select nothing
            starts = self.starts[:, None, None]  # (B, 1, 1)
            s = s.masked_fill(off | ((kp[None] <= starts) & (qp[None] >= starts)), 0.0)
        return s

    def selection_penalty(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """F (B, Tq, Tk): each key's selection summed over the queries before each query, those of
        this call (an exclusive cumulative sum over its queries) and those of earlier calls
        (``selected``)."""
        s = self.selection(q, k)
        f = s.cumsum(1) - s  # (B, Tq, Tk): the queries before each one
        return f if self.selected is None else f + self.selected[:, None, :].to(f.dtype)

    def part(self, q_positions: torch.Tensor, k_positions: torch.Tensor, *, padded: bool = False, q_start: int | None = None,
             k_start: int | None = None, curves: torch.Tensor | None = None, log_gates: torch.Tensor | None = None) -> ScoreSpec:
        """The same call for a sub-range of its queries and keys, without log gates unless given
        (``log_gates`` (B, H, Lk): these keys' gates, a window's block whose keys include each of its
        queries' own key; the sums start over at the block's first key, and c_i - c_j does not
        change). ``padded``: keep the left padding (``starts``)
        and, for a single query, this call's workspace (a decode step); else neither, and the
        workspace is the memo's (a caller's cache outside posenc, whose entries are keyed by what
        made them). ``q_start`` / ``k_start``: the first positions, when the caller knows them.
        ``curves`` (B, H, C, R): these queries' rows of the call's curves (a window's block), or None."""
        keep = padded and q_positions.numel() == 1
        return ScoreSpec(encoding=self.encoding, q_positions=q_positions, k_positions=k_positions, causal=self.causal, scale=self.scale,
                         memo=self.memo, consecutive=self.consecutive, starts=self.starts if padded else None,
                         workspace=self.workspace if keep else None, known_q_start=q_start, known_k_start=k_start, curves=curves,
                         log_gates=log_gates)


def curve_bias(curves: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """The curves' score term (the Inkling bias, :class:`~posenc.encodings.protocol.Curves`), (B, H, C, Tk).

    ``curves`` (B, H, C, R): the bias of each of these C queries (at ``q_positions`` (C,)) over the
    backward distances 0..R-1; key j at ``k_positions[j]`` gets curves[..., p_i - p_j] when
    0 <= p_i - p_j < R and 0 otherwise (keys after the query, keys R or more behind it).
    """
    r = curves.shape[-1]
    distance = q_positions[:, None] - k_positions[None, :]  # (C, Tk)
    inside = (distance >= 0) & (distance < r)
    index = distance.clamp(0, r - 1).expand(*curves.shape[:2], -1, -1)  # (B, H, C, Tk), a view
    return curves.gather(-1, index).masked_fill(~inside, 0.0)


def gate_decay(cumulative: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """The gates' score term (Lin et al. 2025, "Forgetting Transformer", eq. 4), (B, H, C, Tk).

    ``cumulative`` (B, H, Tk): c = cumsum of the keys' log gates. Query i (its own key, the last
    key at or before its position) and key j get sum_{l=j+1..i} log f_l = c_i - c_j; a key after
    the query (bidirectional calls) gets c_j - c_i, the gates between them. The difference is
    taken here, for these C queries only, in c's dtype.
    """
    own = (torch.searchsorted(k_positions, q_positions, right=True) - 1).clamp(min=0)  # (C,) key index
    ci = cumulative[..., own, None]  # (B, H, C, 1)
    cj = cumulative[..., None, :]  # (B, H, 1, Tk)
    later = (k_positions[None, :] > q_positions[:, None])  # (C, Tk)
    return torch.where(later, cj - ci, ci - cj)


__all__ = ["ScoreSpec", "curve_bias", "gate_decay"]
