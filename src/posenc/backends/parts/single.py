"""One query against a KV cache: what every decode step is, without the full-sequence machinery.

For a single query at position i the score terms of the bias methods are one value per key, a
vector: ALiBi's ``-m_h (i - j)``, T5's table at the bucket of ``j - i``. So a decode step is plain
attention plus that vector as the kernel's additive mask (``F.scaled_dot_product_attention``, the
CPU flash kernel): no band planning, no regions, no (H, N, N) anything.

The vector is not even rebuilt per step. For an encoding that offers ``relative_bias`` (a bias of
r = j - i alone), :class:`Workspace` keeps ``f_h(r)`` for r = -(C-1)..0 once, in *reversed* order
(slot t holds r = t - (C-1)), so the keys 0..i of query i are the slots C-1-i..C-1: one contiguous
view, the same values eager computes (``relative_bias`` is ``score(h, 0, r)``). It is rebuilt only
when the cache outgrows C (doubling: O(1) per step amortized) or the encoding's parameters change
(their version counters are part of the key), so decoding allocates nothing that grows with N but
the cache itself. Left padding adds ``-inf`` on each row's padding keys from a (B, C) buffer made
once; bias and padding are summed into a scratch buffer in place.

The methods with query and value terms get the same treatment (the ``terms`` backend calls them):

- Shaw (``clipped_tables``): one query's keys farther than the clip k all use table row 0, so they
  are plain attention whose log-sum-exp is shifted by ``q . a^K_0`` and whose output gains
  ``a^V_0``: one fused call over the far keys, the last k + 1 keys written out, merged by their
  log-sum-exps (:func:`shaw`).
- Transformer-XL (``distance_key_form``): the position term ``(q + v) . W_R R_{i-j}`` is one position
  key per distance; the workspace keeps them for distances C-1..0 (reversed, as above, extended
  only when the cache doubles), so a step is one product of the query with a view of them, written
  into the scratch buffer, and one fused call with it as the mask (:func:`distance_keys`).
- DeBERTa (``disentangled_tables``): the band's keys written out with both position terms, the far
  keys, which all read one row, one fused call of a shifted query (:func:`disentangled`).

The workspace belongs to a KV cache (one for all layers of a model; shared encodings share their
entries); a lone call gets a fresh one, which then allocates as any call would.

Shape legend: B batch, H heads, C workspace capacity, Tk keys, D head dim.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...call.memo import Workspace
from ...encodings.protocol import Biases, ClippedTables, DisentangledTables, DistanceBias, DistanceKeys, offers, require
from .base import ScoreSpec, accumulation_dtype, needs_grad
from .disentangled import tables as disentangled_tables
from .padding import by_rows
from .regions import Merge, kernel_forward


def versions(module: nn.Module) -> tuple[tuple[int, int], ...]:
    """What a buffer made from ``module``'s parameters depends on: their identities and versions."""
    return tuple((id(p), p._version) for p in module.parameters())


def applies(spec: ScoreSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """One query at the last key's position (a decode step), every row's query a real token, and no
    gradient to compute (the workspace's buffers are made without autograd).

    A predicate only: it reads the call and fills nothing (backend selection asks it).
    """
    if q.dim() != 4 or q.shape[-2] != 1 or k.dim() != 4 or k.shape[-2] == 0 or not spec.consecutive or spec.q_positions.numel() != 1:
        return False
    if not spec.aligned or needs_grad(spec, q, k, v):
        return False
    return spec.starts is None or spec.q_start >= int(spec.starts.max())


def workspace(spec: ScoreSpec) -> Workspace:
    return spec.workspace if spec.workspace is not None else Workspace()


def padding(spec: ScoreSpec, tk: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor | None, int]:
    """(additive key mask (B, 1, 1, Tk): -inf on each row's padding keys, or None; the last start)."""
    starts = spec.starts
    if starts is None:
        return None, 0
    ws, ks = workspace(spec), spec.k_start
    c = ws.fit(ks + tk)

    def make() -> tuple[torch.Tensor, int]:
        slots = torch.arange(c, device=device)  # (C,) key positions
        hidden = slots[None, :] < starts.to(device)[:, None]  # (B, C)
        mask = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
        return mask, int(starts.max())

    key = (tuple(starts.tolist()), c, dtype, device)
    mask, last = ws.get(("padding",), key, make)
    return mask[:, None, None, ks : ks + tk], last


def relative_vector(spec: ScoreSpec, tk: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The bias of the one query for keys ks..i, (1, H, 1, Tk): a view of the reversed f(r) table
    for an encoding whose bias depends on r = j - i alone (:class:`DistanceBias`: ALiBi, T5, KERPLE,
    Sandwich); ``bias`` computed for this step otherwise (FIRE: its bias depends on i too)."""
    enc = spec.encoding
    if not offers(enc, DistanceBias):
        return require(enc, Biases).bias(spec.q_positions, spec.k_positions).to(dtype)[None]  # (1, H, 1, Tk)
    ws = workspace(spec)
    c = ws.fit(tk)
    name = ("relative", ws.hold(enc))
    make = lambda: enc.relative_bias(torch.arange(1 - c, 1, device=device)).to(dtype)  # noqa: E731  (H, C)
    rel = ws.get(name, (c, dtype, device, versions(enc)), make)
    return rel[:, c - tk :][None, :, None, :]  # (1, H, 1, Tk): slot c-1 is r = 0, the query itself


def mask(
    spec: ScoreSpec, terms: torch.Tensor | None, b: int, h: int, tk: int, dtype: torch.dtype, device: torch.device,
) -> torch.Tensor | None:
    """``terms`` (a (B or 1, H, 1, Tk) score term, or None) plus the padding mask: a view, or the
    workspace's scratch written in place."""
    pad, _ = padding(spec, tk, dtype, device)
    if pad is None or terms is None:
        return terms if pad is None else pad
    out = workspace(spec).scratch(b, h, tk, dtype, device)
    return torch.add(terms, pad, out=out)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec) -> torch.Tensor:
    """One query, no score terms or a bias: fused attention with the bias vector as its mask.

    With grouped key/value heads (k, v (B, Hkv, Tk, D), H = g x Hkv), the g query heads of a group
    are one (B, Hkv, g, D) batch of queries against their shared keys, and the (., H, 1, Tk) mask is
    viewed as (., Hkv, g, Tk): nothing is repeated.
    """
    b, h, _, d = q.shape
    hkv, tk = k.shape[1], k.shape[-2]
    bias = relative_vector(spec, tk, q.dtype, q.device) if spec.has_bias else None
    m = mask(spec, bias, b, h, tk, q.dtype, q.device)  # (B or 1, H or 1, 1, Tk) or None
    if hkv == h:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=spec.scale)
    g = h // hkv
    if m is not None:
        m = m.reshape(m.shape[0], hkv, g, tk) if m.shape[1] == h else m  # (., Hkv, g, Tk) or (B, 1, 1, Tk)
    out = F.scaled_dot_product_attention(q.reshape(b, hkv, g, d), k, v, attn_mask=m, scale=spec.scale)  # (B, Hkv, g, D)
    return out.reshape(b, h, 1, -1)


def shaw(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec) -> torch.Tensor:
    """One query of Shaw et al. (2018) attention: far keys in one fused call, the band written out."""
    tables = require(spec.encoding, ClippedTables).clipped_tables()
    clip, key_table, value_table, term_scale = tables.clip, tables.key_table, tables.value_table, tables.scale
    tk, acc = k.shape[-2], accumulation_dtype(q.dtype)
    per_distance = torch.matmul(q, (key_table.to(q.dtype) * term_scale).t())  # (B, H, 1, 2k+1)
    values = value_table.to(q.dtype)
    pad, _ = padding(spec, tk, q.dtype, q.device)
    width = min(clip + 1, tk)  # band: r = -(width-1)..0, table rows clip-width+1..clip
    far = tk - width  # keys 0..far-1: r < -clip, table row 0
    rows = slice(clip - width + 1, clip + 1)
    scores = (torch.matmul(q, k[:, :, far:].transpose(-1, -2)) * spec.scale + per_distance[..., rows]).to(acc)  # (B, H, 1, w)
    if pad is not None:
        scores = scores + pad[..., far:]
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, 1); never empty: the query sees itself
    probs = torch.exp(scores - lse[..., None]).to(q.dtype)
    out = (torch.matmul(probs, v[:, :, far:]) + torch.matmul(probs, values[rows])).to(acc)  # (B, H, 1, D)
    if far == 0:
        return out.to(q.dtype)
    o_far, l_far = kernel_forward(q, k[:, :, :far], v[:, :, :far], False, spec.scale, None if pad is None else pad[..., :far])
    l_far = l_far.to(acc) + per_distance[..., 0].to(acc)  # (B, H, 1): every far key's term is q . a^K_0
    if spec.starts is not None:  # a row whose far keys are all padding has no far part
        empty = spec.starts.to(q.device) > spec.k_start + far - 1  # (B,)
        l_far = l_far.masked_fill(empty[:, None, None], float("-inf"))
    merged = Merge(out.shape[0], out.shape[1], 1, out.shape[-1], q.dtype, q.device)  # (B, H, 1, D)
    merged.add((0, 1), out, lse)
    merged.add((0, 1), o_far + values[0], l_far)  # the far keys' values gain a^V_0
    return merged.out.to(q.dtype)


def distance_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec) -> torch.Tensor:
    """One query of Transformer-XL (Dai et al. 2019) attention: the position term from the kept
    position keys, one fused call with it as the mask."""
    enc = spec.encoding
    form = require(enc, DistanceKeys).distance_key_form()
    u, v_bias, term_scale = form.u, form.v, form.scale
    b, h, _, d = q.shape
    tk = k.shape[-2]
    ws = workspace(spec)
    c = ws.fit(tk)
    name = ("position_keys", ws.hold(enc))
    distances = require(enc, DistanceKeys)
    make = lambda: distances.position_keys(torch.arange(c - 1, -1, -1, device=q.device), q.dtype)  # noqa: E731
    keys = ws.get(name, (c, q.dtype, q.device, versions(enc)), make)  # (H, C, D): slot t is distance C-1-t
    # (a) + (c): q.k*scale + u.k*s = (q*scale + u*s).k ; (b) + (d): (q + v).W_R R_{i-j} * s.
    content = q * spec.scale + (u.to(q.dtype) * term_scale)[:, None, :]  # (B, H, 1, D)
    position = (q + v_bias.to(q.dtype)[:, None, :]) * term_scale
    terms = ws.scratch(b, h, tk, q.dtype, q.device)  # (B, H, 1, Tk), written below
    flat = terms[:, :, 0].permute(1, 0, 2)  # (H, B, Tk): the scratch's own layout
    torch.bmm(position[:, :, 0].transpose(0, 1), keys[:, c - tk :].transpose(-1, -2), out=flat)  # keys ks..i: distances i-ks..0
    pad, _ = padding(spec, tk, q.dtype, q.device)
    if pad is not None:
        terms.add_(pad)
    return F.scaled_dot_product_attention(content, k, v, attn_mask=terms, scale=1.0)


Attend = Callable[..., torch.Tensor]  # a backend's attend(q, k, v, spec, **options) -> (B, H, Tq, D)


def _disentangled_rows(encoding: DisentangledTables, c: int, device: torch.device) -> tuple[torch.Tensor, list[int], list[int]]:
    """What a decode step needs of the rows for up to C keys, made once per capacity: the rows of
    r = 1-C..0 (C,) (slot x holds r = x - (C-1): the keys of a step with Tk keys are the last Tk
    slots), the same as a list, and for every slot x the last slot of the run of equal rows that
    starts there (where the far past of a step whose first key is slot x ends)."""
    rows = encoding.relative_rows(torch.arange(1 - c, 1, device=device))  # (C,)
    listed = rows.tolist()
    run_end = list(range(c))
    for x in range(c - 2, -1, -1):
        if listed[x] == listed[x + 1]:
            run_end[x] = run_end[x + 1]
    return rows, listed, run_end


def disentangled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec) -> torch.Tensor:
    """DeBERTa's disentangled terms (:mod:`.disentangled`) for one query at the last key, no
    gradient: the band's keys written out, the far keys one fused call of the shifted query
    (log-sum-exp shifted by q . A[t_p]), merged; (B, H, 1, D).

    What does not change from step to step is kept in the KV cache's workspace (``spec.workspace``,
    :class:`~posenc.call.memo.Workspace`): the rows of every distance up to the cache's capacity and
    where their runs end (integers, rebuilt when the cache grows), the position tables (rebuilt
    when a parameter of the encoding changes: their versions are in the key) and the band's rows of
    them (for the band's width and far row). A step then computes no table and no row: its work is
    O(keys x D), the band's keys written out and the far keys in the fused kernel.
    """
    enc = spec.encoding
    tk, acc, dt, dev = k.shape[-2], accumulation_dtype(q.dtype), q.dtype, q.device
    ws = workspace(spec)
    c, ident = ws.fit(tk), ws.hold(enc)
    step_rows: tuple[torch.Tensor, list[int], list[int]] = ws.get(
        ("disentangled_rows", ident), (c, dev), lambda: _disentangled_rows(require(enc, DisentangledTables), c, dev))
    slots, listed, run_end = step_rows
    first = c - tk  # the slot of key 0 (r = 1 - Tk)
    e_p = min(run_end[first] - (c - 1), -1)  # the far past: r <= e_p, every key there reads row listed[first]
    far = max(0, tk + e_p)  # keys 0..far-1
    width, t_p = tk - far, listed[first]
    params = versions(enc)

    Tables = tuple[torch.Tensor | None, torch.Tensor | None, float]
    Band = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]

    def made() -> Tables:
        a_table, b_table, term_scale = disentangled_tables(spec)  # (H, R, D) each, or None
        return (None if a_table is None else (a_table * term_scale).to(dt),
                None if b_table is None else (b_table * term_scale).to(dt), term_scale)

    kept: Tables = ws.get(("disentangled_tables", ident), (params, dt, dev), made)
    a_table, b_table, _ = kept

    def band_rows() -> Band:
        t = slots[c - width :]  # (w,) the rows of r = 1-w..0
        return (None if a_table is None else a_table[:, t], None if b_table is None else b_table[:, t],  # (H, w, D)
                None if a_table is None else a_table[:, t_p], None if b_table is None else b_table[:, t_p] / spec.scale)

    band_kept: Band = ws.get(("disentangled_band", ident), (width, t_p, params, dt, dev), band_rows)
    a_band, b_band, a_far, b_far = band_kept
    pad, _ = padding(spec, tk, dt, dev)
    scores = torch.matmul(q, k[:, :, far:].transpose(-1, -2)).to(acc) * spec.scale  # (B, H, 1, w)
    if a_band is not None:
        scores = scores + torch.matmul(q, a_band.transpose(-1, -2)).to(acc)  # (B, H, 1, w)
    if b_band is not None:
        scores = scores + (k[:, :, far:] * b_band).sum(-1)[:, :, None, :].to(acc)
    if pad is not None:
        scores = scores + pad[..., far:]
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, 1); never empty: the query sees itself
    out = torch.matmul(torch.exp(scores - lse[..., None]).to(dt), v[:, :, far:]).to(acc)  # (B, H, 1, D)
    if far == 0:
        return out.to(dt)
    shifted = q if b_far is None else q + b_far[None, :, None, :]
    o_far, l_far = kernel_forward(shifted, k[:, :, :far], v[:, :, :far], False, spec.scale, None if pad is None else pad[..., :far])
    l_far = l_far.to(acc)
    if a_far is not None:
        l_far = l_far + torch.matmul(q, a_far[..., None])[..., 0].to(acc)
    if spec.starts is not None:  # a row whose far keys are all padding has no far part
        empty = spec.starts.to(q.device) > spec.k_start + far - 1  # (B,)
        l_far = l_far.masked_fill(empty[:, None, None], float("-inf"))
    merged = Merge(out.shape[0], out.shape[1], 1, out.shape[-1], dt, q.device)  # (B, H, 1, D)
    merged.add((0, 1), out, lse)
    merged.add((0, 1), o_far, l_far)
    return merged.out.to(dt)




def steps_and_padding(inner: Attend) -> Attend:
    """Wrap a backend's ``attend(q, k, v, spec, **options)`` so that a decode step takes the
    single-query path (:func:`attend` here) and a left-padded call is split into unpadded calls
    (:func:`posenc.backends.parts.padding.by_rows`); everything else reaches ``inner`` unchanged. One
    place for what sdpa, features, flex and blocked all do first."""

    @functools.wraps(inner)
    def wrapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec, **options: Any) -> torch.Tensor:
        if applies(spec, q, k, v):  # one query against the cache: the bias is one kept vector
            return attend(q, k, v, spec)
        if spec.starts is not None:  # left-padded rows: two unpadded calls per row
            return by_rows(lambda *a: wrapped(*a, **options), q, k, v, spec)
        return inner(q, k, v, spec, **options)

    return wrapped


__all__ = ["Workspace", "applies", "attend", "disentangled", "distance_keys", "mask", "padding", "relative_vector", "shaw",
           "steps_and_padding", "versions"]

