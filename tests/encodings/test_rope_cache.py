"""Cached decoding equals the full forward for every RoPE scaling and for xPos, on both sides of
the original length where the rotation depends on the length (dynamic NTK, LongRoPE's switch).

For such a rotation "the full forward" of a prefix of n tokens rotates every q and k with the
parameters of length n (Hugging Face's seq_len). Decoding the chunk that ends at n must give the
same logits as the last rows of that full forward. With one layer this holds exactly: the
attention keeps these keys un-rotated in its KV cache and rotates all of them at every step. (With
more layers no KV cache can be exact for such a rotation: a deeper layer's cached keys and values
at position p came from a lower layer's output computed at the length of p's own step; the test
below measures that gap and checks it vanishes where the length-dependence does.) A cache that
keeps keys rotated on arrival, as Hugging Face does, is off: the contrast test shows it.
"""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc.encodings.rope import RoPE
from posenc.encodings.rope_scaling import ROPE_TYPES

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny tensors run on one thread


L = 8  # original length of the cases below; sequences run to 2L + 4
T = 2 * L + 4
SHORT = [1.0, 1.1, 1.3, 1.2, 1.5, 1.4, 2.0, 1.7]
LONG = [1.2, 1.9, 2.5, 3.3, 4.0, 5.1, 6.0, 7.5]

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.5},
    "ntk": {"rope_type": "ntk", "factor": 3.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0, "original_max_position_embeddings": L},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": L},
    "longrope": {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "original_max_position_embeddings": L, "factor": 4.0},
    "proportional": {"rope_type": "proportional", "partial_rotary_factor": 0.5},
    "ntk_alpha": {"rope_type": "ntk_alpha", "alpha": 50.0},
    "resonance": {"rope_type": "resonance"},
}
# One case per scaling type the library knows: a new type fails here until it has one.
assert set(SCALINGS) == set(ROPE_TYPES), sorted(set(ROPE_TYPES) ^ set(SCALINGS))
# The scalings whose rotation uses the current length, by RoPE's own declaration (the attention
# then caches keys un-rotated): exact decoding needs the re-rotation tested below.
LENGTH_DEPENDENT = [n for n in SCALINGS if RoPE(2, 16, scaling=SCALINGS[n]).rotation_depends_on_length]
assert {"dynamic", "longrope"} <= set(LENGTH_DEPENDENT) and "default" not in LENGTH_DEPENDENT, LENGTH_DEPENDENT
XPOS = {"xpos": {}, "xpos-uncentred": {"centre": False}, "xpos-blockwise": {"block_size": 5}}


def lm(name: str, depth: int) -> posenc.LM:
    torch.manual_seed(0)
    if name in SCALINGS:
        config = posenc.LMConfig(encoding="rope", dim=32, depth=depth, num_heads=2, vocab_size=64,
                                 encoding_options={"scaling": SCALINGS[name], "cache_length": 8})
    else:
        config = posenc.LMConfig(encoding="xpos", dim=32, depth=depth, num_heads=2, vocab_size=64, encoding_options=XPOS[name])
    model = posenc.LM(config).eval()
    with torch.no_grad():  # larger weights than the init, so positions matter in the logits
        for p in model.parameters():
            p.mul_(4.0)
    return model


def decode_gap(model: posenc.LM, tokens: torch.Tensor, chunks: list[int]) -> float:
    """Largest |decoded logits - last rows of the full forward of the same prefix| over the chunks."""
    cache = model.new_cache(tokens.shape[0])
    gap, start = 0.0, 0
    with torch.no_grad():
        for size in chunks:
            end = start + size
            step = model(tokens[:, start:end], cache)  # (B, size, V)
            full = model(tokens[:, :end])[:, start:end]  # the full forward of the prefix
            gap = max(gap, (step - full).abs().max().item())
            start = end
    assert start == tokens.shape[1]
    return gap


TOKEN_BY_TOKEN = [1] * T
CHUNKS = [3, 4, 1, 1, 5, 6]  # ends at 3, 7, 8 (= L), 9, 14, 20: both sides of the switch
PROMPT_PAST_SWITCH = [L + 3, 1, 1, 4, T - L - 9]


@pytest.mark.parametrize("name", [*SCALINGS, *XPOS])
def test_decoding_equals_full_forward_one_layer(name: str) -> None:
    tokens = torch.randint(0, 64, (2, T))
    model = lm(name, depth=1)
    assert decode_gap(model, tokens, TOKEN_BY_TOKEN) < 2e-5
    if model.encoding.rotation_depends_on_length:  # chunks that end on both sides of the switch
        assert decode_gap(model, tokens, CHUNKS) < 2e-5
        assert decode_gap(model, tokens, PROMPT_PAST_SWITCH) < 2e-5


@pytest.mark.parametrize("name", [n for n in [*SCALINGS, *XPOS] if n not in LENGTH_DEPENDENT])
def test_decoding_equals_full_forward_two_layers(name: str) -> None:
    tokens = torch.randint(0, 64, (1, T))
    assert decode_gap(lm(name, depth=2), tokens, CHUNKS) < 2e-5


class RotatedOnArrival(RoPE):
    """What Hugging Face does: keys rotated with the parameters of their own step, then cached."""

    rotation_depends_on_length = False


@pytest.mark.parametrize("name", LENGTH_DEPENDENT)
def test_length_dependent_two_layers_exact_up_to_the_switch(name: str) -> None:
    """Exact while every length is at most L. Past it a deeper layer's cache holds values computed
    at older lengths (inherent, see the module docstring); still several times closer to the full
    forward than a cache of keys rotated on arrival."""
    tokens = torch.randint(0, 64, (1, T))
    model = lm(name, depth=2)
    assert decode_gap(model, tokens[:, :L], [1] * L) < 2e-5
    past = decode_gap(model, tokens, TOKEN_BY_TOKEN)
    # LongRoPE past the switch is one fixed set of factors: a prompt that crosses the switch in
    # one chunk leaves nothing stale, so the later steps are exact again.
    if name == "longrope":
        assert decode_gap(model, tokens, [L + 1] + [1] * (T - L - 1)) < 2e-5
    stale = RotatedOnArrival(2, 16, scaling=SCALINGS[name])
    for block in model.blocks:
        block.attn.encoding = stale
    assert past < 0.5 * decode_gap(model, tokens, TOKEN_BY_TOKEN)


@pytest.mark.parametrize("name", LENGTH_DEPENDENT)
def test_keys_rotated_on_arrival_go_stale(name: str) -> None:
    """The contrast that shows the test above can fail: the HF-style cache is off past L."""
    tokens = torch.randint(0, 64, (2, T))
    model = lm(name, depth=1)
    stale = RotatedOnArrival(2, 16, scaling=SCALINGS[name])
    assert not stale.rotation_depends_on_length and model.encoding.rotation_depends_on_length
    for block in model.blocks:
        block.attn.encoding = stale
    assert decode_gap(model, tokens[:, :L], [1] * L) < 2e-5  # same up to L
    assert decode_gap(model, tokens, TOKEN_BY_TOKEN) > 1e-2
