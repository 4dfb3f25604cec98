"""``posenc.attend``: attention with a positional encoding, as one function call.

The drop-in for ``torch.nn.functional.scaled_dot_product_attention`` when the attention has a
positional encoding: the caller brings q, k, v from their own projections (grouped-query heads
allowed), posenc applies the encoding's rotation and score terms and runs the fastest exact
backend for it, for shared or per-row positions, packed documents and padded rows
(:mod:`posenc.call.geometry`).

    out = posenc.attend(q, k, v, rope)                                     # (B, H, T, D)
    out = posenc.attend(q, k, v, alibi, document_ids=doc)                  # packed rows
    out = posenc.attend(q, k, v, t5, key_padding_mask=mask)                # padded rows
    out = posenc.attend(q, k, v, rope, window=128)                         # sliding window

Shape legend: B batch, H query heads, Hkv key/value heads (H a multiple of Hkv), Tq queries,
Tk keys, D head dim.

Grouped-query attention (Ainslie et al. 2023, "GQA"): query head h uses key/value head
h // (H // Hkv), the order of Hugging Face's ``repeat_kv``. Encodings stay per query head (a bias
per query head, Shaw's tables, T5's table). Plain attention (NoPE, RoPE) broadcasts the key/value
heads inside the fused kernel (``enable_gqa``); the score-term backends get them repeated.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace
from typing import cast

import torch

from . import backends
from .backends.parts import remapped, windows
from .backends.parts.windows import Extras
from .call.axes import as_taken, check_takes_axes
from .call.geometry import Geometry, Segments
from .call.inputs import check_curves, check_gates, check_qkv
from .call.memo import ForwardMemo
from .call.spec import ScoreSpec
from .encodings import build
from .encodings.base import PositionalEncoding, content_scale
from .encodings.protocol import Remaps, Rotates, Selects, offers, require
from .encodings.query_scale import QueryScale, scaled_queries
from .errors import UsageError

#: The refusal of forget gates with a window, chunk or sinks in posenc's own layer (Attention, schedules: its
#: windowed KV cache keeps no gates); attend takes them (the blocks of posenc.backends.parts.windows).
GATES_ALONE = "log_gates (forget gates) take no window, chunk, sinks or softcap: give the full causal attention"
#: The same refusal for per-query bias curves (the Inkling bias).
CURVES_ALONE = "query_curves (bias curves over distance) take no window, chunk, sinks or softcap: give the full attention"
#: And for selective attention (its selection sums run over every earlier query and key).
SELECTS_ALONE = "selective attention takes no window, chunk, sinks or softcap: give the full causal attention"


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    encoding: PositionalEncoding | None = None,
    *,
    positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
    causal: bool = True,
    scale: float | None = None,
    document_ids: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    rotate: bool = True,
    backend: str = "auto",
    geometry: Geometry | None = None,
    memo: ForwardMemo | None = None,
    window: int | None = None,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
    query_scale: QueryScale | None = None,
    log_gates: torch.Tensor | None = None,
    softcap: float | None = None,
    query_curves: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention with ``encoding``'s positions: (B, H, Tq, D).

    Args:
        q: queries (B, H, Tq, D).
        k: keys (B, Hkv, Tk, D); H must be a multiple of Hkv (grouped-query or multi-query heads).
        v: values (B, Hkv, Tk, D).
        encoding: a posenc encoding built for H heads and head dim D (``posenc.build(...)``); None
            is NoPE. Its ``embed`` hook (absolute methods) is not applied here: it acts on token
            embeddings, before the projections.
        positions: the queries' positions, (Tq,) or (B, Tq) integers; None: 0..T-1 (restarting at
            each document, counted from each row's first real token). For an encoding with
            ``position_axes`` A > 1, also ids with an axis dimension: (A, Tq) or (A, B, Tq) for
            M-RoPE (temporal, height, width, as Qwen2-VL passes them), (Tq, A) or (B, Tq, A) for a
            patch grid (x, y). q is rotated at them and k at ``k_positions``; the masks (causal,
            documents, padding, window, chunks) and a query scale read the sequence index, the
            positions of the same call without ``positions``. Other encodings refuse them.
        k_positions: the keys' positions, (Tk,) or (B, Tk); None: the queries' when Tq == Tk,
            else consecutive, ending at each row's last query (the queries are the last keys).
            With an axis dimension when ``positions`` have one (then required if Tq < Tk).
        causal: a query sees only keys at or before it.
        scale: the factor of q . k; None: the encoding's ``content_scale``, else 1 / sqrt(D).
        document_ids: (B, T) integers (Tq == Tk): packed rows, no attention across documents
            (a document is a run of equal ids); positions restart at each document by default.
        key_padding_mask: (B, Tk) bool, True on real tokens, one contiguous run per row (left or
            right padding); outputs at padding queries are 0.
        rotate: apply the encoding's rotation (RoPE family); False when q and k come rotated.
        backend: "auto" or one of :func:`posenc.backends.names`.
        geometry: a :class:`~posenc.call.geometry.Geometry` built once for several calls (a model's
            layers); replaces ``positions``, ``k_positions``, ``document_ids`` and
            ``key_padding_mask``.
        memo: a :class:`~posenc.call.memo.ForwardMemo` shared by the layers of one model forward.
        window: sliding window W: a causal query at i sees keys i-W < j <= i, a bidirectional one
            |i - j| <= W // 2 (:mod:`posenc.backends.parts.windows`); None: every key.
        chunk: chunked attention of size C: a query sees the keys of its chunk [cC, (c+1)C) of
            positions, which stay global (Llama 4); None: no chunks. Not with ``window``.
        sinks: (H,) attention-sink logits, one per query head, in every softmax row with no value
            (gpt-oss), or (B, H, Tq) per-query sink logits, one per softmax row (Inkling-2's
            ``sink_proj`` of each token's layer input); None: no sinks.
        query_scale: a per-query factor of the positions (:mod:`posenc.encodings.query_scale`: Llama 4's
            temperature, Ministral 3's beta form, Scalable-Softmax), applied after the rotation.
        log_gates: (B, H, Tk) per-key log forget gates (finite, <= 0), the keys' ``encoding.log_gates(x)``
            for an encoding with the ``Gates`` hook (the Forgetting Transformer): query i and key j
            gain the sum of the gates of the keys after j up to i (restarting at each document).
            Required for such an encoding; None otherwise. They take a window, chunks, sinks and a
            soft cap (the blocks of :mod:`posenc.backends.parts.windows`).
        softcap: logit soft-capping (Gemma 2): each content score s = q . k * scale becomes
            ``softcap * tanh(s / softcap)`` before the position terms and masks; None: no cap.
        query_curves: (B, H, Tq, R) per-query bias curves over backward distance, the queries'
            ``encoding.query_curves(x, positions)`` for an encoding with the ``Curves`` hook (the
            Inkling bias): query i and key j gain ``query_curves[..., i, p_i - p_j]`` when
            0 <= p_i - p_j < R. Required for such an encoding; None otherwise. They take a window,
            chunks, sinks and a soft cap (the blocks of :mod:`posenc.backends.parts.windows`).

    Returns:
        (B, H, Tq, D) in q's dtype.

    Raises:
        UsageError: shapes that do not fit (naming the argument), an encoding built for other
            sizes, or a forced backend that cannot run the call.
    """
    encoding = _encoding_of(encoding, q, causal)
    b, h, hkv, tq, tk, d = check_qkv(q, k, v, encoding)
    q, k, v = _dtypes(q, k, v)
    check_gates(log_gates, encoding, b, h, tk)
    check_curves(query_curves, encoding, b, h, tq)
    if getattr(encoding, "causal", causal) != causal:
        raise UsageError(f"encoding was built with causal={encoding.causal}; attend got causal={causal}")
    backends.check_name(backend)
    scale = content_scale(encoding, d) if scale is None else check_scale(scale)
    if geometry is None:
        geometry = Geometry.of(b, tq, tk, q.device, positions=positions, k_positions=k_positions, causal=causal,
                               document_ids=document_ids, key_padding_mask=key_padding_mask, encoding=encoding)
    elif (geometry.batch, geometry.tq, geometry.tk) != (b, tq, tk):
        raise UsageError(f"geometry was built for (batch, queries, keys) = {(geometry.batch, geometry.tq, geometry.tk)}, got {(b, tq, tk)}")
    extras = None
    if window is not None or chunk is not None or sinks is not None or query_scale is not None or softcap is not None:
        extras = Extras(window, chunk, sinks, query_scale, softcap)
        if sinks is not None and sinks.dim() == 3 and tuple(sinks.shape) != (b, h, tq):
            raise UsageError(f"per-query sinks must have shape (batch, heads, queries) = {(b, h, tq)}, got {tuple(sinks.shape)}")
        if offers(encoding, Selects) and extras.restricts:
            raise UsageError(SELECTS_ALONE)
    if q.numel() == 0 or tk == 0:  # nothing in, nothing out; a query that sees no key gets 0 (docs/conventions.md)
        return q.new_zeros(b, h, tq, v.shape[-1])
    with _autocast_off(q):
        return run_geometry(q, k, v, encoding, geometry, scale, ForwardMemo() if memo is None else memo, backend, rotate, extras,
                            log_gates, query_curves)[0]


def _encoding_of(encoding: object, q: object, causal: bool) -> PositionalEncoding:
    """The encoding of a call: a built posenc encoding as it is, a registry name built for q's heads
    and head dim, None for NoPE.

    Raises:
        UsageError: anything else (naming its type), or an unknown name.
    """
    if isinstance(encoding, PositionalEncoding):
        return encoding
    if encoding is not None and not isinstance(encoding, str):
        raise UsageError(f"encoding must be a posenc encoding (posenc.build(...)), a registry name or None, "
                         f"got {type(encoding).__name__}")
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise UsageError(f"q must be a 4-D tensor (batch, heads, length, head_dim), got {getattr(q, 'shape', type(q).__name__)}")
    return build("nope" if encoding is None else encoding, num_heads=q.shape[1], head_dim=q.shape[-1], causal=causal)


def check_scale(scale: object) -> float:
    """``scale`` as a float.

    Raises:
        UsageError: not a real number, or not finite and > 0.
    """
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise UsageError(f"scale must be a finite number > 0 (the factor of q . k) or None, got {scale!r}")
    return float(scale)


def _dtypes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v in one floating dtype: under ``torch.autocast`` the autocast dtype (as
    ``F.scaled_dot_product_attention`` casts them), else as given.

    Raises:
        UsageError: an integer or boolean input, or dtypes that differ outside autocast.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not x.is_floating_point():
            raise UsageError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    device = q.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        return q.to(dtype), k.to(dtype), v.to(dtype)
    if not q.dtype == k.dtype == v.dtype:
        raise UsageError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype} (or run under torch.autocast)")
    return q, k, v


def _autocast_off(q: torch.Tensor) -> contextlib.AbstractContextManager:
    """Inside the call autocast is off: the inputs already hold its dtype, and each backend keeps
    its own accumulation dtypes (docs/precision.md)."""
    if torch.is_autocast_enabled(q.device.type):
        return torch.autocast(q.device.type, enabled=False)
    return contextlib.nullcontext()


def run_geometry(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, encoding: PositionalEncoding, geometry: Geometry, scale: float,
                 memo: ForwardMemo, backend: str, rotate: bool, extras: Extras | None = None,
                 log_gates: torch.Tensor | None = None, curves: torch.Tensor | None = None) -> tuple[torch.Tensor, str]:
    """(out, the registered name of the backend that ran) for inputs :func:`attend` has checked, on
    a made :class:`Geometry`: a uniform call, or its runs of segments. :class:`posenc.Attention`
    calls it with its own checks done. ``curves`` (B, H, Tq, R) travel with their queries."""
    q_axes, k_axes = geometry.q_axes, geometry.k_axes
    if q_axes is not None:
        # Ids with an axis dimension: q and k rotated once, each token at its own ids, before the
        # call is cut into segments (a rotation acts token by token); the segments' 1-D positions
        # are the sequence index, which only the masks read.
        check_takes_axes(encoding, q_axes)
        if rotate and k_axes is not None and offers(encoding, Rotates):
            rotation = require(encoding, Rotates)
            q, k = rotation.rotate(q, k, as_taken(encoding, q_axes), as_taken(encoding, k_axes))
        rotate = False
    if geometry.uniform:
        calls = [(q, k, v, geometry.spec(encoding, scale, memo, log_gates, curves), extras)]
    else:
        calls, q_cut = _stacked_runs(q, k, v, encoding, geometry, scale, memo, rotate, log_gates, curves, extras)
    outs, name = [], backend
    for qs, ks, vs, spec, more in calls:
        o, name = run(qs, ks, vs, spec, backend, rotate, more)
        outs.append(o)
    if geometry.uniform:
        return outs[0], name
    return _put_back(outs, geometry, q, v, q_cut), name


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec, backend: str = "auto",
        rotate: bool = True, extras: Extras | None = None) -> tuple[torch.Tensor, str]:
    """One backend call on 1-D positions: rotation, grouped heads, the backend; (out, backend name).
    ``extras`` (:class:`posenc.backends.parts.windows.Extras`): a query scale after the rotation, then a window,
    chunks or sinks through :func:`posenc.backends.parts.windows.attend`. Inputs whose last dimension is not
    contiguous, or that repeat memory (stride 0), are copied first: the CPU flash kernel and the
    backends' own loops read rows of unit stride."""
    q, k, v = _kernel_ready(q), _kernel_ready(k), _kernel_ready(v)
    if (spec.causal and spec.q_start < spec.k_start and spec.starts is None and spec.log_gates is None and spec.curves is None
            and not spec.selective and spec.k_positions.numel()):
        return _unseen(q, k, v, spec, backend, rotate, extras)
    enc = spec.encoding
    if offers(enc, Remaps):  # rotated per region, inside (q and k always come un-rotated: it has no rotate hook)
        return remapped.attend(q, k, v, spec, extras, backend)
    if rotate and offers(enc, Rotates):
        q, k = enc.rotate(q, k, spec.q_positions, spec.k_positions)
    if extras is not None:
        if extras.query_scale is not None:
            q = scaled_queries(q, extras.query_scale, spec.q_positions)
        if extras.restricts:
            return windows.attend(q, k, v, spec, extras, backend, backends.attend)
    return backends.attend(backend, q, k, v, spec)


def _unseen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec, backend: str, rotate: bool,
            extras: Extras | None) -> tuple[torch.Tensor, str]:
    """A causal call whose first queries come before every key: those queries see no key and get
    0 (every backend alike, docs/conventions.md); the others run as one call."""
    seen = spec.q_positions >= spec.k_positions.min()  # (Tq,)
    index = seen.nonzero().squeeze(-1)
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])  # (B, H, Tq, Dv)
    if not index.numel():
        return out, backend
    if extras is not None and extras.sinks is not None and extras.sinks.dim() == 3:  # per-query sinks: those queries' rows
        extras = replace(extras, sinks=extras.sinks[:, :, index])
    o, name = run(q[:, :, index], k, v, spec.part(spec.q_positions[index], spec.k_positions), backend, rotate, extras)
    return out.index_copy(2, index, o), name


def _kernel_ready(x: torch.Tensor) -> torch.Tensor:
    if x.stride(-1) != 1 or any(st == 0 and n > 1 for st, n in zip(x.stride(), x.shape)):
        return x.contiguous()
    return x


def _stacked_runs(q, k, v, encoding, geometry: Geometry, scale: float, memo: ForwardMemo, rotate: bool,
                  log_gates: torch.Tensor | None, curves: torch.Tensor | None = None, extras: Extras | None = None,
                  ) -> tuple[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, ScoreSpec, Extras | None]], Cut | None]:
    """Each run of identical segments of a segmented geometry as one stacked backend call: (q, k, v,
    spec, extras) of n segments, (n, H, Lq, D), (n, Hkv, Lk, D), (n, Hkv, Lk, Dv); per-key log gates travel
    with their keys, so their sums restart at each segment, and per-query curves and per-query sinks
    (``extras.sinks`` (B, H, Tq), carried as one more column of the curves) with their queries. Also the row's cut at its queries
    (:func:`_row_pieces`) for :func:`_put_back` when the runs are tiled views of one row, else None.

    One row whose runs each tile a contiguous range (the equal documents of a packed row) stacks
    each run as a view of q, k, v in their own head-major layout, every (document, head) block of
    L x D contiguous, as in a batch of the documents: no copy before the kernels. Any other geometry
    gathers each run's tokens from the token-major (B*T, H, D) rows.
    """
    b, h, tq, d = q.shape
    tk, hkv = k.shape[2], k.shape[1]
    runs = geometry.runs or ()  # a segmented geometry has its runs
    sinks = None if extras is None or extras.sinks is None or extras.sinks.dim() != 3 else extras.sinks  # (B, H, Tq)
    if sinks is not None:  # per-query sinks ride with the queries as the curves' last column
        column = sinks[..., None]  # (B, H, Tq, 1)
        curves = column if curves is None else torch.cat((curves, column.to(curves.dtype)), dim=-1)
    rows: tuple
    q_cut: Cut | None = None
    if b == 1 and all(seg.q_first is not None and seg.k_first is not None for seg in runs):
        stack, contiguous = _tiled_stack, False
        q_cut = _row_pieces([(seg.q_first, seg.q_index.numel()) for seg in runs], tq)
        k_cut = _row_pieces([(seg.k_first, seg.k_index.numel()) for seg in runs], tk)
        rows = (_split(q, q_cut), _split(k, k_cut), _split(v, k_cut), None if log_gates is None else _split(log_gates, k_cut),
                None if curves is None else _split(curves, q_cut))
    else:
        stack, contiguous = _gathered_stack, rotate and offers(encoding, Rotates)  # the rotation reads contiguous rows faster
        rows = (q.transpose(1, 2).reshape(b * tq, h, d), k.transpose(1, 2).reshape(b * tk, hkv, d),  # (B*T, H, D)
                v.transpose(1, 2).reshape(b * tk, hkv, v.shape[-1]),
                None if log_gates is None else log_gates.transpose(1, 2).reshape(b * tk, h),  # (B*Tk, H)
                None if curves is None else curves.transpose(1, 2).reshape(b * tq, h, curves.shape[-1]))  # (B*Tq, H, R)
    calls = []
    for i, seg in enumerate(runs):
        qs, ks, vs, gs, cs = stack(seg, i, *rows)  # (n, H, Lq, D), (n, Hkv, Lk, D), (n, Hkv, Lk, Dv), (n, H, Lk), (n, H, Lq, R)
        if contiguous:
            qs, ks = qs.contiguous(), ks.contiguous()
        more = extras if sinks is None or cs is None else replace(cast(Extras, extras), sinks=cs[..., -1].to(sinks.dtype))
        if sinks is not None and cs is not None:  # the run's sinks came as the curves' last column
            cs = cs[..., :-1] if cs.shape[-1] > 1 else None
        calls.append((qs, ks, vs, geometry.run_spec(seg, encoding, scale, memo, gs, cs), more))
    return calls, q_cut


def _put_back(outs: list[torch.Tensor], geometry: Geometry, q: torch.Tensor, v: torch.Tensor, q_cut: Cut | None) -> torch.Tensor:
    """The runs' outputs (n, H, Lq, Dv) in place, (B, H, Tq, Dv): a single run that holds every query
    in order is the output as it is; one row whose runs hold disjoint ranges (the tiled runs of a
    packed row, ``q_cut`` from :func:`_stacked_runs`) is one ``cat`` in token order, head-major as its
    views were taken, gaps (padding) 0;
    else one scatter, token-major as several rows were gathered, the queries of no run 0."""
    b, h, tq, _ = q.shape
    runs = geometry.runs or ()
    if b == 1:
        parts, dim = [o.transpose(0, 1).reshape(h, -1, o.shape[-1]) for o in outs], 1  # (H, n*Lq, Dv)
    else:
        parts, dim = [o.transpose(1, 2).reshape(-1, h, o.shape[-1]) for o in outs], 0  # (n*Lq, H, Dv)
    if len(runs) == 1 and runs[0].q_first == 0 and runs[0].q_index.numel() == b * tq:  # one run, every query in order
        out = parts[0]
    elif q_cut is not None and (at := q_cut[1]) is not None:
        sizes = q_cut[0]
        pieces: list[torch.Tensor | None] = [None] * len(sizes)
        for j, part in zip(at, parts):
            pieces[j] = part
        out = torch.cat([q.new_zeros(h, n, v.shape[-1]) if x is None else x for x, n in zip(pieces, sizes)], dim=1)
    else:
        out = q.new_zeros(h, tq, v.shape[-1]) if b == 1 else q.new_zeros(b * tq, h, v.shape[-1])
        if parts:
            out = out.index_copy(dim, torch.cat([seg.q_index.reshape(-1) for seg in runs]), torch.cat(parts, dim=dim))
    return out.unsqueeze(0) if b == 1 else out.view(b, tq, h, -1).transpose(1, 2)


Stacks = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


Cut = tuple[list[int], list[int] | None]


def _row_pieces(spans: list[tuple[int | None, int]], t: int) -> Cut:
    """How one row's T queries or keys split at its tiled runs, given each run's (first token, number
    of tokens): (sizes of the pieces in order, covering [0, T) with the gaps between runs as pieces of
    their own; for each run the index of its piece), or ([T], None) when two runs share tokens (each
    run then slices the row)."""
    order = sorted(range(len(spans)), key=lambda i: spans[i][0] or 0)
    sizes, at, end = [], [0] * len(spans), 0
    for i in order:
        first, size = spans[i]
        assert first is not None  # (a tiled run)
        if first < end:
            return [t], None
        if first > end:
            sizes.append(first - end)
        at[i] = len(sizes)
        sizes.append(size)
        end = first + size
    if end < t:
        sizes.append(t - end)
    return sizes, at


def _split(x: torch.Tensor, cut: Cut) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """x (1, H, T, ...) and each run's (1, H, n*L, ...) piece of it, views of one ``split`` (its
    backward writes every run's gradient into one tensor, where a slice per run would fill a zero
    row each); no pieces when the row is one piece or the runs overlap."""
    sizes, at = cut
    if at is None or len(sizes) == 1:
        return x, None
    pieces = x.split(sizes, dim=2)
    return x, [pieces[j] for j in at]


def _tiled_stack(seg: Segments, i: int, q, k, v, gates, curves=None) -> Stacks:
    """Run ``i``'s stacks as views of one row's (1, H, T, ...) q, k, v, gates and curves, each given as
    (row, the runs' pieces or None) (see :func:`_stacked_runs`)."""
    n, lq = seg.q_index.shape
    lk = seg.k_index.shape[1]
    a, c = seg.q_first, seg.k_first
    assert a is not None and c is not None  # (a tiled run)
    gs = None if gates is None else _tiled(gates, i, c, n, lk)
    cs = None if curves is None else _tiled(curves, i, a, n, lq)
    return _tiled(q, i, a, n, lq), _tiled(k, i, c, n, lk), _tiled(v, i, c, n, lk), gs, cs


def _tiled(x: tuple[torch.Tensor, list[torch.Tensor] | None], i: int, first: int, n: int, length: int) -> torch.Tensor:
    """Run ``i``'s n segments of ``length`` from ``first`` of a row (1, H, T, ...) as (n, H, length, ...):
    views only, of the run's piece when the row was split (the whole row is not sliced, so its
    backward writes the gradient in place of a zero-filled copy)."""
    whole, pieces = x
    if pieces is not None:
        row = pieces[i]
    elif first or n * length != whole.shape[2]:
        row = whole[:, :, first:first + n * length]
    else:
        row = whole
    return row.squeeze(0).unflatten(1, (n, length)).transpose(0, 1)


def _gathered_stack(seg: Segments, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: torch.Tensor | None,
                    curves: torch.Tensor | None = None) -> Stacks:
    """A run's stacks gathered from token-major (B*T, H, ...) q, k, v, gates and curves (a slice, a view, when
    the run tiles a contiguous range: no gather and no scatter back)."""
    n, lq = seg.q_index.shape
    lk = seg.k_index.shape[1]
    qi = seg.q_index.reshape(-1) if seg.q_first is None else slice(seg.q_first, seg.q_first + n * lq)
    ki = seg.k_index.reshape(-1) if seg.k_first is None else slice(seg.k_first, seg.k_first + n * lk)
    gs = None if gates is None else gates[ki].view(n, lk, -1).transpose(1, 2)  # (n, H, Lk)
    cs = None if curves is None else curves[qi].view(n, lq, curves.shape[1], -1).transpose(1, 2)  # (n, H, Lq, R)
    return (q[qi].view(n, lq, q.shape[1], -1).transpose(1, 2), k[ki].view(n, lk, k.shape[1], -1).transpose(1, 2),
            v[ki].view(n, lk, v.shape[1], -1).transpose(1, 2), gs, cs)


__all__ = ["attend", "run", "run_geometry"]
