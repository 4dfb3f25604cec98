"""Forget gates (FoX) with windows, chunks, sinks and a soft cap (posenc.attend): what a model whose
layers have them needs (issue 47 item 7: Gemma 2/3, Mistral, gpt-oss, Llama 4, Inkling-2 under "fox").

Reference, written out in float64 with a dense (Tq, Tk) mask: the Forgetting Transformer's logit
(Lin et al. 2025, eq. 4) ``q_i . k_j * scale + D_ij`` with ``D_ij = sum_{l=j+1..i} log f_l`` summed gate
by gate (no cumulative sum), the content score capped first (Gemma 2: ``cap * tanh(s / cap)``), then
the causal mask, the window ``i - W < j <= i`` or the chunk ``j // C == i // C``, left padding, and the
sink logit s_h (or s_{b,h,i}) as one more softmax column with no value. Compared: the outputs of a full
call, of a cached call (the last queries against every key, and against the window's keys alone: a
sliding cache's), a left-padded batch against each row alone, and the gradients of q, k, v, the gates
and the sinks. Float32 and float64.
"""

from __future__ import annotations

import math

import pytest
import torch

import posenc

pytestmark = pytest.mark.usefixtures("one_thread")

B, H, HKV, T, D, DV = 2, 4, 2, 23, 8, 6
CASES = [dict(window=5), dict(window=9, sinks="head"), dict(sinks="query"), dict(chunk=6), dict(chunk=6, sinks="head"),
         dict(window=7, softcap=1.5), dict(softcap=1.5, sinks="head"), dict(window=7, sinks="query")]


def _decay(log_f: torch.Tensor, tq: int) -> torch.Tensor:
    """D (B, H, Tq, Tk): for the last Tq of the Tk keys as queries, D_ij = sum_{l=j+1..i} log f_l (0 for j >= i)."""
    tk = log_f.shape[-1]
    i = torch.arange(tk - tq, tk)[:, None, None]  # (Tq, 1, 1)
    j = torch.arange(tk)[None, :, None]  # (1, Tk, 1)
    gate = torch.arange(tk)[None, None, :]  # (1, 1, Tk): the gates summed
    between = ((gate > j) & (gate <= i)).to(log_f.dtype)  # (Tq, Tk, Tk)
    return torch.einsum("bhl,ijl->bhij", log_f, between)


def _dense(q, k, v, log_f, *, window=None, chunk=None, sinks=None, softcap=None, starts=None):
    """softmax(cap(q k^T * scale) + D + masks [, sink]) v in q's dtype; the keys' heads repeated."""
    tq, tk = q.shape[2], k.shape[2]
    kk, vv = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
    s = q @ kk.transpose(-1, -2) / math.sqrt(D)  # (B, H, Tq, Tk)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s + _decay(log_f, tq)
    i, j = torch.arange(tk - tq, tk)[:, None], torch.arange(tk)[None]
    ok = j <= i
    if window is not None:
        ok = ok & (j > i - window)
    if chunk is not None:
        ok = ok & (j // chunk == i // chunk)
    s = s.masked_fill(~ok, -math.inf)
    if starts is not None:  # left padding: a real query never sees a padding key
        s = s.masked_fill((j < starts[:, None, None, None]) & (i >= starts[:, None, None, None]), -math.inf)
    if sinks is None:
        return torch.softmax(s, -1) @ vv
    column = sinks.view(1, H, 1, 1).expand(q.shape[0], H, tq, 1) if sinks.dim() == 1 else sinks[..., None]
    return torch.softmax(torch.cat((s, column), -1), -1)[..., :-1] @ vv


def _inputs(case: dict, dtype: torch.dtype = torch.float64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def leaf(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale + shift).to(dtype).requires_grad_(True)

    q, k, v = leaf(B, H, T, D, scale=1.5), leaf(B, HKV, T, D, scale=1.5), leaf(B, HKV, T, DV)
    log_f = torch.nn.functional.logsigmoid(torch.randn(B, H, T, generator=gen, dtype=torch.float64) + 2.5)  # forgetting slowly
    log_f = log_f.to(dtype).requires_grad_(True)
    kind = case.get("sinks")
    sinks = None if kind is None else leaf(H) if kind == "head" else leaf(B, H, T)
    call = {key: value for key, value in case.items() if key != "sinks"}
    return q, k, v, log_f, sinks, call


def _fox():
    return posenc.build("fox", num_heads=H, head_dim=D)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gates_with_windows_chunks_sinks_and_caps_equal_the_formula(case: dict, dtype: torch.dtype) -> None:
    q, k, v, log_f, sinks, call = _inputs(case, dtype)
    got = posenc.attend(q, k, v, _fox(), log_gates=log_f, sinks=sinks, **call)
    want = _dense(*(x.double() for x in (q, k, v, log_f)), sinks=None if sinks is None else sinks.double(), **call)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    assert (got.double() - want).abs().max() < tol
    # without the gates, or without the window / chunk / sinks, the result differs: each one is felt
    assert (_dense(*(x.double() for x in (q, k, v)), log_f.double() * 0, sinks=None if sinks is None else sinks.double(), **call)
            - want).abs().max() > 1e-3
    if call.get("window") or call.get("chunk") or sinks is not None:
        assert (_dense(*(x.double() for x in (q, k, v, log_f))) - want).abs().max() > 1e-3
    if dtype == torch.float64:
        grad = torch.randn_like(want)
        inputs = [x for x in (q, k, v, log_f, sinks) if x is not None]
        ours = torch.autograd.grad((got * grad).sum(), inputs)
        theirs = torch.autograd.grad((want * grad).sum(), inputs)
        for name, a, b in zip("q k v gates sinks".split(), ours, theirs):
            assert (a - b).abs().max() < 1e-10, name
            assert b.abs().max() > 1e-6, name  # the gradient reaches it


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_a_cached_call_equals_the_full_calls_last_rows(case: dict) -> None:
    """The last 3 queries against every key; with a window, also against the keys a sliding cache
    keeps (the last W - 1 before the new queries): the gates of the dropped keys change no score."""
    q, k, v, log_f, sinks, call = _inputs(case)
    full = _dense(q, k, v, log_f, sinks=sinks, **call).detach()
    n = 3
    rows = None if sinks is None or sinks.dim() == 1 else sinks[..., -n:]
    kept = sinks if rows is None else rows
    got = posenc.attend(q[:, :, -n:], k, v, _fox(), positions=torch.arange(T - n, T), k_positions=torch.arange(T),
                        log_gates=log_f, sinks=kept, **call)
    assert (got - full[:, :, -n:]).abs().max() < 1e-12
    window = call.get("window")
    if window is not None:
        first = T - n - (window - 1)
        got = posenc.attend(q[:, :, -n:], k[:, :, first:], v[:, :, first:], _fox(), positions=torch.arange(T - n, T),
                            k_positions=torch.arange(first, T), log_gates=log_f[..., first:], sinks=kept, **call)
        assert (got - full[:, :, -n:]).abs().max() < 1e-12


@pytest.mark.parametrize("case", [dict(window=5, sinks="head"), dict(chunk=6), dict(softcap=1.5, sinks="query")],
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_a_left_padded_batch_equals_its_rows_alone(case: dict) -> None:
    q, k, v, log_f, sinks, call = _inputs(case)
    pad = 4
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :pad] = False
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # each row's positions from its first real token
    got = posenc.attend(q, k, v, _fox(), positions=positions, key_padding_mask=mask, log_gates=log_f, sinks=sinks, **call)
    for row, start in ((0, pad), (1, 0)):
        alone_sinks = None if sinks is None else sinks if sinks.dim() == 1 else sinks[row: row + 1, :, start:]
        alone = _dense(q[row: row + 1, :, start:], k[row: row + 1, :, start:], v[row: row + 1, :, start:],
                       log_f[row: row + 1, :, start:], sinks=alone_sinks, **call)
        assert (got[row: row + 1, :, start:] - alone).abs().max() < 1e-12, row
