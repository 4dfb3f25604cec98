"""The Hugging Face ``transformers`` decoder families, as data: one :class:`Family` row each.

What differs between families, for a layer schedule (:func:`posenc.schedule_from_hf`) and for
posenc's attention inside a model (:func:`posenc.hf.use`), read from ``transformers`` 5.24's
``configuration_*.py`` / ``modeling_*.py``. Everything else is common to every family and lives in
the code, not here: one text rotary module on the decoder stack (``rotary_emb``), called once per
forward (once per layer type where the RoPE parameters differ by type); q, k, v reaching the
registered attention function as (B, H, T, D) / (B, Hkv, S, D) with the cached past included, k and
v never repeated; ``scaling`` passed by the layer; ``config.layer_types`` naming each layer's kind
where the family has kinds.

Definitions (r the rotated features of a head, D its q/k head dim):

- ``layout``: the pairs the model's rotation turns: ``"half"`` (feature i with i + r/2, GPT-NeoX /
  LLaMA ``rotate_half``) or ``"interleaved"`` (2i with 2i + 1: RoFormer, GPT-J, and the complex
  products of Llama 4 and DeepSeek-V2). DeepSeek-V3 rotates interleaved pairs by first moving its
  rope features to [evens | odds]; the attention function sees them moved, so its row says half.
- ``rope_slice``: which r of the D features rotate: ``"first"`` (partial rotary: Phi, GPT-NeoX,
  StableLM, GLM-4, Qwen3-Next) or ``"last"`` (multi-head latent attention, DeepSeek-V2/V3: each
  head is [no-position part | rope part], the rope key part one head shared by all). r itself is
  read from the model's rotary module (twice its number of frequencies).
- ``rope_blocks``: ``"shared"``, one ``rope_parameters`` block for every layer, or ``"per_type"``,
  one per layer type (Gemma 3, OLMo 3, ModernBERT: local base 1e4, global 1e6 or 1.6e5).
- ``typed_layers``: the config must say each layer's kind (``layer_types``); a config without it
  is refused rather than read as all-full.
- ``window``: which layers slide, over ``window_key`` keys: ``"layer_types"`` (the layers typed
  ``sliding_attention``), ``"every_layer"`` (all of them, when the config sets the key: Mistral,
  Mixtral, Qwen3-MoE, Phi-3, StarCoder2) or ``"none"``.
- ``nope``: which layers have no positions: ``"none"``, ``"no_rope_layers"`` (SmolLM3, Llama 4:
  ``no_rope_layers[l] == 1`` means RoPE, despite the name), ``"full_layers"`` (Cohere2: only its
  sliding layers rotate), ``"zero_theta"`` (Muse: a layer whose ``layer_rope_theta`` is 0; the others
  take the one RoPE block), ``"layer_theta"`` (Granite-SWA: each layer's base is its ``layer_rope_theta``,
  0 for NoPE), ``"full_layers_but_dense"`` (Cohere2-MoE: so do its full layers with a
  dense MLP, ``mlp_layer_types``, when ``prefix_dense_sliding_window_pattern`` is 1) or
  ``"full_layers_if_windowed"`` (EXAONE 4: full layers are NoPE when the config sets a window; without
  one every layer rotates).
- ``chunk_key``: the chunk size of the ``chunked_attention`` layers (Llama 4).
- ``sinks``: the attention module's attribute holding one sink logit per head (gpt-oss).
- ``softcap``: the config key of the logit soft cap of the content scores (Gemma 2).
- ``temperature``: Llama 4's query temperature on its NoPE layers. The model applies it to q before
  the attention function at index positions (a packed row's later documents, a left-padded row's
  tokens get the temperature of where they sit in the row); inside posenc.hf the model's is turned
  off and posenc's query scale applies it at each token's own position, so a packed row equals its
  documents alone.
- ``log_beta``: Ministral 3's (and Mistral 4's) query scale, a key of its RoPE block. The model scales its
  queries itself, at the positions its layers are passed, whatever the encoding, so posenc.hf's plans leave
  it out (a schedule read for posenc's own model keeps it).
- ``no_attention``: layer types whose layers never call the attention function (Qwen3-Next's Gated
  DeltaNet layers, Bamba's Mamba-2 layers, LFM2's short convolutions): they have no positions, and
  posenc leaves them as they are (an attention module they hold, MiniMax's Lightning attention, is
  not given a plan).
- ``type_names``: (the family's layer type, posenc's) pairs for layers that are attention layers
  under another name: Falcon-H1's ``hybrid`` layers run attention and Mamba-2 side by side, ZAYA's
  ``hybrid_sliding`` ones slide. Their RoPE tables keep the family's name (``hybrid_inv_freq``).
- ``qk_head_dim``: the config keys whose sum is D (MLA: ``qk_nope_head_dim + qk_rope_head_dim``);
  by default ``head_dim``, else ``hidden_size // num_attention_heads``.
- ``causal``: a decoder; the encoders (ModernBERT, EuroBERT, GTE, Nomic BERT, Jina v3, ESM-2, UltraBERT) are
  bidirectional, and their attention modules may have no ``layer_idx`` (GTE, Nomic BERT, Jina v3).
- ``window_per_side``: ``window_key`` counts the keys on each side (UltraBERT's ``sliding_window``:
  ``|i - j| <= w``), where posenc's bidirectional window W is the total width (``|i - j| <= W // 2``),
  so posenc's window is 2w. ModernBERT's ``local_attention`` is already the total width.
- ``mrope``: M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V, Cosmos3 Edge, Cohere Compass): the decoder
  stack hands its rotary module (3, B, T) ids (temporal, height, width; image tokens of a grid differ in
  each) and ``rope_parameters`` splits the frequencies over them (``mrope_section``; Qwen3-VL, Cosmos3
  Edge and Cohere Compass interleaved, GLM-4V and GLM-OCR interleaved pairs, GLM-4.1V and GLM-4.5V partial
  rotary; Cohere Compass one block per layer type). Its layers are not handed those ids (None, or the
  text row of a 4-row form), so posenc's attention cannot rotate M-RoPE itself, nor know a cached
  key's ids: under ``"rope"`` the model rotates q and k with its own tables, verified at use()
  against posenc's :class:`~posenc.encodings.mrope.MRoPE` read from the config on 3-axis ids; other
  encodings see each token at its text position (docs/hf.md, "M-RoPE backbones").
- ``mrope_encoding``: posenc's encoding of an ``mrope`` family's rotation, read from its config and
  checked against the model's tables: ``"mrope"`` (:func:`posenc.mrope_from_hf`) or ``"xdrope"``
  (HunYuan-VL's four axes, its sections over features: :func:`posenc.hf.rope_config.xdrope_from_hf`);
  the check's ids have as many axes as the module's sections, which must be the encoding's
  ``position_axes``.

- ``model_rotates``: the model must rotate q and k itself, and why posenc cannot (a clause completing
  "model_type X ..."): its rotation happens where posenc's attention function cannot place one. The
  M-RoPE rows (their layers are not handed the 3-axis ids; set for every ``mrope`` row), HunYuan v1 (a learned q/k RMSNorm after
  the rotation) and Dory (a learned per-channel query scale after it): a learned per-channel weight
  does not commute with a rotation. Under ``use(model, "rope")`` without options
  the rotary module passes through (the plan's ``rotate=False``) after posenc verified its tables
  against the RoPE read from the config (:func:`posenc.hf.rotary_checks.verify_rope`); an encoding
  without a rotation (ALiBi, T5, NoPE, FoX, ...) gets the identity rotation and runs in the
  attention; any rotation posenc would apply (``"rope"`` with options, a remap, xPos, a schedule's
  rope layer, a RoPE module) is refused at use() with this reason (:func:`posenc.hf.mrope.refuse_other`).

- ``rotary_list``: the decoder stack's list of rotary modules, one per RoPE base, each layer rotated
  by the one of its ``layer_rope_theta`` (Granite-SWA's ``rotary_embs``; :mod:`posenc.hf.rotary_sets`), or
  the one module of the layers outside ``scaled_layers``.
- ``scaled_layers``: the config key listing the layers that take the RoPE block's scaling; the others
  rotate without it (the same base), with the module named by ``rotary_list`` (Molmo2).
- ``per_layer_config``: the head dim and key/value heads differ between layers (Gemma 4), read from
  ``config.per_layer_config[layer]`` (or ``[layer type]``); each layer's encoding is built for its own.
- ``kv_heads_per_layer``: the layers differ in key/value heads only, each its attention module's
  (MiMo-V2-Flash: its sliding layers have twice the full layers').
- ``reversed_rotation``: the model turns its pairs the other way (angle -theta: nanochat's rotate_half
  is [x2, -x1]), which posenc's RoPE cannot: ``use(model, "rope")`` keeps the model's own rotation
  (verified by its frequencies), and a RoPE posenc would apply itself (options, a schedule, a remap) is
  refused; other encodings replace it.
- ``sincos_table``: the rotary module holds no ``inv_freq`` buffer: its buffer of this name is a
  (positions, r) table ``[sin | cos]`` of each position's angles, and it returns ``(sin, cos)``, sin
  first (GPT-J's and CodeGen's ``embed_positions``, made by ``create_sinusoidal_positions``; their
  attention rotates the first ``rotary_dim`` features in interleaved pairs). posenc reads r from the
  table's width, verifies its RoPE read from the config against the whole table at use(), and its
  stand-in's identity rotation is (sin 0, cos 1).
- ``attention_rotary``: the decoder stack holds no rotary module: each attention module holds its own
  under this attribute and calls it on every forward with the positions it is passed
  (RecurrentGemma's and Moshi's ``rotary_emb``, all built from the one RoPE block). posenc verifies
  each layer's RoPE against the module of that layer, stands in for every one of them (sharing one
  forward state, started by the decoder stack's pre-hook rather than by the first rotary call), and
  reads the rotated features from the first.
- ``fixed_theta``: the RoPE base fixed in the family's modeling code, whose config has no RoPE block
  (GPT-J, CodeGen: 10000); a ``rope_parameters`` or ``rope_theta`` the config holds is not read, as
  the model does not read it.
- ``theta_key``: the config key of the RoPE base of a family whose config has no ``rope_parameters``
  block and whose modeling code rotates with the default frequencies of that base (ESM-2's
  ``rope_theta``, read by its ``EsmRotaryEmbedding``); a ``rope_parameters`` the config may hold is not read.
- ``refused_when``: (config key, why) pairs: :func:`posenc.hf.use` refuses a model whose config sets
  the key (true or non-zero), saying why (what posenc lacks for it).
- ``own``: the encoding of the family's own attention, ``"rope"`` for all but the Inkling families
  (``"inkling"``: no rotary module; each layer's learned distance curves, mixed per query from its
  input, :mod:`posenc.hf.inkling`). ``use(model, own)`` with no options is the untouched model.
- ``query_sinks``: the keyword under which the layer hands the attention function per-query sink
  logits (B, H, Tq, 1) it computed (Inkling-2's ``sink_proj`` of each token's input); every
  encoding then keeps them.

A family not in :data:`FAMILIES` is read as its config's ``model_type`` says nothing more: the
adapter checks the model against the LLaMA pattern (see :func:`posenc.hf.use`) and refuses it,
naming what differs, when it does not fit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    """One ``transformers`` family (see the module docstring for each field)."""

    name: str
    model_types: tuple[str, ...]
    layout: str = "half"
    rope_slice: str = "first"
    rope_blocks: str = "shared"
    typed_layers: bool = False
    window: str = "layer_types"
    window_key: str = "sliding_window"
    nope: str = "none"
    chunk_key: str | None = None
    sinks: str | None = None
    softcap: str | None = None
    temperature: bool = False
    log_beta: bool = False
    no_attention: tuple[str, ...] = ()
    type_names: tuple[tuple[str, str], ...] = ()
    qk_head_dim: tuple[str, ...] = ("head_dim",)
    causal: bool = True
    window_per_side: bool = False
    # A config key that, when true, puts a weightless q/k norm after the rotation (Llama 4's use_qk_norm): the
    # norm cancels a scaling's attention factor, so posenc (which rotates after the model's norm) drops it.
    qk_norm_after_rotation: str | None = None
    mrope: bool = False
    mrope_encoding: str = "mrope"
    model_rotates: str | None = None
    rotary_list: str | None = None
    scaled_layers: str | None = None
    per_layer_config: bool = False
    kv_heads_per_layer: bool = False
    reversed_rotation: bool = False
    sincos_table: str | None = None
    fixed_theta: float | None = None
    attention_rotary: str | None = None
    theta_key: str | None = None
    refused_when: tuple[tuple[str, str], ...] = ()
    own: str = "rope"
    query_sinks: str | None = None
    needs: str = ""  # what the family needed beyond the LLaMA pattern, for docs/hf.md

    def __post_init__(self) -> None:
        if self.mrope and self.model_rotates is None:  # an M-RoPE row: only the model can rotate (its layers lack the ids)
            object.__setattr__(self, "model_rotates", _MROPE_ROTATES)


_EVERY = "every_layer"
_MLA = ("qk_nope_head_dim", "qk_rope_head_dim")
_MLA_NEEDS = "MLA (DeepSeek-V3's layout): the rope part is the last qk_rope_head_dim features, de-interleaved; value head dim differs"
#: Family.model_rotates of the M-RoPE rows (posenc.hf.mrope), set for every row with ``mrope``
_MROPE_ROTATES = ("is an M-RoPE backbone: its layers are not handed the 3-axis (temporal, height, width) ids, nor are a "
                  "cached key's known, so posenc would rotate at 1-D text positions, not at an image token's ids (an "
                  "encoding without a rotation runs at the text positions)")
#: Family.model_rotates of a family whose attention normalises q and k after rotating them (HunYuan v1)
_NORM_AFTER_ROTATION = ("normalises q and k after the rotation with a learned per-channel weight (query_layernorm, "
                        "key_layernorm: RMSNorm), which does not commute with a rotation, so posenc, which rotates inside "
                        "the attention function (after that norm), cannot place a rotation there")
#: Family.model_rotates of a family whose attention scales q per channel after rotating it (Dory's sqk)
_SCALE_AFTER_ROTATION = ("scales q per channel after the rotation with a learned weight (sqk), which does not commute "
                         "with a rotation, so posenc, which rotates inside the attention function (after that scale), "
                         "cannot place a rotation there")
_INKLING_TYPES = (("hybrid", "full_attention"), ("hybrid_sliding", "sliding_attention"))

FAMILIES: tuple[Family, ...] = (
    Family("Llama", ("llama",), needs="the pattern itself"),
    Family("Mistral", ("mistral",), window=_EVERY, needs="a window on every layer (config.sliding_window)"),
    Family("Mixtral", ("mixtral",), window=_EVERY, needs="a window on every layer; router kwargs ignored"),
    Family("Ministral", ("ministral",), needs="per-layer windows (layer_types)"),
    Family("Ministral 3", ("ministral3",), window=_EVERY, log_beta=True, needs="a window on every layer; the log-floor query scale"),
    Family("Qwen2", ("qwen2",), needs="per-layer windows (layer_types)"),
    Family("Qwen2-MoE", ("qwen2_moe",), needs="per-layer windows from layer_types (the window kwarg is not passed)"),
    Family("Qwen3", ("qwen3",), needs="q/k norms before RoPE (nothing to do); per-layer windows"),
    Family("Qwen3-MoE", ("qwen3_moe",), window=_EVERY, needs="a window on every layer when set"),
    Family("Qwen3-Next", ("qwen3_next",), no_attention=("linear_attention",),
           needs="partial rotary (first quarter); linear-attention layers have no positions"),
    # Hybrids: attention layers take the encoding, the state-space / linear / convolution layers are left as they are
    Family("Qwen3.5", ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe"), no_attention=("linear_attention",),
           needs="partial rotary; Gated DeltaNet layers have no positions; interleaved M-RoPE, 1-D on text positions"),
    Family("Bamba", ("bamba",), no_attention=("linear_attention",), needs="partial rotary (first half); Mamba-2 layers have no positions"),
    Family("Falcon-H1", ("falcon_h1",), type_names=(("hybrid", "full_attention"),),
           needs="attention beside Mamba-2 in every layer (layer type hybrid); the key multiplier before RoPE (nothing to do)"),
    Family("Granite 4 hybrid", ("granitemoehybrid",), no_attention=("linear_attention",),
           needs="Mamba-2 layers have no positions; RoPE only with position_embedding_type='rope'"),
    Family("LFM2", ("lfm2", "lfm2_moe"), no_attention=("conv",), needs="short-convolution layers have no positions"),
    Family("MiniMax-01", ("minimax",), window=_EVERY, no_attention=("linear_attention",),
           needs="Lightning-attention layers (their own decay slopes) left as they are; a window on every layer when set"),
    Family("OLMo hybrid", ("olmo_hybrid",), no_attention=("linear_attention",), needs="Gated DeltaNet layers have no positions"),
    Family("Zamba2", ("zamba2",), no_attention=("linear_attention",), type_names=(("hybrid", "full_attention"),),
           needs="Mamba-2 layers have no positions; hybrid layers run tied transformer blocks (their attention input is "
                 "2 x hidden_size: no forget gates); RoPE only with use_mem_rope=True"),
    Family("ZAYA", ("zaya",), typed_layers=True, rope_blocks="per_type",
           type_names=(("hybrid", "full_attention"), ("hybrid_sliding", "sliding_attention")),
           needs="convolutional (CCA) q/k/v projections, their own padding mask; a RoPE block per layer type (hybrid, hybrid_sliding)"),
    Family("Gemma", ("gemma",), needs="the pattern itself"),
    Family("Gemma 2", ("gemma2",), typed_layers=True, softcap="attn_logit_softcapping",
           needs="logit soft-capping; query_pre_attn_scalar scaling; alternating windows"),
    Family("Gemma 3", ("gemma3_text", "gemma3"), typed_layers=True, rope_blocks="per_type",
           needs="a RoPE block per layer type (local 1e4, global 1e6); 5 sliding : 1 full"),
    Family("Gemma 3n", ("gemma3n_text",), typed_layers=True, rope_blocks="per_type",
           needs="a RoPE block per layer type; the last num_kv_shared_layers layers reuse the keys and values of the last "
                 "earlier layer of their type (each rotated at its own position)"),
    Family("Gemma 4", ("gemma4_text", "gemma4"), typed_layers=True, rope_blocks="per_type", per_layer_config=True,
           refused_when=(("num_kv_shared_layers", "its KV-shared layers keep only the last logits_to_keep queries of a "
                          "generate prefill and slice the 4-D attention mask to them, and posenc's attention takes a 2-D "
                          "padding mask and every query"),),
           needs="a RoPE block per layer type (proportional RoPE on full layers); per-layer head dims and key/value heads "
                 "(per_layer_config); refused with KV-shared layers"),
    Family("Phi", ("phi",), needs="partial rotary (first half)"),
    Family("Phi-3", ("phi3",), window=_EVERY, needs="a window on every layer when set; LongRoPE's attention factor"),
    Family("OLMo", ("olmo",), needs="float32 rotary tables"),
    Family("OLMo 2", ("olmo2",), needs="whole-projection q/k norms before RoPE"),
    Family("OLMo 3", ("olmo3",), typed_layers=True, rope_blocks="per_type", needs="a RoPE block per layer type; 3 sliding : 1 full"),
    Family("OLMoE", ("olmoe",), window="none", needs="the pattern; router kwargs ignored"),
    Family("SmolLM3", ("smollm3",), typed_layers=True, nope="no_rope_layers", needs="NoPE layers (no_rope_layers: 1 = RoPE)"),
    Family("Granite", ("granite",), needs="scaling = attention_multiplier (passed by the layer)"),
    Family("GraniteMoE", ("granitemoe",), needs="scaling = attention_multiplier"),
    Family("GPT-NeoX", ("gpt_neox",), needs="partial rotary (rotary_pct); no head_dim attribute"),
    Family("StarCoder2", ("starcoder2",), window=_EVERY, needs="a window on every layer when set"),
    Family("StableLM", ("stablelm",), needs="partial rotary; its layers pass position_ids only"),
    Family("Cohere", ("cohere",), layout="interleaved", needs="interleaved pairs"),
    Family("Cohere2", ("cohere2",), typed_layers=True, layout="interleaved", nope="full_layers",
           needs="interleaved pairs; RoPE on the sliding layers only (full layers NoPE)"),
    Family("Cohere2-MoE", ("cohere2_moe",), typed_layers=True, layout="interleaved", nope="full_layers_but_dense",
           needs="interleaved pairs; RoPE on the sliding layers and the dense prefix's full layers (other full layers NoPE)"),
    # NoPE full layers beside RoPE sliding ones
    Family("AFMoE", ("afmoe",), typed_layers=True, nope="full_layers", needs="RoPE on the sliding layers only (full layers NoPE)"),
    Family("Flint", ("flint",), typed_layers=True, nope="full_layers", sinks="sinks",
           needs="RoPE on the sliding layers only (full layers NoPE); attention sinks (module.sinks)"),
    Family("EXAONE 4", ("exaone4", "exaone_moe", "kolibri1"), typed_layers=True, nope="full_layers_if_windowed",
           needs="RoPE on the sliding layers only when a window is set (full layers NoPE), else on every layer"),
    Family("MiMo-V2-Flash", ("mimo_v2_flash",), typed_layers=True, rope_blocks="per_type", sinks="sinks", kv_heads_per_layer=True,
           needs="a RoPE block per layer type (partial rotary); attention sinks on the sliding layers only; twice the key/value "
                 "heads on the sliding layers; value head dim differs"),
    Family("nanochat", ("nanochat",), reversed_rotation=True,
           needs="half pairs turned the other way (rotate_half is [x2, -x1]): the model's own rotation under \"rope\"; "
                 "posenc's RoPE refused"),
    Family("Molmo2 text", ("molmo2_text",), rotary_list="rotary_emb_unscaled", scaled_layers="rope_scaling_layers",
           needs="the RoPE block's scaling on rope_scaling_layers only (the others its base unscaled, a second rotary module)"),
    Family("Lara mini", ("lara_mini",), typed_layers=True, nope="full_layers", no_attention=("linear_attention",),
           needs="linear-attention layers have no positions; RoPE on the sliding layers only (full layers NoPE)"),
    Family("Falcon", ("falcon",), refused_when=(("alibi", "its ALiBi bias reaches the attention in the mask, which posenc's "
                                                        "attention does not take"),),
           needs="its layers in h, attention in self_attention; refused with alibi=True"),
    # No inv_freq buffer: a [sin | cos] table of base 10000 (embed_positions), interleaved pairs on the first rotary_dim features
    Family("GPT-J", ("gptj",), layout="interleaved", window="none", sincos_table="embed_positions", fixed_theta=10000.0,
           needs="partial rotary (the first rotary_dim features), interleaved pairs; no inv_freq: a (positions, rotary_dim) "
                 "[sin, cos] table of base 10000 (embed_positions), returned sin first, verified against posenc's RoPE; "
                 "layers in h"),
    Family("CodeGen", ("codegen",), layout="interleaved", window="none", sincos_table="embed_positions", fixed_theta=10000.0,
           needs="GPT-J's rotation (partial rotary, interleaved pairs, a [sin, cos] table of base 10000 verified against "
                 "posenc's RoPE, rotated in float32); a fused qkv projection (nothing to do); layers in h"),
    # Rotary inside each attention module (none on the decoder stack)
    Family("RecurrentGemma", ("recurrent_gemma",), no_attention=("linear_attention",), attention_rotary="rotary_emb",
           needs="RG-LRU recurrent layers have no positions (their own reset where a position is 0); local attention "
                 "(sliding_attention, attention_window_size); partial rotary (first half); each attention's own rotary "
                 "module; attention in temporal_block"),
    Family("Moshi", ("moshi",), window="none", attention_rotary="rotary_emb",
           needs="each attention's own rotary module; a full causal mask (its sliding_window sizes only its cache: past "
                 "it the model, and posenc with it, decodes over the last sliding_window keys)"),
    # Per-layer bases (layer_rope_theta), a base of 0 for a NoPE layer
    Family("Muse", ("muse_glimmer_text", "muse_spark_text"), nope="zero_theta",
           needs="NoPE layers where layer_rope_theta is 0 (the others rotate with the one RoPE block)"),
    Family("Granite-SWA", ("granite_swa", "granitemoe_swa"), typed_layers=True, nope="layer_theta", sinks="sinks", rotary_list="rotary_embs",
           needs="per-layer bases (layer_rope_theta, 0 = NoPE), one rotary module per base (rotary_embs); attention sinks; "
                 "scaling = attention_multiplier"),
    # One rotary table per layer type (no inv_freq buffer); a type whose block is None has no positions
    Family("Beam", ("beam",), typed_layers=True, rope_blocks="per_type",
           needs="a RoPE block per layer type, None for the full layers (NoPE, the model's own query scale)"),
    Family("Ergo", ("ergo",), typed_layers=True, rope_blocks="per_type", layout="interleaved",
           needs="a RoPE block per layer type, None for the full layers (NoPE, scaled q and k); interleaved pairs"),
    Family("Laguna", ("laguna",), typed_layers=True, rope_blocks="per_type",
           needs="a RoPE block per layer type, each with its own partial rotary"),
    Family("Mellum", ("mellum",), typed_layers=True, rope_blocks="per_type", needs="a RoPE block per layer type"),
    Family("LFM3", ("lfm3",), typed_layers=True, rope_blocks="per_type", no_attention=("conv",),
           needs="a RoPE block per layer type; short-convolution layers have no positions"),
    # Interleaved pairs: cos/sin's first half repeated pairwise, rotate_half over (2i, 2i + 1)
    Family("ERNIE 4.5", ("ernie4_5", "ernie4_5_moe"), layout="interleaved", needs="interleaved pairs (rotated in float32)"),
    Family("Helium", ("helium",), layout="interleaved", needs="interleaved pairs"),
    Family("GLM", ("glm",), layout="interleaved", needs="partial rotary (first half), interleaved pairs"),
    Family("DeepSeek-V2", ("deepseek_v2",), layout="interleaved", rope_slice="last", window="none",
           qk_head_dim=("qk_nope_head_dim", "qk_rope_head_dim"),
           needs="MLA: the rope part is the last qk_rope_head_dim features (complex pairs); value head dim differs"),
    Family("DeepSeek-V3", ("deepseek_v3",), rope_slice="last", window="none",
           qk_head_dim=("qk_nope_head_dim", "qk_rope_head_dim"),
           needs="MLA: the rope part is the last qk_rope_head_dim features, de-interleaved; value head dim differs"),
    # MLA as DeepSeek-V3's: [no-position part | rope part], the rope key part one head shared by all
    Family("MiniCPM3", ("minicpm3",), rope_slice="last", window="none", qk_head_dim=_MLA,
           needs="MLA (DeepSeek-V3's layout, half pairs without rope_interleave)"),
    Family("GLM-4 Lite", ("glm4_moe_lite",), rope_slice="last", window="none", qk_head_dim=_MLA, needs=_MLA_NEEDS),
    Family("Sarvam MLA", ("sarvam_mla",), rope_slice="last", window="none", qk_head_dim=_MLA, needs=_MLA_NEEDS),
    Family("Youtu", ("youtu",), rope_slice="last", window="none", qk_head_dim=_MLA, needs=_MLA_NEEDS),
    Family("A.X K1", ("axk1",), rope_slice="last", window="none", qk_head_dim=_MLA, needs=_MLA_NEEDS),
    Family("Mistral 4", ("mistral4",), rope_slice="last", window="none", qk_head_dim=_MLA, log_beta=True,
           needs=_MLA_NEEDS + "; the log-floor query scale"),
    Family("Bailing hybrid", ("bailing_hybrid",), rope_slice="last", window="none", qk_head_dim=_MLA, no_attention=("linear_attention",),
           needs=_MLA_NEEDS + "; Gated DeltaNet layers have no positions"),
    Family("LongCat-Flash", ("longcat_flash",), rope_slice="last", window="none", qk_head_dim=_MLA,
           needs=_MLA_NEEDS + "; two attention sublayers per decoder layer (a ModuleList self_attn, layer_idx 2i and 2i + 1, "
                 "num_hidden_layers = 2 x num_layers); LoRA scales on q and the kv latent before the rotation (nothing to do)"),
    Family("GLM-4", ("glm4",), layout="interleaved", needs="partial rotary (first half), interleaved pairs"),
    Family("GLM-4-MoE", ("glm4_moe",), needs="partial rotary (first half)"),
    Family("gpt-oss", ("gpt_oss",), typed_layers=True, sinks="sinks", needs="attention sinks (module.sinks); YaRN; alternating windows"),
    Family("Llama 4", ("llama4_text", "llama4"), typed_layers=True, layout="interleaved", nope="no_rope_layers",
           chunk_key="attention_chunk_size", temperature=True, qk_norm_after_rotation="use_qk_norm",
           needs="NoPE layers with the query temperature (posenc's, at each document's positions); chunked attention on RoPE layers; complex pairs"),
    Family("Qwen2-VL text", ("qwen2_vl_text", "qwen2_5_vl_text"), mrope=True,
           needs="M-RoPE (contiguous sections over 3-axis ids), rotated by the model, verified against posenc's mrope"),
    Family("Qwen3-VL text", ("qwen3_vl_text", "qwen3_vl_moe_text"), window="none", mrope=True,
           needs="M-RoPE (interleaved sections), rotated by the model, verified against posenc's mrope; router kwargs ignored"),
    Family("GLM-4V text", ("glm4v_text", "glm_ocr_text"), layout="interleaved", window="none", mrope=True,
           needs="M-RoPE (contiguous sections), interleaved pairs, partial rotary; rotated by the model, verified against posenc's mrope"),
    Family("GLM-4V-MoE text", ("glm4v_moe_text",), window="none", mrope=True,
           needs="M-RoPE (contiguous sections), half pairs, partial rotary; rotated by the model, verified against posenc's mrope"),
    Family("Cosmos3 Edge text", ("cosmos3_edge_text",), window="none", mrope=True,
           needs="M-RoPE (interleaved sections, as Qwen3-VL, without mrope_interleaved in its config); rotated by the model, "
                 "verified against posenc's mrope"),
    Family("Cohere Compass text", ("cohere_compass_text",), typed_layers=True, rope_blocks="per_type", mrope=True,
           needs="M-RoPE (interleaved sections) with a RoPE block per layer type (a None block: NoPE); rotated by the model, "
                 "each type's table verified against posenc's mrope"),
    Family("HunYuan v1", ("hunyuan_v1_dense", "hunyuan_v1_moe"), window="none", model_rotates=_NORM_AFTER_ROTATION,
           needs="q/k RMSNorms with a learned weight after the rotation: rotated by the model (its tables verified against "
                 "posenc's RoPE, NTK-alpha base); ALiBi, T5 and other encodings without a rotation replace it, a rotation "
                 "of posenc's is refused; router kwargs ignored"),
    Family("Dory", ("dory",), typed_layers=True, rope_blocks="per_type", model_rotates=_SCALE_AFTER_ROTATION,
           needs="a RoPE block per layer type; unit-norm q and k, then the rotation, then a learned per-channel query scale "
                 "(sqk): rotated by the model (its tables verified against posenc's RoPE); recurrent layers looped, each loop "
                 "its own cache layer (cache_offset)"),
    Family("HunYuan-VL text", ("hunyuan_vl_text",), window="none", mrope=True, mrope_encoding="xdrope",
           needs="XD-RoPE (4 axes, sections over features, NTK-alpha base); q/k norms after the rotation; rotated by the model, "
                 "verified against posenc's xdrope"),
    # No RoPE: the Inkling bias (posenc.hf.inkling), windows on the hybrid_sliding layers
    Family("Inkling", ("inkling_text",), typed_layers=True, own="inkling", type_names=_INKLING_TYPES,
           needs="no RoPE: the Inkling bias read from each layer's r_proj and curve bank; windows on hybrid_sliding layers; "
                 "the log scaling at cache slots"),
    Family("Inkling-2", ("inkling2_text", "inkling2_loop_text"), typed_layers=True, own="inkling", query_sinks="sinks", type_names=_INKLING_TYPES,
           needs="no RoPE: the Inkling bias read from each layer (clipped, log-scaled on full layers); per-query sinks "
                 "(sink_proj); windows on hybrid_sliding layers"),
    Family("ModernBERT", ("modernbert",), typed_layers=True, rope_blocks="per_type", window_key="local_attention", causal=False,
           needs="an encoder; a RoPE block per layer type; local windows"),
    Family("ModernBERT decoder", ("modernbert-decoder",), typed_layers=True, rope_blocks="per_type",
           needs="a RoPE block per layer type; causal windows of sliding_window (local_attention // 2)"),
    Family("EuroBERT", ("eurobert",), window="none", causal=False, needs="an encoder (LLaMA's layers, bidirectional)"),
    Family("GTE", ("gte",), window="none", causal=False, needs="an encoder; attention modules without layer_idx"),
    Family("Nomic BERT", ("nomic_bert",), window="none", causal=False, needs="an encoder; attention modules without layer_idx"),
    Family("Jina v3", ("jina_embeddings_v3",), window="none", causal=False, needs="an encoder; attention modules without layer_idx"),
    Family("ESM C", ("esmc",), window="none", causal=False,
           needs="an encoder; q/k layer norms before RoPE (nothing to do); sequence_id chains refused at the forward"),
    Family("ESM-2", ("esm",), window="none", causal=False, theta_key="rope_theta",
           refused_when=(("is_decoder", "a causal decoder (ESM's is_decoder), where posenc's row runs it as the "
                          "bidirectional encoder it is"),),
           needs="an encoder (RoPE with position_embedding_type='rotary'); layers in encoder.layer, attention in "
                 "attention.self, the rotary module rotary_embeddings beside them; its base rope_theta (no RoPE block); "
                 "q scaled by head_dim**-0.5 before the rotation and scaling 1 passed (nothing to do)"),
    Family("UltraBERT", ("ultrabert",), typed_layers=True, rope_blocks="per_type", causal=False, window_per_side=True,
           needs="an encoder; a RoPE block per layer type; local windows of sliding_window keys on each side"),
)

#: model_type -> its :class:`Family`.
BY_MODEL_TYPE: dict[str, Family] = {t: f for f in FAMILIES for t in f.model_types}

#: The multimodal wrappers whose text model is read from ``text_config``.
WRAPPERS = ("gemma3", "llama4", "qwen3_5", "qwen3_5_moe")


def family_of(model_type: Any) -> Family | None:
    """The row of ``model_type``, or None when the table has none."""
    return BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None


def getter(config: Any):
    """``get(key, default)`` over a config object or its dict."""

    def get(key: str, default: Any = None) -> Any:
        if isinstance(config, Mapping):
            return config.get(key, default)
        return getattr(config, key, default)

    return get


def text_config(config: Any) -> Any:
    """The text model's config of a multimodal wrapper (Gemma 3, Llama 4), else ``config``."""
    get = getter(config)
    if get("model_type") in WRAPPERS and get("text_config") is not None:
        return get("text_config")
    return config


def layer_config(config: Any, family: Family | None, layer: int | str | None) -> Any:
    """The config of one layer (an index, or a layer type) of a family with ``per_layer_config`` (its
    head dim and key/value heads; the last layer's when ``layer`` is None), else ``config``."""
    if family is None or not family.per_layer_config:
        return config
    return config.per_layer_config[int(config.num_hidden_layers) - 1 if layer is None else layer]


def qk_head_dim(config: Any, family: Family | None, layer: int | str | None = None) -> int:
    """D, the q/k head dim the attention function sees (of ``layer``: see :func:`layer_config`)."""
    get = getter(layer_config(config, family, layer))
    keys = family.qk_head_dim if family is not None else ("head_dim",)
    if all(get(k) is not None for k in keys):
        return sum(int(get(k)) for k in keys)
    return int(get("hidden_size")) // int(get("num_attention_heads"))


__all__ = ["BY_MODEL_TYPE", "FAMILIES", "Family", "WRAPPERS", "family_of", "getter", "layer_config", "qk_head_dim", "text_config"]
