"""The census of ``transformers`` families for posenc.hf (tests/hf/test_census.py): every model type
of the installed ``transformers``' causal-LM mapping and the text backbone of each image-text-to-text
model, each built from a tiny config with random weights, and what ``posenc.hf.use(model, "rope")``
does with it.

The tiny config is made generically: every key of :data:`TINY` that the family's default config has
(and can set) takes the tiny value, in the config and in each of its sub-configs (vision towers,
text models), and a family with several kinds of layers (``layer_types``) gets one layer of each
kind. :data:`OVERRIDES` holds the few families whose defaults do not build that way;
:data:`UNBUILDABLE` those that cannot be built here at all, with why. A new family in a later
``transformers`` is built the generic way and lands in the census by itself.

A family uses RoPE when its built model holds a rotary module (a module whose class name says
"Rotary", not a vision tower's) or its modeling module calls a rotation function; the others are
not part of the census (a family whose modeling source never names ``rotary`` is not even built).
"""

from __future__ import annotations

import copy
import inspect
import re
import sys
from dataclasses import dataclass
from typing import Any

import torch

VOCAB = 64
WINDOW = 8  # shorter than the census's sequences, so every window is crossed
LIMIT = 16_000_000  # parameters: a tiny model above this asks for an override

#: config key -> its tiny value, set wherever the family's default config has the key.
TINY: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    # experts
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
    # multi-head latent attention
    kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
    # windows and chunks
    sliding_window=WINDOW, attention_chunk_size=WINDOW,
    # partial rotary given as a width (GPT-J, CodeGen)
    rotary_dim=8,
    # state-space layers (Mamba-2 in the hybrids): their scan's chunks crossed, and a fast CPU scan
    mamba_chunk_size=WINDOW, mamba_d_state=16, mamba_n_heads=8,
    # vision towers and other sub-models
    num_layers=2, depth=2, embed_dim=64, num_heads=4, out_hidden_size=64, projection_dim=64,
)

#: model_type -> config keys over the generic tiny ones (the families whose defaults do not build,
#: or build a sub-model far too large).
def _mrope(theta: float, sections: list[int], **more: Any) -> dict[str, Any]:
    """An M-RoPE block whose sections (in frequencies) fit the tiny head (the backbones' rotary
    modules default to sections for a head dim of 128)."""
    return {"rope_parameters": {"rope_type": "default", "rope_theta": theta, "mrope_section": sections, **more}}


def _log_floor(theta: float, **more: Any) -> dict[str, Any]:
    """A YaRN block with Ministral 3's query scale over an original length of 4 (reached in 20 tokens)."""
    return {"rope_type": "yarn", "rope_theta": theta, "factor": 4.0, "original_max_position_embeddings": 4, "beta_fast": 32.0,
            "beta_slow": 1.0, "llama_4_scaling_beta": 0.5, **more}


_INKLING = dict(swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16, rel_extent=6, d_rel=4, log_scaling_n_floor=8)

_QWEN4_EXP = dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, hc_lowrank=8,
                  indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4)

_DOTS3 = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, head_dim=24, index_n_heads=2,
              index_head_dim=16, index_topk=8, swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_q_lora_rank=32,
              swa_kv_lora_rank=16, swa_head_dim=24, swa_qk_nope_head_dim=16, swa_v_head_dim=12, swa_qk_rope_head_dim=8)

OVERRIDES: dict[str, dict[str, Any]] = {
    "gemma4_text": dict(head_dim=16, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16,
                        per_layer_config={"1": {"head_dim": 32}}),  # its full layer's head dim differs
    "gemma4.text_config": dict(head_dim=16, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16,
                               per_layer_config={"1": {"head_dim": 32}}),
    "gemma3n_text": dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                         num_kv_shared_layers=2, activation_sparsity_pattern=[0.0] * 4, vocab_size_per_layer_input=VOCAB,
                         hidden_size_per_layer_input=16, laurel_rank=8, altup_num_inputs=2),
    "bamba": dict(attn_layer_indices=[1]),  # one mamba and one attention layer
    "granitemoehybrid": dict(layer_types=["mamba", "attention"], position_embedding_type="rope"),  # its default is NoPE
    "lfm2": dict(layer_types=["conv", "full_attention"]),  # one short-convolution and one attention layer
    "zamba2": dict(layers_block_type=["linear_attention", "hybrid"], use_mem_rope=True, head_dim=32),  # default NoPE; head 2 x 64 / 4
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], head_dim=16),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "longcat_flash": dict(qk_head_dim=24, head_dim=8),  # MLA: qk_nope_head_dim + qk_rope_head_dim
    "kolibri1_1": dict(index_num_heads=2, index_layers=[1], kv_source_layers=[0, 1], mlp_only_layers=[0]),
    "zaya": dict(num_experts_per_tok=1, layer_types=["hybrid", "hybrid_sliding"]),  # "supports num_experts_per_tok=1 only"
    "qwen2_vl_text": _mrope(1e6, [2, 3, 3]),
    "qwen2_5_vl_text": _mrope(1e6, [2, 3, 3]),
    "glm4v_text": _mrope(1e4, [2, 3, 3]),
    "glm_ocr_text": _mrope(1e4, [2, 3, 3]),
    "glm4v_moe_text": _mrope(1e4, [1, 1, 2], partial_rotary_factor=0.5),
    # Qwen3-VL's interleaved sections default to a head dim of 128 (24, 20, 20) and its block names none to shrink
    "qwen3_vl_text": _mrope(5e5, [3, 3, 2]),
    "qwen3_vl_moe_text": _mrope(5e5, [3, 3, 2]),
    # the log-floor query scale 1 + beta ln(1 + floor(pos / original)) moves within the census's 20 tokens
    "ministral3": dict(rope_parameters=_log_floor(1e6)),
    "mistral4": dict(qk_nope_head_dim=8, rope_parameters=_log_floor(1e4, partial_rotary_factor=0.5)),  # MLA: rope 8 of 16
    "flint": dict(layer_types=["sliding_attention", "full_attention"]),  # its default makes the first two layers full (NoPE)
    # its default partial rotary (0.334) turns an odd int(16 * 0.334) = 5 features at the tiny head dim
    "mimo_v2_flash": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}),
    # the RoPE block's scaling on layer 0 only (layer 1 rotates unscaled, with its second rotary module)
    "molmo2_text": dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}, rope_scaling_layers=[0]),
    # per-layer bases, a NoPE layer (base 0), and sliding and full layers
    "granite_swa": dict(num_hidden_layers=3, layer_types=["full_attention", "sliding_attention", "full_attention"],
                        layer_rope_theta=[0, 1e4, 1e5]),
    "granitemoe_swa": dict(num_hidden_layers=3, layer_types=["full_attention", "sliding_attention", "full_attention"],
                           layer_rope_theta=[0, 1e4, 1e5]),
    # DBRX: its sizes under its own names (the generic keys reach d_model after ffn_config took the default's); an
    # attention sub-config that must name rope_theta (read, never used) and a clip (torch's clamp refuses None for both)
    "dbrx": dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=256),
    "dbrx.attn_config": dict(rope_theta=5e5, kv_n_heads=2, clip_qkv=8.0),
    "dbrx.ffn_config": dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2),
    # Zamba: two hybrid layers, so that its shared transformer block has a layer to tie to
    "zamba": dict(num_hidden_layers=3, layer_types=["mamba", "hybrid", "hybrid"]),
    # one M-RoPE block per layer type (its rotary module reads rope_parameters[<layer type>]), interleaved sections
    "cohere_compass_text": dict(layer_types=["sliding_attention", "full_attention"], rope_parameters={
        kind: {"rope_type": "default", "rope_theta": theta, "mrope_section": [3, 3, 2]}
        for kind, theta in (("sliding_attention", 1e4), ("full_attention", 1e6))}),
    # Dory: one input, one looped (twice) and one output layer (its defaults are 8 + 20 + 8)
    "dory": dict(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"], n_input_layers=1,
                 n_output_layers=1, n_recurrent_layers=1, n_recurrent_loops=2),
    # Qwen4-Exp: small linear-attention heads and hyper-connections, and the indexer's sizes (its indexed layers need them)
    "qwen4_exp_text": _QWEN4_EXP,
    "qwen4_exp.text_config": _QWEN4_EXP,
    # Cosmos3 Edge's interleaved sections: the generic shrink of (24, 20, 20) gives (3, 2, 3), whose width
    # frequencies (3 * 3 - 1 = 8) do not fit interleaved in the tiny head's 8 (posenc's mrope refuses them)
    "cosmos3_edge_text": _mrope(1e8, [3, 3, 2]),
    # HunYuan-VL's four-axis sections, in frequencies of the tiny head (its default sets none)
    "hunyuan_vl_text": _mrope(1e4, [2, 2, 2, 2]),
    "glm5_next_text": dict(qk_rope_head_dim=0),  # its validator: the DSA (MLA) layers are NoPE
    "hy_v4_vl_text": _mrope(1e4, [1, 1, 2]),  # its sections sum to half the rope part of its MLA head (qk_rope_head_dim 8)
    # Chameleon: a vocabulary map (the image token and one image code) and a small VQ-VAE (the default's is 27M)
    "chameleon": dict(vocabulary_map={"<image>": 0, "IMGIMGAZ": VOCAB - 1}),
    "chameleon.vq_config": dict(embed_dim=32, num_embeddings=64, latent_channels=32, resolution=32, base_channels=32,
                                channel_multiplier=[1, 2], num_res_blocks=1),
    # MusicGen's causal LM is built from the decoder sub-config (one codebook: the census's (B, T) ids)
    "musicgen.decoder": dict(num_codebooks=1, ffn_dim=64),
    "musicgen_melody.decoder": dict(num_codebooks=1, ffn_dim=64),
    # BLT: a small hash-embedding table (its default is 500,002 x 6 rows of the encoder's width), the global width its
    # local encoder and decoder project to and from, and the depth its cache reads off the top config (which has none)
    "blt": dict(num_hidden_layers=2, encoder_hash_byte_group_vocab=VOCAB, encoder_hash_byte_group_size=[3, 4]),
    "blt.encoder_config": dict(hidden_size_global=64),
    "blt.decoder_config": dict(hidden_size_global=64),
    # Dots 3 Note: small MLA heads on both layer types (the sliding layers' through its swa_* keys) and a small indexer;
    # its vision tower dense (no per-layer expert counts keyed by the default depth), its adapters at the tiny widths
    "dots3_note_text": _DOTS3,
    "dots3_note.text_config": _DOTS3,
    "dots3_note.vision_config": dict(per_layer_config={}, adapter_in_dim=64, adapter_out_dim=64, mlp_layer_types=["dense", "dense"]),
    "dots3_note.audio_config": dict(adapter_input_size=64, adapter_out_dim=64, downsample_hidden_size=32, feature_size=16),
    "esm": dict(position_embedding_type="rotary"),  # ESM-2's (the default is absolute positions)
    # Inkling, Inkling-2 (no RoPE: use(model, "inkling")): small sliding heads, curves over 6 distances (crossed), the
    # log scaling from position 8 (reached), a head over the tiny vocabulary; Inkling-2-Loop loops its middle layer twice
    "inkling_text": _INKLING,
    "inkling2_text": dict(_INKLING, unpadded_vocab_size=VOCAB),
    "inkling2_loop_text": dict(_INKLING, unpadded_vocab_size=VOCAB, num_hidden_layers=3, n_layers_per_attn_res_block=1,
                               layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"], loop_layer_index_start=1,
                               loop_layer_index_end=2, loop_num_passes=2, loop_gate_rank=4),
}

#: model_type -> why the census cannot build it here (the test skips it, naming the reason).
_POLICY = "a robot-action policy: its forward takes action embeddings before any token ids (and its nested VLM config is not shrunk)"
UNBUILDABLE: dict[str, str] = {
    "pi05": _POLICY, "pi0": _POLICY,
    "gemma3n": "its vision tower needs timm, which is not installed",
    "gemma4_assistant": "a draft model: its forward needs the target model's input embeddings and shared KV states",
    "gemma4_unified_assistant": "a draft model: its forward needs the target model's shared KV states",
    "evolla": "no bare model class for its text config",
    "idefics": "its backbone's forward needs image inputs",
}


def _settable(config: Any, key: str) -> bool:
    """Whether ``key`` is a config field (not a read-only property)."""
    key = getattr(type(config), "attribute_map", {}).get(key, key)  # a standard name for the family's own
    static = inspect.getattr_static(type(config), key, None)
    if isinstance(static, property) and static.fset is None:
        return False
    try:
        return hasattr(config, key)
    except Exception:  # a per-layer attribute that refuses a global read (Gemma 4's head_dim)
        return False


WITHOUT_GQA = ("esmc",)  # "ESMC does not support grouped-query attention"


def _tiny_keys(config: Any, model_type: str | None) -> dict[str, Any]:
    """The tiny keys of one config (not its sub-configs)."""
    keys = {k: v for k, v in TINY.items() if _settable(config, k)}
    types = getattr(config, "layer_types", None) if _settable(config, "layer_types") else None
    if isinstance(types, (list, tuple)) and types:
        kinds = list(dict.fromkeys(types))  # one layer of each kind, in the order they first appear
        if len(kinds) > 1:
            keys["layer_types"] = kinds
            keys["num_hidden_layers"] = len(kinds)
        elif "num_hidden_layers" in keys:
            keys["layer_types"] = kinds * keys["num_hidden_layers"]
    block = getattr(config, "rope_parameters", None) if "hidden_size" in keys else None
    if isinstance(block, dict) and isinstance(block.get("mrope_section"), (list, tuple)):
        # M-RoPE: its sections (in frequencies) shrunk to the tiny head's rotated half
        factor = block.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
        head_dim = keys.get("head_dim") or keys["hidden_size"] // keys.get("num_attention_heads", 4)
        total, sections = int(head_dim * factor) // 2, list(block["mrope_section"])
        shrunk = [max(1, x * total // sum(sections)) for x in sections]
        shrunk[-1] += total - sum(shrunk)
        keys["rope_parameters"] = {**block, "mrope_section": shrunk}
    if "kv_lora_rank" in keys:  # MLA: every query head has its key head; head dims from the MLA keys
        keys["num_key_value_heads"] = keys.get("num_attention_heads", 4)
        keys.pop("head_dim", None)
    if model_type in WITHOUT_GQA and "num_attention_heads" in keys:  # as many key/value heads as query heads, at any size
        keys["num_key_value_heads"] = keys["num_attention_heads"]
    if model_type is not None:
        keys.update(OVERRIDES.get(model_type, {}))
    return keys


def tiny_config(model_type: str) -> Any:
    """The family's config with the tiny keys in it and in each sub-config."""
    from transformers import AutoConfig, PretrainedConfig

    base = AutoConfig.for_model(model_type)
    kwargs = _tiny_keys(base, model_type)
    for name in getattr(base, "sub_configs", {}) or {}:
        sub = getattr(base, name, None)
        if isinstance(sub, PretrainedConfig):  # the sub-config's defaults, with the tiny keys
            kwargs[name] = {**_tiny_keys(sub, None), **OVERRIDES.get(f"{model_type}.{name}", {})}
    return AutoConfig.for_model(model_type, **kwargs)


@dataclass(frozen=True)
class Case:
    """One census entry: a model type and where it came from."""

    model_type: str
    source: str  # "causal-lm", "backbone of <image-text-to-text type>", or "masked-lm" (an encoder)

    def __str__(self) -> str:
        return self.model_type


def cases() -> list[Case]:
    """Every causal-LM model type, then the text backbones of the image-text-to-text models that are
    not causal-LM types themselves (each once)."""
    from transformers import AutoConfig
    from transformers.models.auto import modeling_auto

    causal = list(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    found = [Case(t, "causal-lm") for t in causal]
    seen = set(causal)
    for wrapper in modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        try:
            text = _text_config(AutoConfig.for_model(wrapper))
        except Exception:  # a wrapper without a readable text config: nothing to census
            continue
        backbone = getattr(text, "model_type", None)
        if isinstance(backbone, str) and backbone not in seen and backbone in modeling_auto.MODEL_MAPPING_NAMES:
            seen.add(backbone)
            found.append(Case(backbone, f"backbone of {wrapper}"))
    return found


def encoder_cases() -> list[Case]:
    """Every model type of the masked-LM mapping (the encoders: tests/hf/test_census_encoders.py),
    RoFormer's too (its causal-LM class is a decoder; its masked LM the encoder)."""
    from transformers.models.auto import modeling_auto

    return [Case(t, "masked-lm") for t in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES]


def _text_config(config: Any) -> Any:
    getter = getattr(config, "get_text_config", None)
    if getter is None:
        return config
    try:
        return getter(decoder=True)
    except Exception:
        return getattr(config, "text_config", None)


def model_class(case: Case) -> Any:
    """The Auto class the census builds with: the causal LM, the masked LM (an encoder), or for a
    backbone its bare model."""
    from transformers.models.auto import modeling_auto

    if case.source == "masked-lm":
        return modeling_auto.AutoModelForMaskedLM
    return (modeling_auto.AutoModelForCausalLM if case.source == "causal-lm" else modeling_auto.AutoModel)


def rotates(case: Case) -> bool:
    """Whether the family may rotate, read before building it: its modeling module's source names
    ``rotary``, or it wraps sub-models (a text model of another family). The others are not built."""
    import transformers
    from transformers.models.auto import modeling_auto

    names = {"causal-lm": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "masked-lm": modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
             }.get(case.source, modeling_auto.MODEL_MAPPING_NAMES)[case.model_type]
    name = names[0] if isinstance(names, (list, tuple)) else names
    try:
        cls = getattr(transformers, name)
    except Exception:  # a class the installed transformers cannot import (a missing extra): built to find out
        return True
    if "rotary" in inspect.getsource(sys.modules[cls.__module__]).lower():
        return True
    # A wrapper whose text model is another family's (Fuyu's Persimmon, GOT-OCR 2's Qwen2): built to find out
    try:
        return bool(getattr(transformers.AutoConfig.for_model(case.model_type), "sub_configs", None))
    except Exception:  # a default config that does not validate: built (with the tiny keys) to find out
        return True


def _class_config(case: Case, config: Any) -> tuple[Any, Any]:
    """The config the census's class for ``case`` takes and how to build from it: ``config`` and the
    Auto class's ``from_config``, or the sub-config of that class and the class's own ``_from_config``
    (MusicGen's causal LM takes its composite config's ``decoder``, which the Auto class does not map)."""
    import transformers
    from transformers.models.auto import modeling_auto

    names = {"causal-lm": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "masked-lm": modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
             }.get(case.source, modeling_auto.MODEL_MAPPING_NAMES).get(case.model_type)
    cls = getattr(transformers, names, None) if isinstance(names, str) else None
    wanted = getattr(cls, "config_class", None)
    if not isinstance(wanted, type) or isinstance(config, wanted):
        return config, model_class(case).from_config
    sub = next((sub for name in getattr(config, "sub_configs", {}) or {} if isinstance(sub := getattr(config, name, None), wanted)), None)
    return (config, model_class(case).from_config) if sub is None else (sub, cls._from_config)


def build(case: Case, **overrides: Any) -> torch.nn.Module:
    """The family's tiny model, every weight moved off its init value (norm weights not 1, sinks
    not 0), in eval mode; ``overrides`` are set on its tiny config first.

    Raises:
        ValueError: the tiny model would have more than :data:`LIMIT` parameters (it needs an override).
    """
    config = tiny_config(case.model_type)
    for key, value in overrides.items():
        setattr(config, key, value)
    config, make = _class_config(case, config)
    with torch.device("meta"):
        shell = make(config)
    size = sum(p.numel() for p in shell.parameters())
    if size > LIMIT:
        raise ValueError(f"{case.model_type}: the tiny config still makes {size:,} parameters; add an override "
                         "to tests/hf_census_configs.py")
    torch.manual_seed(0)
    model = make(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def uses_rope(model: torch.nn.Module) -> bool:
    """Whether the model rotates: a rotary module in it (not a vision tower's), or its modeling
    module calling a rotation function (GPT-J, CodeGen, RoFormer compute their tables inline; Jamba
    defines LLaMA's apply_rotary_pos_emb and never calls it)."""
    if any("rotary" in type(m).__name__.lower() and "vision" not in type(m).__name__.lower() for m in model.modules()):
        return True
    source = inspect.getsource(sys.modules[type(model).__module__])
    return re.search(r"(?<!def )\bapply_rotary\w*\(", source) is not None


def untouched_copy(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)


__all__ = ["Case", "LIMIT", "OVERRIDES", "TINY", "UNBUILDABLE", "VOCAB", "WINDOW", "build", "cases", "encoder_cases", "model_class", "rotates",
           "tiny_config", "untouched_copy", "uses_rope"]
