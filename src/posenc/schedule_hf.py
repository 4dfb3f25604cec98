"""``schedule_from_hf``: the layer schedule of a Hugging Face ``transformers`` config.

Reads a config object (``AutoConfig.from_pretrained(...)``, or one built in code) or the dict of
one, for the families below, and says per layer what its attention sees: the RoPE base, the
scaling block (only on the layers where that model applies it), the pair layout, NoPE layers, the
window or chunk, the query temperature and the sinks. Every value comes from the config: a missing
``rope_theta`` or ``layer_types`` is a UsageError naming the key, never a default base (the silent
10000 of vLLM PR #56066), and an unknown scaling key or layer type is one too.

What each family needs (``transformers`` 5.24 ``configuration_*.py`` and ``modeling_*.py``):

- Gemma 2 (``gemma2``): ``layer_types`` alternate sliding/full; one ``rope_parameters`` block
  for both; window ``sliding_window`` on the sliding layers.
- Gemma 3 (``gemma3_text``, ``gemma3``): ``rope_parameters`` per layer type (local base 1e4,
  global 1e6); a ``rope_scaling`` the config got lives in the ``full_attention`` block only, so
  the local layers keep plain RoPE (the vLLM PR #29111 / llama.cpp #14367 bug was the opposite).
- Cohere2 (``cohere2``): RoPE on the sliding layers only; the full layers are NoPE; the
  interleaved pair layout (its ``rotate_half`` pairs features 2k and 2k + 1).
- Llama 4 text (``llama4_text``, ``llama4``: its ``text_config``): ``no_rope_layers[l]`` = 1 for
  RoPE; RoPE layers take chunked attention of ``attention_chunk_size`` and the interleaved layout
  (complex pairs); NoPE layers take full attention and, with ``attn_temperature_tuning``, the
  temperature ``attn_scale`` / ``floor_scale`` (:class:`~posenc.query_scale.Temperature`).
- SmolLM3 (``smollm3``): ``no_rope_layers`` for the NoPE layers; a window only where
  ``layer_types`` says sliding (``use_sliding_window``).
- OLMo 3 (``olmo3``): ``rope_parameters`` per layer type, 3 sliding : 1 full.
- gpt-oss (``gpt_oss``): one YaRN block on every layer, window ``sliding_window`` on the sliding
  ones, and sinks on every layer (its ``sinks`` parameter, one logit per head).
- ModernBERT (``modernbert``): an encoder (build the model with ``causal=False``); its local layers
  see ``|i - j| <= local_attention // 2``, which is ``window=local_attention`` here; a base per
  layer type (160k global, 10k local).
- Ministral 3 (``ministral3``): no ``layer_types``: every layer alike, windowed when
  ``sliding_window`` is set; YaRN, and the query scale
  ``1 + beta ln(1 + floor(pos / original))`` on every layer from the block's
  ``llama_4_scaling_beta`` and ``original_max_position_embeddings``
  (:class:`~posenc.query_scale.LogFloorScale`), a key taken out of the RoPE block.

The multimodal wrappers (``gemma3``, ``llama4``) are read through their ``text_config``.

Not positional, hence not in the schedule (the caller's projections keep them): Gemma's
``query_pre_attn_scalar`` (the scale of q . k, give ``scale=`` to :func:`posenc.attend`) and
logit soft-capping, Gemma 3's q/k RMSNorm, Llama 4's weightless L2 q/k norm after RoPE.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .encodings.rope_scaling import options_from_hf
from .errors import UsageError
from .query_scale import LogFloorScale, Temperature
from .schedule import Layer, Schedule

FAMILIES = ("gemma2", "gemma3_text", "gemma3", "cohere2", "llama4_text", "llama4", "smollm3", "olmo3", "gpt_oss", "modernbert",
            "ministral3")
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
INTERLEAVED = ("cohere2", "llama4_text")
PER_TYPE_BLOCKS = ("gemma3_text", "olmo3", "modernbert")


def _getter(config):
    def get(key: str, default=None):
        if isinstance(config, Mapping):
            return config.get(key, default)
        return getattr(config, key, default)

    return get


def _need(get, key: str, family: str):
    value = get(key)
    if value is None:
        raise UsageError(f"schedule_from_hf: {family} config has no {key!r}; load it with transformers' AutoConfig "
                         f"(which fills it) or give {key}")
    return value


def _rope(get, block_name: str, block, family: str, layout: str) -> dict:
    """The RoPE options of one rope_parameters block: base, scaling (None when 'default'), layout."""
    if not isinstance(block, Mapping):
        raise UsageError(f"schedule_from_hf: {family} {block_name} must be a dict of RoPE parameters, got {block!r}")
    block = dict(block)
    theta = block.get("rope_theta", get("rope_theta"))
    if theta is None:
        raise UsageError(f"schedule_from_hf: {family} {block_name} has no 'rope_theta' (and the config none either); "
                         "refusing to guess a base")
    block["rope_theta"] = theta
    view = {key: get(key) for key in ("num_attention_heads", "head_dim", "hidden_size", "partial_rotary_factor",
                                      "max_position_embeddings", "original_max_position_embeddings")}
    view["rope_parameters"] = block
    found = options_from_hf(view)
    options: dict[str, Any] = {"base": float(found["base"])}
    scaling = {k: v for k, v in found["scaling"].items() if k != "rope_theta"}
    if scaling.get("rope_type", scaling.get("type", "default")) != "default" or set(scaling) - {"rope_type", "type"}:
        options["scaling"] = scaling
    if layout != "half":
        options["layout"] = layout
    # Build it once here: an unknown scaling key or a bad value is a UsageError naming it now.
    from .encodings import build

    build("rope", num_heads=int(found["num_heads"]), head_dim=int(found["head_dim"]), **options)
    return options


def schedule_from_hf(config) -> Schedule:
    """The :class:`~posenc.schedule.Schedule` of a ``transformers`` config (object or dict) of one of
    :data:`FAMILIES` (see the module docstring for what each needs).

    Raises:
        UsageError: another family, a missing key (naming it), an unknown layer type or scaling key.
    """
    get = _getter(config)
    family = get("model_type")
    if family in ("llama4", "gemma3") and get("text_config") is not None:
        return schedule_from_hf(get("text_config"))
    if family not in FAMILIES:
        raise UsageError(f"schedule_from_hf: model_type {family!r} is not one of {list(FAMILIES)}")
    family = {"gemma3": "gemma3_text", "llama4": "llama4_text"}.get(family, family)
    if get("use_bidirectional_attention"):
        raise UsageError(f"schedule_from_hf: {family} with use_bidirectional_attention=True is not read here")
    depth = int(_need(get, "num_hidden_layers", family))
    beta: float | LogFloorScale | None = None
    params = _need(get, "rope_parameters", family)
    if family == "ministral3":  # one kind of layer; the beta scale sits in the RoPE block
        types = ["sliding_attention" if get("sliding_window") is not None else "full_attention"] * depth
        params = dict(params)
        if "llama_4_scaling_beta" in params:
            beta = float(params.pop("llama_4_scaling_beta"))
            original = params.get("original_max_position_embeddings")
            if original is None:
                raise UsageError("schedule_from_hf: ministral3 rope_parameters has llama_4_scaling_beta but no "
                                 "'original_max_position_embeddings' (the length its floor divides by)")
            beta = LogFloorScale(beta, int(original))
    else:
        types = list(_need(get, "layer_types", family))
    if len(types) != depth:
        raise UsageError(f"schedule_from_hf: layer_types has {len(types)} entries, num_hidden_layers is {depth}")
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise UsageError(f"schedule_from_hf: layer_types holds {unknown}; known: {list(LAYER_TYPES)}")
    layout = "interleaved" if family in INTERLEAVED else "half"

    def block_for(kind: str) -> tuple[str, Any]:
        if family in PER_TYPE_BLOCKS:
            if not isinstance(params, Mapping) or kind not in params:
                raise UsageError(f"schedule_from_hf: {family} needs rope_parameters[{kind!r}] (one block per layer type)")
            return f"rope_parameters[{kind!r}]", params[kind]
        return "rope_parameters", params

    rope_cache: dict[str, dict] = {}

    def rope_options(kind: str) -> dict:
        key = kind if family in PER_TYPE_BLOCKS else "all"
        if key not in rope_cache:
            rope_cache[key] = _rope(get, *block_for(kind), family, layout)
        return dict(rope_cache[key])

    window = None
    if "sliding_attention" in types:
        window = int(_need(get, "local_attention" if family == "modernbert" else "sliding_window", family))
    no_rope = None
    if family in ("llama4_text", "smollm3"):
        no_rope = list(_need(get, "no_rope_layers", family))
        if len(no_rope) != depth:
            raise UsageError(f"schedule_from_hf: no_rope_layers has {len(no_rope)} entries, num_hidden_layers is {depth}")
    temperature = None
    if family == "llama4_text" and get("attn_temperature_tuning"):
        temperature = Temperature(float(_need(get, "attn_scale", family)), int(_need(get, "floor_scale", family)))
    layers = []
    for i, kind in enumerate(types):
        uses_rope = True
        if no_rope is not None:
            uses_rope = bool(no_rope[i])
        if family == "cohere2":
            uses_rope = kind == "sliding_attention"
        layer: dict = {"encoding": "rope" if uses_rope else "nope"}
        if uses_rope:
            layer["options"] = rope_options(kind)
        if kind == "sliding_attention":
            layer["window"] = window
        elif kind == "chunked_attention":
            layer["chunk"] = int(_need(get, "attention_chunk_size", family))
        if family == "gpt_oss":
            layer["sinks"] = True
        if temperature is not None and not uses_rope:
            layer["query_scale"] = temperature
        if beta is not None:
            layer["query_scale"] = beta
        layers.append(Layer.from_dict(layer))
    return Schedule(tuple(layers))


__all__ = ["FAMILIES", "schedule_from_hf"]
