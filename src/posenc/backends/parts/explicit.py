"""Bias attention with a hand-written backward, per block of queries: the ``blocked`` backend's path
for biases without affine tails (KERPLE, FIRE, any bias method).

Forward: per block of ``BLOCK`` queries, the CPU flash kernel with the block's (H, C, L) bias as
its additive mask (L: the keys the block may see; the causal staircase is -inf in the mask), which
returns the output and the log-sum-exp. Backward, per block: the probabilities recomputed from the
saved log-sum-exp, ``dS = P (dP - D)`` written out, and dq, dk, dv from it, as flash attention's
backward does; dS is also the bias's gradient, which goes to the encoding's parameters. Memory is
O(H x C x N) per step, never (H, N, N); nothing but q, k, v, the output and the log-sum-exp is saved.
The fused kernel has no gradient for its mask, which is why the backward is written out here.

Grouped-query heads (k, v with Hkv heads, H = g x Hkv) are taken as they are: the kernel
broadcasts them, and the written-out backward folds the g query heads of each key/value head into
one batch of g x C rows (:func:`~posenc.backends.parts.regions.fold_heads`), so its products read
each key/value head once and sum the group's dk and dv inside the product.

Two ways to build the block's bias and return its gradient, from what the encoding offers:

- :class:`~posenc.encodings.protocol.DistanceBias` (``relative_bias(r)``: the bias depends on
  r = j - i alone, KERPLE): one vector ``E[t] = f(r_lo + t)`` per head for every r of the call (the
  future set to -inf for a decoder). With the block's query rows taken in reverse order, the bias of
  (row a', key b) is ``E[start + a' + b]``: an overlapping strided *view* of E, no copy, which the
  kernel reads as its mask. In the backward, dS of the block is written into a zeroed buffer along
  its anti-diagonals and summed over rows, giving dE (the sum of dS per relative position); autograd
  takes it from E back to the parameters.
- any bias (``bias(q_positions, k_positions)``, FIRE): the block's slice computed by the encoding,
  once without a gradient for the forward, and again in the backward with autograd on, which then
  turns dS into the parameters' gradients (``torch.autograd.grad``).
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import torch

from ...encodings.protocol import Biases, DistanceBias, offers, require
from .base import ScoreSpec, accumulation_dtype, needs_grad
from .denormals import flushed
from .regions import apply, fold_heads, heads_first, kernel_forward, new_output, unfold_heads, up
from .toeplitz import hankel

BLOCK = 64  # query rows per block: temporaries are (B, H, BLOCK, keys)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec, block: int | None = None) -> torch.Tensor:
    """Bias attention for consecutive positions (query a is key a + offset)."""
    block = BLOCK if block is None else block
    offset = spec.offset  # query a is key a + offset
    geometry = _Geometry(q.shape[-2], k.shape[-2], offset, spec.causal, spec.scale, block)
    enc = spec.encoding
    if offers(enc, DistanceBias):
        r = torch.arange(geometry.r_lo, geometry.r_hi + 1, device=q.device)  # every r = key - query of the call
        table = enc.relative_bias(r)  # (H, R)
        if spec.causal:
            table = table.masked_fill(r > 0, float("-inf"))  # the future, as part of the mask
        return apply(_Relative, q, k, v, table.to(accumulation_dtype(q.dtype)), geometry)
    params = [p for p in enc.parameters() if p.requires_grad] if needs_grad(spec, q, k, v) else []
    return apply(_Generic, q, k, v, spec, geometry, *params)


class _Geometry:
    """Blocks of queries and the keys each may see; r = key position - query position."""

    def __init__(self, tq: int, tk: int, offset: int, causal: bool, scale: float, block: int) -> None:
        self.tq, self.tk, self.offset, self.causal, self.scale = tq, tk, offset, causal, scale
        self.block = block
        self.r_lo = -(tq - 1) - offset  # key 0 against the last query
        self.r_hi = tk - 1 - offset  # the last key against query 0

    def blocks(self) -> Iterator[tuple[int, int, int]]:
        """(a0, a1, keys): query rows a0..a1-1 see keys 0..keys-1 (a decoder: up to the last row).
        Last block first: a decoder's blocks then shrink, so each block's temporaries can reuse the
        memory the one before has just freed."""
        for a0 in reversed(range(0, self.tq, self.block)):
            a1 = min(a0 + self.block, self.tq)
            keys = min(self.tk, max(1, a1 + self.offset)) if self.causal else self.tk
            yield a0, a1, keys


# ---------------------------------------------------------------------------------------------
# The explicit backward of one block, shared by both paths


class BackwardBuffers:
    """Buffers that every block of one backward reuses. On CPU a fresh (B, H, C, keys) tensor per
    operation can cost more than the operation itself (new pages to fault in, cold caches); views
    of one buffer stay warm."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.numel, self.dtype, self.device = numel, dtype, device
        self.buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        """A contiguous tensor of ``shape`` in buffer ``name`` (its old contents), of the workspace's
        dtype unless ``dtype`` says otherwise; a buffer too small for ``shape`` is made again."""
        dtype = self.dtype if dtype is None else dtype
        need = math.prod(shape)
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < need or buf.dtype != dtype:
            buf = self.buffers[name] = torch.empty(max(need, self.numel), dtype=dtype, device=self.device)
        return buf[:need].view(shape)


def _add_product(target: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> None:
    """target += alpha a @ b, accumulated by the matrix product itself when target allows a 3-d view."""
    try:
        flat = target.view(-1, *target.shape[-2:])
    except RuntimeError:  # not one stride per batch: a temporary
        target.add_(torch.matmul(a, b), alpha=alpha)
        return
    flat.baddbmm_(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]), alpha=alpha)


def block_grads(
    ws: BackwardBuffers, p: torch.Tensor, dout_c: torch.Tensor, total_c: torch.Tensor, q_c: torch.Tensor,
    k_c: torch.Tensor, v_c: torch.Tensor, scale: float, dk: torch.Tensor, dv: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """p: probabilities (B, H, C, L), in workspace memory; k_c, v_c, dk, dv have Hkv heads. Adds
    the block's dk, dv (keys 0..L-1) and returns dS (in p's memory) and the block's dq."""
    hkv, h = k_c.shape[1], p.shape[1]
    p_g, dout_g = fold_heads(p, hkv), fold_heads(dout_c, hkv)  # (B, Hkv, g C, .)
    _add_product(dv, p_g.transpose(-1, -2), dout_g)  # dv += P^T dO
    # dP - D in one product: the buffer starts at -D and the product accumulates into it
    dp = ws.take("dp", p_g.shape)  # (B, Hkv, g C, L)
    unfold_heads(dp, h).copy_(total_c[..., None].neg().expand(p.shape))
    _add_product(dp, dout_g, v_c.transpose(-1, -2))
    ds = p.mul_(unfold_heads(dp, h))  # dS = P (dP - D), (B, H, C, L)
    ds_g = fold_heads(ds, hkv)
    dq_c = unfold_heads(torch.matmul(ds_g, k_c), h).mul_(scale)  # (B, H, C, D)
    _add_product(dk, ds_g.transpose(-1, -2), fold_heads(q_c, hkv), alpha=scale)
    return ds, dq_c


def block_probabilities(ws: BackwardBuffers, q_c: torch.Tensor, k_c: torch.Tensor, scale: float, bias: torch.Tensor, lse_c: torch.Tensor,
            staircase_only: bool = False) -> torch.Tensor:
    """exp(q k^T * scale + bias - lse): the block's probabilities (B, H, C, L), in workspace memory
    (bias - lse written first, the product accumulated into it: one pass fewer than adding after).
    ``staircase_only``: the bias is -inf nowhere but in the block's last C keys (a distance table's
    future); otherwise anywhere (a bias that hides keys, as xPos's blockwise one)."""
    hkv, h = k_c.shape[1], q_c.shape[1]
    q_g = fold_heads(q_c, hkv)  # (B, Hkv, g C, D)
    s = ws.take("s", (*q_g.shape[:-1], k_c.shape[-2]))  # (B, Hkv, g C, L)
    torch.sub(bias, lse_c[..., None], out=unfold_heads(s, h))
    _add_product(s, q_g, k_c.transpose(-1, -2), alpha=scale)
    s = unfold_heads(s, h)  # (B, H, C, L)
    # A large bias (the dynamic position bias far from the diagonal) sends most logits far below the
    # row's log-sum-exp, where exp's result underflows and the vectorised exp falls back to a scalar
    # path (an order of magnitude slower an element): logits below ``floor`` are raised to it,
    # a probability of e^20 times the dtype's smallest normal number (8e-30 in float32), far below
    # what any sum of them can show; the pairs the bias hides (-inf) are set back to exactly 0 (with
    # ``staircase_only``, a decoder's future, only the block's last C keys are looked at).
    c = s.shape[-2]
    p = s.clamp_(min=_floor(s.dtype)).exp_()
    if staircase_only:
        p[..., -c:].masked_fill_(torch.isneginf(bias[..., -c:]), 0.0)
    else:
        p.masked_fill_(torch.isneginf(bias), 0.0)
    return p


def _floor(dtype: torch.dtype) -> float:
    """The lowest logit minus log-sum-exp worth an exact exp in ``dtype``: log of its smallest normal number, plus 20."""
    return math.log(torch.finfo(dtype).tiny) + 20.0


# ---------------------------------------------------------------------------------------------
# Relative biases: strided views of one vector per head


def _heads_first(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """q, k, v (B, H, T, D) whose memory is (H, B, T, D), one head count (the documents of a packed
    head-major row, stacked as views of it, are): the backward then runs on the (H, B, ...) views,
    whose two leading axes fold into one for the matrix products without a copy, and returns its
    gradients in that memory too. The axes' roles are exchanged there: a per-head bias broadcasts
    over axis 1 and is summed over it (:func:`_batch_sum`); with one head count, folding query heads
    into their key/value head (:func:`~posenc.backends.parts.regions.fold_heads`) is the identity."""
    return q.shape[1] == k.shape[1] and all(heads_first(x) for x in (q, k, v))


def _batch_sum(ds: torch.Tensor, swap: bool) -> torch.Tensor:
    """dS (B, H, C, L), or (H, B, C, L) when ``swap``, summed over the batch: (H, C, L)."""
    axis = 1 if swap else 0
    return ds.sum(axis) if ds.shape[axis] > 1 else ds.select(axis, 0)


def _outputs(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (B, H, Tq, Dv) output, in q's memory (:func:`~posenc.backends.parts.regions.new_output`),
    and (B, H, Tq) log-sum-exp."""
    lse = torch.empty(q.shape[:3], dtype=accumulation_dtype(q.dtype), device=q.device)
    return new_output(q, v.shape[-1], q.dtype), lse


def _view(table: torch.Tensor, g: _Geometry, a0: int, a1: int, keys: int) -> torch.Tensor:
    """The (1, H, C, keys) bias of rows a1-1 .. a0 (reversed) as a view of ``table`` (H, R)."""
    # reversed row a' is query a1 - 1 - a'; r = b - (a1 - 1 - a') - offset, index r - r_lo.
    return hankel(table, a1 - a0, keys, start=g.tq - a1)  # start = -(a1 - 1 + offset) - r_lo


class _Relative(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, g: _Geometry) -> torch.Tensor:
        table = table.contiguous()
        out, lse = flushed(_relative_forward, q, k, v, table, g)
        ctx.g = g
        ctx.save_for_backward(q, k, v, table, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads = flushed(_relative_backward, ctx.g, dout, *ctx.saved_tensors, ctx.needs_input_grad[3])
        return (*grads, None)


def _relative_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, g: _Geometry) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _outputs(q, v)  # (B, H, Tq, Dv), (B, H, Tq)
    for a0, a1, keys in g.blocks():
        mask = _view(table, g, a0, a1, keys).to(q.dtype)
        o, lz = kernel_forward(q[:, :, a0:a1].flip(-2), k[:, :, :keys], v[:, :, :keys], False, g.scale, mask)
        out[:, :, a0:a1], lse[:, :, a0:a1] = o.flip(-2), lz.flip(-1)
    return out, lse


def _relative_backward(
    g: _Geometry, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    table: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, need_table: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    swap = _heads_first(q, k, v)
    if swap:  # (the batch and head axes exchanged: see _heads_first)
        q, k, v, dout, out, lse = (x.transpose(0, 1) for x in (q, k, v, dout, out, lse))
    dout = dout.contiguous()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # (each read by several matrix products)
    acc = accumulation_dtype(q.dtype)
    total = (up(dout) * up(out)).sum(-1)  # (B, H, Tq): D_i = dO_i . O_i
    dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k, v))
    dtable = torch.zeros_like(table) if need_table else None
    b, h = q.shape[:2]
    heads = table.shape[0]
    ws = BackwardBuffers(b * h * min(g.block, g.tq) * (g.tk + min(g.block, g.tq)), acc, q.device)
    for a0, a1, keys in g.blocks():
        c = a1 - a0
        q_c, dout_c = up(q[:, :, a0:a1].flip(-2)), up(dout[:, :, a0:a1].flip(-2))  # reversed rows
        k_c, v_c = up(k[:, :, :keys]), up(v[:, :, :keys])
        bias = _view(table, g, a0, a1, keys)  # (1, H, C, L)
        p = block_probabilities(ws, q_c, k_c, g.scale, bias.transpose(0, 1) if swap else bias, lse[:, :, a0:a1].flip(-1), staircase_only=True)
        total_c = total[:, :, a0:a1].flip(-1)
        ds, dq_c = block_grads(ws, p, dout_c, total_c, q_c, k_c, v_c, g.scale, dk[:, :, :keys], dv[:, :, :keys])
        dq[:, :, a0:a1] = dq_c.flip(-2)
        if dtable is not None:
            # Row a', key b reads table[start + a' + b]: write dS along anti-diagonals, sum the rows.
            width = c + keys - 1
            buf = ws.take("diagonals", (heads, c, width)).zero_()  # (H, C, C + L - 1)
            diagonal = buf.as_strided((heads, c, keys), (buf.stride(0), width + 1, 1))
            diagonal.copy_(_batch_sum(ds, swap))
            start = g.tq - a1
            dtable[:, start : start + width] += buf.sum(1)
    dq, dk, dv = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    if swap:
        dq, dk, dv = dq.transpose(0, 1), dk.transpose(0, 1), dv.transpose(0, 1)
    return dq, dk, dv, dtable


# ---------------------------------------------------------------------------------------------
# Any bias: the encoding's slice per block, differentiated by autograd in the backward


def _block_bias(enc: Biases, spec: ScoreSpec, g: _Geometry, a0: int, a1: int, keys: int, dtype: torch.dtype) -> torch.Tensor:
    """The (H, C, keys) bias of rows a0..a1-1, with -inf on the causal staircase."""
    qp, kp = spec.q_positions[a0:a1], spec.k_positions[:keys]
    bias = enc.bias(qp, kp).to(dtype)  # (H, C, L)
    if g.causal:  # only the last C keys can be ahead of a row of the block
        first = max(0, keys - (a1 - a0))
        bias[:, :, first:].masked_fill_(kp[None, None, first:] > qp[None, :, None], float("-inf"))
    return bias


class _Generic(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec, g: _Geometry, *params: torch.Tensor) -> torch.Tensor:
        out, lse = flushed(_generic_forward, q, k, v, spec, g)
        ctx.spec, ctx.g, ctx.n_params = spec, g, len(params)
        ctx.save_for_backward(q, k, v, out, lse, *params)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, *params = ctx.saved_tensors
        spec, g = ctx.spec, ctx.g
        swap = _heads_first(q, k, v)
        if swap:  # (the batch and head axes exchanged: see _heads_first)
            q, k, v, dout, out, lse = (x.transpose(0, 1) for x in (q, k, v, dout, out, lse))
        dout = dout.contiguous()
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # (each read by several matrix products)
        total = (up(dout) * up(out)).sum(-1)  # (B, H, Tq)
        acc = accumulation_dtype(q.dtype)
        dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k, v))
        dparams = [torch.zeros_like(p) for p in params]
        ws = BackwardBuffers(q.shape[0] * q.shape[1] * min(g.block, g.tq) * g.tk, acc, q.device)
        for a0, a1, keys in g.blocks():
            # The bias with autograd here; the kernel-like loop in the flushing thread.
            with torch.enable_grad():
                bias = _block_bias(require(spec.encoding, Biases), spec, g, a0, a1, keys, acc)  # (H, C, L)
            shared = bias.detach()[:, None] if swap else bias.detach()  # (H, 1, C, L) or (H, C, L), against (., ., C, L)
            ds, dq[:, :, a0:a1] = flushed(_generic_block, ws, g, shared, dout, total, q, k, v, lse, a0, a1, keys, dk, dv)
            if params:
                ds_sum = _batch_sum(ds, swap)  # (H, C, L): the bias is shared by the batch
                for acc_p, gp in zip(dparams, torch.autograd.grad(bias, params, ds_sum, allow_unused=True)):
                    if gp is not None:
                        acc_p += gp
        dq, dk, dv = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        if swap:
            dq, dk, dv = dq.transpose(0, 1), dk.transpose(0, 1), dv.transpose(0, 1)
        return (dq, dk, dv, None, None, *dparams)


def _generic_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec, g: _Geometry) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _outputs(q, v)  # (B, H, Tq, Dv), (B, H, Tq)
    for a0, a1, keys in g.blocks():
        mask = _block_bias(require(spec.encoding, Biases), spec, g, a0, a1, keys, q.dtype)[None]  # (1, H, C, L)
        out[:, :, a0:a1], lse[:, :, a0:a1] = kernel_forward(q[:, :, a0:a1], k[:, :, :keys], v[:, :, :keys], False, g.scale, mask)
    return out, lse


def _generic_block(
    ws: BackwardBuffers, g: _Geometry, bias: torch.Tensor, dout: torch.Tensor, total: torch.Tensor,
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
    a0: int, a1: int, keys: int, dk: torch.Tensor, dv: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    q_c, dout_c = up(q[:, :, a0:a1]), up(dout[:, :, a0:a1])
    k_c, v_c = up(k[:, :, :keys]), up(v[:, :, :keys])
    p = block_probabilities(ws, q_c, k_c, g.scale, bias, lse[:, :, a0:a1])
    return block_grads(ws, p, dout_c, total[:, :, a0:a1], q_c, k_c, v_c, g.scale, dk[:, :, :keys], dv[:, :, :keys])
