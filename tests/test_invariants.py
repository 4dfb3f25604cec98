"""Relative methods see only j - i: shifting every position by the same offset leaves the scores
unchanged (property test). Scores are computed with the protocol's hooks, as the attention does:
rotate, then ``q k^T * scale + bias + query_terms``.
"""

from __future__ import annotations

import math
from functools import lru_cache

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import posenc
from posenc.encodings import has_hook

# FIRE (normalised by the query's position) and CoPE (positions counted by the content) are not.
RELATIVE = ["shaw", "transformer_xl", "t5", "rope", "alibi", "kerple", "sandwich"]
H, D = 3, 8


@lru_cache(maxsize=None)
def encoding(name: str, causal: bool) -> torch.nn.Module:
    """One instance per (method, mode), with weights large enough that every term matters."""
    torch.manual_seed(1)
    options = {"max_relative_position": 4} if name == "shaw" else {}
    enc = posenc.build(name, num_heads=H, head_dim=D, causal=causal, **options)
    with torch.no_grad():
        for p in enc.parameters():
            p.normal_(std=0.5)
    return enc


def scores(enc: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """(B, H, Tq, Tk) pre-softmax scores from the hooks (no mask)."""
    if has_hook(enc, "rotate"):
        q, k = enc.rotate(q, k, q_positions, k_positions)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if has_hook(enc, "bias"):
        s = s + enc.bias(q_positions, k_positions)
    if has_hook(enc, "query_terms"):
        s = s + enc.query_terms(q, k, q_positions, k_positions)
    return s


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    name=st.sampled_from(RELATIVE),
    causal=st.booleans(),
    tq=st.integers(1, 10),
    past=st.integers(0, 6),
    start=st.integers(0, 50),
    offset=st.integers(1, 5000),
    seed=st.integers(0, 2**16),
)
def test_shifting_all_positions_leaves_scores_unchanged(name, causal, tq, past, start, offset, seed) -> None:
    enc = encoding(name, causal)
    gen = torch.Generator().manual_seed(seed)
    tk = tq + past  # queries are the last tq keys, as after a KV cache
    q = torch.randn(1, H, tq, D, generator=gen)
    k = torch.randn(1, H, tk, D, generator=gen)
    k_positions = torch.arange(start, start + tk)
    q_positions = k_positions[past:]
    with torch.no_grad():
        before = scores(enc, q, k, q_positions, k_positions)
        after = scores(enc, q, k, q_positions + offset, k_positions + offset)
    # rope: cos/sin are float32 roundings of different angles, so not bit-identical.
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)
    v_terms = has_hook(enc, "value_terms")
    if v_terms:
        probs = torch.softmax(before, dim=-1)
        torch.testing.assert_close(
            enc.value_terms(probs, q_positions + offset, k_positions + offset),
            enc.value_terms(probs, q_positions, k_positions),
            rtol=0, atol=1e-6,
        )


@pytest.mark.parametrize("name", RELATIVE)
@pytest.mark.parametrize("causal", [True, False])
def test_scores_do_depend_on_relative_position(name: str, causal: bool) -> None:
    """Guards the property above against a method that ignores positions altogether."""
    enc = encoding(name, causal)
    q, k = torch.randn(1, H, 6, D), torch.randn(1, H, 6, D)
    pos = torch.arange(6)
    with torch.no_grad():
        aligned = scores(enc, q, k, pos, pos)
        moved = scores(enc, q, k, pos + 3, pos)  # queries 3 further from the keys
    assert (aligned - moved).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["sinusoidal", "learned"])
def test_absolute_methods_are_not_shift_invariant(name: str) -> None:
    """The contrast: an absolute method's embedding changes with the absolute position."""
    enc = posenc.build(name, num_heads=H, head_dim=D)
    x = torch.zeros(1, 5, H * D)
    assert not torch.allclose(enc.embed(x, torch.arange(5)), enc.embed(x, torch.arange(7, 12)), atol=1e-3)
