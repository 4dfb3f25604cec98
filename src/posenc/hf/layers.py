"""The plan of a model for :func:`posenc.hf.use`: its decoder stack, its family's row
(:data:`posenc.hf.families.FAMILIES`), its sizes (heads, the q/k head dim, the rotated features read
from its rotary module), its own schedule, and per attention layer a
:class:`~posenc.hf.attention.LayerPlan` with the encoding :func:`use` installs.

For ``use(model, "rope")`` each layer's RoPE is checked against the model's own rotary tables
(frequencies and attention factor); a model outside the table is checked against its own
``apply_rotary_pos_emb``. A difference is a UsageError, never a silently different model.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any, cast

from torch import nn

from ..encodings import build, get_class, options_of
from ..encodings.base import PositionalEncoding
from ..encodings.protocol import Curves, Embeds, Gates, Remaps, Selects, offers
from ..errors import UsageError
from ..model.schedule import Layer, Schedule
from .attention import LayerPlan
from .fallback import probe
from .families import Family, layer_config, qk_head_dim
from .mrope import refuse_other
from .rope_config import options_from_hf
from .rotary_checks import check_rotation, rotary_tables, verify_rope
from .rotary_sets import layer_rotary, per_layer
from .schedule_config import schedule_from_hf

# -- the plan: family, sizes, schedule -----------------------------------------------------------


def check_shared(layers: list[nn.Module], attentions: list[nn.Module | None], plans: list[LayerPlan | None]) -> None:
    """An attention module that serves several layers holds one plan, so those layers must be planned
    alike; and an encoding that reads the layer input (forget gates, bias curves) is not run in a
    shared transformer block (Zamba2's: one module per hybrid layer, their weights tied): its
    attention takes the hidden state and the embeddings side by side (twice hidden_size wide), and
    each block's ``layer_idx`` is -1, under which the gates of every such layer would be kept.

    Raises:
        UsageError: two layers of one attention module with different plans (an encoding that learns
            per layer, or a schedule that differs between them), or gates / curves in a shared block.
    """
    held: dict[int, tuple[int, LayerPlan | None]] = {}
    for i, (layer, attention, plan) in enumerate(zip(layers, attentions, plans)):
        if attention is None:
            continue
        shared = getattr(layer, "shared_transformer", None) is not None
        if shared and plan is not None and (offers(plan.encoding, Gates) or offers(plan.encoding, Curves)):
            raise UsageError(f"{getattr(plan.encoding, 'name', type(plan.encoding).__name__)}: layer {i} runs a shared "
                             "transformer block, whose attention input is not the layer's hidden state and whose gates "
                             "would be kept under one layer index for every layer it serves; refusing before any forward")
        first, other = held.setdefault(id(attention), (i, plan))
        if other != plan:
            raise UsageError(f"model: layers {first} and {i} share one attention module ({type(attention).__name__}, a "
                             "shared transformer block), which posenc gives one plan, and they were given different ones "
                             "(an encoding that learns per layer, or a schedule that differs between them)")


def _layer_types(config: Any) -> list[str] | None:
    types = getattr(config, "layer_types", None)
    return list(types) if types is not None else None


def family_schedule(config: Any, family: Family | None, depth: int) -> Schedule:
    """The model's own schedule: its table row read by :func:`posenc.schedule_from_hf`, or for a
    model outside the table the LLaMA pattern: RoPE from the config on every layer, windowed
    where ``layer_types`` says sliding or, without them, everywhere when ``sliding_window`` is set."""
    if family is not None:
        return schedule_from_hf(config)
    found = options_from_hf(config)
    options: dict[str, Any] = {"base": float(found["base"])}
    scaling = {k: v for k, v in found["scaling"].items() if k != "rope_theta"}
    if scaling.get("rope_type", scaling.get("type", "default")) != "default" or set(scaling) - {"rope_type", "type"}:
        options["scaling"] = scaling
    window = getattr(config, "sliding_window", None)
    types = _layer_types(config) or ["sliding_attention" if window is not None else "full_attention"] * depth
    layers = []
    for kind in types:
        if kind not in ("full_attention", "sliding_attention"):
            raise UsageError(f"model: model_type {config.model_type!r} is not in posenc's family table and has layers of "
                             f"type {kind!r}, which the LLaMA pattern does not describe")
        layers.append(Layer("rope", dict(options), window=int(window) if window is not None and kind == "sliding_attention" else None))
    return Schedule(tuple(layers))


@dataclass
class _AttentionSizes:
    heads: int
    kv_heads: int
    head_dim: int  # D, the q/k head dim the attention function sees
    rotary_dim: int  # r, read from the model's rotary module
    layout: str
    rope_last: bool
    hidden: int | None = None  # the layer input's width (config.hidden_size)


def _sizes(model: Any, config: Any, family: Family | None, rotary: nn.Module) -> _AttentionSizes:
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(layer_config(config, family, None), "num_key_value_heads", None) or heads)
    d = qk_head_dim(config, family)
    types = _layer_types(config)
    inv, _ = rotary_tables(rotary, ([k for k in types or () if getattr(rotary, f"{k}_inv_freq", None) is not None] or types or [""])[-1],
                            family)
    r = 2 * int(inv.numel())
    if family is not None and family.rope_slice == "last":
        r = int(config.qk_rope_head_dim)
    if not 2 <= r <= d:
        raise UsageError(f"model: its rotary module turns {r} features, outside [2, head_dim={d}]")
    layout = family.layout if family is not None else "half"
    if family is None and not inv.is_meta:
        check_rotation(model, rotary, r, layout)
    hidden = getattr(config, "hidden_size", None)
    return _AttentionSizes(heads, kv_heads, d, r, layout, family is not None and family.rope_slice == "last",
                  hidden if isinstance(hidden, int) else None)


def _build(name: str, options: dict[str, Any], sizes: _AttentionSizes, causal: bool) -> PositionalEncoding:
    """A registry encoding for the model's heads, the family's layout and rotated features by default."""
    cls = get_class(name)
    accepted = options_of(cls)
    extra: dict[str, Any] = {}
    if "layout" in accepted and "layout" not in options and sizes.layout != "half":
        extra["layout"] = sizes.layout
    own_share = isinstance(options.get("scaling"), dict) and "partial_rotary_factor" in options["scaling"]  # per type (Laguna)
    if "rotary_dim" in accepted and "rotary_dim" not in options and sizes.rotary_dim != sizes.head_dim and not own_share:
        extra["rotary_dim"] = sizes.rotary_dim
    if "num_kv_heads" in accepted and "num_kv_heads" not in options:
        extra["num_kv_heads"] = sizes.kv_heads
    if "input_dim" in accepted and "input_dim" not in options and sizes.hidden is not None:
        extra["input_dim"] = sizes.hidden  # a gate that reads the layer input (FoX)
    return build(name, num_heads=sizes.heads, head_dim=sizes.head_dim, causal=causal, **options, **extra)


def layer_plans(model: Any, config: Any, family: Family | None, attentions: list[nn.Module | None], rotary: nn.Module,
           encoding: str | nn.Module | Schedule, options: dict[str, Any]) -> tuple[list[LayerPlan | None], nn.ModuleList, dict[str, Any]]:
    """One plan per layer (None where a layer has no attention), the encoding modules, the record."""
    depth = len(attentions)
    sizes = _sizes(model, config, family, rotary)
    causal = family.causal if family is not None else True
    own = family_schedule(config, family, depth)
    if len(own.layers) != depth:  # each attention layer must have its schedule entry (zip would drop or shift them)
        raise UsageError(f"model: its config describes {len(own.layers)} attention layers (num_hidden_layers, layer_types) "
                         f"and its decoder stack holds {depth}; posenc.hf cannot tell which layer is which")
    if family is None:  # the generic fallback: each layer run alone against the schedule read (posenc.hf.fallback)
        expected = [_build(layer.encoding, dict(layer.options), sizes, causal) if layer.encoding == "rope" else None
                    for layer in own.layers]
        probe(model, config, attentions, rotary, expected, sizes.head_dim, sizes.heads)
    types = _layer_types(config)
    record: dict[str, Any]
    absolute: nn.Module | None = None
    if isinstance(encoding, str) and "[" in encoding:
        encoding = Schedule.parse(encoding, depth)
    if isinstance(encoding, Schedule):
        if options:
            raise UsageError("options: give them inside the schedule's layers, not beside a schedule")
        schedule = Schedule.of(encoding, depth)
        layers = [_with_own_rope(layer, own.layers[i]) for i, layer in enumerate(schedule.layers)]
        record = {"encoding": None, "options": {}, "schedule": schedule.to_list(), "causal": causal}
        from_config = False
    elif isinstance(encoding, nn.Module):
        layers = [Layer("nope", window=o.window, chunk=o.chunk, sinks=o.sinks, query_scale=o.query_scale) for o in own.layers]
        record, from_config = _module_record(encoding, options, sizes, causal), False
    elif isinstance(encoding, str):
        cls = get_class(encoding)
        if not _jsonable(options):
            raise UsageError("options: posenc.hf records them in the model's config, so they must be JSON values")
        from_config = encoding == "rope" and not options
        if from_config:
            layers = list(own.layers)
        elif offers(cls, Embeds):  # absolute: one module, its embed on the input, nothing in the layers
            layers = [Layer("nope", window=o.window, chunk=o.chunk, sinks=o.sinks, query_scale=o.query_scale) for o in own.layers]
            absolute = _build(encoding, dict(options), sizes, causal)
        elif offers(cls, Remaps) or encoding == "rope":
            # The model's own RoPE under other options, or a remap of it: each RoPE layer keeps its base (and
            # its scaling, unless one is given), the family's NoPE layers stay NoPE.
            layers = [Layer(encoding, _own_rope_options(cls, o.options, options, config, family), o.window, o.chunk, o.sinks,
                            o.query_scale) if o.encoding == "rope" else o for o in own.layers]
            for layer in {layer.sharing_key: layer for layer in layers}.values():
                _build(layer.encoding, dict(layer.options), sizes, causal)  # the registry's own errors, first
        else:
            _build(encoding, dict(options), sizes, causal)  # the registry's own errors for a bad option, first
            layers = [Layer(encoding, dict(options), o.window, o.chunk, o.sinks, o.query_scale) for o in own.layers]
        record = {"encoding": encoding, "options": dict(options), "causal": causal}
        if from_config:
            record["from_config"] = True
    else:
        raise UsageError(f"encoding must be a posenc encoding name, a schedule or an encoding module, got {type(encoding).__name__}")
    if family is not None and family.model_rotates:  # the model rotates itself: no rotation of posenc's (posenc.hf.mrope)
        names = {layer.encoding for layer in layers} | ({encoding} if isinstance(encoding, str) else set())
        refuse_other(getattr(config, "model_type", None), family, encoding if isinstance(encoding, nn.Module) else None,
                     names, from_config)
    built: dict[Any, PositionalEncoding] = {}
    modules: list[nn.Module] = []
    plans: list[LayerPlan | None] = []
    shared_module = encoding if isinstance(encoding, nn.Module) else absolute
    for i, (attention, layer) in enumerate(zip(attentions, layers)):
        if attention is None:
            plans.append(None)
            continue
        kind = types[i] if types is not None else None
        if shared_module is not None:
            enc: PositionalEncoding = cast(PositionalEncoding, shared_module if i == 0 or shared_module.shares_across_layers
                                           else copy.deepcopy(shared_module))
        else:
            own = per_layer(sizes, config, family, i, attention)  # its head dim and key/value heads (Gemma 4)
            key = (layer.sharing_key, own.head_dim, own.kv_heads)
            cached = built.get(key)
            if cached is not None and cached.shares_across_layers:
                enc = cached
            else:
                enc = _build(layer.encoding, dict(layer.options), own, causal)
                built[key] = enc
        if from_config:
            verify_rope(enc, layer_rotary(rotary, model, family, config, i, attention), kind, family,
                         getattr(config, "model_type", None))
        if offers(enc, Selects):
            raise UsageError(f"{getattr(enc, 'name', type(enc).__name__)}: posenc.hf does not run selective attention (a "
                             "transformers KV cache keeps no per-key selection sums, so cached decoding would differ from "
                             "the full pass); use posenc.LM")
        if layer.sinks and (family is None or family.sinks is None):
            raise UsageError(f"schedule: layer {i} asks for sinks, but the {type(attention).__name__} of this model has no "
                             "sink logits")
        if offers(enc, Curves) and (layer.window or layer.chunk or layer.sinks or getattr(config, "attn_logit_softcapping", None)):
            what = "window" if layer.window else "chunk" if layer.chunk else "sinks" if layer.sinks else "logit soft cap"
            raise UsageError(f"{getattr(enc, 'name', type(enc).__name__)}: layer {i} of this model has a {what}, and bias "
                             "curves run here only on full attention (posenc.hf has no such path with windows, chunks, "
                             "sinks or soft caps outside the Inkling family); refusing before any forward")
        if enc not in modules:
            modules.append(enc)
        plans.append(LayerPlan(enc, layer.window, layer.chunk, family.sinks if layer.sinks and family is not None else None,
                               None if family is not None and family.log_beta else layer.query_scale,  # the model's own
                               sizes.rotary_dim if sizes.rope_last else 0, causal))
    return plans, nn.ModuleList(modules), record


def _own_rope_options(cls: type, own: dict[str, Any], options: dict[str, Any], config: Any,
                      family: Family | None = None) -> dict[str, Any]:
    """A RoPE layer's options for ``use(model, "rope" or a remap, **options)``: the layer's own (base,
    scaling) under the user's. A given base, or a scaling block naming its own ``rope_theta``, replaces
    the layer's base; a ``dynamic`` block without the training length takes the config's
    ``max_position_embeddings``, as transformers does; in a family whose weightless q/k norm follows
    the rotation (``Family.qk_norm_after_rotation``), a YaRN or LongRoPE block's attention factor is 1,
    since the model's norm cancels it (posenc rotates after that norm)."""
    accepted = set(options_of(cls))
    merged = {k: v for k, v in own.items() if k in accepted}
    block = options.get("scaling")
    if "base" in options or (isinstance(block, dict) and "rope_theta" in block):
        merged.pop("base", None)
    merged.update(options)
    if isinstance(block, dict) and block.get("rope_type", block.get("type")) == "dynamic" and not (
            {"original_max_position_embeddings", "max_position_embeddings"} & set(block)):
        length = getattr(config, "max_position_embeddings", None)
        if isinstance(length, int):
            merged["scaling"] = {**block, "original_max_position_embeddings": length}
    scaling = merged.get("scaling")
    if (family is not None and family.qk_norm_after_rotation and getattr(config, family.qk_norm_after_rotation, False)
            and isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) in ("yarn", "longrope")):
        merged["scaling"] = {**scaling, "attention_factor": 1.0}
    return merged


def _with_own_rope(layer: Layer, own: Layer) -> Layer:
    """A schedule layer of ``rope`` without a base takes the model's own RoPE options for that layer."""
    if layer.encoding != "rope" or "base" in layer.options or own.encoding != "rope":
        return layer
    return Layer("rope", {**own.options, **layer.options}, layer.window, layer.chunk, layer.sinks, layer.query_scale)


def _module_record(encoding: nn.Module, options: dict[str, Any], sizes: _AttentionSizes, causal: bool) -> dict[str, Any]:
    if options:
        raise UsageError("options: give them to posenc.build, not with an encoding module")
    if not isinstance(encoding, PositionalEncoding) or encoding.num_heads != sizes.heads or encoding.head_dim != sizes.head_dim:
        raise UsageError(f"encoding: needs a posenc encoding for num_heads={sizes.heads}, head_dim={sizes.head_dim}, "
                         f"got {encoding!r}")
    if encoding.causal != causal:
        raise UsageError("encoding: a decoder needs a causal encoding (causal=True), got a bidirectional one "
                         "(for T5, import the decoder's table: t5_from_hf(model, stack='decoder'))")
    cls = type(encoding)
    recorded = {k: getattr(encoding, k) for k in options_of(cls) if hasattr(encoding, k) and _jsonable(getattr(encoding, k))}
    unrecorded = [k for k in options_of(cls) if hasattr(encoding, k) and k not in recorded]
    record: dict[str, Any] = {"encoding": cls.name, "options": recorded, "causal": encoding.causal}
    if unrecorded:
        record["unrecorded"] = unrecorded
    return record


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
