"""The explicit path's backward raises logits far below the log-sum-exp to a floor before exp (exp's
underflow path is slow): against eager with a bias large enough that most logits are below it
(the dynamic position bias with its MLP scaled up), float64 and float32, outputs and gradients; and
the keys a bias hides (-inf: a decoder's future, xPos's blockwise mask anywhere in a block's keys)
still get exactly zero gradient from the queries that cannot see them."""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc.backends.parts import explicit

H, D, T = 2, 8, 40


def _run(enc, q, k, v, w, backend):
    out = posenc.attend(q, k, v, enc, backend=backend)
    return out, torch.autograd.grad((out * w).sum(), [q, k, v, *enc.parameters()])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_huge_bias_equals_the_same_path_without_the_floor_and_eager(monkeypatch, dtype):
    torch.manual_seed(0)
    enc = posenc.build("dpb", num_heads=H, head_dim=D).to(dtype)
    with torch.no_grad():
        enc.weights[-1].mul_(2000.0)  # biases of thousands: most probabilities underflow
    q, k, v = (torch.randn(1, H, T, D, dtype=dtype, requires_grad=True) for _ in range(3))
    w = torch.randn(1, H, T, D, dtype=dtype)
    logits = (q @ k.transpose(-1, -2)) * D ** -0.5 + enc.bias(torch.arange(T), torch.arange(T))
    low = logits.tril() - logits.tril().logsumexp(-1, keepdim=True) < explicit._floor(dtype)
    assert low.float().mean() > 0.3  # the floor is reached by many pairs
    got, g_got = _run(enc, q, k, v, w, "blocked")
    want, g_want = _run(enc, q, k, v, w, "eager")
    monkeypatch.setattr(explicit, "_floor", lambda dtype: float("-inf"))
    plain, g_plain = _run(enc, q, k, v, w, "blocked")
    scale = max(1.0, *(b.abs().max().item() for b in g_want))  # the MLP's gradients reach ~10: rounding scales with them
    # the floor changes nothing that shows (largest seen: 0 in float64, 0 in float32)
    torch.testing.assert_close(got, plain, rtol=0, atol=1e-15 if dtype == torch.float64 else 1e-7)
    for a, b in zip(g_got, g_plain):
        torch.testing.assert_close(a, b, rtol=0, atol=(1e-15 if dtype == torch.float64 else 1e-7) * scale)
    # and the path equals eager to the rounding that biases of thousands allow, with or without the
    # floor (largest seen, relative to the largest gradient: 2e-12 in float64, 1.5e-4 in float32)
    tol = 1e-10 if dtype == torch.float64 else 1e-3
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=0, atol=tol * scale)


@pytest.mark.parametrize("method", [("dpb", {}), ("xpos", {"block_size": 8})])
def test_hidden_keys_get_exactly_zero_gradient(method):
    name, options = method
    torch.manual_seed(1)
    enc = posenc.build(name, num_heads=H, head_dim=D, **options)
    n = 3 * explicit.BLOCK  # several blocks: hidden keys before a block's last C keys too
    q, k, v = (torch.randn(1, H, n, D, requires_grad=True) for _ in range(3))
    out = posenc.attend(q, k, v, enc, backend="blocked")
    i = n - 10  # one query: the keys it cannot see get no gradient from it
    gk, gv = torch.autograd.grad(out[:, :, i].sum(), [k, v])
    seen = torch.zeros(n, dtype=torch.bool)
    seen[: i + 1] = True
    if name == "xpos":
        seen[: (i // 8 - 1) * 8] = False  # xPos's blocks: its own and the one before
    assert (gk[:, :, ~seen] == 0).all() and (gv[:, :, ~seen] == 0).all()
    assert gv[:, :, seen].abs().amax(-1).gt(0).all()
