"""The blocked backend's non-causal path for a fixed relative bias (backends/parts/toeplitz.py): one
kernel call whose mask is a strided (Hankel) view of a (H, Tq + Tk - 1) table, over reversed keys.

Reference: attention written out in float64, softmax(q k^T / sqrt(D) + bias) v per padded row, with
ALiBi's bias -m |j - i| (slopes from ``posenc.alibi_slopes``) and T5's bias from Hugging Face's
``T5Attention._relative_position_bucket`` (imported live) indexing the encoding's table; outputs and
the gradients of q, k and v compared, with left and right key padding and grouped key/value heads.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import posenc
from posenc.backends.parts import toeplitz

modeling_t5 = pytest.importorskip("transformers.models.t5.modeling_t5")

H, D = 4, 16


def alibi_bias(enc: torch.nn.Module, n: int) -> torch.Tensor:
    i = torch.arange(n, dtype=torch.float64)
    return -posenc.alibi_slopes(H).double()[:, None, None] * (i[None, :] - i[:, None]).abs()  # (H, n, n)


def t5_bias(enc: Any, n: int) -> torch.Tensor:
    i = torch.arange(n)
    bucket = modeling_t5.T5Attention._relative_position_bucket(i[None, :] - i[:, None], bidirectional=True,
                                                               num_buckets=32, max_distance=128)  # (n, n), r = j - i
    return enc.relative_attention_bias.weight.detach().double()[bucket].permute(2, 0, 1)  # (H, n, n)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor,
              bias_of: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """Float64 attention of each row's real tokens (positions 0..n-1 from its first real token);
    padding queries give 0."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    rows = []
    for b in range(q.shape[0]):
        idx = real[b].nonzero().flatten()
        qb, kb, vb = q[b][:, idx], k[b][:, idx], v[b][:, idx]  # (H, n, D)
        s = qb @ kb.transpose(-1, -2) / D**0.5 + bias_of(idx.numel())  # (H, n, n)
        ob = torch.zeros_like(q[b])
        ob[:, idx] = torch.softmax(s, -1) @ vb
        rows.append(ob)
    return torch.stack(rows)


CASES = [("alibi", 1024, H), ("alibi", 256, 2), ("t5", 400, H), ("t5", 300, 1)]


@pytest.mark.parametrize("name,n,hkv", CASES)
def test_matches_float64_formula_with_padding(name: str, n: int, hkv: int, monkeypatch: pytest.MonkeyPatch) -> None:
    enc = posenc.build(name, num_heads=H, head_dim=D, causal=False)
    if name == "t5":
        with torch.no_grad():
            enc.relative_attention_bias.weight.normal_()
        enc.requires_grad_(False)  # a frozen table (a learned one takes the tailed path: test below)
    calls: list[int] = []
    inner = toeplitz.attend
    monkeypatch.setattr(toeplitz, "attend", lambda *a: (calls.append(1), inner(*a))[1])
    gen = torch.Generator().manual_seed(n + hkv)
    b = 3
    q64 = (torch.randn(b, H, n, D, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    k64 = (torch.randn(b, hkv, n, D, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    v64 = torch.randn(b, hkv, n, D, generator=gen, dtype=torch.float64).requires_grad_()
    real = torch.ones(b, n, dtype=torch.bool)
    real[1, : n // 3] = False  # left padding
    real[2, n - n // 4 :] = False  # right padding
    q, k, v = (x.detach().float().requires_grad_() for x in (q64, k64, v64))
    out = posenc.attend(q, k, v, enc, causal=False, key_padding_mask=real, backend="blocked")
    assert calls, "the non-causal fixed-bias call did not take the Toeplitz path"
    bias_of = (lambda m: alibi_bias(enc, m)) if name == "alibi" else (lambda m: t5_bias(enc, m))
    expected = reference(q64, k64, v64, real, bias_of)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-5)
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    out.backward(grad.float())
    expected.backward(grad)
    for got, want, what in ((q.grad, q64.grad, "dq"), (k.grad, k64.grad, "dk"), (v.grad, v64.grad, "dv")):
        assert got is not None and want is not None
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-4, msg=lambda m, w=what: f"{name} {w}: {m}")


@pytest.mark.parametrize("n,hkv,b", [(200, H, 1), (300, 2, 2), (700, 1, 1)])
def test_learned_table_takes_one_kernel_call_each_way(n: int, hkv: int, b: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """T5's table with grad: the output and dq, dk, dv from the Toeplitz path's two kernel calls,
    the table's gradient from the band written out and one forward per far region; all of them
    against the float64 formula (Hugging Face's buckets), with grouped key/value heads, padding."""
    enc = posenc.build("t5", num_heads=H, head_dim=D, causal=False)
    with torch.no_grad():
        enc.relative_attention_bias.weight.normal_()
    calls: list[int] = []
    inner = toeplitz.attend
    monkeypatch.setattr(toeplitz, "attend", lambda *a: (calls.append(len(a)), inner(*a))[1])
    gen = torch.Generator().manual_seed(n)
    q64 = (torch.randn(b, H, n, D, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    k64 = (torch.randn(b, hkv, n, D, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    v64 = torch.randn(b, hkv, n, D, generator=gen, dtype=torch.float64).requires_grad_()
    real = torch.ones(b, n, dtype=torch.bool)
    if b > 1:
        real[1, : n // 3] = False  # left padding
    q, k, v = (x.detach().float().requires_grad_() for x in (q64, k64, v64))
    out = posenc.attend(q, k, v, enc, causal=False, key_padding_mask=real, backend="blocked")
    assert calls and all(c == 7 for c in calls), "the learned table did not take the Toeplitz path with its gradient"
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    out.backward(grad.float())
    weight64 = enc.relative_attention_bias.weight.detach().double().requires_grad_()

    def bias_of(m: int) -> torch.Tensor:
        i = torch.arange(m)
        bucket = modeling_t5.T5Attention._relative_position_bucket(i[None, :] - i[:, None], bidirectional=True,
                                                                   num_buckets=32, max_distance=128)
        return weight64[bucket].permute(2, 0, 1)  # (H, m, m)

    expected = reference(q64, k64, v64, real, bias_of)
    torch.testing.assert_close(out.double(), expected.detach(), rtol=0, atol=2e-5)
    expected.backward(grad)
    for got, want, what in ((q.grad, q64.grad, "dq"), (k.grad, k64.grad, "dk"), (v.grad, v64.grad, "dv"),
                            (enc.relative_attention_bias.weight.grad, weight64.grad, "table")):
        assert got is not None and want is not None
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-4 if what != "table" else 1e-3,
                                   msg=lambda m, w=what: f"{w}: {m}")


def test_hankel_view_is_the_toeplitz_matrix() -> None:
    """hankel(w)[0, h, i, j'] = w[h, i + j'], i.e. f(j - i) with the keys reversed, no copy."""
    tq, tk = 5, 7
    w = torch.arange(2 * (tq + tk - 1), dtype=torch.float32).reshape(2, tq + tk - 1)
    m = toeplitz.hankel(w, tq, tk)
    assert m.shape == (1, 2, tq, tk) and m.data_ptr() == w.data_ptr()
    i, j = torch.arange(tq)[:, None], torch.arange(tk)[None, :]
    torch.testing.assert_close(m[0], w[:, i + j], rtol=0, atol=0)


def test_learned_table_in_bfloat16_is_within_its_rounding() -> None:
    """bfloat16 q, k, v: the table's gradient (float32, from the band, the far-future forward and the
    rows' zero sums) within 2% of its largest entry of the float64 formula's, the output within 2e-2."""
    n = 300
    enc = posenc.build("t5", num_heads=H, head_dim=D, causal=False)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        enc.relative_attention_bias.weight.copy_(torch.randn(enc.relative_attention_bias.weight.shape, generator=gen))
    q, k, v = (torch.randn(2, H, n, D, generator=gen, dtype=torch.float64) for _ in range(3))
    grad = torch.randn(2, H, n, D, generator=gen, dtype=torch.float64)
    out = posenc.attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), enc, causal=False, backend="blocked")
    out.backward(grad.bfloat16())
    weight64 = enc.relative_attention_bias.weight.detach().double().requires_grad_()
    i = torch.arange(n)
    bucket = modeling_t5.T5Attention._relative_position_bucket(i[None, :] - i[:, None], bidirectional=True,
                                                               num_buckets=32, max_distance=128)
    expected = torch.softmax(q @ k.transpose(-1, -2) / D**0.5 + weight64[bucket].permute(2, 0, 1), -1) @ v
    expected.backward(grad)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected.detach(), rtol=0, atol=2e-2)
    got = enc.relative_attention_bias.weight.grad
    assert got is not None and weight64.grad is not None
    torch.testing.assert_close(got.double(), weight64.grad, rtol=0, atol=0.02 * float(weight64.grad.abs().max()))
