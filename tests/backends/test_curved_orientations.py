"""The ``curved`` backend with its band's keys reversed and with its curves reversed (it picks the
one that copies less: the keys for full passes, the curves for decode steps), each forced, against
eager's written-out formula and against the formula with a window and sinks: outputs and the
gradients of q, k, v, the curves and the sinks; a full pass, a chunk after a cache and a decode
step, in several blocks whose bands start before key 0 and inside the keys, and calls shorter than
the R distances (the band then reaches Tk keys, and the curves' entries past Tk get 0)."""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc.backends import curved, eager
from posenc.backends.parts.base import ScoreSpec

H, D, R = 2, 4, 6


def _dense(q, k, v, curves, window, sinks, offset):
    """softmax over the keys (and a sink per row) of q k^T / sqrt(D) + curves[i, i + offset - j] for
    0 <= distance < R, causal, keys outside the window hidden: (B, H, Tq, D)."""
    tq, tk = q.shape[-2], k.shape[-2]
    d = (torch.arange(tq)[:, None] + offset) - torch.arange(tk)[None, :]  # (Tq, Tk)
    bias = curves.gather(-1, d.clamp(0, R - 1).expand(*curves.shape[:2], -1, -1)).masked_fill((d < 0) | (d >= R), 0.0)
    s = q @ k.transpose(-1, -2) * D ** -0.5 + bias
    hidden = d < 0 if window is None else (d < 0) | (d >= window)
    s = s.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks[..., None].expand(*s.shape[:-1], 1)], -1)
    p = torch.softmax(s, -1)
    return p[..., :tk] @ v


@pytest.mark.parametrize("reverse", [True, False])
@pytest.mark.parametrize(("tq", "tk", "block"), [(13, 13, 4), (6, 15, 4), (1, 15, 4), (40, 40, 16), (5, 5, 2), (2, 4, 8)])
@pytest.mark.parametrize("window", [None, 3, 9])
def test_both_orientations_equal_the_formula(monkeypatch, reverse, tq, tk, block, window):
    monkeypatch.setattr(curved, "REVERSED", reverse)
    enc = posenc.build("inkling", num_heads=H, head_dim=D, distances=R, rank=3)
    g = torch.Generator().manual_seed(tq * 100 + tk)
    q, k, v = (torch.randn(2, H, n, D, generator=g, dtype=torch.float64).requires_grad_() for n in (tq, tk, tk))
    c = torch.randn(2, H, tq, R, generator=g, dtype=torch.float64).requires_grad_()
    sinks = torch.randn(2, H, tq, generator=g, dtype=torch.float64).requires_grad_()
    kp = torch.arange(tk)
    spec = ScoreSpec(encoding=enc, q_positions=kp[tk - tq :], k_positions=kp, causal=True, scale=D ** -0.5, curves=c)
    assert curved.supports(spec, q)
    leaves = [q, k, v, c, sinks]
    w = torch.randn(2, H, tq, D, generator=g, dtype=torch.float64)
    cases = [(curved.attend_extras(q, k, v, spec, window, sinks, block), _dense(q, k, v, c, window, sinks, tk - tq))]
    if window is None:  # and the plain call against eager
        cases.append((curved.attend(q, k, v, spec, block), eager.attend(q, k, v, spec)))
    for got, want in cases:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        for a, b in zip(torch.autograd.grad((got * w).sum(), leaves, allow_unused=True),
                        torch.autograd.grad((want * w).sum(), leaves, allow_unused=True)):
            if b is None:
                assert a is None or a.abs().max() == 0
            else:
                torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


def test_the_choice_follows_the_copies():
    """A full pass reverses its keys (Tq R > 2 (P + Tq) D), a decode step its curves."""
    k = torch.zeros(1, 2, 4096, 64)
    assert curved._CurveBand(k, k, 4096, 1024, 1024, None).reversed
    assert not curved._CurveBand(k, k, 1, 1024, 1024, None).reversed
