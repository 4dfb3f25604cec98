"""Sandwich (Chi et al. 2023): the bias against a float64 re-derivation (dot products of sinusoidal
position vectors), its low-rank features, the ``features`` backend, cache and memory."""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from agreement import CHUNKINGS, D, H, check_backends, check_flex_inference, decoded, largest_tensor, reference, run
from posenc import backends
from posenc.backends import features, flex
from posenc.backends.parts.base import ScoreSpec
from posenc.errors import UsageError


def sinusoid(position: int, dim: int) -> list[float]:
    """Vaswani et al.'s position vector with frequencies 10000^(-2k/d'), k = 1..d'/2 (as Sandwich)."""
    out = []
    for k in range(1, dim // 2 + 1):
        angle = position / 10000 ** (2 * k / dim)
        out += [math.sin(angle), math.cos(angle)]
    return out


def formula(q_positions, k_positions, heads: int, dim: int) -> torch.Tensor:
    """(p_i . p_j - d'/2) / (8 h / H), h = 1..H, in float64."""
    out = torch.zeros(heads, len(q_positions), len(k_positions), dtype=torch.float64)
    for a, i in enumerate(q_positions):
        for b, j in enumerate(k_positions):
            dot = sum(x * y for x, y in zip(sinusoid(i, dim), sinusoid(j, dim)))
            for h in range(heads):
                out[h, a, b] = (dot - dim / 2) / (8 * (h + 1) / heads)
    return out


@pytest.mark.parametrize("dim", [16, 64])
def test_bias_is_the_dot_product_of_sinusoids(dim):
    enc = posenc.build("sandwich", num_heads=H, head_dim=D, sinusoid_dim=dim).double()
    qp, kp = [0, 5, 6, 700, 4095], [0, 1, 5, 6, 650, 700, 4000, 4095]
    want = formula(qp, kp, H, dim)
    torch.testing.assert_close(enc.bias(torch.tensor(qp), torch.tensor(kp)), want, rtol=0, atol=1e-12)
    # float32: angles in float64, so no loss at large positions
    got = posenc.build("sandwich", num_heads=H, head_dim=D, sinusoid_dim=dim).bias(torch.tensor(qp), torch.tensor(kp))
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_zero_at_distance_zero_negative_elsewhere_and_head_one_most_local():
    enc = posenc.build("sandwich", num_heads=8, head_dim=D)
    pos = torch.arange(300)
    bias = enc.bias(pos, pos)
    assert (bias.diagonal(0, 1, 2) == 0).all() and (bias[:, ~torch.eye(300, dtype=torch.bool)] < 0).all()
    # the head scale s_h = 8h/H: head 1 gets the largest penalty, head H the smallest
    far = bias[:, 299, 0]
    assert (far[:-1] < far[1:]).all()
    torch.testing.assert_close(far[0] / far[-1], torch.tensor(8.0))


def test_features_reproduce_the_bias_up_to_a_per_query_constant():
    enc = posenc.build("sandwich", num_heads=H, head_dim=D).double()
    qp, kp = torch.tensor([3, 9, 10, 2000]), torch.arange(0, 2001, 7)
    qf, kf = enc.bias_features(qp, kp)
    assert qf.shape == (H, 4, 16) and kf.shape == (H, kp.numel(), 16)
    constant = 16 / 2 / (8 * torch.arange(1, H + 1, dtype=torch.float64) / H)  # d'/(2 s_h)
    torch.testing.assert_close(qf @ kf.transpose(-1, -2) - constant[:, None, None], enc.bias(qp, kp), rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_every_backend_agrees_with_eager(causal):
    enc = posenc.build("sandwich", num_heads=H, head_dim=D, causal=causal)
    check_backends(enc, causal, expect=("features", "blocked", "sdpa", "eager"))


def test_features_backend_skips_values_and_pads_to_a_multiple_of_8(monkeypatch):
    """Positions with gaps (the features are exact for any positions) and head dims that are not a
    multiple of 8 after the features; every SDPA call gets one head dim for q, k, v, a multiple of 8."""
    widths = []
    original = torch.nn.functional.scaled_dot_product_attention
    def spy(q, k, v, **kw):
        widths.append((q.shape[-1], k.shape[-1], v.shape[-1]))
        return original(q, k, v, **kw)

    monkeypatch.setattr(features.F, "scaled_dot_product_attention", spy)
    for head_dim, dim in ((16, 16), (12, 6), (5, 2)):
        enc = posenc.build("sandwich", num_heads=2, head_dim=head_dim, sinusoid_dim=dim)
        positions = torch.tensor([0, 3, 4, 9, 10, 11, 20, 31, 40, 41, 55, 63])
        q, k, v = (torch.randn(1, 2, 12, head_dim) for _ in range(3))
        spec = ScoreSpec(encoding=enc, q_positions=positions, k_positions=positions, causal=True, scale=1 / math.sqrt(head_dim), consecutive=False)
        assert features.supports(spec, q)
        grad = torch.randn(1, 2, 12, head_dim)
        got = run(features.attend, enc, q, k, v, spec, grad, torch.float32)
        want = reference(enc, q, k, v, spec, grad)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    assert all(a == b == c and a % 8 == 0 for a, b, c in widths), widths
    assert [w[0] for w in widths] == [32, 24, 8]


def test_auto_picks_the_features_backend_and_no_quadratic_tensor():
    largest, backend = largest_tensor("sandwich")
    assert backend == "features"
    assert largest < 1024 * 1024, largest
    spec = ScoreSpec(encoding=posenc.build("sandwich", num_heads=H, head_dim=D), q_positions=torch.arange(8), k_positions=torch.arange(8),
                     causal=True, scale=0.25)
    assert backends.choose("auto", spec, torch.randn(1, H, 8, D))[0] == "features"
    assert list(backends.BACKENDS)[:3] == ["sdpa", "features", "flex"]


def test_cached_decoding_equals_full_pass():
    model = posenc.LM(posenc.LMConfig(encoding="sandwich", dim=32, depth=2, num_heads=4)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.2)  # logits of a few units: a wrong position shows
    tokens = torch.randint(0, 256, (2, 20))
    with torch.no_grad():
        full = model(tokens)
        for chunks in CHUNKINGS:
            got = decoded(model, tokens, chunks)
            assert model.blocks[0].attn.last_backend == "features"
            torch.testing.assert_close(got, full, rtol=0, atol=1e-5)
    eager_model = posenc.LM(posenc.LMConfig(encoding="sandwich", dim=32, depth=2, num_heads=4, attention_backend="eager")).eval()
    eager_model.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(eager_model(tokens), full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dim", [0, 3, -2, 2.0])
def test_bad_sinusoid_dim_is_a_usage_error(dim):
    with pytest.raises(UsageError, match="sinusoid_dim must be"):
        posenc.build("sandwich", num_heads=2, head_dim=4, sinusoid_dim=dim)


def test_has_no_parameters():
    assert not list(posenc.build("sandwich", num_heads=2, head_dim=4).parameters())


@pytest.mark.skipif(not flex.compile_available("cpu"), reason="torch.compile cannot build CPU kernels here")
def test_flex_agrees_with_eager_for_cpu_inference():
    check_flex_inference(posenc.build("sandwich", num_heads=H, head_dim=D))
