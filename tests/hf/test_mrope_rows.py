"""posenc.hf on the M-RoPE backbones the census found beyond Qwen-VL and GLM-4V (issue 47 item 4),
each built from the census's tiny config (tests/hf_census_configs.py) with random weights, against
the untouched ``transformers`` backbone:

- Cosmos3 Edge text (``cosmos3_edge_text``): three axes, Qwen3-VL's interleaved sections, with no
  ``mrope_interleaved`` key in its config (its rotary module always interleaves);
- Cohere Compass text (``cohere_compass_text``): three interleaved axes, one RoPE block per layer
  type (its own base and sections per type; a None block is a NoPE layer type);
- HunYuan-VL text (``hunyuan_vl_text``): XD-RoPE, four axes (position, width, height, image index)
  whose sections split the half layout's *features* (posenc's ``xdrope``), a base stretched by
  NTK-alpha in its checkpoints, and q/k norms after the rotation.

For each: ``use(model, "rope")`` *is* the untouched model (float32, 1e-4, as the census) on
text-only rows (no ids, (B, T) ids) and on rows with an image, fed the (A, B, T) ids the vision
tower's ``get_rope_index`` makes (A = 3, or 4 for HunYuan-VL), alone, left-padded, in the packed form
where the family takes one, and through cached greedy decoding; a rotary module whose table differs
from its config is refused at use(), naming why; ALiBi sees each token at its text position; posenc's
own rotations are refused there, as on the other M-RoPE backbones.
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
from posenc.hf.schedule_config import schedule_from_hf  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]

TOLERANCE = 1e-4
LENGTH = 20
PAD = 4  # left padding of row 0 in the padded checks
#: per row: text tokens, then an image grid (height, width), then text to LENGTH
ROWS = [(3, (3, 3)), (6, (2, 3))]

#: the backbones (and variants of their configs) checked here -> the axes of their position ids
AXES = {"cosmos3_edge_text": 3, "cohere_compass_text": 3, "cohere_compass_text+nope": 3, "hunyuan_vl_text": 4,
        "hunyuan_vl_text+alpha": 4}

#: config variants: HunYuan-VL's checkpoints' NTK-alpha block ("dynamic" with alpha: a static base
#: stretched by alpha^(D / (D - 2))); Cohere Compass with a NoPE layer type (its block None)
VARIANTS = {
    "hunyuan_vl_text+alpha": {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "alpha": 1000.0, "factor": 1.0,
                                                  "mrope_section": [2, 2, 2, 2]}},
    "cohere_compass_text+nope": {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4,
                                                                           "mrope_section": [3, 3, 2]},
                                                     "full_attention": None}},
}

_BUILT: dict[str, torch.nn.Module] = {}


def untouched(name: str) -> torch.nn.Module:
    """The census's tiny backbone (bare text model; a variant's config keys over it), every weight
    moved off its init, as census.build does; a fresh copy."""
    if name not in _BUILT:
        model_type = name.split("+")[0]
        if name in VARIANTS:
            config = census.tiny_config(model_type)
            for key, value in VARIANTS[name].items():
                setattr(config, key, value)
            torch.manual_seed(0)
            model = transformers.AutoModel.from_config(config).eval()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
        else:
            model = census.build(census.Case(model_type, "backbone"))
        _BUILT[name] = model
    return copy.deepcopy(_BUILT[name])


def mrope_ids(rows=ROWS, length: int = LENGTH) -> torch.Tensor:
    """(3, B, T) M-RoPE ids as Qwen-VL's get_rope_index makes them (Cosmos3 Edge and Cohere Compass
    build theirs the same way): text equal on the three axes; an image's tokens at temporal id s
    (its first slot's id) and height / width ids s + i, s + j of its grid; the text after it from
    max(id) + 1."""
    out = []
    for before, (h, w) in rows:
        ii, jj = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        grid = torch.stack((torch.full((h * w,), before), before + ii.reshape(-1), before + jj.reshape(-1)))  # (3, h*w)
        after = length - before - h * w
        start = int(grid.max()) + 1
        out.append(torch.cat((torch.arange(before).expand(3, before), grid, (start + torch.arange(after)).expand(3, after)), 1))
    return torch.stack(out, dim=1)  # (3, B, T)


def xdrope_ids(rows=ROWS, length: int = LENGTH) -> torch.Tensor:
    """(4, B, T) XD-RoPE ids as HunYuan-VL's get_rope_index makes them: every token its slot on axis
    0 (and text on every axis); an image's tokens its column (over w + 1: the merger's newline
    token ends each grid row), its row, and the image's ordinal in the batch on axes 1, 2, 3."""
    out = []
    for index, (before, (h, w)) in enumerate(rows):
        ids = torch.arange(length).expand(4, length).clone()  # (4, T)
        ii, jj = torch.meshgrid(torch.arange(h), torch.arange(w + 1), indexing="ij")
        span = slice(before, before + h * (w + 1))
        ids[1, span], ids[2, span], ids[3, span] = jj.reshape(-1), ii.reshape(-1), index
        out.append(ids)
    return torch.stack(out, dim=1)  # (4, B, T)


def image_ids(name: str, rows=ROWS, length: int = LENGTH) -> torch.Tensor:
    return (xdrope_ids if AXES[name] == 4 else mrope_ids)(rows, length)


def padded(name: str, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row 0 left-padded by PAD slots: its ids over its real tokens shifted right (pads at id 0 for
    HunYuan-VL, 1 for the others, as their get_rope_index leave them), and the mask (B, T)."""
    pos = pos.clone()
    row = image_ids(name, [ROWS[0]], LENGTH - PAD)[:, 0]  # (A, T - PAD)
    pad = 0 if AXES[name] == 4 else 1
    pos[:, 0] = torch.cat((torch.full((AXES[name], PAD), pad, dtype=torch.long), row), dim=1)
    mask = torch.ones(2, LENGTH, dtype=torch.long)
    mask[0, :PAD] = 0
    return pos, mask


def tokens(batch: int = 2, length: int = LENGTH, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, census.VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))




# -- the rows and what use() reads from them ----------------------------------------------------------


def test_the_rows_and_their_schedules() -> None:
    """Each backbone has its row, and its schedule reads the rotation the rotary module applies."""
    for model_type in ("cosmos3_edge_text", "cohere_compass_text", "hunyuan_vl_text"):
        assert family_of(model_type) is not None and family_of(model_type).mrope
    cosmos = schedule_from_hf(untouched("cosmos3_edge_text").config).layers[0]
    assert (cosmos.encoding, cosmos.options) == ("mrope", {"base": 1e8, "mrope_section": [3, 3, 2], "mrope_interleaved": True})
    compass = schedule_from_hf(untouched("cohere_compass_text").config).layers  # sliding, full
    assert [(layer.encoding, layer.options["base"], layer.options["mrope_interleaved"], layer.window) for layer in compass] == [
        ("mrope", 1e4, True, census.WINDOW), ("mrope", 1e6, True, None)]
    assert [layer.encoding for layer in schedule_from_hf(untouched("cohere_compass_text+nope").config).layers] == ["mrope", "nope"]
    hunyuan = schedule_from_hf(untouched("hunyuan_vl_text+alpha").config).layers[0]
    assert hunyuan.encoding == "xdrope"
    assert hunyuan.options == {"base": 1e4, "xdrope_section": [2, 2, 2, 2], "scaling": {"rope_type": "ntk_alpha", "alpha": 1000.0}}


# -- use(model, "rope") is the untouched model -------------------------------------------------------


@pytest.mark.parametrize("name", sorted(AXES))
def test_rope_equals_the_untouched_backbone(name: str) -> None:
    ref = untouched(name)
    model = phf.use(untouched(name), "rope")
    ids, pos = tokens(), image_ids(name)
    assert all((pos[a] != pos[a + 1]).any() for a in range(pos.shape[0] - 1))  # the image rows differ on every axis
    text = torch.arange(LENGTH).expand(2, LENGTH)
    forms: list[dict] = [{}, {"position_ids": text}, {"position_ids": pos}]
    if AXES[name] == 3:  # the packed form: the text row first (HunYuan-VL's backbone refuses its 5-row form)
        forms.append({"position_ids": torch.cat((text[None], pos))})
    assert_exact(model, ref, ids, pos, forms, padded(name, pos), TOLERANCE)


# -- a table that differs from the config is refused -------------------------------------------------


def test_a_rotary_module_otherwise_than_its_config_is_refused() -> None:
    """The check compares the model's own tables with posenc's read from the config, per layer type
    and over the module's number of axes."""
    model = untouched("cosmos3_edge_text")
    model.rotary_emb.mrope_section = [4, 2, 2]  # the config says [3, 3, 2]: frequency 7 moves from height to temporal
    with pytest.raises(UsageError, match=r"'cosmos3_edge_text'.*rotates otherwise than posenc's mrope.*mrope_section=\[3, 3, 2\]"):
        phf.use(model, "rope")
    model = untouched("cohere_compass_text")
    model.rotary_emb.mrope_section["full_attention"] = [4, 2, 2]
    with pytest.raises(UsageError, match="'cohere_compass_text'.*rotates otherwise than posenc's mrope"):
        phf.use(model, "rope")
    model = untouched("cohere_compass_text")
    model.rotary_emb.full_attention_inv_freq.mul_(1.01)  # the sliding layers' table is right
    with pytest.raises(UsageError, match="differs from the model's rotary module .* on layers of type 'full_attention'"):
        phf.use(model, "rope")
    model = untouched("hunyuan_vl_text")
    model.rotary_emb.mrope_section = [4, 2, 1, 1]  # the config says [2, 2, 2, 2]
    with pytest.raises(UsageError, match=r"'hunyuan_vl_text'.*rotates otherwise than posenc's xdrope.*xdrope_section=\[2, 2, 2, 2\]"):
        phf.use(model, "rope")
    model = untouched("hunyuan_vl_text")
    model.rotary_emb.mrope_section = [4, 2, 2]  # three axes, where posenc's xdrope has four
    with pytest.raises(UsageError, match="'hunyuan_vl_text'.*over 3 position axes.*posenc's xdrope .* over 4"):
        phf.use(model, "rope")
    model = untouched("hunyuan_vl_text+alpha")
    model.config.rope_parameters = {**model.config.rope_parameters, "alpha": 10.0}  # the module holds alpha 1000's base
    with pytest.raises(UsageError, match="differs from the model's rotary module"):
        phf.use(model, "rope")
    model = untouched("hunyuan_vl_text")
    before = hidden(model, tokens(), position_ids=xdrope_ids())
    model.rotary_emb.attention_scaling = 0.5
    with pytest.raises(UsageError, match="'hunyuan_vl_text'.*rotates otherwise"):
        phf.use(model, "rope")
    model.rotary_emb.attention_scaling = 1.0
    assert torch.equal(hidden(model, tokens(), position_ids=xdrope_ids()), before)  # refused, and left as it was


# -- other encodings: at the text positions; posenc's rotations refused ------------------------------


@pytest.mark.parametrize("name", ["cosmos3_edge_text", "cohere_compass_text", "hunyuan_vl_text"])
def test_alibi_sees_text_positions(name: str) -> None:
    """Under ALiBi an image token sits at its slot: the image ids change nothing, and cached
    decoding (teacher-forced) after the image equals the full pass."""
    model = phf.use(untouched(name), "alibi")
    ids, pos = tokens(), image_ids(name)
    full = hidden(model, ids, position_ids=pos)
    assert gap(full, hidden(model, ids)) < 1e-5
    assert gap(full, hidden(untouched(name), ids, position_ids=pos)) > 1e-3  # posenc's attention runs
    cut, name_ = 14, cache_name(model)
    with torch.no_grad():
        out = model(ids[:, :cut], position_ids=pos[..., :cut], use_cache=True)
        steps = []
        for i in range(cut, LENGTH):
            held = out.cache if name_ == "cache" else out.past_key_values
            out = model(ids[:, i:i + 1], position_ids=pos[..., i:i + 1], use_cache=True, **{name_: held})
            steps.append(out.last_hidden_state)
    assert gap(torch.cat(steps, dim=1), full[:, cut:]) < TOLERANCE


@pytest.mark.parametrize("name", ["cosmos3_edge_text", "cohere_compass_text", "hunyuan_vl_text"])
def test_what_posenc_cannot_run_there_is_refused(name: str) -> None:
    model = untouched(name)
    before = hidden(model, tokens(), position_ids=image_ids(name))
    for encoding, options in (("rope", {"base": 1e4}), ("mrope", {}), ("xdrope", {}), ("sinusoidal", {})):
        with pytest.raises(UsageError, match=f"'{name}' is an M-RoPE backbone"):
            phf.use(model, encoding, **options)
    assert torch.equal(hidden(model, tokens(), position_ids=image_ids(name)), before)


# -- the config readers: the rotary modules' own defaults ---------------------------------------------


def test_the_readers_follow_the_rotary_modules_defaults() -> None:
    """mrope_from_hf on Cosmos3 Edge's default config (head dim 128, base 1e8, sections (24, 20, 20)),
    and on a config.json dict that names no base, sections or interleaving: the class's default base
    and Qwen3-VL's interleaved sections, as its rotary module (built alone, no weights) applies them."""
    from transformers.models.cosmos3_edge.modeling_cosmos3_edge import Cosmos3EdgeTextRotaryEmbedding

    from posenc.hf.mrope import check_axes
    from posenc.hf.rope_config import DEFAULT_THETA, mrope_from_hf

    config = transformers.Cosmos3EdgeTextConfig()
    assert DEFAULT_THETA["cosmos3_edge_text"] == DEFAULT_THETA["cosmos3_edge"] == config.default_theta
    enc = mrope_from_hf(config)
    assert (enc.base, enc.mrope_section, enc.mrope_interleaved, enc.head_dim) == (1e8, [24, 20, 20], True, 128)
    bare = mrope_from_hf({"model_type": "cosmos3_edge_text", "num_attention_heads": 16, "head_dim": 128,
                          "rope_parameters": {"rope_type": "default"}})
    assert (bare.base, bare.mrope_section, bare.mrope_interleaved) == (1e8, [24, 20, 20], True)
    rotary = Cosmos3EdgeTextRotaryEmbedding(config)
    assert torch.allclose(enc.inv_freq, rotary.inv_freq, rtol=1e-6)
    check_axes(enc, rotary, "cosmos3_edge_text")  # the 128-feature head, at its own frequencies and at 1 / (f + 1)
    rotary.mrope_section = [24, 24, 16]  # the low frequencies of base 1e8 turn a probe id by ~1e-7: only the copy sees this
    with pytest.raises(UsageError, match="rotates otherwise"):
        check_axes(enc, rotary, "cosmos3_edge_text")


# -- the whole image-text-to-text model ---------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["cosmos3_edge", "cohere_compass", "hunyuan_vl"])
def test_the_whole_model_takes_use(model_type: str) -> None:
    """use() on the image-text-to-text model (its text config given the census's tiny backbone's RoPE
    block): posenc's attention in its text model; a text-only forward and cached generate equal the
    untouched model's."""
    config = census.tiny_config(model_type)
    for key, value in census.OVERRIDES[config.text_config.model_type].items():
        setattr(config.text_config, key, value)
    torch.manual_seed(0)
    ref = transformers.AutoModelForImageTextToText.from_config(config).eval()
    model = phf.use(copy.deepcopy(ref), "rope")
    assert model.config.text_config._attn_implementation == "posenc"
    ids = torch.randint(7, census.VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    steps = {"max_new_tokens": 3, "do_sample": False}
    with torch.no_grad():
        assert gap(model(ids).logits, ref(ids).logits) < TOLERANCE
        assert torch.equal(model.generate(ids, **steps), ref.generate(ids, **steps))
