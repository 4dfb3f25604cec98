"""PoPE (Gopalakrishnan et al. 2025): against x-transformers' ``PolarEmbedding`` / ``apply_polar_pos_emb``
(a whole attention layer with the same weights, and the phase bias's gradient) and pope-pytorch's
``PoPE`` / ``apply_pope_to_qk`` / ``flash_attn_with_pope``; against the paper's score written out in
float64; relative positions, every path of the attention (backends, decode step, grouped heads,
windows), cached decoding, packed rows, memory and errors."""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from agreement import assert_decoding_equals_full, largest_tensor
from posenc.errors import UsageError

H, D = 3, 8


def pope(causal: bool = True, seed: int = 0, **options) -> torch.nn.Module:
    """A PoPE encoding whose phase bias is random in [-2 pi, 0] (so every term of it matters)."""
    torch.manual_seed(seed)
    return posenc.build("pope", num_heads=H, head_dim=D, causal=causal, bias_init="uniform", **options)


def formula(enc, q: torch.Tensor, k: torch.Tensor, qp: list[int], kp: list[int]) -> torch.Tensor:
    """The paper's score (§3), pair by pair in float64: sum_c softplus(q_c) softplus(k_c)
    cos((j - i) theta_c + delta_hc), theta_c = base^(-c / D). (B, H, Tq, Tk)."""
    q, k = q.double(), k.double()
    delta = enc.phase_bias.detach().double().clamp(-2 * math.pi, 0)  # (H, D)
    theta = torch.tensor([enc.base ** (-c / D) for c in range(D)], dtype=torch.float64)
    mq, mk = torch.nn.functional.softplus(q), torch.nn.functional.softplus(k)
    out = torch.zeros(q.shape[0], H, len(qp), len(kp), dtype=torch.float64)
    for a, i in enumerate(qp):
        for b, j in enumerate(kp):
            phase = (j - i) * theta + delta  # (H, D)
            out[:, :, a, b] = (mq[:, :, a] * mk[:, :, b] * torch.cos(phase)).sum(-1)
    return out


def scores(enc, q, k, qp, kp) -> torch.Tensor:
    q2, k2 = enc.rotate(q, k, qp, kp)
    return q2 @ k2.transpose(-1, -2)


def test_rotate_doubles_the_head_size_and_gives_the_papers_score():
    enc = pope().double()
    q, k = torch.randn(2, H, 4, D, dtype=torch.float64), torch.randn(2, H, 6, D, dtype=torch.float64)
    qp, kp = [9, 10, 40, 41], [0, 2, 9, 10, 39, 41]  # gaps, and keys after queries
    q2, k2 = enc.rotate(q, k, torch.tensor(qp), torch.tensor(kp))
    assert q2.shape == (2, H, 4, 2 * D) and k2.shape == (2, H, 6, 2 * D) and q2.dtype == torch.float64
    torch.testing.assert_close(q2 @ k2.transpose(-1, -2), formula(enc, q, k, qp, kp), rtol=1e-12, atol=1e-12)


@pytest.fixture
def x_transformers():
    return pytest.importorskip("x_transformers.x_transformers")


def test_scores_and_phase_gradient_equal_x_transformers(x_transformers):
    enc = pope()
    ref = x_transformers.PolarEmbedding(D, H)
    with torch.no_grad():
        ref.learned_bias.copy_(enc.phase_bias[:, None, :])  # (H, 1, D)
    torch.manual_seed(1)
    q, k = torch.randn(2, H, 7, D), torch.randn(2, H, 7, D)
    pos = torch.arange(5, 12)
    freqs, bias = ref(pos)
    want = x_transformers.apply_polar_pos_emb(q, freqs) @ x_transformers.apply_polar_pos_emb(k, freqs + bias).transpose(-1, -2)
    got = scores(enc, q, k, pos, pos)
    diff = (got - want).abs().max().item()
    assert diff < 1e-5 * want.abs().max().item(), diff  # seen: 1.2e-6 on scores of size ~10
    g = torch.randn_like(got)
    (got * g).sum().backward()
    (want * g).sum().backward()
    assert (enc.phase_bias.grad != 0).all()  # every head and frequency of the bias gets a gradient
    torch.testing.assert_close(enc.phase_bias.grad, ref.learned_bias.grad[:, 0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("causal", [True, False])
def test_a_layer_equals_x_transformers_attention_with_polar_positions(x_transformers, causal):
    """The whole layer (projections, the polar rotation, the 1/sqrt(D) scale, the mask, the output
    projection) with the same weights, and its gradients."""
    enc = pope(causal)
    ref = x_transformers.Attention(H * D, heads=H, dim_head=D, causal=causal)
    polar = x_transformers.PolarEmbedding(D, H)
    layer = posenc.Attention(H * D, H, enc, causal=causal)
    with torch.no_grad():
        polar.learned_bias.copy_(enc.phase_bias[:, None, :])
        layer.qkv.weight.copy_(torch.cat((ref.to_q.weight, ref.to_k.weight, ref.to_v.weight)))
        layer.proj.weight.copy_(ref.to_out.weight)
    x = torch.randn(2, 11, H * D)
    got = layer(x)
    want = ref(x, polar_pos_emb=polar(torch.arange(11)))
    assert (got - want).abs().max().item() < 1e-5  # seen: 6e-8
    g = torch.randn_like(got)
    (got * g).sum().backward()
    (want * g).sum().backward()
    torch.testing.assert_close(enc.phase_bias.grad, polar.learned_bias.grad[:, 0], rtol=1e-4, atol=1e-5)


@pytest.fixture
def pope_pytorch():
    return pytest.importorskip("PoPE_pytorch")


@pytest.mark.parametrize("causal", [True, False])
def test_attention_equals_pope_pytorch(pope_pytorch, causal):
    enc = pope(causal)
    ref = pope_pytorch.PoPE(D, heads=H)
    with torch.no_grad():
        ref.bias.copy_(enc.phase_bias)
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, H, 13, D, requires_grad=True) for _ in range(3))
    # its rotated q and k (interleaved cos and sin features: the same dot products)
    rq, rk = pope_pytorch.apply_pope_to_qk(ref(13), q, k)
    pos = torch.arange(13)
    s_ref = rq @ rk.transpose(-1, -2)
    assert (scores(enc, q, k, pos, pos) - s_ref).abs().max().item() < 1e-5 * s_ref.abs().max().item()  # seen: 9.5e-7
    want = pope_pytorch.flash_attn_with_pope(q, k, v, pos_emb=ref(13), causal=causal)
    got = posenc.attend(q, k, v, enc, causal=causal)
    assert (got - want).abs().max().item() < 1e-6  # seen: 2.4e-7
    g = torch.randn_like(got)
    grads = torch.autograd.grad((got * g).sum(), (q, k, v, enc.phase_bias))
    grads_ref = torch.autograd.grad((want * g).sum(), (q, k, v, ref.bias))
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_scores_depend_only_on_i_minus_j():
    enc = pope()
    q, k = torch.randn(1, H, 5, D), torch.randn(1, H, 9, D)
    qp, kp = torch.arange(4, 9), torch.arange(9)
    with torch.no_grad():
        base = scores(enc, q, k, qp, kp)
        for shift in (1, 17, 3000):
            torch.testing.assert_close(scores(enc, q, k, qp + shift, kp + shift), base, rtol=0, atol=1e-4)
        # the same content at every position: constant along each diagonal, and not the same on all of them
        qc, kc = q[:, :, :1].expand(1, H, 9, D), k[:, :, :1].expand(1, H, 9, D)
        s = scores(enc, qc, kc, kp, kp)[0]  # (H, 9, 9)
        for offset in (-5, -1, 0, 2):
            diagonal = s.diagonal(offset, dim1=-2, dim2=-1)
            torch.testing.assert_close(diagonal, diagonal[:, :1].expand_as(diagonal), rtol=0, atol=1e-5)
        assert (s.diagonal(-1, dim1=-2, dim2=-1)[:, 0] - s.diagonal(-4, dim1=-2, dim2=-1)[:, 0]).abs().min() > 1e-4


def dense(enc, q, k, v, qp, kp, causal):
    """softmax(a / sqrt(D) + mask) v from the paper's score, float64 (grouped keys repeated)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = formula(enc, q, k, qp.tolist(), kp.tolist()) / math.sqrt(D)
    if causal:
        s = s.masked_fill(kp[None, :] > qp[:, None], float("-inf"))
    return torch.softmax(s, -1) @ v.double()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("backend", ["auto", "sdpa", "blocked", "eager"])
def test_every_backend_equals_the_formula(backend, causal):
    """Full pass, a cached chunk (Tq < Tk) and one decoded query, with 1 and 3 key/value heads, float64:
    outputs, and the gradients of q, k, v and the phase bias against autograd through the formula."""
    enc = pope(causal).double()
    for tq, tk, hkv in ((40, 40, H), (40, 40, 1), (6, 40, H), (1, 40, 1)):
        if not causal and tq < tk:
            continue
        torch.manual_seed(tq + hkv)
        q = torch.randn(2, H, tq, D, dtype=torch.float64, requires_grad=True)
        k, v = (torch.randn(2, hkv, tk, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
        kp = torch.arange(3, 3 + tk)
        qp = kp[tk - tq :]
        got = posenc.attend(q, k, v, enc, positions=qp, k_positions=kp, causal=causal, backend=backend)
        want = dense(enc, q, k, v, qp, kp, causal)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
        g = torch.randn_like(got)
        params = (q, k, v, enc.phase_bias)
        grads = torch.autograd.grad((got * g).sum(), params)
        # the formula's gradient: the same score through the encoding's rotation, autograd in float64
        q2, k2 = enc.rotate(q, k.repeat_interleave(H // hkv, 1), qp, kp)
        s = q2 @ k2.transpose(-1, -2) / math.sqrt(D)
        if causal:
            s = s.masked_fill(kp[None, :] > qp[:, None], float("-inf"))
        out = torch.softmax(s, -1) @ v.repeat_interleave(H // hkv, 1)
        torch.testing.assert_close(out, want, rtol=0, atol=1e-10)
        for a, b in zip(grads, torch.autograd.grad((out * g).sum(), params)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-9)
        with torch.no_grad():  # a decode step without gradient takes the single-query path
            torch.testing.assert_close(posenc.attend(q, k, v, enc, positions=qp, k_positions=kp, causal=causal,
                                                     backend=backend), want, rtol=0, atol=1e-10)


def test_training_makes_no_quadratic_tensor():
    n = 1024
    largest, backend = largest_tensor("pope", n=n)
    assert backend == "sdpa"
    assert largest < n * n, largest  # the widened q and k (and v padded to their width) are O(N x D)
    eager_largest = largest_tensor_eager(n)
    assert eager_largest >= n * n  # the check sees eager's (B, H, 256, N) scores, 4 x 256 x 1024 = N x N


def largest_tensor_eager(n: int) -> int:
    from agreement import MaxTensor

    enc = posenc.build("pope", num_heads=4, head_dim=16)
    layer = posenc.Attention(64, 4, enc, backend="eager")
    with MaxTensor() as seen:
        layer(torch.randn(1, n, 64, requires_grad=True)).sum().backward()
    return seen.largest


@pytest.mark.parametrize("num_kv_heads", [None, 1])
def test_cached_decoding_equals_the_full_pass(num_kv_heads):
    torch.manual_seed(0)
    model = posenc.LM(posenc.LMConfig(encoding="pope", dim=32, depth=2, num_heads=4, vocab_size=64, num_kv_heads=num_kv_heads,
                                      encoding_options={"bias_init": "uniform"})).eval()
    assert_decoding_equals_full(model, backend="sdpa")
    cache = model.new_cache(2)
    model(torch.randint(0, 64, (2, 5)), cache=cache)
    hkv = 4 if num_kv_heads is None else num_kv_heads
    layer = cache.layers[0]
    assert layer.k.shape[1] == hkv and layer.k.shape[-1] == 2 * 8 and layer.v.shape[-1] == 8  # keys rotated, widened, per key head


def test_a_packed_row_equals_its_documents_alone():
    enc = pope()
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, H, 30, D) for _ in range(3))
    docs = torch.tensor([[0] * 12 + [1] * 7 + [2] * 11])
    packed = posenc.attend(q, k, v, enc, document_ids=docs)
    for lo, hi in ((0, 12), (12, 19), (19, 30)):
        alone = posenc.attend(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], enc)
        torch.testing.assert_close(packed[:, :, lo:hi], alone, rtol=0, atol=1e-6)
    # and through a model: a packed row's logits are each document's
    torch.manual_seed(0)
    model = posenc.LM(posenc.LMConfig(encoding="pope", dim=24, depth=2, num_heads=H, vocab_size=50)).eval()
    tokens = torch.randint(0, 50, (1, 30))
    with torch.no_grad():
        row = model(tokens, document_ids=docs)
        for lo, hi in ((0, 12), (12, 19), (19, 30)):
            torch.testing.assert_close(row[:, lo:hi], model(tokens[:, lo:hi]), rtol=0, atol=1e-5)


def test_gradients_reach_the_phase_bias_in_training():
    torch.manual_seed(0)
    model = posenc.LM(posenc.LMConfig(encoding="pope", dim=24, depth=2, num_heads=H, vocab_size=50))
    tokens = torch.randint(0, 50, (2, 16))
    torch.nn.functional.cross_entropy(model(tokens).reshape(-1, 50), tokens.reshape(-1)).backward()
    for block in model.blocks:  # one phase bias per layer, each (H, D) with a gradient everywhere
        grad = block.attn.encoding.phase_bias.grad
        assert grad is not None and grad.shape == (H, D) and (grad != 0).all()
    assert model.blocks[0].attn.encoding is not model.blocks[1].attn.encoding


def test_the_phase_bias_is_clamped_as_the_references_clamp_it():
    enc = pope()
    with torch.no_grad():
        enc.phase_bias.fill_(-10.0)
        enc.phase_bias[0].fill_(3.0)
    delta = enc.delta()
    assert (delta[0] == 0).all() and torch.allclose(delta[1:], torch.full_like(delta[1:], -2 * math.pi))
    q, k = torch.randn(1, H, 4, D), torch.randn(1, H, 4, D)
    pos = torch.arange(4)
    scores(enc, q, k, pos, pos).sum().backward()
    assert (enc.phase_bias.grad == 0).all()  # outside the clamp no gradient, as in both references


def test_bad_options_and_inputs_are_usage_errors():
    for options, name in (({"base": 1.0}, "base"), ({"base": float("inf")}, "base"), ({"base": True}, "base"),
                          ({"bias_init": "normal"}, "bias_init")):
        with pytest.raises(UsageError, match=name):
            posenc.build("pope", num_heads=H, head_dim=D, **options)
    enc = pope()
    pos = torch.arange(4)
    with pytest.raises(UsageError, match="q must be"):
        enc.rotate(torch.randn(1, H, 4, D + 1), torch.randn(1, H, 4, D), pos, pos)
    with pytest.raises(UsageError, match="k_positions"):
        enc.rotate(torch.randn(1, H, 4, D), torch.randn(1, H, 4, D), pos, pos.float())
    with pytest.raises(UsageError, match="heads"):
        enc.rotate(torch.randn(1, H, 4, D), torch.randn(1, 2, 4, D), pos, pos)
