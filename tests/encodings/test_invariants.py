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
from posenc.encodings import available, get_class, has_hook, offers
from posenc.encodings.base import position_axes_of
from posenc.encodings.protocol import Biases, Embeds, QueryTerms, Rotates, ValueTerms
from posenc.encodings.rope_scaling import ROPE_TYPES

H, D = 3, 8

# Hooks through which positions reach the scores (or the values); the gates of FoX come from the
# content, and NoPE has no hook at all.
POSITION_HOOKS = (Rotates, Biases, QueryTerms, ValueTerms)


def _instance(name: str) -> torch.nn.Module:
    return posenc.build(name, num_heads=H, head_dim=D)


# Every registered method that declares ``shift_invariant`` and lets positions into the scores:
# the property below must hold for it. FIRE (normalised by the query's position) and CoPE
# (positions counted by the content) declare False and are not in it.
RELATIVE = [n for n in available() if get_class(n).shift_invariant and any(offers(_instance(n), h) for h in POSITION_HOOKS)]
assert {"shaw", "transformer_xl", "t5", "rope", "alibi", "kerple", "sandwich", "deberta", "xpos", "mrope", "axial_rope",
        "rope_mixed"} <= set(RELATIVE), RELATIVE
assert not {"fire", "cope", "sinusoidal", "learned"} & set(RELATIVE), RELATIVE
# The shift-invariant methods without any position hook: shifting cannot change them (NoPE, FoX).
POSITIONLESS = [n for n in available() if get_class(n).shift_invariant and n not in RELATIVE]
assert {"nope", "fox"} <= set(POSITIONLESS), POSITIONLESS
# Absolute methods: positions enter through ``embed`` only, and the class does not claim invariance.
ABSOLUTE = [n for n in available() if not get_class(n).shift_invariant and offers(_instance(n), Embeds)]
assert {"sinusoidal", "learned"} <= set(ABSOLUTE), ABSOLUTE
# (method, causal) pairs: a causal-only method (xPos) has no bidirectional form to test.
RELATIVE_CASES = [(n, c) for n in RELATIVE for c in (True, False) if c or not get_class(n).causal_only]


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


def with_axes(enc: torch.nn.Module, positions: torch.Tensor) -> torch.Tensor:
    """1-D positions (T,) as ``enc`` reads them: unchanged for one id per token; for a multi-axis
    method (``position_axes`` A > 1) A different ids per token, (A, T) or (T, A) as ``axis_first``
    says, axis a = (p (a + 1)) // 2 + a, so that the axes do not move in step."""
    axes, first = position_axes_of(enc)
    if axes == 1:
        return positions
    ids = torch.stack([(positions * (a + 1)) // 2 + a for a in range(axes)])  # (A, T)
    return ids if first else ids.T


def scores(enc: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """(B, H, Tq, Tk) pre-softmax scores from the hooks (no mask); positions as ``enc`` reads them."""
    if has_hook(enc, "rotate"):
        q, k = enc.rotate(q, k, q_positions, k_positions)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if has_hook(enc, "bias"):
        s = s + enc.bias(q_positions, k_positions)
    if has_hook(enc, "query_terms"):
        s = s + enc.query_terms(q, k, q_positions, k_positions)
    return s


def shifted_scores(enc, tq: int, past: int, start: int, offset: int, seed: int):
    """Random q (tq queries, the last of tq + past keys, as after a KV cache) and k from ``seed``;
    the scores at positions from ``start``, then all moved by ``offset``; and the positions."""
    gen = torch.Generator().manual_seed(seed)
    tk = tq + past
    q = torch.randn(1, H, tq, D, generator=gen)
    k = torch.randn(1, H, tk, D, generator=gen)
    k_positions = with_axes(enc, torch.arange(start, start + tk))
    q_positions = with_axes(enc, torch.arange(start + past, start + tk))
    with torch.no_grad():
        before = scores(enc, q, k, q_positions, k_positions)
        after = scores(enc, q, k, q_positions + offset, k_positions + offset)
    return before, after, q_positions, k_positions


@settings(max_examples=80, deadline=None, derandomize=True)  # RELATIVE holds twelve methods
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
    enc = encoding(name, causal or get_class(name).causal_only)
    before, after, q_positions, k_positions = shifted_scores(enc, tq, past, start, offset, seed)
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


@pytest.mark.parametrize("name, causal", RELATIVE_CASES)
def test_scores_do_depend_on_relative_position(name: str, causal: bool) -> None:
    """Guards the property above against a method that ignores positions altogether."""
    enc = encoding(name, causal)
    q, k = torch.randn(1, H, 6, D), torch.randn(1, H, 6, D)
    pos = torch.arange(6)
    with torch.no_grad():
        aligned = scores(enc, q, k, with_axes(enc, pos), with_axes(enc, pos))
        moved = scores(enc, q, k, with_axes(enc, pos + 3), with_axes(enc, pos))  # queries 3 further from the keys
    assert (aligned - moved).abs().max() > 1e-3


@pytest.mark.parametrize("name", RELATIVE + POSITIONLESS)
def test_an_attention_layer_is_shift_invariant(name: str) -> None:
    """What ``shift_invariant`` promises, through a whole layer (every hook, gates included):
    the output does not change when all positions move by the same amount."""
    enc = encoding(name, True)
    assert offers(enc, Embeds) is False  # an absolute embedding would make the claim false
    layer = posenc.Attention(H * D, H, enc)
    x = torch.randn(2, 7, H * D)
    pos = torch.arange(7)
    with torch.no_grad():
        torch.testing.assert_close(layer(x, with_axes(enc, pos) + 37), layer(x, with_axes(enc, pos)), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ABSOLUTE)
def test_absolute_methods_are_not_shift_invariant(name: str) -> None:
    """The contrast: an absolute method's embedding changes with the absolute position."""
    enc = posenc.build(name, num_heads=H, head_dim=D)
    x = torch.zeros(1, 5, H * D)
    assert not torch.allclose(enc.embed(x, torch.arange(5)), enc.embed(x, torch.arange(7, 12)), atol=1e-3)


# ---- RoPE scalings and xPos ------------------------------------------------------------------------
# Static scalings only change the frequencies (and scale q and k by a constant): the usual RoPE
# invariance holds. Dynamic NTK and LongRoPE rotate with the parameters of the current length, so a
# shift keeps the scores only while it keeps the length on the same side of the original length L;
# within one call (one length) they are relative. xPos decays with i - j: relative too, centred or
# not (the centre cancels between query and key).

L_ORIGINAL = 16
ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.5},
    "ntk": {"rope_type": "ntk", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L_ORIGINAL},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": L_ORIGINAL},
    "proportional": {"rope_type": "proportional", "partial_rotary_factor": 0.5},
    "ntk_alpha": {"rope_type": "ntk_alpha", "alpha": 50.0},
    "resonance": {"rope_type": "resonance"},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0, "original_max_position_embeddings": L_ORIGINAL},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [1.2, 2.0, 4.0, 6.0],
                 "original_max_position_embeddings": L_ORIGINAL, "factor": 4.0},
}
# One configuration per scaling type the library knows (plain RoPE, "default", is in RELATIVE):
# a new type fails here until it has a case.
assert set(ROPE_SCALINGS) == set(ROPE_TYPES) - {"default"}, sorted(set(ROPE_TYPES) ^ set(ROPE_SCALINGS))
XPOS_OPTIONS = {"xpos": {}, "xpos-uncentred": {"centre": False}}


@lru_cache(maxsize=None)
def rotary(name: str) -> torch.nn.Module:
    if name in XPOS_OPTIONS:
        return posenc.build("xpos", num_heads=H, head_dim=D, **XPOS_OPTIONS[name])
    return posenc.build("rope", num_heads=H, head_dim=D, scaling=ROPE_SCALINGS[name])


# The scalings whose rotation uses the current length (the encoding's own declaration,
# ``rotation_depends_on_length``), and the static ones, which only change the frequencies.
LENGTH_DEPENDENT = [n for n in ROPE_SCALINGS if rotary(n).rotation_depends_on_length]
STATIC = [n for n in ROPE_SCALINGS if n not in LENGTH_DEPENDENT]
assert {"dynamic", "longrope"} <= set(LENGTH_DEPENDENT), LENGTH_DEPENDENT
assert {"linear", "ntk", "yarn", "llama3", "proportional"} <= set(STATIC), STATIC


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    name=st.sampled_from([*STATIC, *XPOS_OPTIONS]),
    tq=st.integers(1, 10),
    past=st.integers(0, 6),
    start=st.integers(0, 50),
    offset=st.integers(1, 5000),
    seed=st.integers(0, 2**16),
)
def test_scaled_rope_and_xpos_scores_are_shift_invariant(name, tq, past, start, offset, seed) -> None:
    before, after, _, _ = shifted_scores(rotary(name), tq, past, start, offset, seed)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", LENGTH_DEPENDENT)
@pytest.mark.parametrize("lengths", [(6, 16), (20, 900)])  # both <= L, or both > L
def test_length_dependent_scores_are_shift_invariant_on_one_side_of_l(name, lengths) -> None:
    enc = rotary(name)
    q, k = torch.randn(1, H, 3, D), torch.randn(1, H, 6, D)
    short, long = lengths
    with torch.no_grad():
        a = scores(enc, q, k, torch.arange(short - 3, short), torch.arange(short - 6, short))
        b = scores(enc, q, k, torch.arange(long - 3, long), torch.arange(long - 6, long))
    if name == "dynamic" and short > L_ORIGINAL:  # the base itself moves with the length
        assert not torch.allclose(a, b, atol=1e-3)
    else:
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", [*ROPE_SCALINGS, *XPOS_OPTIONS])
@pytest.mark.parametrize("n", [12, 40])  # below and past L_ORIGINAL
def test_within_one_call_scores_depend_on_i_minus_j(name: str, n: int) -> None:
    """The same query and key content at every position: the score matrix is constant along every
    diagonal (Toeplitz), for every type, including the length-dependent ones past L."""
    enc = rotary(name)
    q = torch.randn(1, H, 1, D).expand(1, H, n, D)
    k = torch.randn(1, H, 1, D).expand(1, H, n, D)
    pos = torch.arange(n)
    with torch.no_grad():
        s = scores(enc, q, k, pos, pos)[0]  # (H, n, n)
    for offset in (-7, -1, 0, 3):
        diagonal = s.diagonal(offset, dim1=-2, dim2=-1)  # (H, n - |offset|)
        torch.testing.assert_close(diagonal, diagonal[:, :1].expand_as(diagonal), rtol=0, atol=1e-5)
    assert (s.diagonal(-1, dim1=-2, dim2=-1)[:, 0] - s.diagonal(-5, dim1=-2, dim2=-1)[:, 0]).abs().max() > 1e-3
