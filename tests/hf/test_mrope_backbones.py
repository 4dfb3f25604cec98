"""posenc.hf on the M-RoPE text backbones (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, GLM-4V,
GLM-4.5V, GLM-OCR), each built from the census's tiny config (tests/hf_census_configs.py) with
random weights, against the untouched ``transformers`` backbone.

- ``use(model, "rope")`` *is* the untouched model (float32, 1e-4, as the census) on text-only rows
  (no ids, (B, T) ids) and on rows with an image: (3, B, T) ids as the vision tower's
  ``get_rope_index`` makes them (text equal on the three axes, an image grid at one temporal id with
  height and width ids, text going on at max + 1), alone, left-padded, in the 4-row packed form, and
  through cached greedy decoding that continues each row at its own max + 1.
- a tampered rotary module (other sections, other frequencies) is refused at use(): the check can fail.
- ALiBi, T5 and NoPE see each token at its text position (its slot): the image ids change nothing,
  cached decoding equals the full pass (also left-padded), and a text-only row under ALiBi equals
  the same weights in Qwen2 / Qwen3 (posenc's plain Llama-like path).
- what posenc cannot run there is refused at use(), naming the model type.
- the whole image-text-to-text model (Qwen2-VL, GLM-4V) with an image: posenc's attention in its
  text model only, the vision tower's left as it was; forward, cached generate and a save/load
  round trip equal the untouched model under "rope".
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

import hf_census_configs as census  # noqa: E402
import posenc.hf as phf  # noqa: E402
from hf_backbone_decoding import assert_exact, cache_name, gap, hidden  # noqa: E402
from posenc.errors import UsageError  # noqa: E402
from posenc.hf.families import family_of  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]

TYPES = ["qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text", "qwen3_vl_moe_text", "glm4v_text", "glm4v_moe_text",
         "glm_ocr_text"]
TOLERANCE = 1e-4
LENGTH = 20
#: per row: text tokens, an image grid (height, width) at one temporal id, then text to LENGTH
ROWS = [(3, (3, 4)), (6, (2, 3))]
PAD = 4  # left padding of row 0 in the padded checks


def image_ids(rows: list[tuple[int, tuple[int, int]]] = ROWS, length: int = LENGTH) -> torch.Tensor:
    """(3, B, T) M-RoPE ids of rows [text | image | text]: text ids equal on the three axes and
    counting up; the image's tokens at temporal id s (its first id) and height/width ids s + i,
    s + j of its grid (row-major); the text after it from max(id) + 1."""
    out = []
    for before, (h, w) in rows:
        t = torch.arange(before).expand(3, before)  # (3, before)
        s = before
        ii, jj = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        grid = torch.stack((torch.full((h * w,), s), s + ii.reshape(-1), s + jj.reshape(-1)))  # (3, h*w)
        start = int(grid.max()) + 1
        after = length - before - h * w
        text = (start + torch.arange(after)).expand(3, after)  # (3, after)
        out.append(torch.cat((t, grid, text), dim=1))
    return torch.stack(out, dim=1)  # (3, B, T)


def tokens(batch: int = 2, length: int = LENGTH, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, census.VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


_BUILT: dict[str, torch.nn.Module] = {}


def untouched(model_type: str) -> torch.nn.Module:
    """The census's tiny backbone (bare text model), every weight moved off its init; a fresh copy."""
    if model_type not in _BUILT:
        model = census.build(census.Case(model_type, "backbone"))
        if family_of(model_type).window == "none":
            # The census's tiny sliding_window lands in a config whose attention never slides (Qwen3-VL-MoE's):
            # transformers' DynamicCache then keeps only the last keys, and the untouched model's own cached
            # decoding drops keys its full pass attends to. The real configs leave it None.
            model.config.sliding_window = None
        _BUILT[model_type] = model
    return copy.deepcopy(_BUILT[model_type])




def padded(pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row 0 left-padded by PAD slots: (its ids shifted right, pads at id 1 as get_rope_index puts
    them; the mask (B, T))."""
    pos = pos.clone()
    row = image_ids([(ROWS[0][0], ROWS[0][1])], LENGTH - PAD)[:, 0]  # (3, T - PAD)
    pos[:, 0] = torch.cat((torch.ones(3, PAD, dtype=torch.long), row), dim=1)
    mask = torch.ones(2, LENGTH, dtype=torch.long)
    mask[0, :PAD] = 0
    return pos, mask


# -- use(model, "rope") is the untouched model -------------------------------------------------------


@pytest.mark.parametrize("model_type", TYPES)
def test_rope_equals_the_untouched_backbone(model_type: str) -> None:
    ref = untouched(model_type)
    model = phf.use(untouched(model_type), "rope")
    ids, pos = tokens(), image_ids()
    assert (pos[1] != pos[0]).any() and (pos[2] != pos[1]).any()  # the image rows differ on every axis
    text = torch.arange(LENGTH).expand(2, LENGTH)
    forms: list[dict] = [{}, {"position_ids": text}, {"position_ids": pos}, {"position_ids": torch.cat((text[None], pos))}]
    assert_exact(model, ref, ids, pos, forms, padded(pos), TOLERANCE)


def test_a_rotary_module_otherwise_than_its_config_is_refused() -> None:
    """The M-RoPE check compares the model's own tables with posenc's read from the config."""
    model = untouched("qwen2_vl_text")
    model.rotary_emb.mrope_section = [3, 3, 2]  # the config says [2, 3, 3]
    with pytest.raises(UsageError, match="'qwen2_vl_text'.*rotates otherwise than posenc's mrope"):
        phf.use(model, "rope")
    model = untouched("qwen3_vl_text")
    model.rotary_emb.inv_freq.mul_(1.01)
    with pytest.raises(UsageError, match="differs from the model's rotary module"):
        phf.use(model, "rope")
    model = untouched("glm4v_text")
    model.rotary_emb.attention_scaling = 0.5
    with pytest.raises(UsageError, match="'glm4v_text'.*rotates otherwise"):
        phf.use(model, "rope")


# -- other encodings: at the text positions ----------------------------------------------------------


@pytest.mark.parametrize("model_type", TYPES)
@pytest.mark.parametrize("encoding", ["alibi", "t5", "nope"])
def test_other_encodings_see_text_positions(model_type: str, encoding: str) -> None:
    model = phf.use(untouched(model_type), encoding)
    ids, pos = tokens(), image_ids()
    full = hidden(model, ids, position_ids=pos)
    # an image token sits at its slot: the 3-axis ids change nothing, as the slots given as (B, T) ids
    assert gap(full, hidden(model, ids)) < 1e-5
    assert gap(full, hidden(model, ids, position_ids=torch.arange(LENGTH).expand(2, LENGTH))) < 1e-5
    # cached decoding (teacher-forced) equals the full pass, unpadded and left-padded
    ppos, mask = padded(pos)
    cut = 14
    name = cache_name(model)
    for p, m in ((pos, None), (ppos, mask)):
        whole = hidden(model, ids, position_ids=p, attention_mask=m)
        with torch.no_grad():
            out = model(ids[:, :cut], position_ids=p[..., :cut], attention_mask=None if m is None else m[:, :cut],
                        use_cache=True)
            steps = []
            for i in range(cut, LENGTH):
                held = out.cache if name == "cache" else out.past_key_values
                out = model(ids[:, i:i + 1], position_ids=p[..., i:i + 1], use_cache=True,
                            attention_mask=None if m is None else m[:, :i + 1], **{name: held})
                steps.append(out.last_hidden_state)
        assert gap(torch.cat(steps, dim=1), whole[:, cut:]) < TOLERANCE, (p is pos)
        if m is not None:  # the padded row's real tokens equal that row alone
            alone = hidden(model, ids[:1, PAD:], position_ids=p[:, :1, PAD:])
            assert gap(whole[0, PAD:], alone[0]) < TOLERANCE


@pytest.mark.parametrize("model_type,plain", [("qwen2_vl_text", "qwen2"), ("qwen3_vl_text", "qwen3")])
def test_alibi_on_a_text_row_equals_the_plain_family(model_type: str, plain: str) -> None:
    """The same weights in the plain text family (posenc's exact Qwen2 / Qwen3 rows) under ALiBi:
    a text-only row gives the same hidden states."""
    ref = untouched(model_type)
    text = ref.config
    config = transformers.AutoConfig.for_model(
        plain, vocab_size=text.vocab_size, hidden_size=text.hidden_size, intermediate_size=text.intermediate_size,
        num_hidden_layers=text.num_hidden_layers, num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads, head_dim=getattr(text, "head_dim", None) or 16,
        rms_norm_eps=text.rms_norm_eps, attention_bias=getattr(text, "attention_bias", False))
    other = transformers.AutoModel.from_config(config).eval()
    missing, unexpected = other.load_state_dict(ref.state_dict(), strict=False)
    assert not missing and all("inv_freq" in k for k in unexpected), (missing, unexpected)
    a, b = phf.use(ref, "alibi"), phf.use(other, "alibi")
    ids = tokens()
    assert gap(hidden(a, ids, position_ids=image_ids()), hidden(b, ids)) < TOLERANCE


@pytest.mark.parametrize("model_type", ["qwen2_vl_text", "glm4v_moe_text"])
def test_what_posenc_cannot_run_there_is_refused(model_type: str) -> None:
    model = untouched(model_type)
    before = hidden(model, tokens(), position_ids=image_ids())
    for encoding, options in (("rope", {"base": 1e4}), ("mrope", {}), ("string", {}), ("sinusoidal", {}),
                              ("2x[rope base=10000]", {})):
        with pytest.raises(UsageError, match=f"'{model_type}' is an M-RoPE backbone"):
            phf.use(model, encoding, **options)
    assert torch.equal(hidden(model, tokens(), position_ids=image_ids()), before)  # left as it was


# -- posenc's M-RoPE with partial rotation, and the config reader -------------------------------------


def test_mrope_reads_partial_rotation_and_glm_pairs() -> None:
    """mrope_from_hf on the GLM configs: GLM-4V's interleaved pairs, GLM-4.5V's half pairs over the
    first int(D * partial_rotary_factor) features; a partial MRoPE passes the other features through."""
    from posenc.encodings.mrope import MRoPE
    from posenc.hf.rope_config import mrope_from_hf

    dense, moe = (mrope_from_hf(census.tiny_config(t)) for t in ("glm4v_text", "glm4v_moe_text"))
    assert (dense.layout, dense.rotary_dim, dense.mrope_section) == ("interleaved", 16, [2, 3, 3])
    assert (moe.layout, moe.rotary_dim, moe.mrope_section) == ("half", 8, [1, 1, 2])
    x = torch.randn(1, 2, 5, 16)
    pos = image_ids([(1, (2, 2))], 5)[:, 0]  # (3, T)
    q, _ = moe.rotate(x, x, pos, pos)
    assert torch.equal(q[..., 8:], x[..., 8:]) and not torch.allclose(q[..., :8], x[..., :8])
    with pytest.raises(UsageError, match="rotary_dim must be an even integer"):
        MRoPE(2, 16, rotary_dim=7, mrope_section=[1, 1, 1])
    with pytest.raises(UsageError, match="sum to rotary_dim/2 = 4"):
        MRoPE(2, 16, rotary_dim=8, mrope_section=[2, 3, 3])


# -- the whole image-text-to-text model: its vision tower keeps its own attention --------------------


def _vision_language(model_type: str) -> tuple[torch.nn.Module, torch.Tensor, dict]:
    """A tiny image-text-to-text model (the census's tiny keys, sections fitting the tiny head, image
    tokens inside the tiny vocabulary) and a row [text | vision start | image | text] with one
    4 x 4-patch image (merged to 2 x 2 tokens), with what its forward takes."""
    config = census.tiny_config(model_type)
    text = config.text_config
    text.rope_parameters = {**text.rope_parameters, "mrope_section": [3, 3, 2] if model_type.startswith("qwen3") else [2, 3, 3]}
    config.image_token_id, config.vision_start_token_id = 5, 6
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(config).eval()
    vision = config.vision_config
    p, merge = vision.patch_size, vision.spatial_merge_size
    channels = getattr(vision, "in_channels", None) or getattr(vision, "in_chans", 3)
    pixels = torch.randn(16, channels * vision.temporal_patch_size * p * p, generator=torch.Generator().manual_seed(2))
    image = 16 // (merge * merge)
    ids = torch.cat((tokens(1, 3, seed=3) + 7, torch.tensor([[6]]), torch.full((1, image), 5), tokens(1, 5, seed=4) + 7), 1)
    ids = ids.clamp(max=census.VOCAB - 1)
    inputs = {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, 4, 4]]), "mm_token_type_ids": (ids == 5).long()}
    return model, ids, inputs


@pytest.mark.parametrize("model_type", ["qwen2_vl", "glm4v"])
def test_the_whole_model_runs_an_image(model_type: str, tmp_path) -> None:
    """use() on the image-text-to-text model: posenc's attention in its text model only (the vision
    tower's attention is left as it was), so an image forward and cached generation equal the
    untouched model's under "rope", and run under ALiBi; saved and loaded, the same."""
    ref, ids, inputs = _vision_language(model_type)
    model = phf.use(copy.deepcopy(ref), "rope")
    assert model.config.text_config._attn_implementation == "posenc"
    assert model.config.vision_config._attn_implementation == ref.config.vision_config._attn_implementation
    with torch.no_grad():
        expected = ref(ids, **inputs).logits
        assert gap(model(ids, **inputs).logits, expected) < TOLERANCE
        steps = {"max_new_tokens": 3, "do_sample": False}
        assert torch.equal(model.generate(ids, **inputs, **steps), ref.generate(ids, **inputs, **steps))
        alibi = phf.use(copy.deepcopy(ref), "alibi")
        assert gap(alibi(ids, **inputs).logits, expected) > 1e-3  # posenc's attention runs in the text model
    model.save_pretrained(tmp_path)
    loaded = phf.from_pretrained(transformers.AutoModelForImageTextToText, tmp_path).eval()
    assert loaded.config.vision_config._attn_implementation != "posenc"
    with torch.no_grad():
        assert gap(loaded(ids, **inputs).logits, expected) < TOLERANCE
