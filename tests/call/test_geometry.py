"""Positions given to the attention: validated, and honoured by every backend when they skip values
(randomized positions): the fast paths step aside rather than assume consecutive positions."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import posenc
import posenc.hf
from posenc import Attention, available, build
from posenc.encodings import get_class, offers
from posenc.encodings.protocol import Biases, ContextualPositions, QueryTerms, Rotates, ValueTerms
from posenc.errors import UsageError
from posenc.model.attention import LayerCache


def qkv(t: int = 5, heads: int = 2, d: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(1, heads, t, d), torch.randn(1, heads, t, d), torch.randn(1, heads, t, d)


def _rotated(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """float64 RoPE, half layout (RoFormer eq. 34 with HF's rotate_half pairing), as reference."""
    d = x.shape[-1]
    inv_freq = (1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)).double()  # float32 frequencies
    angles = positions.double()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
    x = x.double()
    half = torch.cat((-x[..., d // 2:], x[..., : d // 2]), -1)
    return x * cos + half * sin


H, D = 2, 8


def layers(method: str, causal: bool = True):
    torch.manual_seed(0)
    enc = build(method, num_heads=H, head_dim=D, causal=causal) if method != "learned" else build(
        method, num_heads=H, head_dim=D, causal=causal, max_positions=64
    )
    for p in enc.parameters():  # large enough that the position terms matter
        torch.nn.init.normal_(p, std=0.5)
    fast = Attention(H * D, H, enc, causal=causal)
    slow = Attention(H * D, H, copy.deepcopy(enc), causal=causal, backend="eager")
    slow.load_state_dict(fast.state_dict())
    return fast, slow.double()


CASES = [(m, c) for m in available() for c in (True, False) if c or not get_class(m).causal_only]
# Methods whose attention layer reads positions: a hook of the attention that takes them
# (``embed`` is the model's, not the layer's; FoX's gates and NoPE take none).
IN_ATTENTION = [m for m in available() if any(offers(build(m, num_heads=H, head_dim=D), h) for h in (Rotates, Biases, QueryTerms, ValueTerms))]
assert {"alibi", "t5", "shaw", "transformer_xl", "rope", "kerple", "fire", "cope", "xpos", "deberta"} <= set(IN_ATTENTION), IN_ATTENTION
assert not {"nope", "sinusoidal", "learned", "fox"} & set(IN_ATTENTION), IN_ATTENTION
# Methods that read one position per token (``position_axes`` 1): the layer's messages about
# positions are theirs (the multi-axis ones have their own, tests/call/test_axes.py).
ONE_AXIS = [m for m in available() if get_class(m).position_axes == 1]
assert {"alibi", "t5", "shaw", "transformer_xl", "rope", "learned"} <= set(ONE_AXIS), ONE_AXIS
assert not {"mrope", "axial_rope", "rope_mixed"} & set(ONE_AXIS), ONE_AXIS


@pytest.mark.parametrize("method, causal", CASES)
def test_skipping_positions_match_the_formula(method, causal):
    """Sorted distinct positions with gaps: auto's result is eager's (float64), outputs and grads."""
    if not causal and get_class(method).causal_only:
        with pytest.raises(UsageError, match="causal=True"):
            layers(method, causal)
        return
    fast, slow = layers(method, causal)
    positions = torch.tensor([0, 3, 4, 9, 10, 11, 20, 31, 40, 41, 55, 63])
    x = torch.randn(2, positions.numel(), H * D)
    out = fast(x, positions)
    assert fast.last_backend in ("sdpa", "eager", "remapped")  # no fast path that assumes steps of one  # remapped: intervals found by bisection
    want = slow(x.double(), positions)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    # (embed tables are the model's business, unused by one attention layer: allow_unused)
    grads = torch.autograd.grad(out.sum(), list(fast.parameters()), allow_unused=True)
    want_grads = torch.autograd.grad(want.sum(), list(slow.parameters()), allow_unused=True)
    for g, w in zip(grads, want_grads):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", IN_ATTENTION)
def test_gapped_positions_differ_from_consecutive_ones(method):
    """The positions are really used: the same tokens at other positions attend differently. A
    contextual method (CoPE) counts gated keys instead, so for it the positions give only the
    order, and the same order at other positions attends the same."""
    fast, _ = layers(method)
    x = torch.randn(1, 6, H * D)
    a = fast(x, torch.arange(6))
    b = fast(x, torch.tensor([0, 2, 4, 6, 8, 10]))
    if offers(fast.encoding, ContextualPositions):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    else:
        assert not torch.allclose(a, b)


@pytest.mark.parametrize(
    "positions, message",
    [
        (torch.arange(5), "positions must have shape (6,) or (batch, 6) = (1, 6), got (5,)"),
        (torch.arange(7), "positions must have shape (6,) or (batch, 6) = (1, 6), got (7,)"),
        (torch.arange(6).float(), "positions must be an integer tensor of shape (6,) or (1, 6), got a 1-D float32 tensor of shape (6,)"),
        (torch.arange(12).view(2, 6), "positions must have shape (6,) or (batch, 6) = (1, 6), got (2, 6)"),
        (torch.arange(-1, 5), "positions must be >= 0, got -1"),
        (torch.tensor([[0, 1, -2, 3, 4, 5]]), "positions must be >= 0, got -2"),
    ],
)
@pytest.mark.parametrize("method", ONE_AXIS)
def test_bad_positions_are_refused(method, positions, message):
    fast, _ = layers(method)
    with pytest.raises(UsageError) as error:
        fast(torch.randn(1, 6, H * D), positions)
    assert message in str(error.value)


@pytest.mark.parametrize("method", available())
def test_restarting_positions_are_documents(method):
    """Positions that do not increase start a new document: never attended across (packing)."""
    fast, _ = layers(method)
    x = torch.randn(1, 6, H * D)
    packed = fast(x, torch.tensor([0, 1, 2, 0, 1, 2]))
    alone = torch.cat([fast(x[:, :3], torch.arange(3)), fast(x[:, 3:], torch.arange(3))], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-6)


def test_positions_with_a_cache_must_continue_it():
    fast, _ = layers("alibi")
    cache = LayerCache()
    fast(torch.randn(1, 4, H * D), cache=cache)
    fast(torch.randn(1, 2, H * D), torch.tensor([4, 5]), cache=cache)  # continues: fine
    with pytest.raises(UsageError, match=r"continue the cache: 6\.\.7, got 8\.\.9"):
        fast(torch.randn(1, 2, H * D), torch.tensor([8, 9]), cache=cache)


@pytest.mark.parametrize(
    "tokens, message",
    [
        (torch.tensor([[1, 2, 256]]), r"tokens must be ids in \[0, vocab_size=256\), got values in \[1, 256\]"),
        (torch.tensor([[-1, 2, 3]]), r"tokens must be ids in \[0, vocab_size=256\), got values in \[-1, 3\]"),
        (torch.tensor([[1.0, 2.0]]), "tokens must be integer token ids, got float32"),
    ],
)
def test_tokens_outside_the_vocabulary_are_refused(tokens, message):
    from posenc import LM, LMConfig

    model = LM(LMConfig(encoding="alibi", dim=16, depth=1, num_heads=2))
    with pytest.raises(UsageError, match=message):
        model(tokens)


@pytest.mark.parametrize("method", ["rope", "mrope", "axial_rope"])
def test_positions_near_1e9_allocate_no_table_of_1e9(method) -> None:
    """Before: RoPE's table grew to the largest position (8 GB of float64 angles at 1e9)."""
    from posenc.encodings.rope import table_rows

    q, k, v = qkv()
    enc = posenc.build(method, num_heads=2, head_dim=8)
    positions = torch.arange(5) + 10**9
    out = posenc.attend(q, k, v, enc, positions=positions)
    assert out.shape == (1, 2, 5, 8) and bool(out.isfinite().all())
    table = enc._main if method == "rope" else enc._table
    assert table.length <= table_rows(table.inv_freq.numel())
    if method == "rope":  # the result: RoPE at those positions, as a float64 reference computes it
        qr, kr = _rotated(q, positions, 10000.0), _rotated(k, positions, 10000.0)
        logits = (qr @ kr.transpose(-1, -2) / math.sqrt(8)).masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), -math.inf)
        torch.testing.assert_close(out.double(), logits.softmax(-1) @ v.double(), rtol=0, atol=1e-5)
