"""``schedule_from_hf``: the layer schedule of a Hugging Face ``transformers`` config.

Reads a config object (``AutoConfig.from_pretrained(...)``, or one built in code) or the dict of
one, for the families of :data:`posenc.hf.families.FAMILIES`, and says per layer what its attention
sees: the RoPE base, the scaling block (only on the layers where that model applies it), the pair
layout, NoPE layers, the window or chunk, the query scale and the sinks. What differs between
families is a row of that table (its module docstring defines each field); this module reads a
config through the row. Every value comes from the config: a missing ``rope_theta`` or
``layer_types`` is a UsageError naming the key, never a default base (the silent 10000 of vLLM PR
#56066), and an unknown scaling key or layer type is one too.

Some rows, read here (``transformers`` 5.24):

- Gemma 3 (``gemma3_text``, ``gemma3``): ``rope_parameters`` per layer type (local base 1e4,
  global 1e6); a ``rope_scaling`` the config got lives in the ``full_attention`` block only, so
  the local layers keep plain RoPE (the vLLM PR #29111 / llama.cpp #14367 bug was the opposite).
- Cohere2: RoPE on the sliding layers only; the full layers are NoPE; interleaved pairs.
- Llama 4 text: ``no_rope_layers[l]`` = 1 for RoPE; RoPE layers take chunked attention of
  ``attention_chunk_size`` and the interleaved layout (complex pairs); NoPE layers take full
  attention and, with ``attn_temperature_tuning``, the temperature ``attn_scale`` / ``floor_scale``
  (:class:`~posenc.encodings.query_scale.Temperature`).
- gpt-oss: one YaRN block on every layer, the window on the sliding ones, sinks on every layer.
- ModernBERT: an encoder (build the model with ``causal=False``); its local layers see
  ``|i - j| <= local_attention // 2``, which is ``window=local_attention`` here.
- UltraBERT: an encoder whose local layers see ``|i - j| <= sliding_window``: ``window=2 * sliding_window``.
- Ministral 3: every layer alike, windowed when ``sliding_window`` is set; YaRN, and the query
  scale ``1 + beta ln(1 + floor(pos / original))`` from the block's ``llama_4_scaling_beta``
  (:class:`~posenc.encodings.query_scale.LogFloorScale`), a key taken out of the RoPE block.
- Qwen3-Next: its ``linear_attention`` layers have no positions (NoPE here).
- The M-RoPE backbones (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V, Cosmos3 Edge text): ``mrope`` layers,
  read by :func:`posenc.mrope_from_hf` (sections, interleaving, GLM's interleaved pairs and partial
  rotary); Cohere Compass: one ``mrope`` block per layer type; HunYuan-VL: ``xdrope`` layers
  (``Family.mrope_encoding``), read by :func:`posenc.hf.rope_config.xdrope_from_hf`.

The multimodal wrappers (``gemma3``, ``llama4``) are read through their ``text_config``.

Not positional, hence not in the schedule (the caller's projections keep them): Gemma's
``query_pre_attn_scalar`` (the scale of q . k, give ``scale=`` to :func:`posenc.attend`) and
logit soft-capping (``softcap=``), q/k norms, partial rotary (a RoPE option the model's head
sizes decide: :func:`posenc.hf.use` reads it from the model).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..encodings import build
from ..encodings.query_scale import LogFloorScale, Temperature
from ..errors import UsageError
from ..model.schedule import Layer, Schedule
from .families import BY_MODEL_TYPE, family_of, getter, layer_config, text_config
from .rope_config import mrope_from_hf, options_from_hf, xdrope_from_hf

LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def _getter(config):
    return getter(config)


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
    build("rope", num_heads=int(found["num_heads"]), head_dim=int(found["head_dim"]), **options)
    return options


def _mrope(config: Any, layout: str, block: Any = None, encoding: str = "mrope") -> dict:
    """The multi-axis RoPE options of an M-RoPE family's config: for ``encoding="mrope"``
    (:func:`posenc.mrope_from_hf`) base, sections, interleaving, the pair layout and the rotated
    features; for ``"xdrope"`` (:func:`~posenc.hf.rope_config.xdrope_from_hf`: HunYuan-VL) base,
    sections and the NTK-alpha scaling. ``block``: a layer type's RoPE block (one per type: Cohere
    Compass), read in place of the config's ``rope_parameters``."""
    if block is not None:
        get = getter(config)
        config = {"model_type": get("model_type"), "num_attention_heads": get("num_attention_heads"),
                  "head_dim": get("head_dim"), "hidden_size": get("hidden_size"),
                  "partial_rotary_factor": get("partial_rotary_factor"), "rope_parameters": block}
    if encoding == "xdrope":
        xd = xdrope_from_hf(config)
        found: dict[str, Any] = {"base": xd.base, "xdrope_section": list(xd.xdrope_section)}
        if xd.scaling.rope_type != "default":
            found["scaling"] = {"rope_type": xd.scaling.rope_type, "alpha": xd.scaling.alpha}
        return found
    enc = mrope_from_hf(config, layout=layout)
    options: dict[str, Any] = {"base": enc.base, "mrope_section": list(enc.mrope_section),
                               "mrope_interleaved": enc.mrope_interleaved}
    if layout != "half":
        options["layout"] = layout
    if enc.rotary_dim != enc.head_dim:
        options["rotary_dim"] = enc.rotary_dim
    return options


def schedule_from_hf(config) -> Schedule:
    """The :class:`~posenc.model.schedule.Schedule` of a ``transformers`` config (object or dict) of a
    family in :data:`posenc.hf.families.FAMILIES` (see the module docstring).

    Args:
        config: the config, or its dict.

    Raises:
        UsageError: another family, a missing key (naming it), an unknown layer type or scaling key.
    """
    config = text_config(config)
    get = getter(config)
    family = family_of(get("model_type"))
    if family is None:
        known = sorted(BY_MODEL_TYPE)
        raise UsageError(f"schedule_from_hf: model_type {get('model_type')!r} is not one of {known}")
    name = family.name
    if family.own != "rope":  # Inkling: each layer's bias is read from its weights (posenc.hf.inkling), not its config
        raise UsageError(f"schedule_from_hf: {name} has no RoPE; its layers' own encoding is {family.own!r}, read from each "
                         f"layer's weights by posenc.hf.use(model, {family.own!r}), not a schedule of its config")
    if get("use_bidirectional_attention"):
        raise UsageError(f"schedule_from_hf: {name} with use_bidirectional_attention=True is not read here")
    depth = int(_need(get, "num_hidden_layers", name))
    beta: float | LogFloorScale | None = None
    # a base fixed in the modeling code (GPT-J, CodeGen: no RoPE block in the config, none read)
    # or a base the config holds beside no RoPE block (ESM-2's rope_theta, the default rotation: Family.theta_key)
    params: Any = ({"rope_type": "default", "rope_theta": family.fixed_theta} if family.fixed_theta is not None
                   else {"rope_type": "default", "rope_theta": _need(get, family.theta_key, name)} if family.theta_key is not None
                   else _need(get, "rope_parameters", name))
    if family.log_beta and isinstance(params, Mapping) and "llama_4_scaling_beta" in params:
        params = dict(params)
        beta = float(params.pop("llama_4_scaling_beta"))
        original = params.get("original_max_position_embeddings")
        if original is None:
            raise UsageError(f"schedule_from_hf: {name} rope_parameters has llama_4_scaling_beta but no "
                             "'original_max_position_embeddings' (the length its floor divides by)")
        beta = LogFloorScale(beta, int(original))
    window_size = get(family.window_key)
    if family.typed_layers:
        types = list(_need(get, "layer_types", name))
    elif get("layer_types") is not None and family.window == "layer_types":
        types = list(get("layer_types"))
    elif family.window == "every_layer" and window_size is not None:
        types = ["sliding_attention"] * depth
    else:
        types = list(get("layer_types") or ["full_attention"] * depth)
    if len(types) != depth:
        raise UsageError(f"schedule_from_hf: layer_types has {len(types)} entries, num_hidden_layers is {depth}")
    named = dict(family.type_names)  # the family's own names of attention layers (Falcon-H1's "hybrid")
    unknown = sorted(set(types) - set(LAYER_TYPES) - set(family.no_attention) - set(named))
    if unknown:
        raise UsageError(f"schedule_from_hf: layer_types holds {unknown}; known: {list(LAYER_TYPES + family.no_attention)}")

    def block_for(kind: str) -> tuple[str, Any]:
        if family.rope_blocks == "per_type":
            if not isinstance(params, Mapping) or kind not in params:
                raise UsageError(f"schedule_from_hf: {name} needs rope_parameters[{kind!r}] (one block per layer type)")
            return f"rope_parameters[{kind!r}]", params[kind]
        return "rope_parameters", params

    rope_cache: dict[str, dict] = {}

    def rope_options(kind: str) -> dict:
        key = kind if family.rope_blocks == "per_type" else "all"
        if key not in rope_cache:
            own = getter(layer_config(config, family, kind)) if family.per_layer_config else get  # its head dim (Gemma 4)
            rope_cache[key] = (_mrope(config, family.layout, block_for(kind)[1] if family.rope_blocks == "per_type" else None,
                                      family.mrope_encoding) if family.mrope else _rope(own, *block_for(kind), name, family.layout))
        return dict(rope_cache[key])

    window = None
    if "sliding_attention" in [named.get(kind, kind) for kind in types]:
        window = int(_need(get, family.window_key, name))
        if family.window_per_side:  # keys on each side (UltraBERT): posenc's bidirectional window is the total width
            window *= 2
    no_rope = None
    if family.nope == "no_rope_layers":
        no_rope = list(_need(get, "no_rope_layers", name))
        if len(no_rope) != depth:
            raise UsageError(f"schedule_from_hf: no_rope_layers has {len(no_rope)} entries, num_hidden_layers is {depth}")
    tuning = None
    if family.temperature and get("attn_temperature_tuning"):
        tuning = Temperature(float(_need(get, "attn_scale", name)), int(_need(get, "floor_scale", name)))
    layers = []
    for i, kind in enumerate(types):
        uses_rope = kind not in family.no_attention
        if no_rope is not None:
            uses_rope = bool(no_rope[i])
        if family.nope == "full_layers":
            uses_rope = kind == "sliding_attention"
        elif family.rope_blocks == "per_type" and isinstance(params, Mapping) and kind in params and params[kind] is None:
            uses_rope = False  # a layer type without a RoPE block (Beam, Ergo: NoPE full layers)
        elif family.nope in ("zero_theta", "layer_theta"):  # layer_rope_theta: 0 is NoPE; the others each layer's base
            uses_rope = bool(_need(get, "layer_rope_theta", name)[i])  # (Granite-SWA) or the one block's (Muse: zero_theta)
        elif family.nope == "full_layers_if_windowed":  # full layers NoPE when the config sets a window, else all rotate
            uses_rope = kind == "sliding_attention" or get(family.window_key) is None
        elif family.nope == "full_layers_but_dense":  # a full layer with a dense MLP rotates when the prefix pattern is 1
            dense = (get("mlp_layer_types") or ["sparse"] * depth)[i] == "dense" and get("prefix_dense_sliding_window_pattern") == 1
            uses_rope = kind == "sliding_attention" or dense
        layer: dict = {"encoding": (family.mrope_encoding if family.mrope else "rope") if uses_rope else "nope"}
        if uses_rope:
            layer["options"] = rope_options(kind)
            if family.nope == "layer_theta":
                layer["options"]["base"] = float(get("layer_rope_theta")[i])
            if family.scaled_layers is not None and i not in (get(family.scaled_layers) or ()):
                layer["options"].pop("scaling", None)  # its base unscaled (Molmo2)
        kind = named.get(kind, kind)
        if kind == "sliding_attention":
            layer["window"] = window
        elif kind == "chunked_attention":
            layer["chunk"] = int(_need(get, family.chunk_key or "attention_chunk_size", name))
        if family.sinks is not None:
            layer["sinks"] = True
        if tuning is not None and not uses_rope:
            layer["query_scale"] = tuning
        if beta is not None:
            layer["query_scale"] = beta
        layers.append(Layer.from_dict(layer))
    return Schedule(tuple(layers))


__all__ = ["LAYER_TYPES", "schedule_from_hf"]
