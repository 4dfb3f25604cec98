"""Blocked attention for score-bias methods (ALiBi, T5): no (H, N, N) tensor, forward or backward.

An encoding that gives its bias as a function of r = j - i (``relative_bias``) and says where that
function is affine in r (``bias_tails``, see :class:`~posenc.encodings.base.BiasTails`) splits
every query's keys in three:

- the far past, r <= -P: there ``f(r) = f(-P) + s (r + P)`` is a per-key term ``s (j - ref)``
  plus a per-query constant. The per-key term is a (1, H, 1, L) mask the fused kernel broadcasts
  (no mask at all when the tail is constant, as for T5) and the constant shifts the part's
  log-sum-exp. "Keys with j <= i - P" is the kernel's own causal mask on shifted slices
  (q[P:] against k[:N-P], top-left aligned), so the far past of every query is one kernel call
  that keeps the causal skip (DESIGN.md §5, T5 idea);
- the far future, r >= F (encoders only): the mirror image, the same calls on reversed slices;
- the band in between, -P < r < F (T5: the last P keys), with the explicit bias gathered from
  ``relative_bias``, in blocks of ``BAND_BLOCK`` queries against their ``BAND_BLOCK + P - 1``
  keys. The blocks share one (H, block, width) bias, so ``BAND_GROUP`` of them go to the kernel
  as one batched call on overlapping windows of k and v (views, no copies, at batch size 1):
  O(H x GROUP x block x width) memory.

The CPU flash kernel returns each call's log-sum-exp, and the parts are merged with it. The
backward is a custom ``autograd.Function``: the flash backward of each part, given the *merged*
output and log-sum-exp, is exactly that part's share of the gradient, so only q, k, v, the output
and the log-sum-exp are saved, as for plain SDPA. A learned bias (T5) gets its gradient from the
band, where dS = P (dP - D) is computed explicitly and summed per relative position, and from each
far part, whose constant's gradient is ``sum over its pairs of dS = sum_j v_j . dv_j - sum_i w_i
D_i`` (w_i: the part's share of row i, D_i = dO_i . O_i), with no extra kernel call. A fixed bias
(ALiBi) runs its band backward in the kernel too.

Precision: a sloped tail (ALiBi) puts s (j - ref) into the kernel's float32 sum, which rounds it to
~6e-8 |s (j - ref)|; one ref for all of N=4096 queries costs ~1e-4 on the keys that matter
(DESIGN.md §5). So the far calls of a sloped tail walk ``FAR_BLOCK`` queries, each with its own
ref, and the band is at least ``SLOPE_BAND`` wide: the keys whose terms are large are then far
enough to weigh little. Measured against float64 (ALiBi, 8 heads, N=1024-2048): the same error as
SDPA with a dense float32 bias (1e-6 to 1e-5 depending on the logits' size); a band of 32 or far
blocks of 4096 were up to 3x worse.

Other bias encodings (only ``bias``) take the generic path: per block of ``BLOCK`` queries, SDPA
with that block's bias slice, under activation checkpointing when a gradient is needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..errors import UsageError
from . import sdpa
from ..encodings.protocol import RelativeBias, offers
from .base import ScoreSpec, accumulation_dtype, cpu_flash, cpu_flash_backward, needs_grad

BLOCK = 256  # generic path (and the written-out fallback): query rows per block
BAND_BLOCK = 64  # query rows per explicit band block: the band is BAND_BLOCK + P - 1 keys wide
BAND_GROUP = 16  # band blocks batched into one kernel call (temporaries: H x GROUP x BLOCK x width)
EXPLICIT_GROUP = 4  # band blocks per step of the written-out backward of a learned bias
FAR_BLOCK = 1024  # query rows per far call when the tail has a slope (its own reference each)
SLOPE_BAND = 64  # the band of a sloped tail is at least this wide (see Precision above)


def up(x: torch.Tensor) -> torch.Tensor:
    """x in its accumulation dtype (no copy for float32 and float64)."""
    return x.to(accumulation_dtype(x.dtype))


def supports(spec: ScoreSpec, q: torch.Tensor) -> bool:
    return not (spec.has_query_terms or spec.has_value_terms)


def preferred(spec: ScoreSpec, q: torch.Tensor) -> bool:
    return spec.has_bias and supports(spec, q)


def fast_path(spec: ScoreSpec, tq: int, tk: int) -> bool:
    """True when the encoding describes its bias by ``relative_bias`` and ``bias_tails`` and the
    keys cover the queries' positions (a full pass, or decoding after a KV cache)."""
    if not offers(spec.encoding, RelativeBias):
        return False
    if tq == 0 or tk == 0:
        return False
    qs, ks = int(spec.q_positions[0]), int(spec.k_positions[0])
    return ks <= qs and qs + tq <= ks + tk


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec, block: int | None = None) -> torch.Tensor:
    """``block`` (tests) sets the band block and, for sloped tails, the far block to one size."""
    if block is not None and block < 1:
        raise UsageError(f"block must be a positive integer, got {block}")
    if not spec.has_bias:
        return sdpa.attend(q, k, v, spec)
    tq, tk = q.shape[-2], k.shape[-2]
    if fast_path(spec, tq, tk):
        plan = make_plan(spec, tq, tk, block)
        rel = relative_values(spec, plan.r_lo, plan.r_hi)  # (H, R)
        return _TailedBias.apply(q, k, v, rel, plan)
    return _generic(q, k, v, spec, BLOCK if block is None else block)


# ---------------------------------------------------------------------------------------------
# Plan: which kernel calls and which explicit blocks cover every (query, key) pair exactly once


@dataclass
class FarCall:
    rows: tuple[int, int]  # query index range, original order
    keys: tuple[int, int]  # key index range, original order
    causal: bool  # the kernel's top-left causal mask, in call order
    flip: bool  # future side: the call runs on reversed slices
    ref: int  # key position the per-key term s (j - ref) is measured from
    side: int  # 0: past, 1: future


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

    @property
    def row_range(self) -> tuple[int, int]:
        return self.t0, self.t0 + self.count * self.rows


@dataclass
class Plan:
    far: list[FarCall]
    bands: list[BandGroup]
    q_start: int  # absolute position of query 0 and of key 0
    k_start: int
    scale: float
    causal: bool
    past: int  # far past: r <= -past
    future: int  # far future: r >= future (encoders)
    slopes: tuple[torch.Tensor | None, torch.Tensor | None]  # past, future
    r_lo: int  # the rel vector holds f(r) for r = r_lo .. r_hi
    r_hi: int
    cache: dict = field(default_factory=dict, repr=False)  # band bias per block geometry


def _shifted_causal(tq: int, c0: int, block: int) -> list[tuple[tuple[int, int], tuple[int, int], bool, int]]:
    """Kernel calls giving every row t in [0, tq) exactly the keys [0, t + c0]: (rows, keys, causal, ref).

    Per block of rows [t0, t1): the keys every row sees, [0, t0 + c0], as a plain rectangle; the
    rest is a square whose top-left causal mask is the staircase. ``ref`` is the last key of row t0.
    """
    calls = []
    for t0 in range(0, tq, block):
        t1 = min(t0 + block, tq)
        e0 = t0 + c0  # the last key of row t0
        if e0 >= 0:
            calls.append(((t0, t1), (0, e0 + 1), False, e0))
            if t1 - t0 > 1:
                calls.append(((t0 + 1, t1), (e0 + 1, e0 + t1 - t0), True, e0))
        elif t1 + c0 > 0:
            calls.append(((-c0, t1), (0, t1 + c0), True, e0))
    return calls


def make_plan(spec: ScoreSpec, tq: int, tk: int, block: int | None = None) -> Plan:
    tails = spec.encoding.bias_tails()
    past_slope, future_slope = tails.past_slope, tails.future_slope
    past = max(tails.past, SLOPE_BAND) if past_slope is not None else tails.past
    future = max(tails.future, SLOPE_BAND) if future_slope is not None else tails.future
    future = max(future, 1 - past)  # r = 0 belongs to one side only
    band_block = BAND_BLOCK if block is None else block
    qs, ks = int(spec.q_positions[0]), int(spec.k_positions[0])

    far = []
    # Far past: row t sees the keys with index <= t + qs - ks - past.
    size = tq if past_slope is None else (FAR_BLOCK if block is None else block)
    for rows, keys, causal, e0 in _shifted_causal(tq, qs - ks - past, size):
        far.append(FarCall(rows, keys, causal, False, ks + e0, 0))
    if not spec.causal:
        # Far future: row t sees the keys with index >= t + qs - ks + future; reversed, that is
        # the far past of a reversed row against reversed keys.
        size = tq if future_slope is None else (FAR_BLOCK if block is None else block)
        for (r0, r1), (k0, k1), causal, e0 in _shifted_causal(tq, (tk + ks) - (tq + qs) - future, size):
            far.append(FarCall((tq - r1, tq - r0), (tk - k1, tk - k0), causal, True, ks + tk - 1 - e0, 1))

    bands: list[BandGroup] = []
    top = 0 if spec.causal else future - 1  # largest r in the band
    if past + top > 0:  # the band -past < r <= top is not empty
        for t0 in range(0, tq, band_block):
            t1 = min(t0 + band_block, tq)
            k0 = qs + t0 - past + 1 - ks
            k1 = qs + t1 - 1 + top - ks + 1
            inner = k0 >= 0 and k1 <= tk and t1 - t0 == band_block
            k0, k1 = max(k0, 0), min(k1, tk)
            if k1 <= k0:
                continue
            last = bands[-1] if bands else None
            if inner and last is not None and last.inner and last.count < BAND_GROUP:
                last.count += 1
            else:
                bands.append(BandGroup(t0, k0, t1 - t0, k1 - k0, 1, inner))
    width = max(band_block, 1) if bands else 1
    return Plan(
        far, bands, qs, ks, spec.scale, spec.causal, past, future, (past_slope, future_slope),
        r_lo=-(past + width), r_hi=future + width, cache=_band_cache(spec),
    )


def _band_cache(spec: ScoreSpec) -> dict:
    """Band biases are the same for every layer of one forward: keep them in the per-forward memo."""
    return spec.memo.table(spec.encoding, "band_bias", (), dict)


def relative_values(spec: ScoreSpec, r_lo: int, r_hi: int) -> torch.Tensor:
    """f_h(r) for r = r_lo..r_hi, (H, R); computed once per forward and shared by all layers."""
    return spec.memo.relative_values(spec.encoding, r_lo, r_hi, spec.q_positions.device)


# ---------------------------------------------------------------------------------------------
# The pieces: the fused kernel on a far call, the explicit formula on a band block


def _kernel(q: torch.Tensor, v: torch.Tensor) -> bool:
    """The CPU flash kernel runs it (it needs one head dim for q, k and v)."""
    return q.device.type == "cpu" and q.shape[-1] == v.shape[-1]


def _flash_forward(q, k, v, mask, causal, scale):
    if _kernel(q, v):
        return cpu_flash(q, k, v, causal, scale, mask)
    # Otherwise (other devices, where flex is the fast path; v's head dim not q's): the formula,
    # BLOCK rows at a time so memory stays O(BLOCK x L).
    outs, lses = [], []
    for a in range(0, q.shape[-2], BLOCK):
        s = _scores(q, k, mask, causal, scale, a, a + BLOCK)  # (B, H, rows, L)
        lse = torch.logsumexp(s, -1)  # (B, H, rows)
        outs.append(torch.matmul(torch.exp(s - lse[..., None]).to(v.dtype), v))
        lses.append(lse)
    return torch.cat(outs, -2), torch.cat(lses, -1)


def _flash_backward(do, q, k, v, out, lse, mask, causal, scale):
    if _kernel(q, v):
        return cpu_flash_backward(do, q, k, v, out, lse, causal, scale, mask)
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for a in range(0, q.shape[-2], BLOCK):
        r = slice(a, a + BLOCK)
        p = torch.exp(_scores(q, k, mask, causal, scale, a, a + BLOCK) - lse[:, :, r, None])  # (B, H, rows, L)
        dsum = (up(do[:, :, r]) * up(out[:, :, r])).sum(-1, keepdim=True)
        ds = (p * (up(torch.matmul(do[:, :, r], v.transpose(-1, -2))) - dsum)).to(q.dtype)
        dq[:, :, r] = torch.matmul(ds, k) * scale
        dk += torch.matmul(ds.transpose(-1, -2), q[:, :, r]) * scale
        dv += torch.matmul(p.to(do.dtype).transpose(-1, -2), do[:, :, r])
    return dq, dk, dv


def _scores(q, k, mask, causal, scale, a, b):
    """Scores of rows [a, b) of a call, with its mask and its top-left causal mask."""
    q = q[:, :, a:b]
    s = up(torch.matmul(q, k.transpose(-1, -2))) * scale  # (B, H, rows, L)
    if mask is not None:
        s = s + up(mask if mask.shape[-2] == 1 else mask[:, :, a:b])
    if causal:
        rows = torch.arange(a, a + q.shape[-2], device=s.device)[:, None]
        s = s.masked_fill(torch.arange(k.shape[-2], device=s.device)[None, :] > rows, float("-inf"))
    return s


def _far_terms(plan: Plan, rel: torch.Tensor, call: FarCall, dtype: torch.dtype):
    """A far call's key mask (1, H, 1, L) in call order (None for a constant tail), its per-query
    constant (H, C) in row order, and the rel index of its intercept."""
    slope = plan.slopes[call.side]
    r0 = -plan.past if call.side == 0 else plan.future
    device = rel.device
    i = plan.q_start + torch.arange(*call.rows, device=device)  # (C,) query positions
    # f(r) = f(r0) + s (j - i - r0) = [s (j - ref)] + [f(r0) + s (ref - r0 - i)]
    shift = up(rel[:, r0 - plan.r_lo])[:, None].expand(-1, i.numel())  # (H, C)
    mask = None
    if slope is not None:
        shift = shift + up(slope)[:, None] * (call.ref - r0 - i)[None, :]
        j = plan.k_start + torch.arange(*call.keys, device=device)  # (L,) key positions
        if call.flip:
            j = j.flip(0)
        mask = (up(slope)[:, None] * (j - call.ref)[None, :]).to(dtype)[None, :, None, :]  # (1, H, 1, L)
    return mask, shift, r0 - plan.r_lo


def _band_bias(plan: Plan, rel: torch.Tensor, group: BandGroup):
    """A band block's bias (H, C, L) with -inf outside the band, and its rel index (C * L,)."""
    offset = (plan.k_start + group.k0) - (plan.q_start + group.t0)  # r of the block's top-left pair
    key = (group.rows, group.length, offset, plan.past, plan.future, plan.causal, plan.r_lo, rel.dtype)
    hit = plan.cache.get(key)
    if hit is None:
        c, length = group.rows, group.length
        relative = offset + torch.arange(length, device=rel.device)[None, :] - torch.arange(c, device=rel.device)[:, None]  # (C, L)
        inside = relative > -plan.past
        inside &= relative <= 0 if plan.causal else relative < plan.future
        index = (relative - plan.r_lo).clamp_(0, rel.shape[1] - 1)
        bias = up(rel)[:, index].masked_fill_(~inside, float("-inf"))  # (H, C, L)
        hit = plan.cache[key] = (bias, index.reshape(-1))
    return hit


def _split(group: BandGroup, size: int) -> list[BandGroup]:
    """The group as groups of at most ``size`` blocks."""
    return [
        BandGroup(group.t0 + n * group.rows, group.k0 + n * group.rows, group.rows, group.length, min(size, group.count - n), group.inner)
        for n in range(0, group.count, size)
    ]


def _blocks(x: torch.Tensor, group: BandGroup) -> torch.Tensor:
    """Rows of the group's blocks, (B, H, T, ...) -> (B * count, H, C, ...): a view when B = 1."""
    a, b = group.row_range
    return x[:, :, a:b].unflatten(2, (group.count, group.rows)).transpose(1, 2).flatten(0, 1)


def _unblocks(y: torch.Tensor, group: BandGroup) -> torch.Tensor:
    """Inverse of :func:`_blocks`: (B * count, H, C, ...) -> (B, H, count * C, ...)."""
    return y.unflatten(0, (-1, group.count)).transpose(1, 2).flatten(2, 3)


def _windows(x: torch.Tensor, group: BandGroup) -> torch.Tensor:
    """Keys of the group's blocks, overlapping windows: (B, H, Tk, D) -> (B * count, H, L, D)."""
    span = x[:, :, group.k0 : group.k0 + (group.count - 1) * group.rows + group.length]
    windows = span.unfold(2, group.length, group.rows)  # (B, H, count, D, L), a view
    return windows.permute(0, 2, 1, 4, 3).flatten(0, 1)  # (B * count, H, L, D)


def _add_windows(buf: torch.Tensor, group: BandGroup, g: torch.Tensor) -> None:
    """buf[:, :, keys of block n] += g[block n] for overlapping windows, a few strided adds."""
    c, n, tk = group.rows, group.count, buf.shape[2]
    g = g.unflatten(0, (-1, n)).transpose(1, 2)  # (B, H, count, L, D)
    for s in range(0, group.length, c):
        seg = g[:, :, :, s : s + c]  # (B, H, count, c', D): this segment of every window
        start = group.k0 + s
        whole = n if start + n * c <= tk else n - 1  # the last window's segment may overhang
        if whole:
            buf[:, :, start : start + whole * c].unflatten(2, (whole, c))[:, :, :, : seg.shape[3]] += seg[:, :, :whole]
        if whole < n:
            at = start + whole * c
            buf[:, :, at : at + seg.shape[3]] += seg[:, :, whole]


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: tuple[int, int], o: torch.Tensor, l: torch.Tensor, covered: list) -> None:
    """Fold a part (o, its log-sum-exp l) into the running (out, lse) of rows, in place.

    ``covered`` lists the row ranges merged so far: a part on fresh rows is just copied.
    """
    a, b = rows
    if all(b <= c0 or a >= c1 for c0, c1 in covered):
        out[:, :, a:b] = o
        lse[:, :, a:b] = l
    else:
        old = lse[:, :, a:b]
        new = torch.logaddexp(old, l)  # (B, H, C)
        out[:, :, a:b].mul_(torch.exp(old - new)[..., None]).addcmul_(up(o), torch.exp(l - new)[..., None])
        lse[:, :, a:b] = new
    covered.append(rows)


# ---------------------------------------------------------------------------------------------
# The autograd function


def _flip(x: torch.Tensor, flip: bool, dim: int = -2) -> torch.Tensor:
    return x.flip(dim) if flip else x


class _TailedBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rel, plan: Plan):
        b, h, tq, _ = q.shape
        acc = accumulation_dtype(q.dtype)
        out = torch.zeros(b, h, tq, v.shape[-1], dtype=acc, device=q.device)  # (B, H, Tq, D), merged
        lse = torch.full((b, h, tq), float("-inf"), dtype=acc, device=q.device)  # (B, H, Tq), merged
        covered: list = []
        far_lse = []  # each far call's shifted log-sum-exp: the gradient of its constant needs it
        for call in plan.far:
            mask, shift, _ = _far_terms(plan, rel, call, q.dtype)
            f = call.flip
            qc, kc, vc = (_flip(x[:, :, slice(*r)], f) for x, r in ((q, call.rows), (k, call.keys), (v, call.keys)))
            o, l = _flash_forward(qc, kc, vc, mask, call.causal, plan.scale)
            l = _flip(l, f, -1) + shift  # (B, H, C): back to the true bias
            _merge(out, lse, call.rows, _flip(o, f), l, covered)
            far_lse.append(l)
        for group in plan.bands:
            bias, _ = _band_bias(plan, rel, group)
            o, l = _flash_forward(_blocks(q, group), _windows(k, group), _windows(v, group), bias.to(q.dtype)[None], False, plan.scale)
            _merge(out, lse, group.row_range, _unblocks(o, group), _unblocks(l, group), covered)
        out = out.to(q.dtype)
        ctx.plan = plan
        ctx.far_lse = far_lse if ctx.needs_input_grad[3] else None
        ctx.save_for_backward(q, k, v, rel, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, rel, out, lse = ctx.saved_tensors
        plan: Plan = ctx.plan
        need_rel = ctx.needs_input_grad[3]
        dout = dout.contiguous()
        grads = _Grads(q, k, v)
        drel = torch.zeros(rel.shape, dtype=accumulation_dtype(rel.dtype), device=rel.device) if need_rel else None
        dsum = (up(dout) * up(out)).sum(-1)  # (B, H, Tq): D_i = dO_i . O_i
        for n, call in enumerate(plan.far):
            mask, shift, r0 = _far_terms(plan, rel, call, q.dtype)
            f, r, c = call.flip, slice(*call.rows), slice(*call.keys)
            qc, kc, vc = _flip(q[:, :, r], f), _flip(k[:, :, c], f), _flip(v[:, :, c], f)
            lc = _flip(lse[:, :, r] - shift, f, -1).contiguous()
            g = list(_flash_backward(_flip(dout[:, :, r], f), qc, kc, vc, _flip(out[:, :, r], f), lc, mask, call.causal, plan.scale))
            if need_rel:
                # The constant's gradient: sum over the call's pairs of dS = P (dP - D).
                weight = torch.exp(ctx.far_lse[n] - lse[:, :, r])  # (B, H, C): the call's share of each row
                drel[:, r0] += (up(vc) * up(g[2])).sum((0, 2, 3)) - (weight * dsum[:, :, r]).sum((0, 2))
            for i, where in enumerate((r, c, c)):
                grads.add(i, where, _flip(g[i], f))
                g[i] = None  # free it before the next buffer is allocated
        # The explicit formula (learned bias) keeps several (blocks, H, C, L) tensors: smaller groups.
        groups = plan.bands if not need_rel else [part for g in plan.bands for part in _split(g, EXPLICIT_GROUP)]
        for group in groups:
            bias, index = _band_bias(plan, rel, group)
            qc, kc, vc, doc = _blocks(q, group), _windows(k, group), _windows(v, group), _blocks(dout, group)
            oc, lc, dc = _blocks(out, group), _blocks(lse, group), _blocks(dsum, group)
            if not need_rel:  # a fixed bias (ALiBi): the kernel, with the band's mask
                gq, gk, gv = _flash_backward(doc, qc, kc, vc, oc, lc.contiguous(), bias.to(q.dtype)[None], False, plan.scale)
            else:
                # A learned bias needs dS = P (dP - D) itself: the explicit formula.
                s = up(torch.matmul(qc, kc.transpose(-1, -2))).mul_(plan.scale).add_(bias)  # (B*n, H, C, L)
                p = s.sub_(lc[..., None]).exp_()  # probabilities under the merged normaliser
                gv = torch.matmul(p.to(doc.dtype).transpose(-1, -2), doc)
                ds = up(torch.matmul(doc, vc.transpose(-1, -2))).sub_(dc[..., None]).mul_(p)  # dS
                drel.scatter_add_(1, index.expand(rel.shape[0], -1), ds.sum(0).reshape(rel.shape[0], -1))
                ds = ds.to(q.dtype)
                gq = torch.matmul(ds, kc).mul_(plan.scale)
                gk = torch.matmul(ds.transpose(-1, -2), qc).mul_(plan.scale)
            grads.add(0, slice(*group.row_range), _unblocks(gq, group))
            _add_windows(grads.get(1), group, gk)
            _add_windows(grads.get(2), group, gv)
        dq, dk, dv = grads.result()
        return dq, dk, dv, (drel.to(rel.dtype) if need_rel else None), None


class _Grads:
    """dq, dk, dv, each allocated at its first contribution: a full-size kernel gradient then never
    coexists with all three buffers (peak memory)."""

    def __init__(self, *like: torch.Tensor) -> None:
        self.like = like
        self.bufs: list[torch.Tensor | None] = [None] * len(like)

    def get(self, i: int) -> torch.Tensor:
        if self.bufs[i] is None:
            self.bufs[i] = torch.zeros_like(self.like[i])
        return self.bufs[i]

    def add(self, i: int, where: slice, g: torch.Tensor) -> None:
        self.get(i)[:, :, where] += g

    def result(self) -> list[torch.Tensor]:
        return [torch.zeros_like(x) if b is None else b for x, b in zip(self.like, self.bufs)]


# ---------------------------------------------------------------------------------------------
# Generic bias encodings: per block, the bias slice and SDPA, recomputed in the backward


def _generic(q, k, v, spec: ScoreSpec, block: int) -> torch.Tensor:
    tq, tk = q.shape[-2], k.shape[-2]
    enc = spec.encoding
    ks = int(spec.k_positions[0]) if tk else 0

    def one_block(qc, kc, vc, qp, kp):
        bias = enc.bias(qp, kp).to(qc.dtype)  # (H, C, L)
        if spec.causal:
            bias = bias.masked_fill(kp[None, None, :] > qp[None, :, None], float("-inf"))
        return F.scaled_dot_product_attention(qc, kc, vc, attn_mask=bias, scale=spec.scale)

    grad = needs_grad(spec, q, k, v)
    outs = []
    for t0 in range(0, tq, block):
        qp = spec.q_positions[t0 : t0 + block]
        end = max(1, min(tk, int(qp[-1]) - ks + 1)) if spec.causal else tk  # keys this block sees
        args = (q[:, :, t0 : t0 + block], k[:, :, :end], v[:, :, :end], qp, spec.k_positions[:end])
        outs.append(checkpoint(one_block, *args, use_reentrant=False) if grad else one_block(*args))
    return torch.cat(outs, dim=-2)  # (B, H, Tq, D)
