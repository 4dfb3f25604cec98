"""Transformer-XL relative positions (Dai et al. 2019, §3.3) against the direct O(N^2) formula.

A_ij = q_i.k_j + q_i.W_R R_{i-j} + u.k_j + v.W_R R_{i-j}: the module returns the last three terms
divided by sqrt(d), computed once per distance and moved into place with the relative shift. Here
W_R R_{i-j} is built for every (i, j) pair, from a sinusoidal table written out from Vaswani et al.
2017 (§3.5) in float64.
"""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc.encodings.transformer_xl import relative_shift


def vaswani_row(position: int, dim: int) -> torch.Tensor:
    """R_p: [sin(p w_0), cos(p w_0), sin(p w_1), ...] with w_i = 10000^(-2i/dim), float64."""
    w = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = position * w
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten()


def direct_terms(enc, q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """(B, H, Tq, Tk): ((q_i + v) . W_R R_{i-j} + u . k_j) / sqrt(d), pair by pair, float64."""
    h, d = enc.num_heads, enc.head_dim
    w_r = enc.position_key.weight.detach().double()  # (H*D, dim)
    u, v = enc.u.detach().double(), enc.v.detach().double()  # (H, D)
    q, k = q.double(), k.double()
    out = torch.zeros(q.shape[0], h, q_positions.numel(), k_positions.numel(), dtype=torch.float64)
    for a, i in enumerate(q_positions.tolist()):
        for c, j in enumerate(k_positions.tolist()):
            r = (w_r @ vaswani_row(i - j, enc.dim)).view(h, d)  # W_R R_{i-j}, per head
            out[:, :, a, c] = ((q[:, :, a] + v) * r).sum(-1) + (u * k[:, :, c]).sum(-1)
    return out / math.sqrt(d)


def make(causal: bool = True) -> torch.nn.Module:
    enc = posenc.build("transformer_xl", num_heads=2, head_dim=8, causal=causal)
    with torch.no_grad():  # larger than the init, so every term matters
        enc.position_key.weight.normal_(std=0.3)
        enc.u.normal_()
        enc.v.normal_()
    return enc


CASES = {
    "full": (torch.arange(12), torch.arange(12)),  # Tq == Tk
    "cached": (torch.arange(9, 12), torch.arange(12)),  # Tq < Tk, queries are the last keys
    "one-step": (torch.arange(11, 12), torch.arange(12)),
    "offset": (torch.arange(40, 47), torch.arange(35, 47)),
    "offset-full": (torch.arange(200, 208), torch.arange(200, 208)),
    "unaligned": (torch.arange(3, 8), torch.arange(0, 4)),  # any consecutive ranges
}


@pytest.mark.parametrize("name", list(CASES))
def test_relative_shift_equals_direct_formula(name: str) -> None:
    q_positions, k_positions = CASES[name]
    enc = make()
    q = torch.randn(2, 2, q_positions.numel(), 8)
    k = torch.randn(2, 2, k_positions.numel(), 8)
    got = enc.query_terms(q, k, q_positions, k_positions)
    expected = direct_terms(enc, q, k, q_positions, k_positions)
    assert got.shape == expected.shape and got.dtype == torch.float32
    # float32 module (sinusoid angles in float32) against float64 truth
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5)


def test_relative_shift_moves_rows_by_distance() -> None:
    """The shift alone: column m of row a holds distance i - j = (last query - first key) - m."""
    tq, tk = 4, 6
    q_positions, k_positions = torch.arange(2, 6), torch.arange(0, 6)
    largest = int(q_positions[-1] - k_positions[0])
    distances = largest - torch.arange(tq + tk - 1)  # (L,) descending
    per_distance = distances.double().expand(tq, -1)  # each entry is its own distance
    shifted = relative_shift(per_distance, tk)  # (Tq, Tk)
    expected = (q_positions[:, None] - k_positions[None, :]).double()  # i - j
    assert torch.equal(shifted, expected)


def test_terms_depend_on_distance_not_absolute_position() -> None:
    enc = make()
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    near = enc.query_terms(q, k, torch.arange(5), torch.arange(5))
    far = enc.query_terms(q, k, torch.arange(1000, 1005), torch.arange(1000, 1005))
    torch.testing.assert_close(near, far, rtol=0, atol=0)  # same distances: bit-identical
