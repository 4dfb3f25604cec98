"""ALiBi (Press et al. 2021, "Train Short, Test Long") against the paper's slope formula and BLOOM.

The slope formula is written here from the paper's definition (§3 and its official code's
description): for n heads, n a power of two, slopes 2^(-8/n), 2^(-16/n), ..., 2^(-8); otherwise the
2^floor(log2 n) slopes of the closest lower power of two, then every other slope of the next power
of two. BLOOM's ``build_alibi_tensor`` (Hugging Face transformers) is imported live as a second,
independent implementation of the causal attention.
"""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc import backends
from posenc.backends.parts.base import ScoreSpec

modeling_bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")


def paper_slopes(n: int) -> list[float]:
    """ALiBi slopes in float64, from the paper's definition (no shared code with the package)."""
    if n & (n - 1) == 0:  # power of two: geometric, start and ratio 2^(-8/n)
        return [2.0 ** (-8.0 * (k + 1) / n) for k in range(n)]
    lower = 1 << (n.bit_length() - 1)
    upper_slopes = [2.0 ** (-8.0 * (k + 1) / (2 * lower)) for k in range(2 * lower)]
    return paper_slopes(lower) + upper_slopes[0::2][: n - lower]


@pytest.mark.parametrize("num_heads", range(1, 65))
def test_slopes_equal_paper_formula(num_heads: int) -> None:
    ours = posenc.alibi_slopes(num_heads)
    assert ours.shape == (num_heads,) and ours.dtype == torch.float32
    expected = torch.tensor(paper_slopes(num_heads), dtype=torch.float64)
    torch.testing.assert_close(ours.double(), expected, rtol=1e-6, atol=0)
    # And BLOOM's slopes (another implementation of the same formula).
    bloom = modeling_bloom._get_alibi_slopes(num_heads, torch.device("cpu"))
    torch.testing.assert_close(ours, bloom.float(), rtol=1e-6, atol=0)


def test_known_slope_values() -> None:
    assert posenc.alibi_slopes(8).tolist() == [1 / 2**k for k in range(1, 9)]
    assert posenc.alibi_slopes(1).tolist() == [1 / 256]
    assert posenc.alibi_slopes(2).tolist() == [1 / 16, 1 / 256]
    assert posenc.alibi_slopes(4).tolist() == [1 / 4, 1 / 16, 1 / 64, 1 / 256]
    # 12 heads: the 8 slopes of 8 heads, then 16 heads' slopes 1, 3, 5, 7 (2^-0.5, 2^-1.5, ...).
    expected = [2.0**-k for k in range(1, 9)] + [2.0 ** -(k + 0.5) for k in range(0, 4)]
    torch.testing.assert_close(posenc.alibi_slopes(12).double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-7, atol=0)


def probs_via_backend(backend, enc, q, k, causal: bool, q_positions, k_positions) -> torch.Tensor:
    """Attention probabilities out of a backend: attend with v = identity returns them."""
    tk = k.shape[-2]
    v = torch.eye(tk).expand(q.shape[0], q.shape[1], tk, tk)  # (B, H, Tk, Tk)
    spec = ScoreSpec(encoding=enc, q_positions=q_positions, k_positions=k_positions, causal=causal, scale=1.0 / math.sqrt(q.shape[-1]))
    return backend.attend(q, k, v, spec)  # (B, H, Tq, Tk)


@pytest.mark.parametrize("num_heads", [4, 6, 8])
def test_causal_probabilities_equal_bloom(num_heads: int) -> None:
    b, t, d = 2, 24, 16
    q, k = torch.randn(2, b, num_heads, t, d).unbind(0)
    scale = 1.0 / math.sqrt(d)
    # BLOOM: a per-key bias m_h * j, (B*H, 1, T), plus the causal mask; softmax drops the per-row
    # constant that separates it from -m_h (i - j).
    alibi = modeling_bloom.build_alibi_tensor(torch.ones(b, t, dtype=torch.long), num_heads, torch.float32)
    alibi = alibi.view(b, num_heads, 1, t)
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    expected = torch.softmax((q @ k.transpose(-1, -2) * scale + alibi).masked_fill(future, float("-inf")), dim=-1)

    enc = posenc.build("alibi", num_heads=num_heads, head_dim=d)
    pos = torch.arange(t)
    ours = torch.softmax((q @ k.transpose(-1, -2) * scale + enc.bias(pos, pos)).masked_fill(future, float("-inf")), dim=-1)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
    for name in [n for n in ("eager", "sdpa", "blocked") if n in backends.BACKENDS]:
        got = probs_via_backend(backends.BACKENDS[name], enc, q, k, True, pos, pos)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_causal_bias_is_minus_slope_times_distance() -> None:
    enc = posenc.build("alibi", num_heads=5, head_dim=8)
    qpos, kpos = torch.arange(10, 17), torch.arange(0, 17)  # queries after a cache of 10 keys
    r = (kpos[None, :] - qpos[:, None]).double()  # j - i
    expected = posenc.alibi_slopes(5).double()[:, None, None] * r  # -m (i - j)
    torch.testing.assert_close(enc.bias(qpos, kpos).double(), expected, rtol=1e-6, atol=1e-6)


def test_bidirectional_bias_is_symmetric() -> None:
    enc = posenc.build("alibi", num_heads=6, head_dim=8, causal=False)
    pos = torch.arange(20)
    bias = enc.bias(pos, pos)  # (H, T, T)
    distance = (pos[None, :] - pos[:, None]).abs().float()
    expected = -posenc.alibi_slopes(6)[:, None, None] * distance
    torch.testing.assert_close(bias, expected, rtol=0, atol=0)
    torch.testing.assert_close(bias, bias.transpose(-1, -2), rtol=0, atol=0)
    assert (bias[:, 3, 5] == bias[:, 5, 3]).all() and (bias[:, 3, 5] < 0).all()


def test_scalar_score_equals_dense_bias() -> None:
    for causal in (True, False):
        enc = posenc.build("alibi", num_heads=3, head_dim=8, causal=causal)
        qpos, kpos = torch.arange(4, 12), torch.arange(12)
        h = torch.arange(3)[:, None, None]
        torch.testing.assert_close(enc.score(h, qpos[None, :, None], kpos[None, None, :]), enc.bias(qpos, kpos), rtol=0, atol=0)


def test_alibi_has_no_parameters() -> None:
    enc = posenc.build("alibi", num_heads=8, head_dim=8)
    assert list(enc.parameters()) == []
    assert "slopes" not in enc.state_dict()  # a pure function of num_heads, not saved
