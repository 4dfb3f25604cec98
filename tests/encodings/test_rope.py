"""RoPE (Su et al. 2021, "RoFormer") against Hugging Face LLaMA / GPT-NeoX / GPT-J and rotary-embedding-torch.

- layout "half" (feature k pairs with k + d/2): LLaMA's ``LlamaRotaryEmbedding`` +
  ``apply_rotary_pos_emb``; partial rotary: GPT-NeoX's, which rotates the first ``rotary_dim``.
- layout "interleaved" (feature 2k pairs with 2k + 1): GPT-J's ``create_sinusoidal_positions`` +
  ``apply_rotary_pos_emb``, and rotary-embedding-torch's ``RotaryEmbedding``.

The references build their angles as float32 products ``position * inv_freq``; ours are float64
products rounded once to float32. So the two agree to 1e-5 only while the angles are small
(positions below a few hundred); further out the references drift from the float64 truth by about
``position * 2^-24`` and ours does not (checked below).
"""

from __future__ import annotations

import pytest
import torch

import posenc

modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
modeling_neox = pytest.importorskip("transformers.models.gpt_neox.modeling_gpt_neox")
modeling_gptj = pytest.importorskip("transformers.models.gptj.modeling_gptj")
rotary_embedding_torch = pytest.importorskip("rotary_embedding_torch")
from transformers import GPTNeoXConfig, LlamaConfig  # noqa: E402

H, D = 4, 16


def qk(t: int, d: int = D, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = torch.randn(2, 2, H, t, d).unbind(0)  # (B, H, T, D) each
    return q.to(dtype), k.to(dtype)


def permutation(rotary_dim: int, head_dim: int) -> torch.Tensor:
    """Feature order that turns a "half" vector into an "interleaved" one: (k, k + r/2) -> (2k, 2k+1)."""
    half = rotary_dim // 2
    rotary = torch.stack((torch.arange(half), torch.arange(half) + half), dim=-1).flatten()
    return torch.cat((rotary, torch.arange(rotary_dim, head_dim)))


def reference_atol(positions: torch.Tensor, x: torch.Tensor) -> float:
    """Tolerance for a reference whose angles are float32 products: its angle error grows like
    position * 2^-24 (a few ulps), and moves a feature by up to that times |x|."""
    return max(1e-5, int(positions.max()) * 2.0**-22 * float(x.abs().max()))


@pytest.mark.parametrize("base", [10000.0, 500.0])
@pytest.mark.parametrize("start", [0, 37, 4000])
def test_half_equals_hf_llama(base: float, start: int) -> None:
    t = 64
    config = LlamaConfig(hidden_size=H * D, num_attention_heads=H, head_dim=D, rope_parameters={"rope_type": "default", "rope_theta": base})
    rotary = modeling_llama.LlamaRotaryEmbedding(config)
    q, k = qk(t)
    pos = torch.arange(start, start + t)
    cos, sin = rotary(q, pos[None])  # (1, T, D)
    q_ref, k_ref = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    enc = posenc.build("rope", num_heads=H, head_dim=D, base=base, layout="half")
    q_got, k_got = enc.rotate(q, k, pos, pos)
    atol = reference_atol(pos, torch.cat((q, k)))
    torch.testing.assert_close(q_got, q_ref, rtol=0, atol=atol)
    torch.testing.assert_close(k_got, k_ref, rtol=0, atol=atol)


@pytest.mark.parametrize("rotary_dim", [4, 8, 12])
def test_partial_half_equals_hf_gpt_neox(rotary_dim: int) -> None:
    t = 48
    config = GPTNeoXConfig(hidden_size=H * D, num_attention_heads=H, rotary_pct=rotary_dim / D)
    rotary = modeling_neox.GPTNeoXRotaryEmbedding(config)
    q, k = qk(t)
    pos = torch.arange(5, 5 + t)
    cos, sin = rotary(q, pos[None])  # (1, T, rotary_dim)
    assert cos.shape[-1] == rotary_dim
    q_ref, k_ref = modeling_neox.apply_rotary_pos_emb(q, k, cos, sin)
    enc = posenc.build("rope", num_heads=H, head_dim=D, layout="half", rotary_dim=rotary_dim)
    q_got, k_got = enc.rotate(q, k, pos, pos)
    torch.testing.assert_close(q_got, q_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(k_got, k_ref, rtol=0, atol=1e-5)
    assert torch.equal(q_got[..., rotary_dim:], q[..., rotary_dim:])  # the rest passes through


@pytest.mark.parametrize("rotary_dim", [None, 8])
def test_interleaved_equals_gptj(rotary_dim: int | None) -> None:
    t, start = 64, 11
    r = rotary_dim or D
    table = modeling_gptj.create_sinusoidal_positions(start + t, r)  # (P, r): sin | cos
    pos = torch.arange(start, start + t)
    sin, cos = table[pos][None].split(r // 2, dim=-1)  # (1, T, r/2)
    q, k = qk(t)

    def gptj(x: torch.Tensor) -> torch.Tensor:
        x = x.transpose(1, 2)  # GPT-J works on (B, T, H, D)
        rotated = modeling_gptj.apply_rotary_pos_emb(x[..., :r], sin, cos)
        return torch.cat((rotated, x[..., r:]), dim=-1).transpose(1, 2)

    enc = posenc.build("rope", num_heads=H, head_dim=D, layout="interleaved", rotary_dim=rotary_dim)
    q_got, k_got = enc.rotate(q, k, pos, pos)
    torch.testing.assert_close(q_got, gptj(q), rtol=0, atol=1e-5)
    torch.testing.assert_close(k_got, gptj(k), rtol=0, atol=1e-5)


@pytest.mark.parametrize("rotary_dim", [None, 8])
@pytest.mark.parametrize("offset", [0, 20])
def test_interleaved_equals_rotary_embedding_torch(rotary_dim: int | None, offset: int) -> None:
    t = 40
    r = rotary_dim or D
    reference = rotary_embedding_torch.RotaryEmbedding(dim=r, cache_if_possible=False)
    q, _ = qk(t)
    pos = torch.arange(offset, offset + t)
    expected = reference.rotate_queries_or_keys(q, offset=offset)
    enc = posenc.build("rope", num_heads=H, head_dim=D, layout="interleaved", rotary_dim=rotary_dim)
    got, _ = enc.rotate(q, q, pos, pos)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("rotary_dim", [None, 6])
def test_layouts_agree_after_permuting_features(rotary_dim: int | None) -> None:
    t = 32
    r = rotary_dim or D
    perm = permutation(r, D)
    half = posenc.build("rope", num_heads=H, head_dim=D, layout="half", rotary_dim=rotary_dim)
    inter = posenc.build("rope", num_heads=H, head_dim=D, layout="interleaved", rotary_dim=rotary_dim)
    q, k = qk(t)
    qpos, kpos = torch.arange(9, 9 + t), torch.arange(t)
    qh, kh = half.rotate(q, k, qpos, kpos)
    qi, ki = inter.rotate(q[..., perm], k[..., perm], qpos, kpos)
    torch.testing.assert_close(qi, qh[..., perm], rtol=0, atol=1e-6)
    torch.testing.assert_close(ki, kh[..., perm], rtol=0, atol=1e-6)
    # Scores are invariant to a permutation of features, so the two layouts give the same scores.
    torch.testing.assert_close(qi @ ki.transpose(-1, -2), qh @ kh.transpose(-1, -2), rtol=0, atol=1e-5)
    # Without the permutation they are different functions.
    assert not torch.allclose(inter.rotate(q, k, qpos, kpos)[0], qh, atol=1e-3)


def test_scores_depend_on_relative_position_only() -> None:
    enc = posenc.build("rope", num_heads=H, head_dim=D)
    q, k = qk(1)
    # The same content at (i, j) = (3, 1) and (103, 101): the same score.
    near = (enc.rotate_one(q, torch.tensor([3])) * enc.rotate_one(k, torch.tensor([1]))).sum(-1)
    far = (enc.rotate_one(q, torch.tensor([103])) * enc.rotate_one(k, torch.tensor([101]))).sum(-1)
    torch.testing.assert_close(near, far, rtol=0, atol=1e-5)
    other = (enc.rotate_one(q, torch.tensor([3])) * enc.rotate_one(k, torch.tensor([2]))).sum(-1)
    assert not torch.allclose(near, other, atol=1e-3)


# ---- precision: positions never pass through the input's dtype ----------------------------------

N = 65536


def test_cos_sin_tables_are_float64_truth_rounded_once() -> None:
    """At every position up to 65536: cos/sin are the float64 values rounded to float32, so two
    positions share a table row only where float32 cannot tell the true values apart."""
    enc = posenc.build("rope", num_heads=1, head_dim=64)
    pos = torch.arange(N)
    cos, sin = enc.cos_sin(pos)  # (N, 32) float32
    assert cos.dtype == sin.dtype == torch.float32
    angles = pos.double()[:, None] * enc.inv_freq.double()[None, :]  # exact angles of the stored frequencies
    assert torch.equal(cos, angles.cos().float()) and torch.equal(sin, angles.sin().float())
    # The fastest pair (theta_0 = 1 rad per position): every one of the 65536 positions has its own row.
    rows = torch.stack((cos[:, 0], sin[:, 0]), dim=-1)
    assert torch.unique(rows, dim=0).shape[0] == N
    # Whole rows: one per position.
    assert torch.unique(torch.cat((cos, sin), dim=-1), dim=0).shape[0] == N


def test_bf16_rotation_gives_every_position_its_own_vector() -> None:
    enc = posenc.build("rope", num_heads=1, head_dim=64)
    x = torch.randn(1, 1, 1, 64).to(torch.bfloat16).expand(1, 1, N, 64)  # the same vector at every position
    pos = torch.arange(N)
    rotated, _ = enc.rotate(x, x, pos, pos)
    assert rotated.dtype == torch.bfloat16
    rows = rotated[0, 0]  # (N, 64)
    assert (rows[1:] != rows[:-1]).any(-1).all(), "positions p and p+1 rotate to the same bf16 vector"
    assert torch.unique(rows.float(), dim=0).shape[0] == N
    # The rotation is the float32 rotation rounded once to bf16 (it never runs in bf16).
    ref, _ = enc.rotate(x.float(), x.float(), pos, pos)
    torch.testing.assert_close(rotated.float(), ref.to(torch.bfloat16).float(), rtol=0, atol=0)


def test_bf16_positions_do_not_collapse_like_peer() -> None:
    """A peer library builds positions as ``arange(T, dtype=x.dtype)``: in bf16 the 2048 positions
    collapse to 641 distinct values, so far tokens share angles. Ours stay distinct."""
    t = 2048
    naive = torch.arange(t, dtype=torch.bfloat16)
    assert naive.unique().numel() < t  # the detector below can see the bug
    x = torch.randn(1, 1, 1, D).to(torch.bfloat16).expand(1, 1, t, D)
    peer = rotary_embedding_torch.RotaryEmbedding(dim=D, cache_if_possible=False).rotate_queries_or_keys(x)
    peer_distinct = torch.unique(peer[0, 0].float(), dim=0).shape[0]
    enc = posenc.build("rope", num_heads=1, head_dim=D, layout="interleaved")
    ours, _ = enc.rotate(x, x, torch.arange(t), torch.arange(t))
    ours_distinct = torch.unique(ours[0, 0].float(), dim=0).shape[0]
    assert ours_distinct == t
    assert ours_distinct >= peer_distinct


def test_far_positions_closer_to_truth_than_float32_angles() -> None:
    """At positions near 60000, HF LLaMA's float32 angles are off by ~1e-3; ours by < 1e-6."""
    config = LlamaConfig(hidden_size=H * D, num_attention_heads=H, head_dim=D)
    rotary = modeling_llama.LlamaRotaryEmbedding(config)
    enc = posenc.build("rope", num_heads=H, head_dim=D)
    pos = torch.arange(60000, 60064)
    cos_ref, _ = rotary(torch.zeros(1), pos[None])  # (1, T, D), half layout: [c | c]
    cos_ours, _ = enc.cos_sin(pos)  # (T, D/2)
    truth = (pos.double()[:, None] * enc.inv_freq.double()[None, :]).cos()
    ours_err = (cos_ours.double() - truth).abs().max().item()
    ref_err = (cos_ref[0, :, : D // 2].double() - truth).abs().max().item()
    assert ours_err < 1e-6
    assert ref_err > 10 * ours_err


# ---- cache growth ---------------------------------------------------------------------------------


def test_cache_grows_explicitly_and_matches_big_cache() -> None:
    small = posenc.build("rope", num_heads=H, head_dim=D, cache_length=8)
    big = posenc.build("rope", num_heads=H, head_dim=D, cache_length=4096)
    assert small.cache_length == 8
    q, k = qk(1)
    pos = torch.arange(0, 5)
    small.cos_sin(pos)
    assert small.cache_length == 8  # no growth while positions fit
    pos = torch.arange(95, 101)  # past the cache
    got = small.rotate(q.expand(-1, -1, 6, -1), k.expand(-1, -1, 6, -1), pos, pos)
    assert small.cache_length >= 101
    expected = big.rotate(q.expand(-1, -1, 6, -1), k.expand(-1, -1, 6, -1), pos, pos)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    # The grown table is the same as a table built that big in the first place.
    n = small.cache_length
    assert torch.equal(small.cos_cached, big.cos_cached[:n]) and torch.equal(small.sin_cached, big.sin_cached[:n])
    # Growth at least doubles, so one decoding step at a time does not rebuild at every step.
    before = small.cache_length
    small.cos_sin(torch.tensor([before]))
    assert small.cache_length >= 2 * before


def test_output_dtype_follows_input() -> None:
    enc = posenc.build("rope", num_heads=H, head_dim=D)
    pos = torch.arange(8)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        q, k = qk(8, dtype=dtype)
        q2, k2 = enc.rotate(q, k, pos, pos)
        assert q2.dtype == dtype and k2.dtype == dtype


def test_tables_stay_float32_when_the_model_is_cast_to_bfloat16():
    # module.to(bfloat16) casts buffers too; the rotation tables must come back as float32.
    model = posenc.LM(posenc.LMConfig(encoding="rope", dim=32, depth=1, num_heads=4)).to(torch.bfloat16)
    model(torch.randint(0, 256, (1, 10)))
    assert model.encoding.cos_cached.dtype == torch.float32
    assert model.encoding.inv_freq.dtype == torch.float32
    reference = posenc.build("rope", num_heads=4, head_dim=8)
    torch.testing.assert_close(model.encoding.cos_cached, reference.cos_cached, rtol=0, atol=0)


# ---- misuse: positions never wrap, head dims must match ------------------------------------------


def test_negative_positions_are_usage_errors_not_wrapped_indices() -> None:
    """Python indexing would read a table's last rows for negative positions: a silent wrong result."""
    enc = posenc.build("rope", num_heads=H, head_dim=D)
    q, k = qk(3)
    for q_pos, k_pos in ((torch.arange(-1, 2), torch.arange(3)), (torch.arange(3), torch.tensor([-5, 0, 1]))):
        with pytest.raises(posenc.UsageError, match="positions must be >= 0"):
            enc.rotate(q, k, q_pos, k_pos)
    with pytest.raises(posenc.UsageError, match="positions must be >= 0"):
        enc.cos_sin(torch.tensor([-1]))
    learned = posenc.build("learned", num_heads=H, head_dim=D, max_positions=8)
    x = torch.zeros(1, 3, H * D)
    with pytest.raises(posenc.UsageError, match="positions must be >= 0"):
        learned.embed(x, torch.arange(-2, 1))
    with pytest.raises(posenc.UsageError, match="max_positions"):
        learned.embed(x, torch.arange(7, 10))
    assert learned.embed(x, torch.arange(5, 8)).shape == x.shape


def test_head_dim_other_than_the_encodings_is_a_usage_error() -> None:
    """A wider q/k would have only its first head_dim features rotated, silently."""
    enc = posenc.build("rope", num_heads=H, head_dim=D)
    pos = torch.arange(4)
    wide, _ = qk(4, d=2 * D)
    q, k = qk(4)
    with pytest.raises(posenc.UsageError, match=f"head_dim={D}"):
        enc.rotate(wide, k, pos, pos)
    with pytest.raises(posenc.UsageError, match=f"head_dim={D}"):
        enc.rotate(q, wide[..., : D - 2], pos, pos)
    with pytest.raises(posenc.UsageError, match="k_positions"):
        enc.rotate(q, k, pos, torch.arange(5))
