"""Selective attention (Leviathan et al. 2024, §3) against x-transformers, with the same inputs and
weights: its ``Attend(causal=True, selective=True)`` on q, k, v (outputs and the gradients of q, k,
v) and its ``Attention(selective=True)`` layer; then cached decoding equals the full pass (the KV
cache keeps each key's selection sums), a packed row equals its documents alone, a padded batch its
rows, grouped heads equal repeated ones, and the selection is the formula written out pair by pair.
"""

from __future__ import annotations

import pytest
import torch

import posenc
from agreement import assert_decoding_equals_full, assert_packed_rows_equal_documents
from posenc.errors import UsageError

H, D = 4, 8
DIM = H * D


def qkv(b: int, t: int, seed: int = 0, hkv: int = H) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, hh, t, D, generator=g, dtype=torch.float64) * 1.5 for hh in (H, hkv, hkv)]


@pytest.mark.parametrize("t", [12, 300], ids=["one block", "two blocks of eager"])
def test_equals_x_transformers_attend_outputs_and_gradients(t):
    attend = pytest.importorskip("x_transformers.attend")
    b = 2 if t == 12 else 1
    q, k, v = (x.requires_grad_() for x in qkv(b, t))
    want, _ = attend.Attend(causal=True, selective=True)(q, k, v)
    got = posenc.attend(q, k, v, posenc.build("selective", num_heads=H, head_dim=D))
    # x-transformers' softmax runs in float32 for any input: that rounding is the difference
    # (largest seen: 2.3e-7 on outputs, ~1e-6 on gradients).
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    g = torch.randn_like(want)
    for a, c in zip(torch.autograd.grad((got * g).sum(), [q, k, v]), torch.autograd.grad((want * g).sum(), [q, k, v])):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)
    plain = posenc.attend(q, k, v, "nope")
    assert (plain - want).abs().max() > 0.1  # the selection matters here


def test_equals_x_transformers_attention_layer():
    xt = pytest.importorskip("x_transformers.x_transformers")
    torch.manual_seed(1)
    ref = xt.Attention(DIM, dim_head=D, heads=H, causal=True, selective=True).double()
    attn = posenc.Attention(DIM, H, posenc.build("selective", num_heads=H, head_dim=D)).double()
    with torch.no_grad():
        for w in (ref.to_q.weight, ref.to_k.weight, ref.to_v.weight):
            w.mul_(4.0)  # scores large enough that the selection masks keys
        attn.qkv.weight.copy_(torch.cat([ref.to_q.weight, ref.to_k.weight, ref.to_v.weight]))
        attn.proj.weight.copy_(ref.to_out.weight)
    x = torch.randn(2, 16, DIM, dtype=torch.float64)
    torch.testing.assert_close(attn(x), ref(x), rtol=0, atol=2e-6)  # float32 softmax there (largest seen: ~1e-7)


def test_the_selection_written_out_pair_by_pair():
    """F_ij = sum_{t<i, t != j, j != 0} relu(s0_tj) over t >= j, logits minus F, softmax: one pair at a time."""
    b, t = 1, 9
    q, k, v = qkv(b, t, seed=3)
    got = posenc.attend(q, k, v, posenc.build("selective", num_heads=H, head_dim=D, head=2))
    s = (q[:, 2] @ k[:, 2].transpose(-1, -2)) / D ** 0.5  # (B, T, T): head 2 selects
    out = torch.zeros_like(got)
    for i in range(t):
        logits = torch.zeros(H, i + 1, dtype=torch.float64)
        for j in range(i + 1):
            f = sum(float(torch.relu(s[0, u, j])) for u in range(j + 1, i) if j != 0)
            logits[:, j] = (q[0, :, i] * k[0, :, j]).sum(-1) / D ** 0.5 - f
        out[0, :, i] = (torch.softmax(logits, -1)[:, None, :] @ v[0, :, : i + 1])[:, 0]  # (H, D)
    torch.testing.assert_close(got, out, rtol=0, atol=1e-12)


def model(seed=3):
    config = posenc.LMConfig(vocab_size=32, dim=DIM, depth=2, num_heads=H, encoding="selective")
    torch.manual_seed(seed)
    lm = posenc.LM(config).eval()
    with torch.no_grad():
        for block in lm.blocks:
            block.attn.qkv.weight.mul_(6.0)  # selections well above 0
    return lm


def test_cached_decoding_equals_the_full_pass():
    lm = model()
    assert_decoding_equals_full(lm, length=20)
    tokens = torch.randint(0, 32, (2, 20))
    with torch.no_grad():
        full = lm(tokens)
        lm.blocks[0].attn.encoding.selection_scores = lambda q, k: torch.zeros(q.shape[0], q.shape[2], k.shape[2])  # no selection
        assert (lm(tokens) - full).abs().max() > 1e-3  # the selection matters in this model


def test_a_packed_row_equals_its_documents_alone():
    attn = posenc.Attention(DIM, H, posenc.build("selective", num_heads=H, head_dim=D)).double()
    with torch.no_grad():
        attn.qkv.weight.mul_(6.0)
    assert_packed_rows_equal_documents(attn, torch.randn(2, 15, DIM, dtype=torch.float64))


def test_a_padded_batch_and_a_padded_cache_equal_their_rows_alone():
    attn = posenc.Attention(DIM, H, posenc.build("selective", num_heads=H, head_dim=D)).double()
    with torch.no_grad():
        attn.qkv.weight.mul_(6.0)
    x = torch.randn(2, 10, DIM, dtype=torch.float64)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    got = attn(x, attention_mask=mask)
    torch.testing.assert_close(got[1:, 4:], attn(x[1:, 4:]), rtol=0, atol=1e-12)
    torch.testing.assert_close(got[:1], attn(x[:1]), rtol=0, atol=1e-12)
    cache = posenc.model.cache.LayerCache(padding=[0, 4])
    first = attn(x[:, :7], cache=cache)
    step = attn(x[:, 7:], cache=cache)  # a chunk after the cache
    torch.testing.assert_close(torch.cat([first, step], 1)[1:, 4:], attn(x[1:, 4:]), rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.cat([first, step], 1)[:1], attn(x[:1]), rtol=0, atol=1e-12)


def test_grouped_query_heads_equal_repeated_heads():
    q, k, v = qkv(2, 11, seed=5, hkv=2)
    enc = posenc.build("selective", num_heads=H, head_dim=D, head=3)
    grouped = posenc.attend(q, k, v, enc)
    repeated = posenc.attend(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), enc)
    torch.testing.assert_close(grouped, repeated, rtol=0, atol=1e-12)


def test_gradients_flow_through_the_selection():
    """No learned parameters; the selection's gradient reaches q and k (the selecting head's) beyond
    what NoPE gives."""
    q, k, v = (x.requires_grad_() for x in qkv(1, 10, seed=7))
    enc = posenc.build("selective", num_heads=H, head_dim=D)
    assert not list(enc.parameters())
    g = torch.randn(1, H, 10, D, dtype=torch.float64)
    dq, dk = torch.autograd.grad((posenc.attend(q, k, v, enc) * g).sum(), [q, k])
    nq, nk = torch.autograd.grad((posenc.attend(q, k, v, "nope") * g).sum(), [q, k])
    assert (dq[:, 0] - nq[:, 0]).abs().max() > 1e-3 and (dk[:, 0] - nk[:, 0]).abs().max() > 1e-3


def test_errors_name_their_parameter():
    with pytest.raises(UsageError, match="head"):
        posenc.build("selective", num_heads=H, head_dim=D, head=H)
    with pytest.raises(UsageError, match="causal"):
        posenc.build("selective", num_heads=H, head_dim=D, causal=False)
    enc = posenc.build("selective", num_heads=H, head_dim=D)
    with pytest.raises(UsageError, match="window"):
        posenc.Attention(DIM, H, enc, window=4)
    q, k, v = qkv(1, 5)
    with pytest.raises(UsageError, match="window"):
        posenc.attend(q, k, v, enc, window=3)
