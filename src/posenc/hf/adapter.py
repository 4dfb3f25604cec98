"""posenc's attention inside Hugging Face ``transformers`` models: :func:`use`.

One adapter for the decoder families, driven by their rows in :data:`posenc.hf.families.FAMILIES`
(what differs between families is data there; the code is the same for all of them). Three
modules: :mod:`posenc.hf.attention` (what ``transformers`` calls inside the model),
:mod:`posenc.hf.layers` (each layer's plan, from the family row and what :func:`use` is given), and
this one (:func:`use`, the hooks it installs, saving and loading). How it plugs in:

- An attention function and a mask function are registered under one name, ``"posenc"``, with
  ``AttentionInterface`` and ``AttentionMaskInterface``; the model's ``config._attn_implementation``
  is set to it. Without the mask function every mask the attention receives would be None; ours
  hands the attention the 2-D padding mask (B, Tk), True = real token, or None when nothing is
  padded. Windows, chunks and documents are posenc's, read from the layer's plan, not from masks.
- The model's rotary module (or each attention module's own: ``Family.attention_rotary``) is
  wrapped by :class:`RotaryStandIn`, which returns the original's output as the identity rotation,
  so the model's own rotation leaves q and k exactly as they are;
  the attention function applies the layer's encoding (``posenc.attend``), so the KV cache holds
  un-rotated keys and every key is rotated at its position at every step.
- Each attention layer gets a :class:`LayerPlan`: its encoding and attention kind (window, chunk,
  sinks, query scale), from the model's own schedule (:func:`posenc.schedule_from_hf` of its row)
  or from what :func:`use` was given. Logit soft-capping arrives from the layer (``softcap``).
- HF passes the queries' ``position_ids`` but no key positions. Without a cache past (Tq == Tk),
  the keys are the queries. With one (Tq < Tk), the keys are taken as consecutive and ending at each
  row's last query position, and a key whose position would be negative is not attended: that is
  left padding in ``generate``, and, after a packed prefill, the earlier documents. A sliding
  layer's cache holds the last keys, so the same rule holds there. Families whose layers are not
  passed ``position_ids`` (Llama 4) take those given to the model, read by a pre-hook.
- Packed batches (several documents in one row, ``position_ids`` restarting): a document starts
  wherever a real token's position does not increase (is <= its predecessor's), and attention never
  crosses documents, with or without a cache. Ids that increase by more than 1 (PoSE's skipping
  chunks) are one document, each token at its own id. A cached call whose queries restart or skip
  is a UsageError (their keys' documents and positions are unknown).
- A static cache's unwritten slots (False in every row of the mask) are dropped from the keys.
- The layers of one model forward share one :class:`~posenc.call.geometry.Geometry` per key length
  (positions, documents and padding, read once) and one :class:`~posenc.call.memo.ForwardMemo`.

Encodings with parameters (T5's table, FIRE's MLP, ...) are modules of the model
(``<decoder stack>.posenc_encodings``: one shared by all layers, or one per layer when the method
learns per layer), so they train with the model, follow ``.to()``, and are saved by
``save_pretrained``; the config records the encoding (``config.posenc``), and
:func:`from_pretrained` rebuilds it.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Callable, TypeVar, cast

import torch
import transformers
from torch import nn
from transformers import PreTrainedModel

from ..encodings import build, get_class, options_of
from ..encodings.base import PositionalEncoding
from ..encodings.mrope import MRoPE
from ..encodings.protocol import Curves, Embeds, Gates, Remaps, offers
from ..encodings.rope import RoPE
from ..encodings.xdrope import XDRoPE
from ..errors import UsageError
from ..model.schedule import Schedule
from .attention import (
    NAME,
    Encodings,
    LayerPlan,
    drop_input,
    held_encoding,
    installed_encodings,
    keep_input,
    padding_mask,
    posenc_attention,
    register,
)
from .fallback import check_structure
from .families import FAMILIES, family_of, qk_head_dim, text_config
from .forward_state import ForwardState, RotaryStandIn
from .inkling import inkling_plans, keep_other_attention, layer_stack, without_rope
from .layers import check_shared, layer_plans
from .rotary_sets import install_rotaries, place_rotaries, stack_rotary, stand_in_for
from .stack import ATTENTION_NAMES, attention_slots, decoder_stack, layer_list

# -- what a checkpoint saved after use() carries, so that it loads right or not at all -------------
#
# What a checkpoint saved after :func:`posenc.hf.use` carries so that it loads right, or not at all.
#
# - **A plain load fails.** ``use`` records ``attn_implementation = "posenc"`` in the config, and
#   ``save_pretrained`` writes it to ``config.json``; ``transformers`` reads that key when it loads
#   the config. ``AutoModelForCausalLM.from_pretrained(path)`` then stops: in a process where
#   posenc's attention is not registered, transformers refuses the unknown ``attn_implementation``
#   while building the model (ValueError naming "posenc"); where it is registered (posenc.hf was
#   used), the model builds and its first forward is a UsageError saying to load it with
#   :func:`posenc.hf.from_pretrained`. A model that silently runs its own RoPE in place of the
#   trained encoding (ALiBi, NoPE, ... have no weights to warn about) cannot come out of it. Asking
#   for the model's own attention explicitly (``from_pretrained(path, attn_implementation="sdpa")``)
#   still builds it with its own RoPE, but not without a word: ``use`` puts a marker buffer
#   (:data:`MARKER`, ``<decoder stack>.posenc_marker``, one int64) on the decoder stack, saved with
#   the weights, which a plain class does not have, so transformers' load report lists
#   ``model.posenc_marker`` as UNEXPECTED (a warning naming posenc) for every encoding, parameter-free
#   ones (ALiBi, NoPE, Sandwich, ...) included. :func:`posenc.hf.export` leaves it out.
# - **The encoding comes back whole.** :func:`recorded_options` adds to the recorded options what
#   ``use`` derived from the model's config rather than recorded (the key/value head count of an
#   encoding with per-key-head parameters, RoPE-Mixed's), so :func:`posenc.hf.from_pretrained`
#   rebuilds the encoding that was saved.

#: The name of the marker buffer :func:`posenc.hf.use` puts on the decoder stack (see the module docstring).
MARKER = "posenc_marker"


def mark(config: Any) -> None:
    """Record posenc's attention in ``config`` (written to config.json by ``save_pretrained``;
    read back by transformers as the model's ``attn_implementation``)."""
    config.attn_implementation = NAME


def recorded_options(config: Any, record: dict[str, Any]) -> dict[str, Any]:
    """The options to rebuild the encoding of ``record`` (a ``config.posenc``) with: the recorded
    ones, plus ``num_kv_heads`` from the config's ``num_key_value_heads`` (else its query heads)
    for a method that takes it and a record without it.

    Raises:
        UsageError: the recorded options are not a dict, or the config's head counts are not
            positive integers.
    """
    options = record.get("options") or {}
    if not isinstance(options, dict):
        raise UsageError(f"config.posenc: options must be a dict, got {options!r}")
    options = dict(options)
    if "num_kv_heads" in options_of(get_class(record["encoding"])) and "num_kv_heads" not in options:
        heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
            raise UsageError(f"config: num_key_value_heads must be a positive integer, got {heads!r}")
        options["num_kv_heads"] = heads
    return options


_Model = TypeVar("_Model", bound=PreTrainedModel)

#: model_type -> family name, for the families of the table (:data:`posenc.hf.families.FAMILIES`).
SUPPORTED = {t: f.name for f in FAMILIES if f.causal for t in f.model_types}


_PreHook = Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]]


def _embed_hook(stack: nn.Module, plan: LayerPlan) -> _PreHook:
    """A forward pre-hook for the first decoder layer that adds an absolute encoding's ``embed`` to
    its input, at each row's own positions: the encoding ``stack`` holds at call time."""

    def hook(layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        encoding = cast(Embeds, held_encoding(stack, plan))
        hidden = args[0] if args else kwargs["hidden_states"]
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            raise UsageError("position_ids: an absolute encoding needs them (the model passes them to its layers)")
        position_ids = position_ids.to(hidden.device, torch.long).clamp(min=0)
        if position_ids.shape[0] == 1:
            hidden = encoding.embed(hidden, position_ids[0])
        else:
            hidden = torch.cat([encoding.embed(hidden[b: b + 1], position_ids[b]) for b in range(hidden.shape[0])])
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    return hook


def _positions_hook(state: ForwardState, start: bool = False) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
    """A forward pre-hook on the decoder stack: the forward's ``position_ids`` as given (None when
    the model makes them), for layers that are not passed them: (B, T) text positions, or the text
    row of an M-RoPE backbone's 4-row form (text, temporal, height, width); None for its (3, B, T)
    ids (posenc.hf.mrope: a 1-D encoding then sees each token at its slot). ``start``: it also
    starts the forward (a family without a rotary module, whose stand-in would)."""

    def hook(stack: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if start:
            state.start()
        pos = kwargs.get("position_ids")
        if isinstance(pos, torch.Tensor) and pos.dim() == 3 and pos.shape[0] == 4:
            pos = pos[0]
        state.position_ids = pos if isinstance(pos, torch.Tensor) and pos.dim() == 2 else None

    return hook


def _finish_hook(state: ForwardState) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
    """A forward hook on the decoder stack: the forward's shared state dropped once it returns."""

    def hook(stack: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        state.finish()

    return hook


def _marker_kept(stack: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """A load_state_dict pre-hook on the decoder stack: a state dict saved before the marker buffer
    (see MARKER; a study's checkpoint of an earlier run) loads, strict, keeping the marker."""
    key = prefix + MARKER
    if key not in state_dict and isinstance(getattr(stack, MARKER, None), torch.Tensor):
        state_dict[key] = getattr(stack, MARKER)


def _remove_hooks(holder: nn.Module) -> None:
    for key in [k for k in holder.__dict__ if k.startswith("_posenc_hook")]:
        holder.__dict__.pop(key).remove()


def _naming_the_family(error: UsageError, model: nn.Module) -> UsageError:
    """``error`` naming the model's family (its model_type and class) when it does not already."""
    model_type = getattr(model.config, "model_type", None)
    if repr(model_type) in str(error):
        return error
    return UsageError(f"model_type {model_type!r} ({type(model).__name__}): {error}")


def _planned(model: nn.Module, stack: nn.Module, encoding: str | nn.Module | Schedule, options: dict[str, Any]) -> tuple[Any, ...]:
    """Everything :func:`use` installs, planned (and refused) before anything of the model changes:
    a refused ``use()`` leaves the model as it was. A family outside the table is checked by the
    generic fallback first (:mod:`posenc.hf.fallback`)."""
    config: Any = model.config
    # The decoder stack's own config: a multimodal wrapper's text model (Fuyu, GOT-OCR 2, ...)
    held = getattr(stack, "config", None)
    inner = held if held is not None and hasattr(held, "num_attention_heads") else text_config(config)
    family = family_of(getattr(inner, "model_type", None))
    # layers, Falcon's h, DBRX's blocks; one entry per attention module (a layer holding several: one each, keyed by layer_idx)
    layers, attentions = attention_slots(list(cast(nn.ModuleList, layer_list(stack))))
    types = getattr(inner, "layer_types", None)
    if family is not None and family.no_attention and isinstance(types, (list, tuple)) and len(types) == len(attentions):
        # a hybrid's linear-attention layers never call the attention function (MiniMax's Lightning attention)
        attentions = [None if kind in family.no_attention else a for a, kind in zip(attentions, types)]
    if not any(a is not None for a in attentions):
        raise UsageError(f"model: no decoder layer of {type(model).__name__} has an attention module with layer_idx "
                         f"(posenc.hf looks for {', '.join(ATTENTION_NAMES)} on each layer: a module, or a ModuleList of "
                         "modules each with its own layer_idx)")
    if getattr(inner, "use_bidirectional_attention", None):
        raise UsageError("model: use_bidirectional_attention is not supported by posenc.hf (a decoder with causal masks)")
    for key, why in family.refused_when if family is not None else ():  # what a row cannot run (Gemma 4's KV sharing)
        if getattr(inner, key, None):
            raise UsageError(f"model: {cast(Any, family).name} with {key}={getattr(inner, key)!r}: {why}")
    if family is not None and family.per_layer_config and isinstance(encoding, nn.Module):
        raise UsageError(f"encoding: {family.name}'s layers differ in head dim, and a built encoding serves one; give its name")
    if without_rope(family):  # Inkling, Inkling-2: no rotary module to stand in for (posenc.hf.inkling)
        plans, modules, record = inkling_plans(inner, cast(Any, family), attentions, encoding, options)
        return inner, family, layers, attentions, None, plans, modules, record
    # the stack's rotary module, or the first attention's (Family.attention_rotary: RecurrentGemma, Moshi)
    stand_in = stand_in_for(stack_rotary(stack, family, attentions), family)
    rotary = stand_in.original
    if family is None:
        check_structure(model, stack, inner, attentions, rotary)
    plans, modules, record = layer_plans(model, inner, family, attentions, rotary, encoding, options)
    if family is not None and family.reversed_rotation and not record.get("from_config") and any(
            p is not None and (isinstance(p.encoding, RoPE) or offers(p.encoding, Remaps)) for p in plans):
        raise UsageError(f"encoding: {family.name} turns its RoPE pairs the other way (angle -theta), which posenc's RoPE "
                         "does not: its own rotation runs under use(model, 'rope') without options, or another encoding in its place")
    check_shared(layers, attentions, plans)
    return inner, family, layers, attentions, stand_in, plans, modules, record


def use(model: _Model, encoding: str | nn.Module | Schedule, **options: Any) -> _Model:
    """Turn ``model``'s attention into posenc's attention with ``encoding``; returns ``model``.

    ``encoding``:

    - ``"rope"`` without options: the model's own schedule (:func:`posenc.schedule_from_hf` of its
      family row in :data:`posenc.hf.families.FAMILIES`): per-layer RoPE bases and scaling, windows,
      chunks, sinks, NoPE layers, partial and interleaved rotation, MLA's rope part, the YaRN /
      LongRoPE attention factor; checked at once against the model's own rotary tables. The result
      equals the untouched model.
    - another registry name (``posenc.available()``) built with ``options`` for the model's heads
      and head dim (the family's pair layout and rotated features by default), on every layer, each
      layer keeping the family's window, chunk and sinks.
    - a layer schedule (its text, ``"3x[rope window=512] 1x[nope]"``, or a
      :class:`~posenc.model.schedule.Schedule`): each layer as it says; a ``rope`` layer without a base
      takes the model's own RoPE parameters for that layer.
    - a built posenc encoding module (e.g. from :func:`posenc.hf.t5_from_hf`).

    The model's rotary module is made the identity (its output's types and shapes kept), and the
    rotation, biases and score terms are applied inside the attention, so the KV cache holds
    un-rotated keys. FoX's gates come from each layer's input (without a KV cache). The config
    records the choice (``config.posenc``); :func:`from_pretrained` restores it. Calling ``use``
    again replaces the encoding.

    Raises:
        UsageError: naming the model's family: a model without a decoder stack of ``layers`` and
            one ``rotary_emb``, a layer holding several attention modules whose ``layer_idx`` do not
            number the stack's attention layers in order, a config describing another number of
            attention layers than the stack holds, a model outside the family table that is not the LLaMA pattern
            (:mod:`posenc.hf.fallback`: NoPE layers, per-layer bases, sinks, bidirectional
            attention, MLA, M-RoPE, per-layer head dims or tables, KV sharing, a mask of its own), an unknown encoding name or
            option, options that are not JSON values or given with a module or schedule, a built
            encoding for other heads or head dim or of the other causality, a schedule of another
            depth or asking for sinks the model lacks, or a RoPE read from the config that differs
            from the model's own tables.
    """
    config: Any = model.config
    try:
        stack = layer_stack(model) or decoder_stack(model)
        inner, family, layers, attentions, stand_in, plans, modules, record = _planned(model, stack, encoding, options)
    except UsageError as error:
        raise _naming_the_family(error, model) from error.__cause__
    if stand_in is not None:
        place_rotaries(stack, family, attentions, stand_in)  # on the stack, or in each attention module
    else:
        keep_other_attention(model, attentions)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    stack.posenc_encodings = Encodings(modules).to(device=device, dtype=dtype)
    # Saved with the weights: a plain transformers load reports it as unexpected (see MARKER).
    stack.register_buffer(MARKER, torch.ones((), dtype=torch.int64, device=device), persistent=True)
    # The model's own RoPE, verified equal to posenc's (use(model, "rope")), whose rotation does not
    # depend on the length: the model rotates q and k itself, so the cache keeps rotated keys and a
    # decode step rotates one key, not the whole cache. Everything else rotates in the attention.
    # A family whose model must rotate itself (Family.model_rotates: M-RoPE, a learned q/k norm after the
    # rotation) keeps its own rotation under "rope" whatever it depends on; other encodings got no rotation.
    if stand_in is not None:
        stand_in.identity = not (record.get("from_config") and (family is not None and family.model_rotates or not any(
            isinstance(p.encoding, RoPE) and p.encoding.rotation_depends_on_length for p in plans if p is not None)))
    if stand_in is not None and not stand_in.identity:
        plans = [None if p is None else replace(p, rotate=not isinstance(p.encoding, (RoPE, MRoPE, XDRoPE))) for p in plans]
    # a stack's other rotary modules, one per base (Granite-SWA), or the other attention modules' own (RecurrentGemma)
    install_rotaries(model, family, stand_in, attentions)
    slots = {id(module): i for i, module in enumerate(modules)}  # (each call runs the module held there then)
    plans = [None if p is None else replace(p, slot=slots.get(id(p.encoding))) for p in plans]
    state = stand_in.forward_state if stand_in is not None else stack.__dict__.setdefault("_posenc_forward_state", ForwardState())
    state.base = stack
    for attention, plan in zip(attentions, plans):
        if attention is None:
            continue
        if family is not None and family.temperature and getattr(attention, "attn_temperature_tuning", False):
            setattr(attention, "attn_temperature_tuning", False)  # the layer's plan applies it (posenc.hf.families: temperature)
        _remove_hooks(attention)
        attention.__dict__["_posenc_plan"] = plan
        attention.__dict__["_posenc_forward"] = state
        if plan is not None and (offers(plan.encoding, Gates) or offers(plan.encoding, Curves)):  # they read the layer input
            attention.__dict__["_posenc_hook_input"] = attention.register_forward_pre_hook(keep_input, with_kwargs=True)
            attention.__dict__["_posenc_hook_input_end"] = attention.register_forward_hook(drop_input, with_kwargs=True)
    _remove_hooks(stack)
    positions = _positions_hook(state, start=stand_in is None or not stand_in.starts)
    stack.__dict__["_posenc_hook_positions"] = stack.register_forward_pre_hook(positions, with_kwargs=True)
    stack.__dict__["_posenc_hook_finish"] = stack.register_forward_hook(_finish_hook(state))
    stack.__dict__["_posenc_hook_marker"] = stack.register_load_state_dict_pre_hook(_marker_kept)
    _remove_hooks(layers[0])
    if offers(modules[0], Embeds):
        hook = _embed_hook(stack, LayerPlan(cast(PositionalEncoding, modules[0]), slot=0))
        layers[0].__dict__["_posenc_hook_embed"] = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    register()
    model.set_attn_implementation(_attention_choice(model, stack))
    config.posenc = record
    mark(config)
    return model


def _attention_choice(model: nn.Module, stack: nn.Module) -> str | dict[str, Any]:
    """What ``set_attn_implementation`` is given: posenc's attention for the model and its decoder
    stack; a multimodal model's other sub-models (a vision or audio tower, which posenc does not
    plan) keep their own, or SDPA where theirs is posenc's (a model loaded with config.json's
    ``attn_implementation="posenc"``). Without this an image forward of Qwen2-VL & co. reached
    posenc's attention in the vision tower and failed."""
    config: Any = model.config
    text = getattr(stack, "config", None)
    others = [k for k in getattr(config, "sub_configs", None) or {}
              if getattr(config, k, None) is not None and getattr(config, k) is not text]
    if stack is model or text is None or not others:
        return NAME
    choice: dict[str, Any] = {"": NAME}
    for key in getattr(config, "sub_configs"):
        sub = getattr(config, key, None)
        if sub is None:
            continue
        own = getattr(sub, "_attn_implementation", None)
        choice[key] = NAME if sub is text else own if own not in (None, NAME) else "sdpa"
    return choice


def _installed(model: nn.Module) -> Encodings | nn.ModuleList:
    """The encodings ``model`` holds (its decoder stack's ``posenc_encodings``, through a trainer's wrapper)."""
    return installed_encodings(layer_stack(model) or decoder_stack(model))


def from_pretrained(model_class: Any, path: str | os.PathLike[str], *, encoding: nn.Module | None = None, **kwargs: Any) -> PreTrainedModel:
    """``model_class.from_pretrained(path, **kwargs)`` for a model saved after :func:`use`: the
    encoding recorded in its config (``config.posenc``) is rebuilt when the model is constructed,
    before the weights load, so learned position parameters come back from the checkpoint.

    ``model_class``: a concrete model class (``LlamaForCausalLM``) or an Auto class
    (``AutoModelForCausalLM``). ``encoding``: a built encoding to install instead of the recorded
    one; needed when :func:`use` was given a module with options the config could not record (its
    ``config.posenc["unrecorded"]``), e.g. a RoPE module's scaling object.

    Raises:
        UsageError: the saved config records no posenc encoding, or the encoding's options were
            not recorded and ``encoding`` is not passed.
    """
    config = kwargs.pop("config", None)
    if config is None:
        config = transformers.AutoConfig.from_pretrained(path)
    record = getattr(config, "posenc", None)
    if not isinstance(record, dict) or "encoding" not in record:
        raise UsageError(f"path: the config at {path!r} records no posenc encoding (save a model after posenc.hf.use)")
    if encoding is None and record.get("unrecorded"):
        raise UsageError(f"encoding: the saved encoding's options {record['unrecorded']} are not in the config; "
                         "pass encoding=<the same posenc encoding> to rebuild it")
    register()  # the saved config names attn_implementation="posenc" (see MARKER)
    mapping = getattr(model_class, "_model_mapping", None)
    if mapping is not None:  # an Auto class: its concrete class for this config
        model_class = mapping[type(config)]

    def post_init(self: Any) -> None:
        model_class.post_init(self)
        use(self, encoding if encoding is not None else recorded_encoding(self.config, record))

    # A checkpoint saved before the marker buffer (see MARKER) loads without a missing-key report.
    ignored = {*(model_class._keys_to_ignore_on_load_missing or ()), rf"(^|\.){MARKER}$"}
    loading: Any = type(model_class.__name__, (model_class,), {"post_init": post_init,
                                                               "_keys_to_ignore_on_load_missing": ignored})
    loading.__module__, loading.__qualname__ = model_class.__module__, model_class.__qualname__
    model: PreTrainedModel = loading.from_pretrained(path, config=config, **kwargs)
    model.__class__ = model_class  # the subclass only hooked construction
    # The encodings were built on HF's meta device; their parameters and persistent buffers now hold
    # the checkpoint's values, but buffers not saved (ALiBi's slopes) hold nothing: build them again
    # on the model's device and keep the loaded state.
    state = _installed(model).state_dict()
    use(model, encoding if encoding is not None else recorded_encoding(model.config, record))
    _installed(model).load_state_dict(state)
    return model


def recorded_encoding(config: Any, record: dict[str, Any]) -> nn.Module | str | Schedule:
    """The encoding a ``config.posenc`` record describes: a built module, a schedule, or "rope" for
    the model's own RoPE parameters (then :func:`use` reads them from the config)."""
    if record.get("from_config"):  # the family's own: "rope", or "inkling" (the Inkling families)
        return str(record.get("encoding") or "rope")
    if record.get("schedule") is not None:
        return Schedule.of(record["schedule"])
    inner = text_config(config)
    heads = int(inner.num_attention_heads)
    head_dim = qk_head_dim(inner, family_of(getattr(inner, "model_type", None)))
    return build(record["encoding"], num_heads=heads, head_dim=head_dim, causal=bool(record.get("causal", True)),
                 **recorded_options(inner, record))


__all__ = ["LayerPlan", "MARKER", "RotaryStandIn", "NAME", "SUPPORTED", "from_pretrained", "padding_mask", "posenc_attention",
           "mark", "recorded_encoding", "recorded_options", "register", "use"]
