"""FoPE (Hua et al. 2024, arXiv 2412.17739): against a dense form of the paper's equations written
here, pair by pair in float64 (§4: each dimension a Fourier series over the kept frequencies,
``c_d(n) = sum_e C[e, d] cos(n omega_e)``, ``s_d(n) = sum_e S[e, d] sin(n omega_e)``, the pair turned
by them as RoPE's by cos and sin; frequencies below 2 pi / L clipped to the zero frequency), in the
per-key-head form and checkpoint layout vLLM serves (``FourierRotaryEmbedding``: ``cos_coef`` /
``sin_coef`` (Hkv, M, M), its padding of the dropped pairs as an option); identity coefficients
are RoPE; loading given coefficients; gradients; cached decoding; packed rows; backends; errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import posenc
from agreement import assert_decoding_equals_full, check_backends
from models import tiny_lm
from posenc.encodings.fope import FoPE
from posenc.errors import UsageError

H, D = 4, 16


def dense(x: torch.Tensor, positions: torch.Tensor, cos_coef: torch.Tensor, sin_coef: torch.Tensor, omega: list[float],
          padding: str = "zero") -> torch.Tensor:
    """The paper's series, written out: x (B, heads, T, D), coefficients (Hkv, M, M), float64."""
    b, heads, t, d = x.shape
    half, m, kv = d // 2, len(omega), cos_coef.shape[0]
    out = torch.empty(b, heads, t, d, dtype=torch.float64)
    for h in range(heads):
        g = h // (heads // kv)  # the query head's key head
        for ti, n in enumerate(positions.tolist()):
            for pair in range(half):
                if pair < m:
                    c = sum(float(cos_coef[g, e, pair]) * math.cos(n * omega[e]) for e in range(m))
                    s = sum(float(sin_coef[g, e, pair]) * math.sin(n * omega[e]) for e in range(m))
                else:  # a clipped frequency: the zero frequency (the paper), or vLLM's pad of ones
                    c, s = 1.0, (1.0 if padding == "vllm" else 0.0)
                x1, x2 = x[:, h, ti, pair].double(), x[:, h, ti, pair + half].double()
                out[:, h, ti, pair] = x1 * c - x2 * s
                out[:, h, ti, pair + half] = x2 * c + x1 * s
    return out


def kept_frequencies(base: float, d: int, length: int | None) -> list[float]:
    """omega_k = base^(-2k/d), those with a full cycle within the training length L (2 pi / omega <= L)."""
    omega = [base ** (-2 * k / d) for k in range(d // 2)]
    return omega if length is None else [w for w in omega if w >= 2 * math.pi / length]


@pytest.mark.parametrize("train_length,num_kv_heads,padding", [(64, 4, "zero"), (64, 2, "zero"), (None, 1, "zero"), (200, 2, "vllm")])
def test_matches_the_papers_series(train_length, num_kv_heads, padding) -> None:
    torch.manual_seed(0)
    enc = posenc.build("fope", num_heads=H, head_dim=D, train_length=train_length, num_kv_heads=num_kv_heads, padding=padding,
                       sigma=0.5)
    omega = kept_frequencies(10000.0, D, train_length)
    assert enc.num_frequencies == len(omega) and tuple(enc.cos_coef.shape) == (num_kv_heads, len(omega), len(omega))
    torch.testing.assert_close(enc.inv_freq.double(), torch.tensor(omega, dtype=torch.float64), rtol=1e-6, atol=0)
    q = torch.randn(2, H, 6, D, dtype=torch.float64)
    k = torch.randn(2, num_kv_heads, 6, D, dtype=torch.float64)
    pos = torch.tensor([0, 1, 5, 17, 63, 300])
    qr, kr = enc.rotate(q, k, pos, pos)
    omega32 = enc.inv_freq.double().tolist()  # the float32 frequencies a checkpoint uses
    torch.testing.assert_close(qr, dense(q, pos, enc.cos_coef.detach(), enc.sin_coef.detach(), omega32, padding), rtol=0, atol=1e-6)
    torch.testing.assert_close(kr, dense(k, pos, enc.cos_coef.detach(), enc.sin_coef.detach(), omega32, padding), rtol=0, atol=1e-6)
    assert (enc.cos_coef.detach().diagonal(dim1=1, dim2=2) == 1).all()  # each pair's dominant frequency
    assert enc.cos_coef.detach().std() > 0.01  # and the weaker harmonics


def test_identity_coefficients_are_rope_and_clipped_pairs_stand_still() -> None:
    enc = posenc.build("fope", num_heads=H, head_dim=D, sigma=0.0)
    rope = posenc.build("rope", num_heads=H, head_dim=D)
    q, k = torch.randn(2, 1, H, 9, D).unbind(0)
    pos = torch.arange(3, 12)
    for got, want in zip(enc.rotate(q, k, pos, pos), rope.rotate(q, k, pos, pos)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    clipped = posenc.build("fope", num_heads=H, head_dim=D, sigma=0.0, train_length=64)  # keeps 3 of 8
    p_rope = posenc.build("rope", num_heads=H, head_dim=D, scaling={"rope_type": "proportional", "partial_rotary_factor": 3 / 8})
    for got, want in zip(clipped.rotate(q, k, pos, pos), p_rope.rotate(q, k, pos, pos)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # zero frequency = not rotated (p-RoPE's)


def test_loads_a_checkpoints_coefficients() -> None:
    """The documented layout: cos_coef, sin_coef (Hkv, M, M) [key head, input frequency, pair], as
    vLLM's rotary_emb.cos_coef / sin_coef; load_state_dict and load_coefficients (also (M, M))."""
    enc = posenc.build("fope", num_heads=H, head_dim=D, train_length=64, num_kv_heads=2)
    assert set(enc.state_dict()) == {"cos_coef", "sin_coef"}
    gen = torch.Generator().manual_seed(3)
    cos_coef, sin_coef = torch.randn(2, 2, 3, 3, generator=gen).unbind(0)
    enc.load_state_dict({"cos_coef": cos_coef, "sin_coef": sin_coef})
    assert torch.equal(enc.cos_coef.detach(), cos_coef) and torch.equal(enc.sin_coef.detach(), sin_coef)
    q = torch.randn(1, H, 5, D, dtype=torch.float64)
    pos = torch.tensor([2, 9, 30, 31, 100])
    torch.testing.assert_close(enc.rotate(q, q, pos, pos)[0], dense(q, pos, cos_coef, sin_coef, enc.inv_freq.double().tolist()),
                               rtol=0, atol=1e-6)
    shared_cos, shared_sin = torch.randn(2, 3, 3, generator=gen).unbind(0)
    enc.load_coefficients(shared_cos, shared_sin)
    assert torch.equal(enc.cos_coef.detach(), shared_cos.expand(2, 3, 3))
    with pytest.raises(UsageError, match=r"^cos_coef must have shape \(2, 3, 3\) \(key heads, kept frequencies, pairs\) or \(3, 3\) "
                                         r"\(shared\), got \(4, 3, 3\)$"):
        enc.load_coefficients(torch.zeros(4, 3, 3), torch.zeros(2, 3, 3))
    with pytest.raises(UsageError, match="^sin_coef must be finite$"):
        enc.load_coefficients(torch.zeros(3, 3), torch.full((3, 3), float("nan")))


def test_gradients_reach_the_coefficients() -> None:
    model = tiny_lm("fope", encoding_options={"train_length": 16}).train()
    tokens = torch.randint(0, 64, (2, 12))
    F.cross_entropy(model(tokens).reshape(-1, 64), torch.randint(0, 64, (24,))).backward()
    for block in model.blocks:
        enc = block.attn.encoding
        assert isinstance(enc, FoPE)
        assert enc.cos_coef.grad is not None and enc.cos_coef.grad.abs().sum() > 0
        assert enc.sin_coef.grad is not None and enc.sin_coef.grad.abs().sum() > 0


def test_cached_decoding_equals_the_full_pass() -> None:
    assert_decoding_equals_full(tiny_lm("fope", encoding_options={"train_length": 16}))
    assert_decoding_equals_full(tiny_lm("fope", num_kv_heads=2, encoding_options={"num_kv_heads": 2, "padding": "vllm"}))


def test_a_packed_row_equals_its_documents_alone() -> None:
    enc = posenc.build("fope", num_heads=H, head_dim=D, train_length=32).double()
    q, k, v = torch.randn(3, 1, H, 13, D, dtype=torch.float64).unbind(0)
    docs = torch.tensor([[0] * 5 + [1] * 8])
    packed = posenc.attend(q, k, v, enc, document_ids=docs)
    for lo, hi in ((0, 5), (5, 13)):
        alone = posenc.attend(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], enc)
        torch.testing.assert_close(packed[:, :, lo:hi], alone, rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_every_backend_agrees_with_eager(causal: bool) -> None:
    check_backends(posenc.build("fope", num_heads=2, head_dim=8, causal=causal, train_length=32), causal)


def test_scores_are_not_functions_of_distance_alone() -> None:
    """The series mix frequencies: shifting both positions changes the score (shift_invariant False)."""
    enc = posenc.build("fope", num_heads=1, head_dim=D, sigma=1.0).double()
    q, k = torch.randn(2, 1, 1, 1, D, dtype=torch.float64).unbind(0)
    def score(i: int, j: int) -> float:
        a, b = enc.rotate(q, k, torch.tensor([i]), torch.tensor([j]))
        return float((a * b).sum())
    assert abs(score(10, 3) - score(110, 103)) > 1e-3
    assert not enc.shift_invariant


@pytest.mark.parametrize("options,message", [
    (dict(head_dim=15), "fope needs an even head_dim, got 15"),
    (dict(base=1), "base must be a finite number in (1, 1e12], got 1"),
    (dict(train_length=64, num_frequencies=3), "give train_length or num_frequencies (the kept frequencies), not both"),
    (dict(train_length=0), "train_length must be a positive integer (>= 1), got 0"),
    (dict(train_length=6), "train_length=6 drops every frequency (the fastest, 1, is below 2 pi / L); it must be at least 7"),
    (dict(num_frequencies=9), "num_frequencies must be in [1, head_dim/2 = 8], got 9"),
    (dict(num_kv_heads=3), "num_kv_heads must divide num_heads=4, got 3"),
    (dict(sigma=-0.1), "sigma must be a finite number >= 0, got -0.1"),
    (dict(padding="one"), "padding must be one of ('zero', 'vllm'), got 'one'"),
])
def test_bad_options(options: dict, message: str) -> None:
    with pytest.raises(UsageError) as err:
        posenc.build("fope", **{"num_heads": H, "head_dim": D, **options})
    assert str(err.value) == message


def test_keys_with_another_head_count_are_refused() -> None:
    enc = posenc.build("fope", num_heads=H, head_dim=D, num_kv_heads=2)
    q, k = torch.randn(1, H, 3, D), torch.randn(1, 3, 3, D)
    with pytest.raises(UsageError, match=r"^fope: k has 3 heads; the encoding was built for num_heads=4 and num_kv_heads=2$"):
        enc.rotate(q, k, torch.arange(3), torch.arange(3))
