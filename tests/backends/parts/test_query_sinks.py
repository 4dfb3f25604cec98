"""Per-query sinks and bias curves with windows (posenc.attend): what Inkling-2's layers need.

Inkling-2 (transformers' ``Inkling2SlidingAttention`` / ``Inkling2FullAttention``) adds to each
softmax row a sink logit computed from that token's layer input (``sink_proj``: (B, H, Tq)), and
its sliding layers add the Inkling bias curves inside a window. Each case here is compared with the
formula written out in the test (float64, dense (Tq, Tk) mask): outputs and the gradients of q, k,
v, the curves and the sinks; a cached step (the last queries alone against every key); a packed row
against its documents alone; a left-padded batch against each row alone.
"""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc.call.spec import curve_bias
from posenc.errors import UsageError

B, H, HKV, T, D, R, DIM = 2, 4, 2, 19, 8, 6, 12


def _dense(q, k, v, curves, sinks, window, starts=None):
    """softmax(q k^T / sqrt(D) + curves[i, i - j] + mask [, sink_i]) v, the keys' heads repeated."""
    tq, tk = q.shape[2], k.shape[2]
    kk, vv = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
    i = torch.arange(tk - tq, tk)[:, None]
    j = torch.arange(tk)[None]
    s = q @ kk.transpose(-1, -2) / D**0.5  # (B, H, Tq, Tk)
    if curves is not None:
        s = s + curve_bias(curves, i[:, 0], j[0])
    ok = (j <= i) & ((j > i - window) if window else True)
    s = s.masked_fill(~ok, float("-inf"))
    if starts is not None:  # left padding: real queries never see padding keys
        s = s.masked_fill((j < starts[:, None, None, None]) & (i >= starts[:, None, None, None]), float("-inf"))
    if sinks is not None:
        return torch.softmax(torch.cat((s, sinks[..., None]), -1), -1)[..., :-1] @ vv
    return torch.softmax(s, -1) @ vv


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    enc = posenc.build("inkling", num_heads=H, head_dim=D, distances=R, rank=3, input_dim=DIM).double()
    with torch.no_grad():
        enc.bank.normal_(generator=gen)
    x = torch.randn(B, T, DIM, dtype=torch.float64, generator=gen)
    q = torch.randn(B, H, T, D, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(B, HKV, T, D, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(B, HKV, T, D, dtype=torch.float64, generator=gen, requires_grad=True)
    sinks = torch.randn(B, H, T, dtype=torch.float64, generator=gen, requires_grad=True)
    return enc, x, q, k, v, sinks


@pytest.mark.parametrize("window", [None, 5, 8])
@pytest.mark.parametrize("with_curves", [True, False])
def test_per_query_sinks_and_curves_in_a_window_equal_the_formula(window, with_curves) -> None:
    enc, x, q, k, v, sinks = _inputs()
    curves = enc.query_curves(x, torch.arange(T)) if with_curves else None
    encoding = enc if with_curves else None
    got = posenc.attend(q, k, v, encoding, window=window, sinks=sinks, query_curves=curves)
    want = _dense(q, k, v, curves, sinks, window)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    leaves = [q, k, v, sinks, *([enc.bank, enc.weights.weight, enc.scale] if with_curves else [])]
    g_got = torch.autograd.grad((got * torch.cos(got)).sum(), leaves, retain_graph=True)
    g_want = torch.autograd.grad((want * torch.cos(want)).sum(), leaves)
    for a, b in zip(g_got, g_want):
        assert a.abs().sum() > 0  # every learned input gets a gradient
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


def test_a_cached_step_equals_the_full_pass() -> None:
    """The last 3 queries (a cached call) and the last one (a decode step) against every key."""
    enc, x, q, k, v, sinks = _inputs(1)
    curves = enc.query_curves(x, torch.arange(T))
    full = posenc.attend(q, k, v, enc, window=5, sinks=sinks, query_curves=curves)
    for n in (3, 1):
        step = posenc.attend(q[:, :, -n:], k, v, enc, window=5, sinks=sinks[:, :, -n:], query_curves=curves[:, :, -n:])
        torch.testing.assert_close(step, full[:, :, -n:], rtol=0, atol=1e-12)


def test_a_packed_row_equals_its_documents() -> None:
    enc, x, q, k, v, sinks = _inputs(2)
    docs = torch.tensor([[0] * 7 + [1] * 12, [0] * 10 + [1] * 9])
    curves = enc.query_curves(x, torch.arange(T))  # (no log scaling: the curves do not read positions)
    got = posenc.attend(q, k, v, enc, window=5, sinks=sinks, document_ids=docs, query_curves=curves)
    for row, spans in ((0, ((0, 7), (7, 19))), (1, ((0, 10), (10, 19)))):
        for a, c in spans:
            s = slice(row, row + 1)
            alone = posenc.attend(q[s, :, a:c], k[s, :, a:c], v[s, :, a:c], enc, window=5, sinks=sinks[s, :, a:c],
                                  query_curves=curves[s, :, a:c])
            torch.testing.assert_close(got[s, :, a:c], alone, rtol=0, atol=1e-12)


def test_a_left_padded_batch_equals_each_row_alone() -> None:
    enc, x, q, k, v, sinks = _inputs(3)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :4] = False
    curves = enc.query_curves(x, torch.arange(T))
    got = posenc.attend(q, k, v, enc, window=6, sinks=sinks, query_curves=curves, key_padding_mask=mask)
    want = _dense(q, k, v, curves, sinks, 6, starts=torch.tensor([4, 0]))
    torch.testing.assert_close(got[0, :, 4:], want[0, :, 4:], rtol=0, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-12)


def test_per_query_sinks_of_the_wrong_shape_are_refused() -> None:
    _, _, q, k, v, sinks = _inputs()
    with pytest.raises(UsageError, match="per-query sinks"):
        posenc.attend(q, k, v, None, sinks=sinks[:, :, :-1])
    with pytest.raises(UsageError, match="sinks must be a float tensor"):
        posenc.attend(q, k, v, None, sinks=sinks[0])


@pytest.mark.parametrize("window", [None, 3, 5, 11])
@pytest.mark.parametrize("per_row", [True, False])
def test_the_curved_backend_runs_windows_and_sinks_in_blocks(window, per_row) -> None:
    """curved.attend_extras in blocks of 4 queries (several blocks, far keys without a window, the
    window's edge inside a band) against the formula, outputs and gradients; a cached call of the
    last 6 queries too."""
    from posenc.backends import curved
    from posenc.call.spec import ScoreSpec

    enc, x, q, k, v, sinks = _inputs(4)
    kk, vv = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
    curves = enc.query_curves(x, torch.arange(T))
    rows = sinks if per_row else sinks[:1, :, :1].expand(1, H, T)  # (B or 1, H, T)
    for n in (T, 6):
        spec = ScoreSpec(encoding=enc, q_positions=torch.arange(T - n, T), k_positions=torch.arange(T), causal=True,
                         scale=D**-0.5, curves=curves[:, :, -n:])
        assert curved.supports(spec, q)
        got = curved.attend_extras(q[:, :, -n:], kk, vv, spec, window, rows[:, :, -n:], block=4)
        want = _dense(q, k, v, curves, rows.expand(B, H, T), window)[:, :, -n:]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        leaves = [q, k, v, sinks, enc.bank, enc.weights.weight]
        g_got = torch.autograd.grad((got * torch.cos(got)).sum(), leaves, retain_graph=True)
        g_want = torch.autograd.grad((want * torch.cos(want)).sum(), leaves, retain_graph=True)
        for a, b in zip(g_got, g_want):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


def test_attend_hands_curves_with_a_window_and_sinks_to_the_curved_backend(monkeypatch) -> None:
    from posenc.backends import curved

    seen = []
    monkeypatch.setattr(curved, "attend_extras", lambda *a, **kw: seen.append(a[4]) or torch.zeros_like(a[0]))
    enc, x, q, k, v, sinks = _inputs()
    posenc.attend(q, k, v, enc, window=5, sinks=sinks, query_curves=enc.query_curves(x, torch.arange(T)))
    assert seen == [5]
