"""The ``selective`` backend (selective attention in blocks of queries, the selection carried as a
running column sum) against eager's written-out form (one (B, Tq, Tk) penalty per call): outputs and
the gradients of q, k and v (the selection's included), causal (selective attention is causal only),
in float64 and float32, a full pass, a chunk after a cache with the cache's selection sums, a decode
step, one block and many; and auto's choice."""

from __future__ import annotations

import pytest
import torch

import posenc
from agreement import MaxTensor
from posenc.backends import eager, selective
from posenc.backends.parts.base import ScoreSpec

H, D = 3, 8


@pytest.mark.parametrize(("tq", "tk", "block"), [(12, 12, 4), (12, 12, 5), (7, 12, 3), (1, 12, 4), (20, 20, 256), (300, 300, 64)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("cached", [False, True])
def test_equals_eager_outputs_and_gradients(tq, tk, block, dtype, cached):
    enc = posenc.build("selective", num_heads=H, head_dim=D, head=1)
    g = torch.Generator().manual_seed(tq + tk + block)
    q, k, v = (torch.randn(2, H, n, D, generator=g, dtype=dtype).mul(2.0).requires_grad_() for n in (tq, tk, tk))
    kp = torch.arange(5, 5 + tk)
    selected = torch.rand(2, tk, generator=g, dtype=dtype) * 3 if cached else None  # earlier calls' sums (a KV cache's)
    spec = ScoreSpec(encoding=enc, q_positions=kp[tk - tq :], k_positions=kp, causal=True, scale=D ** -0.5, selected=selected)
    assert selective.supports(spec, q)
    got, want = selective.attend(q, k, v, spec, block), eager.attend(q, k, v, spec)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    w = torch.randn(got.shape, generator=g, dtype=dtype)
    g_got = torch.autograd.grad((got * w).sum(), [q, k, v])
    g_want = torch.autograd.grad((want * w).sum(), [q, k, v])
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=0, atol=tol * 10)
    # the selection's gradient is there: the selecting head's q differs from what the kernel alone gives
    assert g_got[0][:, 1].abs().max() > 0


def test_the_selection_changes_the_result():
    """The test above can fail: without the penalty the blocks give plain causal attention."""
    enc = posenc.build("selective", num_heads=H, head_dim=D)
    q, k, v = (torch.randn(1, H, 40, D, dtype=torch.float64) * 2 for _ in range(3))
    spec = ScoreSpec(encoding=enc, q_positions=torch.arange(40), k_positions=torch.arange(40), causal=True, scale=D ** -0.5)
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=D ** -0.5)
    assert (selective.attend(q, k, v, spec, 8) - plain).abs().max() > 1e-3


def test_auto_picks_selective_for_full_passes_and_cached_chunks_and_eager_for_single_queries_and_padding():
    enc = posenc.build("selective", num_heads=H, head_dim=D)
    attn = posenc.Attention(H * D, H, enc)
    x = torch.randn(2, 12, H * D)
    full = attn(x)
    assert attn.last_backend == "selective"
    cache = posenc.model.cache.LayerCache()
    first = attn(x[:, :6], cache=cache)
    chunk = attn(x[:, 6:9], cache=cache)  # a chunk after a cache, with the cache's selection sums
    assert attn.last_backend == "selective"
    step = attn(x[:, 9:10], cache=cache)  # a decode step: eager's written-out row
    assert attn.last_backend == "eager"
    torch.testing.assert_close(torch.cat([first, chunk, step], 1), full[:, :10], rtol=0, atol=1e-5)
    forced = posenc.Attention(H * D, H, enc, backend="selective")  # a decode step on selective, forced
    full = forced(x)
    cache = posenc.model.cache.LayerCache()
    forced(x[:, :9], cache=cache)
    torch.testing.assert_close(forced(x[:, 9:10], cache=cache), full[:, 9:10], rtol=0, atol=1e-5)
    assert forced.last_backend == "selective"
    padded = posenc.model.cache.LayerCache(padding=[3, 0])
    attn(x[:, :8], cache=padded)
    assert attn.last_backend == "eager"


def test_a_training_pass_at_4096_tokens_holds_no_selection_tensor():
    """eager holds F, (B, N, N); the blocks hold (B, H, BLOCK, N) at most."""
    n = 4096
    enc = posenc.build("selective", num_heads=2, head_dim=8)
    attn = posenc.Attention(16, 2, enc)
    x = torch.randn(1, n, 16, requires_grad=True)
    with MaxTensor() as seen:
        attn(x).sum().backward()
    assert attn.last_backend == "selective"
    assert seen.largest <= 2 * selective.BLOCK * n < n * n, seen.largest
    assert x.grad is not None and x.grad.abs().max() > 0
