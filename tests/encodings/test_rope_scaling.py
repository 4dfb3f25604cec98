"""RoPE scalings (linear, ntk, dynamic, yarn, llama3, longrope, proportional) against Hugging Face
``transformers`` (``ROPE_INIT_FUNCTIONS`` and LLaMA's ``apply_rotary_pos_emb``), x-transformers and
rotary-embedding-torch; config parsing; ``rope_from_hf``; precision.

HF computes its frequencies with float32 powers and its angles as float32 products
``position * inv_freq``; ours are float64 rounded once. So frequencies agree to 1e-6 relative, and
rotated vectors to ``max(1e-5, position * 2^-22 * max|x| * attention_factor)`` (the bound
tests/encodings/test_rope.py uses for plain RoPE, times the attention factor that scales the output).
"""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc.encodings.rope import with_scaling
from posenc.encodings.rope_scaling import RopeScaling, parse_scaling

transformers = pytest.importorskip("transformers")
rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
x_transformers = pytest.importorskip("x_transformers.x_transformers")
rotary_embedding_torch = pytest.importorskip("rotary_embedding_torch")
from transformers import LlamaConfig  # noqa: E402

transformers.logging.set_verbosity_error()  # HF warns about test-sized configs (factor vs lengths)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny tensors run on one thread


H = 2
L = 64  # original (training) length of the HF cases


def longrope_lists(pairs: int, seed: int) -> tuple[list[float], list[float]]:
    gen = torch.Generator().manual_seed(seed)
    return (1 + torch.rand(pairs, generator=gen)).tolist(), (1 + 7 * torch.rand(pairs, generator=gen)).tolist()


SHORT48, LONG48 = longrope_lists(24, 1)
SHORT32, LONG32 = longrope_lists(16, 2)

# (rope_type, head_dim, base, HF block without rope_type/rope_theta, HF max_position_embeddings)
CASES = [
    ("linear", 64, 10000.0, {"factor": 2.0}, L),
    ("linear", 80, 500000.0, {"factor": 3.7}, L),
    ("linear", 48, 10000.0, {"factor": 4.0, "partial_rotary_factor": 0.5}, L),
    ("dynamic", 64, 10000.0, {"factor": 2.0}, L),
    ("dynamic", 80, 1e6, {"factor": 5.5}, L),
    ("yarn", 64, 10000.0, {"factor": 4.0, "original_max_position_embeddings": L}, 4 * L),
    ("yarn", 48, 500000.0, {"factor": 2.5, "original_max_position_embeddings": 4096, "beta_fast": 16, "beta_slow": 2}, 4096),
    ("yarn", 128, 10000.0, {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 0.707, "mscale_all_dim": 1.0}, 4096),
    ("yarn", 80, 10000.0, {"factor": 8.0, "original_max_position_embeddings": L, "truncate": False, "attention_factor": 1.3}, L),
    ("yarn", 64, 10000.0, {"factor": 4.0, "original_max_position_embeddings": L, "partial_rotary_factor": 0.5}, L),
    ("llama3", 64, 500000.0, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, 8192),
    ("llama3", 80, 10000.0, {"factor": 32.0, "low_freq_factor": 1.5, "high_freq_factor": 6.0, "original_max_position_embeddings": L}, L),
    ("longrope", 48, 10000.0, {"short_factor": SHORT48, "long_factor": LONG48, "original_max_position_embeddings": L, "factor": 8.0}, L),
    ("longrope", 48, 10000.0, {"short_factor": SHORT48, "long_factor": LONG48, "original_max_position_embeddings": L}, 16 * L),
    ("longrope", 64, 10000.0, {"short_factor": SHORT32, "long_factor": LONG32, "original_max_position_embeddings": L,
                               "attention_factor": 1.1, "partial_rotary_factor": 0.5}, L),
    ("proportional", 64, 10000.0, {"partial_rotary_factor": 0.25}, L),
    ("proportional", 80, 1e6, {"partial_rotary_factor": 0.5, "factor": 1.5}, L),
    ("proportional", 48, 10000.0, {}, L),
]
IDS = [f"{c[0]}-d{c[1]}-{i}" for i, c in enumerate(CASES)]


def hf_config(head_dim: int, base: float, rope_type: str, block: dict, max_positions: int) -> LlamaConfig:
    parameters = {"rope_type": rope_type, "rope_theta": base, **block}
    return LlamaConfig(hidden_size=H * head_dim, num_attention_heads=H, head_dim=head_dim,
                       max_position_embeddings=max_positions, rope_parameters=parameters)


def hf_parameters(case: tuple, length: int | None) -> tuple[torch.Tensor, float]:
    rope_type, head_dim, base, block, max_positions = case
    config = hf_config(head_dim, base, rope_type, block, max_positions)
    return rope_utils.ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=length)


def ours(case: tuple) -> posenc.PositionalEncoding:
    rope_type, head_dim, base, block, max_positions = case
    scaling = {"rope_type": rope_type, **block}
    if rope_type == "dynamic":
        scaling["original_max_position_embeddings"] = max_positions  # HF's dynamic reads it there
    if rope_type in ("yarn", "longrope") and "factor" not in block:
        scaling["max_position_embeddings"] = max_positions  # HF derives the factor from it
    return posenc.build("rope", num_heads=H, head_dim=head_dim, base=base, scaling=scaling, cache_length=64)


def hf_rotate(q, k, positions, inv_freq, attention_factor):
    """HF LLaMA: cos/sin = cat(angles, angles) * attention_factor, float32 angles; partial
    rotary rotates the first r features (GPT-NeoX style) and passes the rest through."""
    angles = positions[:, None].float() * inv_freq[None, :]  # (T, r/2) float32, as HF's forward
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = (emb.cos() * attention_factor)[None], (emb.sin() * attention_factor)[None]
    r = emb.shape[-1]
    qr, kr = modeling_llama.apply_rotary_pos_emb(q[..., :r], k[..., :r], cos, sin)
    return torch.cat((qr, q[..., r:]), dim=-1), torch.cat((kr, k[..., r:]), dim=-1)


def reference_atol(positions: torch.Tensor, x: torch.Tensor, attention_factor: float) -> float:
    return max(1e-5, int(positions.max()) * 2.0**-22 * float(x.abs().max()) * attention_factor)


# ---- frequencies and attention factor: equal to HF's -------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_frequencies_and_attention_factor_equal_hf(case) -> None:
    enc = ours(case)
    # Only dynamic and longrope read the length; the others are checked at two lengths anyway.
    lengths = [None, L // 2, L, L + 1, 3 * L, 10000] if case[0] in ("dynamic", "longrope") else [None, 10000]
    for length in lengths:
        inv_hf, factor_hf = hf_parameters(case, length)
        got = enc.frequencies(length)
        assert got.dtype == torch.float32 and got.shape == inv_hf.shape
        assert torch.equal(got == 0, inv_hf == 0)  # p-RoPE's unrotated pairs
        nonzero = inv_hf != 0
        rel = ((got.double() - inv_hf.double()).abs() / inv_hf.double().abs())[nonzero]
        assert rel.max() < 1e-6
        assert enc.attention_factor == pytest.approx(factor_hf, rel=1e-12)


def test_the_cases_exercise_what_they_claim() -> None:
    """Guards the comparisons above: scaled frequencies differ from plain RoPE, lengths matter
    where they should, and attention factors are not all 1."""
    for case in CASES:
        rope_type = case[0]
        plain = posenc.build("rope", num_heads=H, head_dim=case[1], base=case[2], rotary_dim=ours(case).rotary_dim, cache_length=1)
        short, long = ours(case).frequencies(L // 2), ours(case).frequencies(10000)
        if rope_type == "proportional" and not case[3]:
            assert torch.equal(long, plain.inv_freq)  # p = 1 keeps every pair: plain RoPE
        else:
            assert not torch.allclose(long, plain.inv_freq, rtol=1e-3)
        if rope_type in ("dynamic", "longrope"):
            assert not torch.allclose(short, long, rtol=1e-3)
        else:
            assert torch.equal(short, long)
    assert {round(ours(c).attention_factor, 6) for c in CASES if c[0] in ("yarn", "longrope")} - {1.0}


# ---- rotation: equal to HF's apply_rotary_pos_emb ------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("start", [0, L - 8, 5000])
def test_rotation_equals_hf_apply_rotary_pos_emb(case, start) -> None:
    t = 24  # positions start .. start + 23: below, across and far past the original length
    head_dim = case[1]
    q, k = torch.randn(2, 1, H, t, head_dim).unbind(0)
    pos = torch.arange(start, start + t)
    inv_hf, factor_hf = hf_parameters(case, int(pos.max()) + 1)  # HF's seq_len in a full pass
    q_ref, k_ref = hf_rotate(q, k, pos, inv_hf, factor_hf)
    q_got, k_got = ours(case).rotate(q, k, pos, pos)
    atol = reference_atol(pos, torch.cat((q, k)), factor_hf)
    torch.testing.assert_close(q_got, q_ref, rtol=0, atol=atol)
    torch.testing.assert_close(k_got, k_ref, rtol=0, atol=atol)


@pytest.mark.parametrize("case", [c for c in CASES if "partial_rotary_factor" not in c[3]], ids=lambda c: c[0])
def test_reference_construction_is_hf_llama_rotary_embedding(case) -> None:
    """The cos/sin built in hf_rotate are what LlamaRotaryEmbedding itself returns (dynamic and
    longrope updates included, for a fresh module and one call)."""
    rope_type, head_dim, base, block, max_positions = case
    for start in (0, L + 20):
        pos = torch.arange(start, start + 8)
        rotary = modeling_llama.LlamaRotaryEmbedding(hf_config(head_dim, base, rope_type, block, max_positions))
        cos, sin = rotary(torch.zeros(1), pos[None])  # (1, T, D)
        inv_hf, factor_hf = hf_parameters(case, int(pos.max()) + 1)
        angles = pos[:, None].float() * inv_hf[None, :]
        torch.testing.assert_close(cos[0], torch.cat((angles, angles), -1).cos() * factor_hf, rtol=0, atol=1e-6)
        torch.testing.assert_close(sin[0], torch.cat((angles, angles), -1).sin() * factor_hf, rtol=0, atol=1e-6)


# ---- static NTK and linear: x-transformers and rotary-embedding-torch ----------------------------


@pytest.mark.parametrize("rope_type,factor", [("linear", 2.0), ("linear", 3.5), ("ntk", 2.0), ("ntk", 8.0)])
@pytest.mark.parametrize("head_dim,rotary_dim", [(32, None), (48, 24)])
def test_linear_and_ntk_equal_x_transformers_and_rotary_embedding_torch(rope_type, factor, head_dim, rotary_dim) -> None:
    r = rotary_dim or head_dim
    t, start = 40, 30
    pos = torch.arange(start, start + t)
    q = torch.randn(1, H, t, head_dim)
    enc = posenc.build("rope", num_heads=H, head_dim=head_dim, layout="interleaved", rotary_dim=rotary_dim,
                       scaling={"rope_type": rope_type, "factor": factor})
    got, _ = enc.rotate(q, q, pos, pos)

    interpolation = {"interpolation_factor": factor} if rope_type == "linear" else {"base_rescale_factor": factor}
    xt = x_transformers.RotaryEmbedding(r, **interpolation)
    freqs, _ = xt(pos)  # (1, T, r)
    expected = x_transformers.apply_rotary_pos_emb(q, freqs)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)

    interpolation = {"interpolate_factor": factor} if rope_type == "linear" else {"theta_rescale_factor": factor}
    ret = rotary_embedding_torch.RotaryEmbedding(dim=r, cache_if_possible=False, **interpolation)
    expected = ret.rotate_queries_or_keys(q, offset=start)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_ntk_is_a_larger_base() -> None:
    """base' = base * s^(r/(r-2)): the slowest pair is interpolated by exactly s, the fastest kept."""
    enc = posenc.build("rope", num_heads=1, head_dim=32, scaling={"rope_type": "ntk", "factor": 4.0})
    plain = posenc.build("rope", num_heads=1, head_dim=32)
    assert enc.inv_freq[0] == plain.inv_freq[0] == 1.0
    assert float(plain.inv_freq[-1] / enc.inv_freq[-1]) == pytest.approx(4.0 ** (30 / 30), rel=1e-6)


def test_proportional_is_not_partial_rotary() -> None:
    """p-RoPE keeps every rotated pair's full-width frequency and zeroes the rest; partial rotary
    rotates fewer features with the whole frequency range squeezed onto them."""
    d = 64
    plain = posenc.build("rope", num_heads=1, head_dim=d)
    p_rope = posenc.build("rope", num_heads=1, head_dim=d, scaling={"rope_type": "proportional", "partial_rotary_factor": 0.25})
    partial = posenc.build("rope", num_heads=1, head_dim=d, scaling={"partial_rotary_factor": 0.25})
    assert p_rope.rotary_dim == d and partial.rotary_dim == d // 4
    assert torch.equal(p_rope.inv_freq[:8], plain.inv_freq[:8]) and torch.equal(p_rope.inv_freq[8:], torch.zeros(24))
    assert partial.inv_freq.numel() == 8 and float(partial.inv_freq[-1]) < float(plain.inv_freq[7]) / 100
    x = torch.randn(1, 1, 5, d)
    pos = torch.arange(100, 105)
    rotated, _ = p_rope.rotate(x, x, pos, pos)  # "half" layout: unrotated pairs are k and k + d/2, k >= 8
    kept = torch.cat((torch.arange(8, 32), torch.arange(40, 64)))
    assert torch.equal(rotated[..., kept], x[..., kept])


# ---- config parsing and errors ------------------------------------------------------------------


@pytest.mark.parametrize(
    "scaling,message",
    [
        ({"rope_type": "linear"}, "factor"),
        ({"rope_type": "linear", "factor": 0}, "factor"),
        ({"rope_type": "linear", "factor": -2.0}, "factor"),
        ({"rope_type": "linear", "factor": True}, "factor"),
        ({"rope_type": "linear", "factor": 2.0, "colour": 1}, "colour"),
        ({"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0}, "low_freq_factor"),
        ({"rope_type": "warp", "factor": 2.0}, "rope_type"),
        ({"rope_type": "yarn", "type": "linear", "factor": 2.0}, "type"),
        ({"rope_type": "yarn", "factor": 4.0}, "original_max_position_embeddings"),
        ({"rope_type": "yarn", "original_max_position_embeddings": 64}, "factor"),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}, "original_max_position_embeddings"),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 1, "beta_slow": 2}, "beta_fast"),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "truncate": "no"}, "truncate"),
        ({"rope_type": "dynamic", "factor": 2.0}, "original_max_position_embeddings"),
        ({"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8, "max_position_embeddings": 16}, "max_position_embeddings"),
        ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64, "low_freq_factor": 1.0}, "high_freq_factor"),
        ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64, "low_freq_factor": 4.0,
          "high_freq_factor": 1.0}, "high_freq_factor"),
        ({"rope_type": "longrope", "short_factor": [1.0] * 8, "original_max_position_embeddings": 64, "factor": 2.0}, "long_factor"),
        ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 7, "original_max_position_embeddings": 64,
          "factor": 2.0}, "long_factor"),
        ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 7 + [0.0], "original_max_position_embeddings": 64,
          "factor": 2.0}, r"long_factor\[7\]"),
        ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8, "original_max_position_embeddings": 64}, "factor"),
        ({"rope_type": "proportional", "partial_rotary_factor": 1.5}, "partial_rotary_factor"),
        ({"rope_type": "proportional", "partial_rotary_factor": 0.01}, "partial_rotary_factor"),
        ("yarn", "scaling"),
    ],
)
def test_bad_scaling_is_a_usage_error_naming_the_key(scaling, message) -> None:
    with pytest.raises(posenc.UsageError, match=message):
        posenc.build("rope", num_heads=H, head_dim=16, scaling=scaling)


def test_conflicting_options_are_usage_errors() -> None:
    linear = {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(posenc.UsageError, match="rope_theta"):
        posenc.build("rope", num_heads=H, head_dim=16, base=10000.0, scaling={**linear, "rope_theta": 500.0})
    with pytest.raises(posenc.UsageError, match="partial_rotary_factor"):  # 16 * 0.5 = 8 rotated features, not 4
        posenc.build("rope", num_heads=H, head_dim=16, rotary_dim=4, scaling={**linear, "partial_rotary_factor": 0.5})
    with pytest.raises(posenc.UsageError, match="rotary_dim"):  # 16 * 0.3125 = 5: odd
        posenc.build("rope", num_heads=H, head_dim=16, scaling={**linear, "partial_rotary_factor": 0.3125})
    with pytest.raises(posenc.UsageError, match="base"):
        posenc.build("rope", num_heads=H, head_dim=16, base=1.0)
    # Consistent duplicates are fine.
    enc = posenc.build("rope", num_heads=H, head_dim=16, base=500.0, rotary_dim=8,
                       scaling={**linear, "rope_theta": 500, "partial_rotary_factor": 0.5})
    assert (enc.base, enc.rotary_dim) == (500.0, 8)


def test_hf_block_spellings_are_accepted() -> None:
    old = parse_scaling({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
    both = parse_scaling({"type": "yarn", "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
    assert old == both and old.rope_type == "yarn"
    enc = posenc.build("rope", num_heads=H, head_dim=16, scaling={"rope_type": "linear", "factor": 2, "rope_theta": 500.0})
    assert enc.base == 500.0  # rope_parameters carries the base
    assert parse_scaling(None) == RopeScaling() and not RopeScaling().depends_on_length
    assert parse_scaling(old.to_dict()) == old
    assert posenc.build("rope", num_heads=H, head_dim=16, scaling={"partial_rotary_factor": 0.5}).rotary_dim == 8


# ---- rope_from_hf ---------------------------------------------------------------------------------


def test_rope_from_hf_config_objects_and_dicts() -> None:
    short, long = longrope_lists(8, 3)
    configs = [
        # Llama 3.1-style block
        LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=4 * L,
                    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": L}),
        # dynamic NTK: the training length is max_position_embeddings
        LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=L,
                    rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 3.0}),
        # Phi-3-style LongRoPE: no factor (HF derives it from the two lengths)
        LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=32 * L,
                    rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short, "long_factor": long,
                                     "original_max_position_embeddings": L}),
    ]
    for config in configs:
        enc = posenc.rope_from_hf(config)
        assert (enc.num_heads, enc.head_dim, enc.base) == (4, 16, config.rope_parameters["rope_theta"])
        for length in (8, 2 * L):
            rotary = modeling_llama.LlamaRotaryEmbedding(config)
            pos = torch.arange(length - 4, length)
            cos, _ = rotary(torch.zeros(1), pos[None])
            got, _ = enc.cos_sin(pos, length)
            torch.testing.assert_close(got * enc.attention_factor, cos[0, :, :8], rtol=0, atol=1e-5)
    # A config.json dict with the pre-5.0 keys: rope_scaling and a top-level rope_theta.
    as_dict = {"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 4 * L, "rope_theta": 1e6,
               "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": L}}
    enc = posenc.rope_from_hf(as_dict)
    inv, factor = hf_parameters(("yarn", 16, 1e6, {"factor": 4.0, "original_max_position_embeddings": L}, 4 * L), None)
    torch.testing.assert_close(enc.inv_freq, inv, rtol=1e-6, atol=0)
    assert enc.base == 1e6 and enc.attention_factor == pytest.approx(factor)
    with pytest.raises(posenc.UsageError, match="num_attention_heads"):
        posenc.rope_from_hf({"hidden_size": 64})


def test_rope_from_hf_phi3_longrope_with_partial_rotary() -> None:
    """Phi-3's layout of keys: the original length and partial_rotary_factor at the top level, the
    old ``type`` key, no factor (derived from the two lengths); checked against Phi3RotaryEmbedding."""
    modeling_phi3 = pytest.importorskip("transformers.models.phi3.modeling_phi3")
    short, long = longrope_lists(8, 4)
    config = transformers.Phi3Config(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16 * L,
        original_max_position_embeddings=L, partial_rotary_factor=0.5,
        rope_scaling={"type": "longrope", "short_factor": short, "long_factor": long},
    )
    for source in (config, config.to_dict()):
        enc = posenc.rope_from_hf(source)
        assert (enc.head_dim, enc.rotary_dim, enc.scaling.original_max_position_embeddings) == (32, 16, L)
        for length in (L - 10, 10 * L):
            pos = torch.arange(length - 4, length)
            cos, sin = modeling_phi3.Phi3RotaryEmbedding(config)(torch.zeros(1), pos[None])  # (1, T, 16)
            got_cos, got_sin = enc.cos_sin(pos, length)
            atol = max(1e-5, length * 2.0**-22 * enc.attention_factor)
            torch.testing.assert_close(got_cos * enc.attention_factor, cos[0, :, :8], rtol=0, atol=atol)
            torch.testing.assert_close(got_sin * enc.attention_factor, sin[0, :, :8], rtol=0, atol=atol)


# ---- evaluating a trained model under another scaling --------------------------------------------


def test_set_scaling_and_with_scaling_match_a_model_built_with_that_scaling() -> None:
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    trained = posenc.LM(posenc.LMConfig(encoding="rope", dim=32, depth=2, num_heads=2, vocab_size=64)).eval()
    built = posenc.LM(posenc.LMConfig(encoding="rope", dim=32, depth=2, num_heads=2, vocab_size=64,
                                      encoding_options={"scaling": scaling})).eval()
    built.load_state_dict(trained.state_dict())
    tokens = torch.randint(0, 64, (1, 40))
    with torch.no_grad():
        before = trained(tokens)
        copy = with_scaling(trained.encoding, scaling)
        assert copy is not trained.encoding and trained.encoding.scaling.rope_type == "default"
        assert (copy.base, copy.layout, copy.rotary_dim) == (trained.encoding.base, "half", 16)
        trained.encoding.set_scaling(scaling)  # every layer shares this encoding
        assert all(block.attn.encoding.scaling.rope_type == "yarn" for block in trained.blocks)
        torch.testing.assert_close(trained(tokens), built(tokens), rtol=0, atol=0)
        assert not torch.allclose(trained(tokens), before, atol=1e-4)
        trained.encoding.set_scaling(None)
        torch.testing.assert_close(trained(tokens), before, rtol=0, atol=0)
    with pytest.raises(posenc.UsageError, match="rope_theta"):
        trained.encoding.set_scaling({"rope_type": "linear", "factor": 2.0, "rope_theta": 123.0})


# ---- precision: scaled tables are float32 roundings of float64 angles ----------------------------


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "longrope", "short_factor": SHORT32, "long_factor": LONG32, "original_max_position_embeddings": 64, "factor": 4.0},
    ],
    ids=lambda s: s["rope_type"],
)
def test_bf16_inputs_keep_float32_tables_and_exact_angles(scaling) -> None:
    n = 4096
    enc = posenc.build("rope", num_heads=1, head_dim=32, scaling=scaling, cache_length=64)
    pos = torch.arange(n)
    cos, sin = enc.cos_sin(pos)  # the parameters of length n (past the original length)
    assert cos.dtype == sin.dtype == torch.float32
    angles = pos.double()[:, None] * enc.frequencies(n).double()[None, :]
    assert torch.equal(cos, angles.cos().float()) and torch.equal(sin, angles.sin().float())
    x = torch.randn(1, 1, 1, 32).to(torch.bfloat16).expand(1, 1, n, 32)
    rotated, _ = enc.rotate(x, x, pos, pos)
    assert rotated.dtype == torch.bfloat16
    assert torch.unique(rotated[0, 0].float(), dim=0).shape[0] == n  # every position its own vector
    reference, _ = enc.rotate(x.float(), x.float(), pos, pos)
    torch.testing.assert_close(rotated.float(), reference.to(torch.bfloat16).float(), rtol=0, atol=0)
    model = posenc.LM(posenc.LMConfig(encoding="rope", dim=32, depth=1, num_heads=1, encoding_options={"scaling": scaling}))
    model = model.to(torch.bfloat16)
    model(torch.randint(0, 256, (1, 100)))
    assert model.encoding.cos_cached.dtype == model.encoding.frequencies(100).dtype == torch.float32


# ---- the figure -----------------------------------------------------------------------------------


def test_scaling_figure_plots_wavelengths_and_marks_the_original_length() -> None:
    from matplotlib.figure import Figure

    from posenc.show.scaling import scaling_figure

    scaling = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256}
    fig = scaling_figure(scaling, head_dim=32, base=10000.0)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    enc = posenc.build("rope", num_heads=1, head_dim=32, scaling=scaling)
    plain = posenc.build("rope", num_heads=1, head_dim=32)
    original = lines["original (base 10000)"].get_ydata()
    scaled = [line for label, line in lines.items() if label.startswith("yarn")][0].get_ydata()
    torch.testing.assert_close(torch.tensor(original, dtype=torch.float64), 2 * torch.pi / plain.inv_freq.double())
    torch.testing.assert_close(torch.tensor(scaled, dtype=torch.float64), 2 * torch.pi / enc.inv_freq.double())
    assert 256 in [line.get_ydata()[0] for line in ax.get_lines() if line.get_linestyle() == "--"]
    import io

    fig.savefig(io.BytesIO(), format="png")  # renders without pyplot
    # longrope draws both sets; p-RoPE marks its unrotated pairs
    fig = scaling_figure({"rope_type": "longrope", "short_factor": SHORT32, "long_factor": LONG32,
                          "original_max_position_embeddings": 64, "factor": 4.0}, head_dim=32)
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert any("short" in s for s in labels) and any("long" in s for s in labels)
    fig = scaling_figure({"rope_type": "proportional", "partial_rotary_factor": 0.5}, head_dim=32)
    assert any("not rotated" in t.get_text() for t in fig.axes[0].texts)
