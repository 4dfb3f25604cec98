"""Positions with an axis dimension through ``posenc.attend``, ``posenc.Attention``, the KV cache
and the LM: M-RoPE's (3, B, T) ids of an image then text against transformers' own Qwen2-VL
position ids (``get_rope_index``) and rotation, axial RoPE and RoPE-Mixed on (T, 2) / (B, T, 2)
patch grids against timm's rotations, each followed by plain softmax attention in float64 (the
references here); cached decoding whose rows continue at their own max(id) + 1; the masks reading
the sequence index; shape errors naming the argument; invariants (text ids are RoPE)."""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from models import tiny_lm
from posenc.encodings.axial_rope import patch_positions
from posenc.encodings.mrope import continue_positions, vision_text_positions
from posenc.hf.rope_config import mrope_from_hf
from posenc.model.cache import LayerCache

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_vl import modeling_qwen2_vl as hf2  # noqa: E402
from transformers.models.qwen3_vl import modeling_qwen3_vl as hf3  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = dict(hidden_size=64, num_attention_heads=2, head_dim=32, num_key_value_heads=1, num_hidden_layers=1,
            intermediate_size=32, vocab_size=64)
VISION = dict(depth=1, embed_dim=16, hidden_size=64, num_heads=2, spatial_merge_size=2, mlp_ratio=1)

# Two rows of 14 tokens: 3 text, a 2 x 3 image (merged patches), 5 text; and 1 text, a 2 x 4 image,
# 5 text. Qwen2-VL's ids (temporal, height, width), written out: the image starts at s = the next
# id, its patches at (s, s + row, s + column), the text after it at max(id) + 1.
ROW0 = [[0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7, 8, 9, 10],
        [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7, 8, 9, 10],
        [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8, 9, 10]]
ROW1 = [[0, 1, 1, 1, 1, 1, 1, 1, 1, 5, 6, 7, 8, 9],
        [0, 1, 1, 1, 1, 2, 2, 2, 2, 5, 6, 7, 8, 9],
        [0, 1, 2, 3, 4, 1, 2, 3, 4, 5, 6, 7, 8, 9]]
NEXT = [11, 10]  # max(id) + 1 per row: where the text after the prompt goes on (cache slot 14)


def prompt_ids() -> torch.Tensor:
    return torch.tensor([ROW0, ROW1]).transpose(0, 1)  # (3, 2, 14)


def qwen_config(family: str, **rope):
    config = transformers.Qwen2VLConfig if family == "qwen2" else transformers.Qwen3VLConfig
    return config(text_config=dict(TEXT, rope_parameters=dict(rope_type="default", **rope)), vision_config=VISION)


def hf_rotate(family: str, config, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
    """transformers' own M-RoPE: the model's rotary embedding (its frequency recomposition) and
    ``apply_rotary_pos_emb``."""
    module, rotary = (hf2, hf2.Qwen2VLRotaryEmbedding) if family == "qwen2" else (hf3, hf3.Qwen3VLTextRotaryEmbedding)
    cos, sin = rotary(config.text_config)(q, positions)  # (B, T, D)
    return module.apply_rotary_pos_emb(q, k, cos, sin)


def plain(q, k, v, causal=True, q_slots=None, k_slots=None, window=None, real=None):
    """softmax(q k^T / sqrt(D) + mask) v in q's dtype (float64 here), key/value heads repeated;
    the mask by sequence index (slots), ``real`` (B, Tk) hides padding keys."""
    tq, tk = q.shape[-2], k.shape[-2]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    q_slots = torch.arange(tk - tq, tk) if q_slots is None else q_slots
    k_slots = torch.arange(tk) if k_slots is None else k_slots
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, Tq, Tk)
    hide = torch.zeros(tq, tk, dtype=torch.bool)
    if causal:
        hide |= k_slots[None, :] > q_slots[:, None]
    if window is not None:
        hide |= k_slots[None, :] <= q_slots[:, None] - window
    hide = hide[None, None]
    if real is not None:
        hide = hide | ~real[:, None, None, :]
    return s.masked_fill(hide, float("-inf")).softmax(-1) @ v


def rand(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def test_qwen2_vl_get_rope_index_gives_the_written_ids() -> None:
    """The ids above are what transformers' Qwen2-VL computes for these rows (a model built from a
    config, random weights, nothing downloaded), and so is each row's offset (``rope_deltas``)."""
    model = hf2.Qwen2VLModel(qwen_config("qwen2", rope_theta=1e4, mrope_section=[4, 6, 6])).eval()
    kinds = torch.tensor([[0] * 3 + [1] * 6 + [0] * 5, [0] + [1] * 8 + [0] * 5])
    ids, delta = model.get_rope_index(torch.zeros(2, 14, dtype=torch.long), mm_token_type_ids=kinds,
                                      image_grid_thw=torch.tensor([[1, 4, 6], [1, 4, 8]]))  # pre-merge grids
    assert torch.equal(ids, prompt_ids())
    assert delta.view(-1).tolist() == [n - 14 for n in NEXT]
    rows = torch.stack([vision_text_positions([3, (1, 2, 3), 5]), vision_text_positions([1, (1, 2, 4), 5])], dim=1)
    assert torch.equal(rows, prompt_ids())
    assert continue_positions(prompt_ids(), 1)[0, :, 0].tolist() == NEXT


@pytest.mark.parametrize("family,rope", [
    ("qwen2", dict(rope_theta=1e6, mrope_section=[4, 6, 6])),
    ("qwen3", dict(rope_theta=5e5, mrope_section=[6, 5, 5], mrope_interleaved=True)),
])
def test_mrope_attend_equals_transformers_rotation_and_plain_attention(family: str, rope: dict) -> None:
    """posenc.attend at (3, B, T) ids (grouped key heads, causal, and with a sliding window by
    sequence index) equals transformers' rotation + softmax attention in float64."""
    config = qwen_config(family, **rope)
    enc = mrope_from_hf(config)
    ids = prompt_ids()
    q, k, v = rand(2, 2, 14, 32), rand(2, 1, 14, 32), rand(2, 1, 14, 32)
    qr, kr = hf_rotate(family, config, q, k, ids)
    for window in (None, 4):
        got = posenc.attend(q, k, v, enc, positions=ids, window=window)
        want = plain(qr, kr, v, window=window)
        assert (got - want).abs().max() < 1e-5, window
    # the rotation is really at the ids: the same call at the sequence index differs
    assert (posenc.attend(q, k, v, enc) - plain(qr, kr, v)).abs().max() > 1e-3
    # a cached call as transformers makes one: 3 new queries against all 14 keys, each at its ids
    got = posenc.attend(q[:, :, 11:], k, v, enc, positions=ids[..., 11:], k_positions=ids)
    assert (got - plain(qr[:, :, 11:], kr, v)).abs().max() < 1e-5


def test_mrope_attention_module_equals_transformers_rotation() -> None:
    """posenc.Attention (projections, grouped key heads) at (3, B, T) ids against the same
    projections, transformers' rotation and plain attention."""
    config = qwen_config("qwen2", rope_theta=1e6, mrope_section=[4, 6, 6])
    attn = posenc.Attention(64, 2, mrope_from_hf(config), num_kv_heads=1).double()
    x = rand(2, 14, 64)
    q, k, v = attn.qkv(x).split((64, 32, 32), dim=-1)
    q, k, v = q.view(2, 14, 2, 32).transpose(1, 2), k.view(2, 14, 1, 32).transpose(1, 2), v.view(2, 14, 1, 32).transpose(1, 2)
    qr, kr = hf_rotate("qwen2", config, q, k, prompt_ids())
    want = attn.proj(plain(qr, kr, v).transpose(1, 2).reshape(2, 14, 64))
    with torch.no_grad():
        assert (attn(x, prompt_ids()) - want).abs().max() < 1e-5


@pytest.mark.parametrize("name", ["axial_rope", "rope_mixed"])
def test_patch_grid_attend_equals_timm_rotation_and_plain_attention(timm_sincos, name: str) -> None:
    """(T, 2) for every row and (B, T, 2) per row (a 2 x 3 and a 3 x 2 grid), bidirectional,
    through posenc.attend and posenc.Attention, against timm's ``RotaryEmbeddingCat`` /
    ``RotaryEmbeddingMixed`` rotation (``grid_indexing="xy"``: (x, y) = (column, row)) + plain
    attention in float64."""
    heads, d = 2, 16
    if name == "axial_rope":
        ref = timm_sincos.RotaryEmbeddingCat(dim=d, in_pixels=False, temperature=100.0, grid_indexing="xy")
        enc = posenc.build(name, num_heads=heads, head_dim=d, causal=False)
    else:
        ref = timm_sincos.RotaryEmbeddingMixed(dim=heads * d, depth=1, num_heads=heads, temperature=10.0, grid_indexing="xy")
        enc = posenc.build(name, num_heads=heads, head_dim=d, causal=False)
        with torch.no_grad():
            enc.frequencies.copy_(ref.freqs[:, 0])

    def timm_rotate(x, h, w):
        embed = ref.get_embed([h, w])
        return timm_sincos.apply_rot_embed_cat(x, embed if name == "axial_rope" else embed[0])

    q, k, v = rand(2, heads, 6, d), rand(2, heads, 6, d), rand(2, heads, 6, d)
    shared = patch_positions(2, 3)  # (6, 2)
    want = plain(timm_rotate(q, 2, 3), timm_rotate(k, 2, 3), v, causal=False)
    assert (posenc.attend(q, k, v, enc, positions=shared, causal=False) - want).abs().max() < 1e-5
    rows = torch.stack([patch_positions(2, 3), patch_positions(3, 2)])  # (2, 6, 2)
    grids = [(2, 3), (3, 2)]
    want = torch.cat([plain(timm_rotate(q[b:b + 1], *g), timm_rotate(k[b:b + 1], *g), v[b:b + 1], causal=False)
                      for b, g in enumerate(grids)])
    assert (posenc.attend(q, k, v, enc, positions=rows, causal=False) - want).abs().max() < 1e-5
    assert (posenc.attend(q, k, v, enc, positions=shared.expand(2, 6, 2), causal=False) - want).abs().max() > 1e-3
    # posenc.Attention: its projections, then the same reference
    attn = posenc.Attention(heads * d, heads, enc, causal=False).double()
    x = rand(2, 6, heads * d)
    q, k, v = (t.view(2, 6, heads, d).transpose(1, 2) for t in attn.qkv(x).split(heads * d, dim=-1))
    want = torch.cat([plain(timm_rotate(q[b:b + 1], *g), timm_rotate(k[b:b + 1], *g), v[b:b + 1], causal=False)
                      for b, g in enumerate(grids)])
    with torch.no_grad():
        got = attn(x, rows)
    assert (got - attn.proj(want.transpose(1, 2).reshape(2, 6, -1))).abs().max() < 1e-5


def lm(encoding: str = "mrope", **config) -> posenc.LM:
    """The tests' tiny LM (tests/models.py) in float64, weights redrawn large enough that a wrong
    rotation shows far above rounding."""
    return tiny_lm(encoding, vocab_size=32, num_heads=2, weights_std=0.3, **config).double()


def test_cached_decoding_with_per_row_offsets_equals_the_full_pass() -> None:
    """Two rows with images of different sizes, then text: a prefill (whole, or in two chunks) at
    the (3, B, T) ids, then steps without positions (each row goes on at its own max(id) + 1, not
    at the cache slot 14) or with the new token's (3, B, 1) ids, equal the full pass; crop and
    continue too. The full pass at the slots instead differs (the test can fail)."""
    model = lm()
    tokens = torch.randint(0, 32, (2, 18))
    ids = torch.cat([prompt_ids(), continue_positions(prompt_ids(), 4)], dim=-1)  # (3, 2, 18)
    assert ids[0, :, 14].tolist() == NEXT
    with torch.no_grad():
        full = model(tokens, positions=ids)
        for chunks, explicit in (([14], False), ([5, 9], False), ([14], True)):
            cache = model.new_cache(2)
            parts, at = [], 0
            for n in chunks:
                parts.append(model(tokens[:, at:at + n], cache=cache, positions=ids[..., at:at + n]))
                at += n
            assert cache.next_positions().tolist() == NEXT
            for t in range(14, 18):
                parts.append(model(tokens[:, t:t + 1], cache=cache, positions=ids[..., t:t + 1] if explicit else None))
            assert (torch.cat(parts, dim=1) - full).abs().max() < 1e-10, (chunks, explicit)
            assert cache.next_positions().tolist() == [n + 4 for n in NEXT]
        cache.crop(15)  # forget the last three; the next ids are the prefix's
        assert cache.next_positions().tolist() == [n + 1 for n in NEXT]
        again = torch.cat([model(tokens[:, t:t + 1], cache=cache) for t in range(15, 18)], dim=1)
        assert (again - full[:, 15:]).abs().max() < 1e-10
        slots = torch.cat([prompt_ids(), torch.arange(14, 18).expand(3, 2, 4)], dim=-1)
        assert (model(tokens, positions=slots)[:, 14:] - full[:, 14:]).abs().max() > 1e-6


def test_windowed_cache_decoding_with_axis_ids_equals_the_full_pass() -> None:
    """Sliding-window layers keep O(W) keys and count the window in tokens (cache slots): decoding
    18 tokens one at a time after a prefill at (3, B, T) ids equals the full pass."""
    model = lm(schedule="2x[mrope window=5]")
    tokens = torch.randint(0, 32, (2, 32))
    ids = torch.cat([prompt_ids(), continue_positions(prompt_ids(), 18)], dim=-1)  # (3, 2, 32)
    with torch.no_grad():
        full = model(tokens, positions=ids)
        cache = model.new_cache(2)
        parts = [model(tokens[:, :14], cache=cache, positions=ids[..., :14])]
        parts += [model(tokens[:, t:t + 1], cache=cache) for t in range(14, 32)]
    assert cache.layers[0].start > 0 and cache.next_positions().tolist() == [n + 18 for n in NEXT]
    assert (torch.cat(parts, dim=1) - full).abs().max() < 1e-10


def test_attention_with_a_layer_cache_carries_each_rows_offset_past_its_padding() -> None:
    """posenc.Attention with a LayerCache: row 1 left-padded by 6 (its padding given id 99, which
    must not count), prefill at (3, B, T), then steps without positions: each row equals itself
    run alone, and the cache's next ids are the rows' max(id) + 1 over their real tokens."""
    attn = posenc.Attention(32, 2, posenc.build("mrope", num_heads=2, head_dim=16)).double()
    first = vision_text_positions([3, (1, 2, 3), 5])  # (3, 14)
    second = vision_text_positions([1, (1, 2, 2), 3])  # (3, 8)
    padded = torch.cat([torch.full((3, 6), 99), second], dim=-1)  # (3, 14)
    ids = torch.stack([first, padded], dim=1)  # (3, 2, 14)
    x = rand(2, 17, 32)
    with torch.no_grad():
        cache = LayerCache(padding=[0, 6])
        both = [attn(x[:, :14], ids, cache)]
        assert cache.next_positions().tolist() == [11, 6]
        both += [attn(x[:, t:t + 1], None, cache) for t in range(14, 17)]
        both = torch.cat(both, dim=1)
        for b, row, pad in ((0, first, 0), (1, second, 6)):
            alone = LayerCache()
            out = [attn(x[b:b + 1, pad:14], row, alone)] + [attn(x[b:b + 1, t:t + 1], None, alone) for t in range(14, 17)]
            assert (torch.cat(out, dim=1) - both[b:b + 1, pad:]).abs().max() < 1e-10, b
        full = attn(x[1:, 6:], torch.cat([second, continue_positions(second, 3)], dim=-1))
        assert (full - both[1:, 6:]).abs().max() < 1e-10


def test_masks_read_the_sequence_index() -> None:
    """With ids that do not increase (an image), causal attention still follows the order of the
    tokens; a padded batch equals each row alone; packed documents equal each document alone;
    a window counts tokens, not ids."""
    enc = posenc.build("mrope", num_heads=2, head_dim=16)
    ids = vision_text_positions([2, (1, 2, 3), 3])  # (3, 11)
    q, k, v = rand(2, 2, 11, 16), rand(2, 2, 11, 16), rand(2, 2, 11, 16)
    qr, kr = enc.rotate(q, k, ids, ids)
    assert (posenc.attend(q, k, v, enc, positions=ids) - plain(qr, kr, v)).abs().max() < 1e-6
    assert (posenc.attend(q, k, v, enc, positions=ids, window=3) - plain(qr, kr, v, window=3)).abs().max() < 1e-6
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, :4] = False  # row 1: 4 tokens of left padding, its 7 real tokens at ids[:, :7]
    rows = torch.stack([ids, torch.cat([torch.zeros(3, 4, dtype=torch.long), ids[:, :7]], dim=-1)], dim=1)
    got = posenc.attend(q, k, v, enc, positions=rows, key_padding_mask=mask)
    alone = posenc.attend(q[1:, :, 4:], k[1:, :, 4:], v[1:, :, 4:], enc, positions=ids[:, :7])
    assert (got[1:, :, 4:] - alone).abs().max() < 1e-6 and got[1, :, :4].abs().max() == 0
    docs = torch.tensor([[0] * 5 + [1] * 6] * 2)
    packed_ids = torch.cat([vision_text_positions([1, (1, 2, 2)]), vision_text_positions([(1, 2, 3)])], dim=-1)  # restarts
    got = posenc.attend(q, k, v, enc, positions=packed_ids, document_ids=docs)
    for a, b, p in ((0, 5, packed_ids[:, :5]), (5, 11, packed_ids[:, 5:])):
        alone = posenc.attend(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], enc, positions=p)
        assert (got[:, :, a:b] - alone).abs().max() < 1e-6


def test_text_ids_on_every_axis_are_rope() -> None:
    """Invariants: (3, B, T) ids equal on every axis (text only) give 1-D RoPE at those positions,
    through attend (per-row offsets), the LM and cached decoding; the diagonal (p, p) of a patch
    grid is 1-D axial RoPE at p; a shift of every id of a row changes nothing."""
    mrope = posenc.build("mrope", num_heads=2, head_dim=16)
    rope = posenc.build("rope", num_heads=2, head_dim=16)
    q, k, v = rand(2, 2, 9, 16), rand(2, 2, 9, 16), rand(2, 2, 9, 16)
    rows = torch.stack([torch.arange(9), torch.arange(30, 39)])  # (B, T)
    want = posenc.attend(q, k, v, rope, positions=rows)
    assert (posenc.attend(q, k, v, mrope, positions=rows.expand(3, 2, 9)) - want).abs().max() < 1e-6
    assert (posenc.attend(q, k, v, mrope, positions=rows.expand(3, 2, 9) + 7) - want).abs().max() < 1e-6
    axial = posenc.build("axial_rope", num_heads=2, head_dim=16)
    diagonal = torch.arange(3, 12)[:, None].expand(9, 2)  # (T, 2)
    torch.testing.assert_close(posenc.attend(q, k, v, axial, positions=diagonal),
                               posenc.attend(q, k, v, axial, positions=torch.arange(3, 12)), atol=1e-6, rtol=0)
    a, b = lm("mrope"), lm("rope")
    b.load_state_dict(a.state_dict())
    tokens = torch.randint(0, 32, (2, 12))
    text = torch.arange(12).expand(3, 2, 12)
    with torch.no_grad():
        want = b(tokens)
        assert (a(tokens, positions=text) - want).abs().max() < 1e-10
        cache = a.new_cache(2)
        out = [a(tokens[:, :8], cache=cache, positions=text[..., :8])] + [a(tokens[:, t:t + 1], cache=cache) for t in range(8, 12)]
        assert (torch.cat(out, dim=1) - want).abs().max() < 1e-10


def test_wrong_shapes_raise_naming_positions() -> None:
    enc = posenc.build("mrope", num_heads=2, head_dim=16)
    q = torch.zeros(2, 2, 5, 16)
    forms = "(5,) or (2, 5) (one position per token) or (3, 5), (3, B, 5) with B = 1 or 2 (3 ids per token for mrope, axis first)"
    cases = [
        (dict(positions=torch.zeros(2, 2, 5, dtype=torch.long)), f"positions must have shape {forms}, got (2, 2, 5)"),
        (dict(positions=torch.zeros(3, 3, 5, dtype=torch.long)), f"positions must have shape {forms}, got (3, 3, 5)"),
        (dict(positions=torch.zeros(3, 4, dtype=torch.long)), f"positions must have shape {forms}, got (3, 4)"),
        (dict(positions=torch.zeros(3, 2, 5, 1, dtype=torch.long)), "got (3, 2, 5, 1)"),
        (dict(positions=torch.zeros(3, 2, 5)), f"positions must be an integer tensor of shape {forms}, got a 3-D float32 tensor"),
        (dict(positions=torch.full((3, 2, 5), -1)), "positions must be >= 0, got -1"),
        (dict(positions=torch.zeros(3, 2, 5, dtype=torch.long), k_positions=torch.zeros(3, 2, 4, dtype=torch.long)),
         "k_positions must have shape (5,) or (2, 5) (one position per token) or (3, 5), (3, B, 5)"),
        (dict(positions=torch.zeros(3, 2, 5, dtype=torch.long), k_positions=torch.arange(5)),
         "positions and k_positions must both have the axis dimension, or neither"),
    ]
    for kwargs, message in cases:
        with pytest.raises(posenc.UsageError) as err:
            posenc.attend(q, q, q, enc, **kwargs)
        assert message in str(err.value), str(err.value)
    with pytest.raises(posenc.UsageError, match=r"k_positions \(the keys' ids, with the axis dimension\) are needed"):
        posenc.attend(q[:, :, 3:], q, q, enc, positions=torch.zeros(3, 2, 2, dtype=torch.long))
    three = torch.zeros(3, 2, 5, 16)  # a batch of 3: (3, 5) reads as 3 rows and as 3 axes
    with pytest.raises(posenc.UsageError, match=r"positions of shape \(3, 5\) is ambiguous for mrope: 3 rows of one position per "
                                                r"token, or 3 ids per token for every row; give them per row, shape \(3, B, 5\)"):
        posenc.attend(three, three, three, enc, positions=torch.zeros(3, 5, dtype=torch.long))
    grid = posenc.build("axial_rope", num_heads=2, head_dim=16)
    with pytest.raises(posenc.UsageError, match=r"positions must have shape \(5,\) or \(2, 5\) \(one position per token\) or "
                                                r"\(5, 2\), \(B, 5, 2\) with B = 1 or 2 \(2 ids per token for axial_rope, axis last\), got \(5, 3\)"):
        posenc.attend(q, q, q, grid, positions=torch.zeros(5, 3, dtype=torch.long))
    # methods that read one position per token refuse ids with an axis dimension, naming positions
    for name in ("rope", "t5", "alibi", "shaw"):
        other = posenc.build(name, num_heads=2, head_dim=16)
        with pytest.raises(posenc.UsageError, match=rf"positions must have shape \(5,\) or \(batch, 5\) = \(2, 5\), got \(3, 2, 5\) "
                                                    rf"\({name} reads one position per token"):
            posenc.attend(q, q, q, other, positions=torch.zeros(3, 2, 5, dtype=torch.long))
        with pytest.raises(posenc.UsageError, match=rf"cannot be read by {name}, which reads one position per token"):
            posenc.attend(q, q, q, other, geometry=posenc.Geometry.of(2, 5, 5, positions=torch.zeros(3, 2, 5, dtype=torch.long),
                                                                      encoding=enc))


def test_decoding_after_axis_ids_refuses_slots_and_other_layers_refuse_axes() -> None:
    """Once a cache has seen ids with an axis dimension, 1-D positions (cache slots) are refused
    (never silently the slot); a model whose other layers read 1-D positions (T5) refuses the
    ids, one whose other layers read none (NoPE) takes them; a 1-D step before any ids continues
    the slots as RoPE."""
    model = lm()
    tokens = torch.randint(0, 32, (2, 16))
    with torch.no_grad():
        cache = model.new_cache(2)
        model(tokens[:, :14], cache=cache, positions=prompt_ids())
        with pytest.raises(posenc.UsageError, match=r"positions: this cache continues positions with an axis dimension .* cache slots "
                                                    r"14\.\.14"):
            model(tokens[:, 14:15], cache=cache, positions=torch.tensor([14]))
        with pytest.raises(posenc.UsageError, match=r"positions must have shape \(1,\) or \(2, 1\) \(one position per token\) or "
                                                    r"\(3, 1\), \(3, B, 1\) with B = 1 or 2"):
            model(tokens[:, 14:15], cache=cache, positions=torch.zeros(3, 2, 2, dtype=torch.long))
        assert cache.length == 14 and cache.next_positions().tolist() == NEXT
        fresh = model.new_cache(2)
        model(tokens[:, :3], cache=fresh, positions=torch.arange(3))  # 1-D, continuing the slots
        assert fresh.next_positions() is None
        model(tokens[:, 3:5], cache=fresh, positions=torch.arange(3, 5).expand(3, 2, 2) + torch.tensor([[0], [4]]))
        assert fresh.next_positions().tolist() == [5, 9]
    rope = lm("rope")
    with torch.no_grad(), pytest.raises(posenc.UsageError, match=r"with a KV cache, positions must be 1-D \(1,\), continuing the cache at "
                                                                r"0, got shape \(3, 2, 1\) \(rope reads one position per token"):
        rope(tokens[:, :1], cache=rope.new_cache(2), positions=torch.zeros(3, 2, 1, dtype=torch.long))
    mixed = lm(schedule="1x[mrope] 1x[t5]")
    with pytest.raises(posenc.UsageError, match=r"positions with an axis dimension \(3 ids per token\) cannot be read by t5, which reads "
                                                r"one position per token \(position_axes = 1\)"):
        mixed(tokens[:, :14], positions=prompt_ids())
    with_nope = lm(schedule="1x[nope] 1x[mrope]")
    assert with_nope.position_encoding is with_nope.blocks[1].attn.encoding
    assert torch.isfinite(with_nope(tokens[:, :14], positions=prompt_ids())).all()
    with pytest.raises(posenc.UsageError, match=r"read different numbers of position axes \(\[\(2, False\), \(3, True\)\]\)"):
        lm(schedule="1x[mrope] 1x[axial_rope]")


def test_declared_axes() -> None:
    """Every registered method declares how many ids per token it reads; only the multi-axis
    rotations read more than one."""
    many = {}
    for name in posenc.available():
        enc = posenc.build(name, num_heads=2, head_dim=16)
        if enc.position_axes != 1:
            many[name] = (enc.position_axes, enc.axis_first)
    assert many == {"mrope": (3, True), "axial_rope": (2, False), "rope_mixed": (2, False), "xdrope": (4, True)}
