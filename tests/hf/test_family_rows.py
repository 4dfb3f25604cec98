"""posenc.hf's family rows for the families the census found refused or crashing (issue 47, item 3):
multi-head latent attention beyond DeepSeek (MiniCPM3, GLM-4 Lite, Sarvam MLA, Youtu, A.X K1,
Mistral 4, Bailing hybrid), interleaved pairs (ERNIE 4.5 dense and MoE, Helium, GLM, Cohere2-MoE),
NoPE full layers (AFMoE, EXAONE 4 / EXAONE-MoE / Kolibri 1, Flint with its sinks), one rotary table
per layer type (Beam, Ergo, Laguna, Mellum, LFM3; a type without a block is NoPE), per-layer bases
with a base of 0 for NoPE (Granite-SWA and GraniteMoE-SWA: one rotary module per base, and sinks;
Muse: only the zeros count), KV sharing with a table per layer type (Gemma 3n: the census's 4 layers,
the last 2 reusing the keys and values of the last earlier layer of their type), per-layer head dims
(Gemma 4: a sliding layer of head dim 16, a full one of 32 with proportional RoPE on a quarter of it;
with KV-shared layers it is refused), per-layer key/value heads (MiMo-V2-Flash: sinks and twice the
key/value heads on its sliding layers), a rotation turned the other way (nanochat: its own only), the RoPE block's scaling on some layers
(Molmo2: the others rotate unscaled, with a second rotary module), Lara mini (linear-attention
layers, NoPE full layers), Falcon (layers in ``h``; refused with ALiBi), GPT-J and CodeGen (no inv_freq: a
``[sin | cos]`` table of base 10000, interleaved pairs on the first ``rotary_dim`` features; a table that is not
posenc's RoPE is refused) and LongCat-Flash (MLA, two attention sublayers per decoder layer, each its own cache
layer; with YaRN's mscale pair), Moshi and RecurrentGemma (no rotary module on the decoder stack: each attention
module holds its own; RecurrentGemma's RG-LRU layers, local attention and partial rotary; both decode through
generate where the model returns no cache).

The census (tests/hf/test_census.py) checks ``use(model, "rope")``, under which the model rotates q
and k with its own tables and posenc only verifies them: it cannot see a row's layout, rope slice or
NoPE layers. Here each family is also run with posenc rotating (``use(model, <its own schedule>)``,
:func:`posenc.schedule_from_hf` of its row: the rotary module becomes the identity, and each layer's
RoPE is applied inside posenc's attention), and must still be the untouched ``transformers`` model:

- a 20-token forward (past every window of 8), a left-padded batch at its real tokens, and the same
  tokens from cached greedy decoding, against the untouched model (float32, 1e-4 on logits); for
  these rows and their variants, and for every other row of the table as the census builds it;
- Cohere2-MoE's full layers: NoPE, except a dense-MLP prefix layer when
  ``prefix_dense_sliding_window_pattern`` is 1 (the model's ``force_rope``), both ways;
- Mistral 4 and Ministral 3: the model scales its queries itself (``llama_4_scaling_beta``); posenc's
  plan must not scale them again (a doubled scale was silently wrong past the original length);
- the DeepSeek-sparse-attention families stay refused, naming the indexer.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

import hf_census_configs as census  # noqa: E402
import posenc.hf as phf  # noqa: E402
from posenc.errors import UsageError  # noqa: E402
from posenc.hf.families import family_of  # noqa: E402
from posenc.hf.forward_state import RotaryStandIn  # noqa: E402
from posenc.hf.rope_config import options_from_hf  # noqa: E402
from posenc.hf.schedule_config import schedule_from_hf  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]

LENGTH, PAD, STEPS, TOLERANCE = 20, 5, 3, 1e-4
# YaRN past an original length of 8 with DeepSeek's mscale pair: the attention factor on the rotated
# features, mscale_all_dim's factor in the layer's softmax scale (yarn_apply_mscale)
_LONGCAT_YARN = {"rope_type": "yarn", "rope_theta": 1e7, "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32.0,
                 "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 1.0}
_DENSE_PREFIX = dict(num_hidden_layers=3, layer_types=["full_attention", "sliding_attention", "full_attention"],
                     mlp_layer_types=["dense", "sparse", "sparse"])

#: (model_type, overrides over the census's): the rows of this item, as the census builds them, and variants
ROWS: list[tuple[str, dict[str, Any]]] = [
    ("minicpm3", {}), ("glm4_moe_lite", {}), ("glm4_moe_lite", {"rope_interleave": False}), ("sarvam_mla", {}),
    ("youtu", {}), ("axk1", {}), ("mistral4", {}), ("bailing_hybrid", {}),
    ("ernie4_5", {}), ("ernie4_5_moe", {}), ("helium", {}), ("glm", {}), ("cohere2_moe", {}),
    ("cohere2_moe", _DENSE_PREFIX), ("cohere2_moe", {**_DENSE_PREFIX, "prefix_dense_sliding_window_pattern": 2}),
    ("ministral3", {}), ("afmoe", {}), ("exaone4", {}), ("exaone4", {"sliding_window": None, "layer_types": ["full_attention"] * 2}),
    ("exaone_moe", {}), ("kolibri1", {}), ("flint", {}), ("beam", {}), ("ergo", {}), ("laguna", {}),
    ("laguna", {"layer_types": ["sliding_attention", "full_attention"]}), ("mellum", {}), ("lfm3", {}),
    ("muse_spark_text", {}), ("muse_glimmer_text", {}), ("granite_swa", {}), ("granitemoe_swa", {}), ("gemma3n_text", {}),
    ("mimo_v2_flash", {}), ("molmo2_text", {}), ("lara_mini", {}), ("falcon", {}),
    ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}), ("falcon", {"multi_query": True}),
    ("molmo2_text", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 8},
                     "rope_scaling_layers": [1]}),
    ("gemma4_text", {}),
    ("gemma4_text", {"attention_k_eq_v": True, "per_layer_config": {"1": {"head_dim": 32, "num_key_value_heads": 1}}}),
    ("gptj", {}), ("gptj", {"rotary_dim": 16}), ("codegen", {}), ("codegen", {"rotary_dim": 4}),
    ("longcat_flash", {}), ("longcat_flash", {"num_hidden_layers": 4, "rope_parameters": _LONGCAT_YARN}),
    ("moshi", {}), ("moshi", {"num_key_value_heads": 4, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}),
    ("recurrent_gemma", {}), ("recurrent_gemma", {"num_hidden_layers": 3, "block_types": ["attention", "recurrent", "attention"],
                                                  "num_key_value_heads": 1, "attention_window_size": 5}),
]


def case(model_type: str) -> census.Case:
    """The census's entry: a causal LM, or a bare backbone (Mistral 4)."""
    causal = model_type in transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return census.Case(model_type, "causal-lm" if causal else "backbone")


def build(model_type: str, **more: Any) -> torch.nn.Module:
    """The census's tiny model of ``model_type``, with ``more`` over its overrides."""
    saved = census.OVERRIDES.get(model_type)
    census.OVERRIDES[model_type] = {**(saved or {}), **more}
    try:
        return census.build(case(model_type))
    finally:
        if saved is None:
            census.OVERRIDES.pop(model_type)
        else:
            census.OVERRIDES[model_type] = saved


def output(model: torch.nn.Module, ids: torch.Tensor, **kwargs: Any) -> Any:
    with torch.no_grad():
        return model(ids, **kwargs)


def scores(out: Any, table: torch.Tensor) -> torch.Tensor:
    """Logits, or a backbone's last hidden states against its input embeddings."""
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state @ table.T


def run(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A forward, a left-padded batch (its real tokens), STEPS greedy tokens from a cached loop."""
    table = model.get_input_embeddings().weight
    ids = torch.randint(3, census.VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, LENGTH, dtype=torch.long)
    mask[0, :PAD] = 0
    full = scores(output(model, ids), table)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    out = output(model, ids, attention_mask=mask, position_ids=position_ids, use_cache=True)
    padded = scores(out, table)[mask.bool()]
    if not hasattr(out, "cache"):  # RecurrentGemma keeps its caches in its modules and returns none: its generate
        with torch.no_grad():
            return full, padded, model.generate(ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=False)[:, LENGTH:]
    tokens = []
    for _ in range(STEPS):
        token = scores(out, table)[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        tokens.append(token)
        mask = torch.cat((mask, torch.ones_like(token)), dim=1)
        position_ids = position_ids[:, -1:] + 1
        out = output(model, token, attention_mask=mask, position_ids=position_ids, use_cache=True, cache=out.cache)
    return full, padded, torch.cat(tokens, dim=1)


def gaps(ours: tuple[torch.Tensor, ...], theirs: tuple[torch.Tensor, ...]) -> tuple[float, float, bool]:
    return float((ours[0] - theirs[0]).abs().max()), float((ours[1] - theirs[1]).abs().max()), torch.equal(ours[2], theirs[2])


def own_base(model: torch.nn.Module) -> float:
    return float(options_from_hf(model.config)["base"])


@pytest.mark.parametrize("model_type, more", ROWS, ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}" for k in v) or "-")
def test_the_row_is_the_model_with_posenc_rotating(model_type: str, more: dict[str, Any]) -> None:
    ref = build(model_type, **more)
    expected = run(ref)
    for encoding in ("rope", schedule_from_hf(ref.config)):  # the model's rotation verified; then posenc's, from the row
        model = phf.use(copy.deepcopy(ref), encoding)
        full, padded, same = gaps(run(model), expected)
        assert full < TOLERANCE and padded < TOLERANCE and same, (model_type, encoding, full, padded)


def _rows() -> list[str]:
    """Every census type with a RoPE row posenc can rotate itself (not one whose model must rotate: M-RoPE, HunYuan v1; not reversed, not Inkling)."""
    found = []
    for entry in census.cases():
        row = family_of(entry.model_type)
        if (row is not None and row.own == "rope" and not row.model_rotates and not row.reversed_rotation
                and entry.model_type not in census.UNBUILDABLE):
            found.append(entry.model_type)
    return found


@pytest.mark.parametrize("model_type", _rows())
def test_every_row_is_the_model_with_posenc_rotating(model_type: str) -> None:
    """The census checks ``use(model, "rope")``, where the model rotates; here every row of the table
    (as the census builds it) with posenc rotating from the row's schedule: a wrong layout, slice,
    NoPE layer or base in any row shows."""
    ref = build(model_type)
    config = getattr(ref.config, "text_config", None) or ref.config
    full, padded, same = gaps(run(phf.use(copy.deepcopy(ref), schedule_from_hf(config))), run(ref))
    assert full < TOLERANCE and padded < TOLERANCE and same, (model_type, full, padded)


def test_a_different_base_is_not_the_model() -> None:
    """The check above can fail: posenc rotating with another base differs from the model."""
    ref = build("ernie4_5")
    model = phf.use(copy.deepcopy(ref), "rope", base=own_base(ref) / 10)
    assert gaps(run(model), run(ref))[0] > 1e-3


def test_cohere2_moe_rotates_its_dense_prefix_only_with_pattern_one() -> None:
    rope = [layer.encoding for layer in schedule_from_hf(build("cohere2_moe", **_DENSE_PREFIX).config).layers]
    assert rope == ["rope", "rope", "nope"]
    other = build("cohere2_moe", **_DENSE_PREFIX, prefix_dense_sliding_window_pattern=2)
    assert [layer.encoding for layer in schedule_from_hf(other.config).layers] == ["nope", "rope", "nope"]


@pytest.mark.parametrize("model_type, kinds", [("beam", ["rope", "nope"]), ("ergo", ["rope", "nope"]), ("afmoe", ["rope", "nope"]),
                                               ("exaone4", ["rope", "nope"]), ("flint", ["rope", "nope"]), ("lfm3", ["nope", "rope", "rope"]),
                                               ("muse_spark_text", ["rope", "nope"]), ("lara_mini", ["nope", "rope", "nope"])])
def test_the_schedule_has_the_nope_layers(model_type: str, kinds: list[str]) -> None:
    """The tiny configs' layers (sliding, full; LFM3: conv, full, sliding): full layers without
    positions where the family has them (a None block, NoPE full layers), LFM3's conv layer none."""
    layers = schedule_from_hf(build(model_type).config).layers
    assert [layer.encoding for layer in layers] == kinds


@pytest.mark.parametrize("model_type", ["granite_swa", "granitemoe_swa"])
def test_granite_swa_rotates_each_layer_with_its_base(model_type: str) -> None:
    """layer_rope_theta [0, 1e4, 1e5]: NoPE, then two bases, each checked against the rotary module
    the model built for it; a base with no module of its own is refused before any forward."""
    ref = build(model_type)
    layers = schedule_from_hf(ref.config).layers
    assert [layer.encoding for layer in layers] == ["nope", "rope", "rope"]
    assert [layer.options["base"] for layer in layers[1:]] == [1e4, 1e5]
    model = copy.deepcopy(ref)
    model.config.layer_rope_theta = [0, 1e4, 2e5]
    with pytest.raises(UsageError, match=r"layer 2's base 200000.0 \(layer_rope_theta\) has no rotary module"):
        phf.use(model, "rope")
    assert not any(isinstance(m, RotaryStandIn) for m in model.modules())  # refused: left as it was


def test_gemma4_builds_each_layer_for_its_head_dim_and_refuses_kv_sharing() -> None:
    model = phf.use(build("gemma4_text"), "t5")  # T5's table shared by the layers of one head dim
    plans = [m.__dict__["_posenc_plan"] for m in model.modules() if "_posenc_plan" in m.__dict__]
    assert [p.encoding.head_dim for p in plans] == [16, 32]
    with pytest.raises(UsageError, match="Gemma 4's layers differ in head dim"):
        phf.use(build("gemma4_text"), plans[0].encoding)
    shared = build("gemma4_text", num_hidden_layers=4, num_kv_shared_layers=2,
                   layer_types=["sliding_attention", "full_attention"] * 2, per_layer_config={"1": {"head_dim": 32}, "3": {"head_dim": 32}})
    with pytest.raises(UsageError, match="'gemma4_text'.*num_kv_shared_layers=2: its KV-shared layers keep only the last"):
        phf.use(shared, "rope")


def test_mimo_v2_flash_builds_each_layer_for_its_key_value_heads() -> None:
    model = phf.use(build("mimo_v2_flash"), "fope")  # FoPE learns per key/value head
    plans = [m.__dict__["_posenc_plan"] for m in model.modules() if "_posenc_plan" in m.__dict__]
    assert [p.encoding.num_kv_heads for p in plans] == [2, 4]  # full, sliding
    ids = torch.randint(3, census.VOCAB, (1, LENGTH), generator=torch.Generator().manual_seed(2))
    assert torch.isfinite(output(model, ids).logits).all()


def test_nanochat_keeps_its_own_rotation_and_refuses_posencs() -> None:
    """nanochat turns its pairs the other way: "rope" is the model's own rotation (exact: the census);
    posenc's RoPE (options, a schedule) would turn them the other way, and is refused; ALiBi replaces it."""
    ref = build("nanochat")
    model = phf.use(copy.deepcopy(ref), "rope")
    full, padded, same = gaps(run(model), run(ref))
    assert full < TOLERANCE and padded < TOLERANCE and same
    for encoding, options in ((schedule_from_hf(ref.config), {}), ("rope", {"base": own_base(ref)}), ("rerope", {})):
        with pytest.raises(UsageError, match="'nanochat'.*turns its RoPE pairs the other way"):
            phf.use(copy.deepcopy(ref), encoding, **options)
    phf.use(copy.deepcopy(ref), "alibi")


def test_molmo2_scales_only_its_rope_scaling_layers() -> None:
    """The census's Molmo2 (linear scaling, factor 4, on layer 0): layer 1 rotates unscaled, and each
    layer's RoPE is verified against the rotary module the model gives it."""
    ref = build("molmo2_text")
    layers = schedule_from_hf(ref.config).layers
    assert layers[0].options["scaling"]["factor"] == 4.0 and "scaling" not in layers[1].options
    model = phf.use(copy.deepcopy(ref), "rope")
    assert sum(isinstance(m, RotaryStandIn) for m in model.modules()) == 2  # both rotary modules stood in for


def test_falcon_with_alibi_is_refused_naming_why() -> None:
    with pytest.raises(UsageError, match="'falcon'.*alibi=True: its ALiBi bias reaches the attention in the mask"):
        phf.use(build("falcon", alibi=True), "rope")


def _sincos(positions: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """A (positions, r) [sin | cos] table of the angles p * inv_freq (float64, then float32)."""
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * inv_freq.double()[None]  # (P, r/2)
    return torch.cat((angles.sin(), angles.cos()), dim=-1).float()


@pytest.mark.parametrize("model_type", ["gptj", "codegen"])
def test_a_gptj_table_that_is_not_posencs_rope_is_refused(model_type: str) -> None:
    """GPT-J and CodeGen hold a [sin | cos] table (embed_positions), not frequencies: the table is
    posenc's RoPE of base 10000 over rotary_dim features (our own table of the same angles), and
    use() refuses one that differs (another base; one altered entry far into the table; frequencies
    off by 1e-4), naming where, before any forward, leaving the model as it was."""
    ref = build(model_type)
    table = ref.get_decoder().rotary_emb.embed_positions
    r = int(ref.config.rotary_dim)
    own = 10000.0 ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)  # (r/2,)
    assert table.shape == (ref.config.max_position_embeddings, r)
    assert float((table - _sincos(table.shape[0], own)).abs().max()) < 1e-4  # what posenc's verification reads
    altered = []
    for name, made in (("base 5000", lambda t: t.copy_(_sincos(t.shape[0], 5000.0 ** (-torch.arange(0, r, 2) / r)))),
                       ("entry", lambda t: t[200, r - 1].add_(1e-3)),
                       ("frequencies", lambda t: t.copy_(_sincos(t.shape[0], own * (1 + 1e-4))))):
        model = copy.deepcopy(ref)
        with torch.no_grad():
            made(model.get_decoder().rotary_emb.embed_positions)
        with pytest.raises(UsageError, match=rf"'{model_type}'.*posenc's RoPE read from the .* config \(base 10000, {r} rotated "
                                             r"features, interleaved pairs\) differs from the model's table "
                                             r"\w+RotaryEmbedding.embed_positions at position (\d+)") as refused:
            phf.use(model, "rope")
        altered.append((name, str(refused.value)))
        assert not any(isinstance(m, RotaryStandIn) for m in model.modules())  # refused: left as it was
    assert "at position 200 " in altered[1][1], altered[1]


@pytest.mark.parametrize("model_type", ["gptj", "codegen"])
def test_the_gptj_stand_in_is_the_identity_rotation(model_type: str) -> None:
    """Their rotary module returns (sin, cos), sin first: under another encoding the stand-in's tables
    leave q and k as they are through the model's own apply_rotary_pos_emb (a (cos, sin) identity
    would turn every pair by 90 degrees: invisible in q . k, not in q itself)."""
    import importlib

    model = phf.use(build(model_type), "t5")
    rotary = model.get_decoder().rotary_emb
    assert isinstance(rotary, RotaryStandIn)
    x = torch.randn(1, 6, 4, int(model.config.rotary_dim), generator=torch.Generator().manual_seed(0))  # (B, T, H, r)
    apply = importlib.import_module(type(rotary.original).__module__).apply_rotary_pos_emb
    sin, cos = rotary(x, torch.arange(6)[None])
    assert torch.equal(apply(x, sin, cos), x)
    rotary.sin_first = False
    assert not torch.allclose(apply(x, *rotary(x, torch.arange(6)[None])), x)


@pytest.mark.parametrize("model_type", ["mistral4", "ministral3"])
def test_the_query_scale_is_the_models_own_once(model_type: str) -> None:
    """The census's config reaches the scale's floor (original length 4): posenc's plans carry no
    second scale, and the model's own makes the logits differ from the same model without it."""
    ref = build(model_type)
    model = phf.use(copy.deepcopy(ref), "rope")
    plans = [m.__dict__["_posenc_plan"] for m in model.modules() if "_posenc_plan" in m.__dict__]
    assert plans and all(p is None or p.query_scale is None for p in plans)
    plain = build(model_type, rope_parameters={**ref.config.rope_parameters, "llama_4_scaling_beta": 1e-9})
    assert gaps(run(plain), run(ref))[0] > 1e-3


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa", "axk2", "mistral_large4_text"])
def test_sparse_attention_is_refused_naming_the_indexer(model_type: str) -> None:
    if model_type not in transformers.models.auto.modeling_auto.MODEL_MAPPING_NAMES:
        pytest.skip(f"{model_type} is not in this transformers")
    model = build(model_type)
    with pytest.raises(UsageError, match=rf"{model_type}.*sparse attention \(an indexer"):
        phf.use(model, "rope")


def test_longcat_runs_each_attention_sublayer_as_a_layer_of_its_own() -> None:
    """LongCat-Flash's decoder layers hold two MLA sublayers each (a ModuleList self_attn, layer_idx 2i
    and 2i + 1): each gets its own plan and KV cache layer. Under ALiBi (posenc's own scores, not the
    model's), cached decoding equals the full pass, which a cache layer shared by the two sublayers or
    a plan on one of them only would break; sublayers whose layer_idx do not number them in order are
    refused before any forward."""
    ref = build("longcat_flash", num_hidden_layers=4)
    model = phf.use(copy.deepcopy(ref), "alibi")
    planned = [m.layer_idx for m in model.modules() if "_posenc_plan" in m.__dict__]
    assert planned == [0, 1, 2, 3] and ref.config.num_layers == 2
    ids = torch.randint(3, census.VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(3))
    full = output(model, ids).logits
    out = output(model, ids[:, :LENGTH - STEPS], use_cache=True)
    assert len(out.cache.layers) == 4
    steps = [out.logits[:, -1]]
    for t in range(LENGTH - STEPS, LENGTH - 1):
        out = output(model, ids[:, t:t + 1], use_cache=True, cache=out.cache)
        steps.append(out.logits[:, -1])
    assert float((torch.stack(steps, 1) - full[:, LENGTH - STEPS - 1:LENGTH - 1]).abs().max()) < TOLERANCE
    assert float((full - output(ref, ids).logits).abs().max()) > 1e-2  # ALiBi ran in place of the model's RoPE
    swapped = copy.deepcopy(ref)
    swapped.model.layers[0].self_attn[1].layer_idx, swapped.model.layers[1].self_attn[0].layer_idx = 2, 1
    with pytest.raises(UsageError, match=r"'longcat_flash'.*attention layer 1 of the stack has layer_idx 2"):
        phf.use(swapped, "rope")
    assert not any(isinstance(m, RotaryStandIn) for m in swapped.modules())  # refused: left as it was


@pytest.mark.parametrize("model_type", ["moshi", "recurrent_gemma"])
def test_a_rotary_module_in_each_attention_is_stood_in_for_in_each(model_type: str) -> None:
    """Moshi and RecurrentGemma hold no rotary module on the decoder stack: each attention module calls
    its own (``Family.attention_rotary``). Every one of them is stood in for, sharing one forward state
    that the stack starts (not each layer's call); under "rope" they pass the model's tables on, under
    the row's schedule they are the identity (posenc rotates); use() again re-points the same
    stand-ins; each layer's RoPE is verified against its own module (one altered in the last
    attention layer is refused, the model left as it was; so is a layer without its rotary module)."""
    ref = build(model_type)
    attentions = [m for m in ref.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "rotary_emb")]
    assert len(attentions) >= 1 and not hasattr(ref.model, "rotary_emb")
    model = phf.use(copy.deepcopy(ref), "rope")
    held = [m.rotary_emb for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "rotary_emb")]
    assert len(held) == len(attentions) and all(isinstance(r, RotaryStandIn) for r in held)
    assert len({id(r.forward_state) for r in held}) == 1 and not any(r.starts or r.identity for r in held)
    again = phf.use(model, schedule_from_hf(ref.config))
    assert [a.rotary_emb for a in again.modules() if hasattr(a, "rotary_emb")] == held and all(r.identity for r in held)
    assert max(gaps(run(again), run(ref))[:2]) < TOLERANCE
    tampered = copy.deepcopy(ref)
    rotary = [m for m in tampered.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "rotary_emb")][-1].rotary_emb
    with torch.no_grad():
        rotary.inv_freq.mul_(1.01)
    with pytest.raises(UsageError, match=rf"'{model_type}'.*differs from the model's rotary module"):
        phf.use(tampered, "rope")
    assert not any(isinstance(m, RotaryStandIn) for m in tampered.modules())
    unrotated = copy.deepcopy(ref)  # a layer without its rotary module (Moshi's depth decoder's): NoPE, not described
    [m for m in unrotated.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "rotary_emb")][-1].rotary_emb = None
    with pytest.raises(UsageError, match=rf"'{model_type}'.*rotates inside each attention module with its 'rotary_emb', and "
                                         r"\w+Attention \(layer_idx \d\) holds NoneType"):
        phf.use(unrotated, "rope")


def test_moshi_alibi_decodes_as_its_full_pass_within_its_cache() -> None:
    """Another encoding in Moshi's attention (the stand-ins the identity): it reaches every layer (the
    output differs from the model's RoPE) and cached greedy steps equal the full pass. Moshi's
    ``sliding_window`` sizes only its DynamicCache (its mask is full causal), so the check stays within
    it; past it the model itself, and posenc with it, decodes over the last ``sliding_window`` keys."""
    ref = build("moshi", sliding_window=64)
    model = phf.use(copy.deepcopy(ref), "alibi")
    ids = torch.randint(3, census.VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    assert float((output(model, ids).logits - output(ref, ids).logits).abs().max()) > 1e-3
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    full = output(model, out.sequences, use_cache=False).logits[0]
    assert max(float((step[0] - full[11 + i]).abs().max()) for i, step in enumerate(out.logits)) < TOLERANCE


def test_a_rotary_module_in_each_layer_without_a_row_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without its row (``attention_rotary`` unknown), Moshi's stack has no rotary module and its layers
    hold their own: refused naming the first, and what posenc needs."""
    import posenc.hf.adapter as adapter
    import posenc.hf.stack as stack

    model = build("moshi")
    monkeypatch.setattr(stack, "family_of", lambda model_type: None)
    monkeypatch.setattr(adapter, "family_of", lambda model_type: None)
    with pytest.raises(UsageError, match=r"'moshi'.*no rotary module: its layers hold their own \(layers.0.self_attn.rotary_emb, "
                                         r"MoshiRotaryEmbedding\).*Family.attention_rotary"):
        phf.use(model, "rope")
