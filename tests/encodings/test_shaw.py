"""Shaw et al. 2018 relative position representations against the paper's formulas, written out.

Paper, §3: e_ij = x_i W^Q (x_j W^K + a^K_ij)^T / sqrt(d), z_i = sum_j alpha_ij (x_j W^V + a^V_ij), with
a^K_ij = w^K_clip(j - i, k), a^V_ij = w^V_clip(j - i, k) and clip(x, k) = max(-k, min(k, x)). Here the
(Tq, Tk, D) tensors a_ij are built explicitly, pair by pair, which the module avoids.
"""

from __future__ import annotations

import math

import pytest
import torch

import posenc


def explicit_pairs(table: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor, k: int) -> torch.Tensor:
    """(Tq, Tk, D): a_ij = table[clip(j - i, -k, k) + k], one pair at a time."""
    rows = []
    for i in q_positions.tolist():
        row = []
        for j in k_positions.tolist():
            row.append(table[max(-k, min(k, j - i)) + k])
        rows.append(torch.stack(row))
    return torch.stack(rows)


def make(k: int, causal: bool = True, d: int = 8, heads: int = 3) -> torch.nn.Module:
    enc = posenc.build("shaw", num_heads=heads, head_dim=d, causal=causal, max_relative_position=k)
    with torch.no_grad():  # larger than the init, so a wrong row shows
        enc.key_table.normal_()
        enc.value_table.normal_()
    return enc


CASES = [  # (max_relative_position, query positions, key positions)
    (3, torch.arange(10), torch.arange(10)),  # full pass, distances beyond the clip
    (3, torch.arange(7, 10), torch.arange(10)),  # queries after a cache (Tq < Tk)
    (2, torch.arange(100, 106), torch.arange(95, 106)),  # an offset
    (16, torch.arange(12), torch.arange(12)),  # nothing clipped
]


@pytest.mark.parametrize("k,q_positions,k_positions", CASES, ids=["full", "cached", "offset", "unclipped"])
def test_query_terms_equal_explicit_formula(k: int, q_positions: torch.Tensor, k_positions: torch.Tensor) -> None:
    enc = make(k)
    b, h, d = 2, 3, 8
    q = torch.randn(b, h, q_positions.numel(), d)
    keys = torch.randn(b, h, k_positions.numel(), d)
    a_k = explicit_pairs(enc.key_table.detach(), q_positions, k_positions, k)  # (Tq, Tk, D)
    expected = torch.einsum("bhid,ijd->bhij", q, a_k) / math.sqrt(d)
    got = enc.query_terms(q, keys, q_positions, k_positions)
    assert got.shape == (b, h, q_positions.numel(), k_positions.numel())
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("k,q_positions,k_positions", CASES, ids=["full", "cached", "offset", "unclipped"])
def test_value_terms_equal_explicit_formula(k: int, q_positions: torch.Tensor, k_positions: torch.Tensor) -> None:
    enc = make(k)
    b, h = 2, 3
    probs = torch.softmax(torch.randn(b, h, q_positions.numel(), k_positions.numel()), dim=-1)
    a_v = explicit_pairs(enc.value_table.detach(), q_positions, k_positions, k)  # (Tq, Tk, D)
    expected = torch.einsum("bhij,ijd->bhid", probs, a_v)
    got = enc.value_terms(probs, q_positions, k_positions)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_clipping_only_the_edge_rows_reach_far_pairs() -> None:
    k = 2
    enc = make(k)
    pos = torch.arange(8)
    index = enc.index(pos, pos)
    r = pos[None, :] - pos[:, None]
    assert torch.equal(index[r <= -k], torch.zeros_like(index[r <= -k]))
    assert torch.equal(index[r >= k], torch.full_like(index[r >= k], 2 * k))
    assert torch.equal(index[r.abs() < k], (r + k)[r.abs() < k])
    # Changing the first row of the key table moves exactly the pairs with j - i <= -k.
    q = torch.randn(1, 3, 8, 8)
    before = enc.query_terms(q, q, pos, pos)
    with torch.no_grad():
        enc.key_table[0] += 1.0
    changed = (enc.query_terms(q, q, pos, pos) - before).abs().amax(dim=(0, 1)) > 0  # (Tq, Tk)
    assert torch.equal(changed, r <= -k)


@pytest.mark.parametrize("causal", [True, False])
def test_attention_equals_paper_formula(causal: bool) -> None:
    """The whole attention layer (eager backend) equals the paper's e_ij and z_i."""
    dim, heads, t, k = 24, 3, 9, 2
    d = dim // heads
    enc = make(k, causal=causal, d=d, heads=heads)
    attn = posenc.Attention(dim, heads, enc, causal=causal, backend="eager")
    x = torch.randn(2, t, dim)
    pos = torch.arange(t)
    q, keys, v = attn.qkv(x).view(2, t, 3, heads, d).permute(2, 0, 3, 1, 4)  # (B, H, T, D) each
    a_k = explicit_pairs(enc.key_table.detach(), pos, pos, k)
    a_v = explicit_pairs(enc.value_table.detach(), pos, pos, k)
    e = (q @ keys.transpose(-1, -2) + torch.einsum("bhid,ijd->bhij", q, a_k)) / math.sqrt(d)
    if causal:
        e = e.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    alpha = torch.softmax(e, dim=-1)
    z = alpha @ v + torch.einsum("bhij,ijd->bhid", alpha, a_v)  # (B, H, T, D)
    expected = attn.proj(z.transpose(1, 2).reshape(2, t, dim))
    torch.testing.assert_close(attn(x), expected, rtol=0, atol=1e-5)
