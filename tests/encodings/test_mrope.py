"""M-RoPE (Qwen2-VL contiguous sections, Qwen3-VL interleaved): live against transformers' own
rotary classes and position ids, built from configs with random weights (nothing downloaded); the
text-after-image offset carried through decoding; positions with an axis dimension; errors."""

from __future__ import annotations

import math
import re

import pytest
import torch

import posenc
import posenc.hf
from posenc.encodings.mrope import MRoPE, continue_positions, mrope_axes, vision_text_positions
from posenc.encodings.rope import RoPE
from posenc.errors import UsageError
from posenc.hf.rope_config import mrope_from_hf

transformers = pytest.importorskip("transformers")

from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf25  # noqa: E402
from transformers.models.qwen2_vl import modeling_qwen2_vl as hf2  # noqa: E402
from transformers.models.qwen3_vl import modeling_qwen3_vl as hf3  # noqa: E402


def raises(message: str):
    return pytest.raises(UsageError, match=f"^{re.escape(message)}$")


def raw(**changes) -> dict:
    """A Qwen2-VL config.json as published (a fresh dict: transformers' config class edits the block)."""
    return {"model_type": "qwen2_vl", "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
            "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]}, **changes}


TEXT = dict(hidden_size=64, num_attention_heads=2, head_dim=32, num_key_value_heads=2, num_hidden_layers=1,
            intermediate_size=32, vocab_size=64)


def text_config(family: str, **rope):
    config = {"qwen2": transformers.Qwen2VLConfig, "qwen2_5": transformers.Qwen2_5_VLConfig, "qwen3": transformers.Qwen3VLConfig}[family]
    return config(text_config=dict(TEXT, rope_parameters=dict(rope_type="default", **rope)))


def two_rows() -> torch.Tensor:
    """(3, 2, 20) ids of two text-image-text rows of one length, with different layouts."""
    return torch.stack([vision_text_positions([3, (1, 3, 4), 5]), vision_text_positions([5, (2, 2, 3), 3])], dim=1)


def hf_rotation(family: str, config, q, k, positions):
    module = {"qwen2": hf2, "qwen2_5": hf25, "qwen3": hf3}[family]
    rotary = {"qwen2": hf2.Qwen2VLRotaryEmbedding, "qwen2_5": hf25.Qwen2_5_VLRotaryEmbedding,
              "qwen3": hf3.Qwen3VLTextRotaryEmbedding}[family](config.text_config)
    cos, sin = rotary(q, positions)  # (B, T, D)
    return module.apply_rotary_pos_emb(q, k, cos, sin), rotary


@pytest.mark.parametrize("family,rope", [
    ("qwen2", dict(rope_theta=1e6, mrope_section=[4, 6, 6])),
    ("qwen2_5", dict(rope_theta=1e4, mrope_section=[2, 7, 7])),
    ("qwen3", dict(rope_theta=5e6, mrope_section=[6, 5, 5], mrope_interleaved=True)),
    ("qwen3", dict(rope_theta=1e4, mrope_section=[8, 4, 4], mrope_interleaved=True)),
])
def test_matches_transformers_rotation(family: str, rope: dict) -> None:
    torch.manual_seed(0)
    config = text_config(family, **rope)
    positions = two_rows()
    q, k = torch.randn(2, 2, 20, 32), torch.randn(2, 2, 20, 32)
    (q_ref, k_ref), rotary = hf_rotation(family, config, q, k, positions)
    enc = mrope_from_hf(config)
    assert enc.mrope_section == rope["mrope_section"] and enc.mrope_interleaved == (family == "qwen3")
    assert enc.base == rope["rope_theta"] and enc.head_dim == 32 and enc.num_heads == 2
    q_rot, k_rot = enc.rotate(q, k, positions, positions)
    assert (q_rot - q_ref).abs().max() < 1e-6 and (k_rot - k_ref).abs().max() < 1e-6
    # the frequencies agree to the last bit or one (HF computes base^x in float32, posenc in float64)
    torch.testing.assert_close(enc.inv_freq, rotary.inv_freq, rtol=2.5e-7, atol=0)
    # per-row ids are used: row 1 rotated with row 0's ids differs
    wrong = enc.rotate(q, k, positions[:, :1].expand(3, 2, 20), positions)[0]
    assert (wrong[1] - q_ref[1]).abs().max() > 1e-2


@pytest.mark.parametrize("family,rope", [
    ("qwen2", dict(rope_theta=1e6, mrope_section=[4, 6, 6])),
    ("qwen3", dict(rope_theta=5e6, mrope_section=[6, 5, 5], mrope_interleaved=True)),
])
def test_frequency_assignment_is_exactly_transformers(family: str, rope: dict) -> None:
    """float64 angles of each axis through HF's own recomposition (which frequency takes which
    axis) against posenc's table: the same float32 numbers, bit for bit."""
    config = text_config(family, **rope)
    positions = two_rows()
    enc = mrope_from_hf(config)
    _, rotary = hf_rotation(family, config, torch.zeros(2, 2, 20, 32), torch.zeros(2, 2, 20, 32), positions)
    angles = positions[..., None].double() * enc.inv_freq.double()  # (3, B, T, F)
    ref_cos = rotary.recomposition_frequencies(angles.cos())[..., :16].float()  # (B, T, F)
    ref_sin = rotary.recomposition_frequencies(angles.sin())[..., :16].float()
    cos, sin = enc.cos_sin(positions, torch.zeros(2, 2, 20, 32))  # (B, 1, T, F)
    assert torch.equal(cos[:, 0], ref_cos) and torch.equal(sin[:, 0], ref_sin)


def test_qwen_default_sections() -> None:
    """Qwen2-VL (16, 24, 24) contiguous and Qwen3-VL (24, 20, 20) interleaved at head_dim 128: the
    rule written out, and each model's default configuration read the same way as HF reads it."""
    f = torch.arange(64)
    contiguous = mrope_axes(64, [16, 24, 24], False)
    assert contiguous.tolist() == [0] * 16 + [1] * 24 + [2] * 24
    interleaved = mrope_axes(64, [24, 20, 20], True)
    expect = torch.where((f % 3 == 1) & (f < 60), 1, torch.where((f % 3 == 2) & (f < 60), 2, 0))
    assert torch.equal(interleaved, expect) and torch.bincount(interleaved).tolist() == [24, 20, 20]
    q2 = mrope_from_hf(transformers.Qwen2VLConfig(text_config=dict(hidden_size=256, num_attention_heads=2)))
    q3 = mrope_from_hf(transformers.Qwen3VLConfig(text_config=dict(hidden_size=256, num_attention_heads=2, head_dim=128)))
    assert (q2.mrope_section, q2.mrope_interleaved, q2.base) == ([16, 24, 24], False, 1e6)
    assert (q3.mrope_section, q3.mrope_interleaved, q3.base) == ([24, 20, 20], True, 5e5)
    assert posenc.build("mrope", num_heads=2, head_dim=128).mrope_section == [16, 24, 24]
    assert posenc.build("mrope", num_heads=2, head_dim=128, mrope_interleaved=True).mrope_section == [24, 20, 20]
    # and against HF at that size, for the default Qwen3-VL config
    torch.manual_seed(1)
    cfg = transformers.Qwen3VLConfig(text_config=dict(hidden_size=256, num_attention_heads=2, head_dim=128))
    positions = vision_text_positions([2, (1, 3, 3), 2])[:, None]  # (3, 1, 13)
    q = torch.randn(1, 2, 13, 128)
    (q_ref, _), _ = hf_rotation("qwen3", cfg, q, q, positions)
    assert (q3.rotate(q, q, positions, positions)[0] - q_ref).abs().max() < 1e-6


def test_text_positions_are_rope() -> None:
    """Text ids (p, p, p), given as (T,) or (3, T), rotate exactly as 1-D RoPE at p."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 9, 16), torch.randn(2, 3, 11, 16)
    qp, kp = torch.arange(2, 11), torch.arange(11)
    for interleaved, section in ((False, [2, 3, 3]), (True, [4, 2, 2]), (True, None)):
        enc = MRoPE(3, 16, base=500.0, mrope_section=section, mrope_interleaved=interleaved)
        ref = RoPE(3, 16, base=500.0).rotate(q, k, qp, kp)
        for a, b in zip(enc.rotate(q, k, qp, kp), ref):
            assert torch.equal(a, b)
        for a, b in zip(enc.rotate(q, k, qp.expand(3, -1), kp.expand(3, 2, -1)), ref):
            assert torch.equal(a, b)


def test_scores_depend_on_id_differences_only() -> None:
    torch.manual_seed(0)
    enc = MRoPE(2, 16)
    q, k = torch.randn(1, 2, 17, 16), torch.randn(1, 2, 17, 16)
    pos = vision_text_positions([3, (2, 2, 3), 2])  # (3, 17)

    def scores(p):
        qr, kr = enc.rotate(q, k, p, p)
        return qr @ kr.transpose(-1, -2)

    base = scores(pos)
    torch.testing.assert_close(scores(pos + 40), base, atol=2e-5, rtol=1e-5)
    moved = pos.clone()
    moved[2, 5] += 1  # one token one step along width
    assert (scores(moved) - base).abs().max() > 1e-3


def test_vision_text_positions_match_transformers_get_rope_index() -> None:
    """posenc's ids of a text-image-text-video-text row against Qwen2-VL's ``get_rope_index`` (a
    tiny model from a config), and Qwen2.5-VL's absolute-time temporal ids."""
    vision = dict(depth=1, embed_dim=16, hidden_size=64, num_heads=2, spatial_merge_size=2, mlp_ratio=1)
    model = hf2.Qwen2VLModel(transformers.Qwen2VLConfig(text_config=TEXT, vision_config=vision)).eval()
    segments = [3, (1, 2, 3), 4, (2, 3, 2), 2]  # an image and a two-frame video, merged grid units
    kinds = [k for s in segments for k in ([0] * s if isinstance(s, int) else [1 if s[0] == 1 else 2] * math.prod(s))]
    ids = torch.zeros(1, len(kinds), dtype=torch.long)
    ref, delta = model.get_rope_index(ids, mm_token_type_ids=torch.tensor([kinds]), image_grid_thw=torch.tensor([[1, 4, 6]]),
                                      video_grid_thw=torch.tensor([[2, 6, 4]]))
    mine = vision_text_positions(segments)
    assert torch.equal(ref[:, 0], mine)
    assert int(delta) == int(mine.max()) + 1 - mine.shape[-1] == -12  # HF's rope_deltas
    assert torch.equal(continue_positions(mine, 2), (mine.max() + 1 + torch.arange(2)).expand(3, 2))

    model = hf25.Qwen2_5_VLModel(transformers.Qwen2_5_VLConfig(text_config=TEXT, vision_config=dict(vision, tokens_per_second=2))).eval()
    segments = [2, (2, 3, 3), 2]  # two frames, one second each: temporal ids step by 2
    kinds = [0, 0] + [2] * 18 + [0, 0]
    ref, _ = model.get_rope_index(torch.zeros(1, 22, dtype=torch.long), mm_token_type_ids=torch.tensor([kinds]),
                                  video_grid_thw=torch.tensor([[2, 6, 6]]), second_per_grid_ts=torch.tensor([1.0]))
    mine = vision_text_positions(segments, temporal_step=2.0)
    assert torch.equal(ref[:, 0], mine) and mine[0, 2:20].unique().tolist() == [2, 4]


def test_text_after_a_long_video_continues_at_max_plus_one() -> None:
    """A video whose temporal ids outrun its height and width: posenc's text goes on at max(id) + 1
    (the rule of the Qwen2-VL paper and its original code); transformers 5.x's ``get_rope_index``
    restarts it at start + max(h, w), so the text reuses ids of the video's later frames. The test
    sees that difference and holds posenc to the rule."""
    mine = vision_text_positions([2, (4, 1, 2), 3])
    assert mine[:, -3:].tolist() == [[6, 7, 8]] * 3 and int(mine[:, :-3].max()) == 5
    vision = dict(depth=1, embed_dim=16, hidden_size=64, num_heads=2, spatial_merge_size=2, mlp_ratio=1)
    model = hf2.Qwen2VLModel(transformers.Qwen2VLConfig(text_config=TEXT, vision_config=vision)).eval()
    ref, _ = model.get_rope_index(torch.zeros(1, 13, dtype=torch.long), mm_token_type_ids=torch.tensor([[0, 0] + [2] * 8 + [0] * 3]),
                                  video_grid_thw=torch.tensor([[4, 2, 4]]))
    assert torch.equal(ref[:, 0, :10], mine[:, :10])  # the same up to the text after the video
    if not torch.equal(ref[:, 0], mine):
        assert ref[0, 0, -3:].tolist() == [4, 5, 6]  # overlaps the video's temporal ids 4, 5


def attend(q, k, v, q_slots, k_slots):
    """Plain causal attention by cache slot (float64 reference)."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(k_slots[None, :] > q_slots[:, None], float("-inf"))
    return s.softmax(-1) @ v


@pytest.mark.parametrize("interleaved", [False, True])
def test_decoding_carries_the_offset(interleaved: bool) -> None:
    """A prompt of text, an image and text (per-row layouts), then decoded tokens: the cached
    keys plus each new token rotated at its own ids (``continue_positions``, max(id) + 1 per row)
    equal the full pass; rotating the new tokens at their cache slots does not."""
    torch.manual_seed(0)
    enc = MRoPE(2, 16, mrope_section=[4, 2, 2] if interleaved else [2, 3, 3], mrope_interleaved=interleaved)
    prompt = torch.stack([vision_text_positions([3, (1, 3, 4), 5]), vision_text_positions([5, (2, 2, 3), 3])], dim=1)  # (3, 2, 20)
    new = 4
    positions = torch.cat([prompt, continue_positions(prompt, new)], dim=-1)  # (3, 2, 24)
    assert positions[0, :, 20].tolist() == [int(prompt[:, 0].max()) + 1, int(prompt[:, 1].max()) + 1]
    q, k, v = (torch.randn(2, 2, 24, 16, dtype=torch.float64) for _ in range(3))
    slots = torch.arange(24)
    qr, kr = enc.rotate(q, k, positions, positions)
    full = attend(qr, kr, v, slots, slots)

    def decode(ids_of):  # prompt at once, then one token at a time against a cache of rotated keys
        _, cache = enc.rotate(q[:, :, :20], k[:, :, :20], prompt, prompt)
        outs = []
        for t in range(20, 24):
            ids = ids_of(t)  # (3, 2, 1)
            qt, kt = enc.rotate(q[:, :, t:t + 1], k[:, :, t:t + 1], ids, ids)
            cache = torch.cat([cache, kt], dim=2)
            outs.append(attend(qt, cache, v[:, :, :t + 1], slots[t:t + 1], slots[:t + 1]))
        return torch.cat(outs, dim=2)

    ids = continue_positions(prompt, new)
    torch.testing.assert_close(decode(lambda t: ids[..., t - 20:t - 19]), full[:, :, 20:], atol=1e-5, rtol=1e-5)
    by_slot = decode(lambda t: torch.full((3, 2, 1), t))
    assert (by_slot - full[:, :, 20:]).abs().max() > 1e-3


def test_runs_in_a_model_as_rope_on_text() -> None:
    """Registered: an LM with mrope runs (1-D positions are text ids) and equals one with rope."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=32, dim=32, num_heads=2, depth=1)
    a = posenc.LM(posenc.LMConfig(encoding="mrope", **cfg))
    b = posenc.LM(posenc.LMConfig(encoding="rope", **cfg))
    b.load_state_dict(a.state_dict())
    tokens = torch.randint(0, 32, (2, 12))
    torch.testing.assert_close(a(tokens), b(tokens), atol=0, rtol=0)


@pytest.mark.parametrize("options,message", [
    (dict(mrope_section=[2, 3, 4]), "mrope_section must sum to head_dim/2 = 8, got [2, 3, 4] (sum 9)"),
    (dict(mrope_section=[4, 4]), "mrope_section must be 3 non-negative integers ('temporal', 'height', 'width'), got [4, 4]"),
    (dict(mrope_section=[2, -1, 7]), "mrope_section must be 3 non-negative integers"),
    (dict(mrope_section=[0, 4, 4], mrope_interleaved=True), "mrope_section [0, 4, 4] cannot be interleaved over head_dim/2 = 8 frequencies"),
    (dict(mrope_interleaved="yes"), "mrope_interleaved must be True or False, got 'yes'"),
    (dict(base=1.0), "base must be > 1, got 1.0"),
    (dict(layout="diagonal"), "layout must be one of ('half', 'interleaved'), got 'diagonal'"),
    (dict(cache_length=0), "cache_length must be a positive integer (>= 1), got 0"),
])
def test_bad_options(options: dict, message: str) -> None:
    with pytest.raises(posenc.UsageError) as err:
        posenc.build("mrope", num_heads=2, head_dim=16, **options)
    assert message in str(err.value)
    with pytest.raises(posenc.UsageError, match="mrope needs an even head_dim, got 7"):
        MRoPE(2, 7)


def test_bad_positions() -> None:
    enc = MRoPE(2, 16)
    q = torch.zeros(2, 2, 5, 16)
    ok = torch.zeros(3, 2, 5, dtype=torch.long)
    cases = [
        (torch.zeros(2, 2, 5, dtype=torch.long), "mrope: q_positions must have shape (5,), (3, 5) or (3, B, 5) with B = 2; got 2 axes, mrope has 3"),
        (torch.zeros(3, 2, 5), "mrope: q_positions must be an integer tensor, got torch.float32"),
        (torch.zeros(3, 3, 5, dtype=torch.long), "with B = 2; got shape (3, 3, 5)"),
        (torch.zeros(3, 4, dtype=torch.long), "got shape (3, 4)"),
        (torch.zeros(7, dtype=torch.long), "got shape (7,)"),
        (torch.full((3, 5), -1), "mrope: q_positions: positions must be >= 0, got -1"),
    ]
    for positions, message in cases:
        with pytest.raises(posenc.UsageError) as err:
            enc.rotate(q, q, positions, ok)
        assert message in str(err.value), str(err.value)
    with pytest.raises(posenc.UsageError, match="k has 8 features per head, but the encoding was built for head_dim=16"):
        enc.rotate(q, q[..., :8], ok, ok)
    message = r"segments: each must be a text length n >= 0 or a \(t, h, w\) grid of positive sizes, got \(1, 0, 2\)"
    with pytest.raises(posenc.UsageError, match=message):
        vision_text_positions([2, (1, 0, 2)])
    with pytest.raises(posenc.UsageError, match="temporal_step must be a number >= 0, got -1"):
        vision_text_positions([2], temporal_step=-1)
    with pytest.raises(posenc.UsageError, match=r"positions must be \(3, T\) or \(3, B, T\) with T >= 1, got shape \(5,\)"):
        continue_positions(torch.arange(5), 2)
    with pytest.raises(posenc.UsageError, match="mrope_from_hf: rope_type 'yarn' is not supported"):
        mrope_from_hf({"num_attention_heads": 2, "head_dim": 16, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})


def test_mrope_from_hf_reads_the_published_qwen2_vl_form() -> None:
    """Before: rope_type 'mrope' refused; without rope_theta the base was 10000, not 1e6."""
    from posenc.hf.rope_config import DEFAULT_THETA, mrope_from_hf

    transformers.logging.set_verbosity_error()
    hf = transformers.Qwen2VLConfig(**raw())
    ours = mrope_from_hf(raw())
    assert ours.base == hf.text_config.rope_parameters["rope_theta"] == 1e6
    assert ours.mrope_section == hf.text_config.rope_parameters["mrope_section"] == [4, 6, 6]
    assert (ours.base, ours.mrope_section, ours.head_dim) == (mrope_from_hf(hf).base, mrope_from_hf(hf).mrope_section, 32)
    for cls in (transformers.Qwen2VLTextConfig, transformers.Qwen2_5_VLTextConfig, transformers.Qwen3VLTextConfig):
        assert DEFAULT_THETA[cls.model_type] == cls.default_theta
        outer = cls.model_type.removesuffix("_text")
        assert DEFAULT_THETA[outer] == cls.default_theta
    given = mrope_from_hf(raw(rope_theta=5e4))
    assert given.base == transformers.Qwen2VLConfig(**raw(rope_theta=5e4)).text_config.rope_parameters["rope_theta"]
    with raises("mrope_from_hf: the config gives no rope_theta and model_type 'other' has no known default (known: "
                f"{sorted(DEFAULT_THETA)}); give rope_theta"):
        mrope_from_hf(raw(model_type="other"))
