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
import re
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from ..encodings import build, get_class, options_of
from ..encodings.base import PositionalEncoding
from ..encodings.mrope import MRoPE
from ..encodings.protocol import Curves, Embeds, Gates, Remaps, Selects, offers
from ..encodings.rope import RoPE, apply_rotation
from ..encodings.xdrope import XDRoPE
from ..errors import UsageError
from ..model.schedule import Layer, Schedule
from .attention import LayerPlan
from .fallback import probe
from .families import Family, family_of, layer_config, qk_head_dim, text_config
from .mrope import check_axes, refuse_other
from .rope_config import options_from_hf
from .rotary_sets import layer_rotary, per_layer
from .schedule_config import schedule_from_hf
from .stack_names import ATTENTION_HOLDERS, ATTENTION_NAMES, ROTARY_NAMES, layer_list

# -- the plan: family, sizes, schedule -----------------------------------------------------------


def rotary_name(stack: nn.Module) -> str | None:
    """The attribute of ``stack`` holding its rotary module, or None."""
    return next((n for n in ROTARY_NAMES if isinstance(getattr(stack, n, None), nn.Module)), None)


def _rotary_in_attention(stack: nn.Module) -> bool:
    """The stack's family holds a rotary module in each attention module (``Family.attention_rotary``)."""
    config = getattr(stack, "config", None)
    family = family_of(getattr(text_config(config), "model_type", None)) if config is not None else None
    return family is not None and family.attention_rotary is not None


def decoder_stack(model: nn.Module) -> nn.Module:
    """The module holding ``layers`` and the rotary module (``rotary_emb``: ``LlamaModel`` & co.), or
    only ``layers`` where the family's rotary modules sit in its attention modules
    (``Family.attention_rotary``: RecurrentGemma, Moshi).

    Raises:
        UsageError: no such module within three levels (base model prefix, ``model``, ``language_model``, ``text_model``);
            a stack whose rotary attribute is None, or that has none (a hybrid whose attention has no
            RoPE), says so.
    """
    frontier: list[nn.Module] = [model]
    bare: nn.Module | None = None  # a stack of layers whose rotary attribute is None
    plain: nn.Module | None = None  # a stack of layers with no rotary attribute at all
    for _ in range(4):
        found: list[nn.Module] = []
        for node in frontier:
            if layer_list(node) is not None:  # layers, Falcon's h, DBRX's blocks
                if rotary_name(node) is not None:
                    return node
                if any(hasattr(node, n) for n in ROTARY_NAMES):
                    bare = node
                elif plain is None:
                    plain = node
            for name in (getattr(node, "base_model_prefix", None), "model", "language_model", "text_model"):
                child = getattr(node, name, None) if isinstance(name, str) else None
                if isinstance(child, nn.Module) and child is not node:
                    found.append(child)
        frontier = found
    if bare is not None:
        raise UsageError(f"model: the attention of {type(model).__name__} has no RoPE ({type(bare).__name__}'s rotary module "
                         "is None: NoPE attention, e.g. position_embedding_type=None), and posenc.hf runs only models "
                         "whose decoder stack computes a rotary embedding once per forward")
    if plain is not None and _rotary_in_attention(plain):  # each attention's own (RecurrentGemma, Moshi)
        return plain
    if plain is not None:
        inside = next((n for n, m in plain.named_modules() if re.search("rotary", type(m).__name__, re.I)), None)
        if inside is not None:  # a rotary module in each layer, and no family row naming it
            raise UsageError(f"model: {type(model).__name__}'s decoder stack ({type(plain).__name__}) has no rotary module: "
                             f"its layers hold their own ({inside}, {type(plain.get_submodule(inside)).__name__}), and "
                             "posenc.hf runs a rotary module inside each attention module only for a family whose row names "
                             "it (Family.attention_rotary: RecurrentGemma, Moshi), else one computed once per forward on "
                             "the decoder stack")
        raise UsageError(f"model: {type(model).__name__}'s decoder stack ({type(plain).__name__}) has no rotary module: its "
                         "attention has no RoPE (NoPE attention, as in Jamba, Nemotron-H and Kimi-Linear), and posenc.hf "
                         "runs only models whose decoder stack computes a rotary embedding once per forward or whose "
                         "attention modules hold their own (Family.attention_rotary)")
    source = next((f"{n} ({type(m).__name__})" for n, m in model.named_modules() if re.search("rotary|sinusoidal", type(m).__name__, re.I)), None)
    raise UsageError(f"model: {type(model).__name__} has no decoder stack with `layers` and one `rotary_emb` module"
                     f"{f', its positions come from {source}' if source else ''} (posenc.hf needs the model's rotary "
                     "embedding computed once per forward on the decoder stack, and each layer's attention taking its tables)")


def _is_attention(module: Any) -> bool:
    """An attention module: one with ``layer_idx`` (its KV cache layer), or an encoder's (``is_causal``
    False: GTE, Nomic BERT and Jina v3 give theirs no index)."""
    return isinstance(module, nn.Module) and (hasattr(module, "layer_idx") or getattr(module, "is_causal", None) is False)


def attentions_of(layer: nn.Module) -> list[nn.Module]:
    """A decoder layer's attention modules: the one with ``layer_idx`` (or an encoder's), or, where the
    layer holds a ``ModuleList`` of them under one of :data:`~posenc.hf.stack_names.ATTENTION_NAMES`,
    each of them, every one with an int ``layer_idx`` (its own KV cache layer: LongCat-Flash's two
    sublayers, 2i and 2i + 1); empty for a layer without attention (a linear-attention layer). A hybrid
    layer's shared transformer block (Zamba2's ``shared_transformer``, see :func:`check_shared`) and a
    DBRX block's ``norm_attn_norm`` are looked in too (:data:`~posenc.hf.stack_names.ATTENTION_HOLDERS`)."""
    for holder in (layer, *(getattr(layer, name, None) for name in ATTENTION_HOLDERS)):
        for name in ATTENTION_NAMES:
            module = getattr(holder, name, None) if isinstance(holder, nn.Module) else None
            if (isinstance(module, nn.ModuleList) and len(module) > 0
                    and all(_is_attention(m) and isinstance(getattr(m, "layer_idx", None), int) for m in module)):
                return list(module)
            if _is_attention(module):
                return [cast(nn.Module, module)]
    return []


def attention_of(layer: nn.Module) -> nn.Module | None:
    """A decoder layer's one attention module (:func:`attentions_of`), or None (none, or several)."""
    found = attentions_of(layer)
    return found[0] if len(found) == 1 else None


def attention_slots(layers: list[nn.Module]) -> tuple[list[nn.Module], list[nn.Module | None]]:
    """The attention layers of a decoder stack, in order, and the decoder layer holding each (two lists
    of one length): one per decoder layer (its attention module, or None), except where a layer holds
    several (:func:`attentions_of`), each of which is then an attention layer of its own, keyed by its
    ``layer_idx``: the model's KV cache layer and its index in the config's per-layer lists
    (``num_hidden_layers`` counts them: LongCat-Flash's 2 per decoder layer).

    Raises:
        UsageError: a stack with a layer of several attention modules whose ``layer_idx`` are not their
            positions 0, 1, ... among all the stack's attention layers (posenc could not tell which
            entry of the model's schedule each one is).
    """
    holders: list[nn.Module] = []
    attentions: list[nn.Module | None] = []
    for layer in layers:
        found = attentions_of(layer)
        holders.extend([layer] * max(1, len(found)))
        attentions.extend(found or [None])
    if len(attentions) > len(layers):
        for i, (layer, attention) in enumerate(zip(holders, attentions)):
            index = getattr(attention, "layer_idx", None)
            if index != i:
                raise UsageError(f"model: {type(layer).__name__} holds several attention modules, and attention layer {i} "
                                 f"of the stack has layer_idx {index!r}: posenc.hf keys each by its layer_idx, which must "
                                 "number the stack's attention layers 0, 1, ... in order")
    return holders, attentions


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


def _rotary_tables(rotary: nn.Module, kind: str | None, family: Family | None = None) -> tuple[torch.Tensor, float]:
    """The model's own inverse frequencies (r/2,) and attention factor for layers of ``kind``
    (float32 on the CPU; :func:`_rotary_buffer` for the buffer as the model holds it)."""
    inv, factor = _rotary_buffer(rotary, kind, family)
    return (inv if inv.is_meta else inv.float().cpu()), factor


def _sincos_table(rotary: nn.Module, family: Family) -> torch.Tensor:
    """The family's (positions, r) ``[sin | cos]`` table held by its rotary module (``Family.sincos_table``).

    Raises:
        UsageError: the module holds no such 2-D table of an even width, or it has fewer than 2 rows.
    """
    name = str(family.sincos_table)
    table = getattr(rotary, name, None)
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[-1] % 2 or table.shape[0] < 2:
        shape = tuple(table.shape) if isinstance(table, torch.Tensor) else type(table).__name__
        raise UsageError(f"model: the {family.name} family rotates with a (positions, r) [sin | cos] table {name!r} of its "
                         f"rotary module, and {type(rotary).__name__} holds {shape}; posenc cannot check its RoPE")
    return table.detach()


def _table_frequencies(table: torch.Tensor) -> torch.Tensor:
    """The inverse frequencies (r/2,) of a (positions, r) ``[sin | cos]`` table: the angles of its
    position 1 (each below pi: atan2 of its sin and cos), in the table's dtype and device."""
    if table.is_meta:
        return torch.empty(table.shape[-1] // 2, device="meta")
    sin, cos = table[1].double().chunk(2)  # (r/2,) each
    return torch.atan2(sin, cos).to(table.dtype)


def _check_table(encoding: RoPE, table: torch.Tensor, name: str, where: str) -> None:
    """posenc's RoPE against a whole ``[sin | cos]`` table (row p: sin and cos of p times each frequency):
    within the table's rounding, which grows with the angle (float32 angles of p * theta), else a UsageError
    naming the first position that differs."""
    held = table.dtype if table.is_floating_point() else torch.float32
    rows = table.shape[0]
    positions = torch.arange(rows, dtype=torch.float64)
    angles = positions[:, None] * encoding.inv_freq.detach().double().cpu()[None]  # (P, r/2)
    ours = torch.cat((angles.sin(), angles.cos()), dim=-1)  # (P, r)
    # the value's rounding in its dtype, and the angle's in float32 (p * theta, theta <= 1) with the frequency's
    tol = 2 * torch.finfo(held).eps + 8 * torch.finfo(torch.float32).eps * (positions + 1)  # (P,)
    gap = (table.double().cpu() - ours).abs().amax(-1)  # (P,)
    bad = (gap > tol).nonzero()
    if bad.numel():
        p = int(bad[0, 0])
        raise UsageError(f"rope: posenc's RoPE read from the {name} config (base {encoding.base:g}, {encoding.rotary_dim} "
                         f"rotated features, {encoding.layout} pairs) differs from the model's table {where} at position {p} "
                         f"(by {float(gap[p]):.2e}); refusing a wrong model")


def _rotary_buffer(rotary: nn.Module, kind: str | None, family: Family | None = None) -> tuple[torch.Tensor, float]:
    """The rotary module's inverse-frequency buffer for layers of ``kind`` (detached, in the model's
    dtype and device) and its attention factor; of a family with a ``[sin | cos]`` table
    (``Family.sincos_table``: GPT-J), the frequencies of the table's position 1 and a factor of 1.

    Raises:
        UsageError: the rotary module has no such buffer.
    """
    if family is not None and family.sincos_table is not None:
        return _table_frequencies(_sincos_table(rotary, family)), 1.0
    inv = getattr(rotary, f"{kind}_inv_freq", None) if kind else None
    factor = getattr(rotary, f"{kind}_attention_scaling", None) if kind else None
    if inv is None:
        inv = getattr(rotary, "inv_freq", None)
        factor = getattr(rotary, "attention_scaling", 1.0)
    if not isinstance(inv, torch.Tensor):
        looked = f"`{kind}_inv_freq` or `inv_freq`" if kind else "`inv_freq`"
        typed = sorted(n for n, _ in rotary.named_buffers(recurse=False) if n.endswith("inv_freq"))
        raise UsageError(f"model: posenc read the rotated features from its rotary module {type(rotary).__name__}'s "
                         f"buffer {looked}, and it has none ({'its buffers: ' + ', '.join(typed) if typed else 'no inv_freq buffer'}"
                         "), so posenc cannot check its RoPE against the config")
    return inv.detach(), float(1.0 if factor is None else factor)


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


def _check_rotation(model: Any, rotary: nn.Module, r: int, layout: str) -> None:
    """For a model outside the family table: its ``apply_rotary_pos_emb`` must rotate as posenc's
    RoPE in ``layout`` over r features, or the model is refused."""
    import sys

    module = sys.modules.get(type(rotary).__module__)
    apply = getattr(module, "apply_rotary_pos_emb", None)
    if apply is None:
        raise UsageError(f"model: model_type {model.config.model_type!r} is not in posenc's family table and its modeling "
                         "module has no apply_rotary_pos_emb(q, k, cos, sin) to check its rotation against")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 6, r, generator=gen)
    positions = torch.arange(6)
    inv, _ = _rotary_tables(rotary, None)
    angles = positions[:, None].float() * inv[None]  # (T, r/2)
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1)[None], torch.cat((angles.sin(), angles.sin()), -1)[None]
    try:
        theirs = apply(x, x, cos, sin)[0]
    except Exception as error:  # their function's own signature or shapes
        raise UsageError(f"model: model_type {model.config.model_type!r} is not in posenc's family table and its "
                         f"apply_rotary_pos_emb does not take (q, k, cos, sin) as LLaMA's does ({error})") from error
    if not torch.allclose(theirs, _rotate_with(layout, x, inv, positions), atol=1e-5):
        raise UsageError(f"model: model_type {model.config.model_type!r} is not in posenc's family table and its rotation "
                         f"is not LLaMA's ({layout} pairs over the first {r} features); add a family row "
                         "(posenc.hf.families.FAMILIES) to describe it")


def _rotate_with(layout: str, x: torch.Tensor, inv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x (1, 1, T, r) rotated at ``positions`` by frequencies ``inv`` (r/2,) in ``layout``."""
    angles = positions[:, None].float() * inv[None]
    return apply_rotation(x, angles.cos(), angles.sin(), layout)


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
    inv, _ = _rotary_tables(rotary, ([k for k in types or () if getattr(rotary, f"{k}_inv_freq", None) is not None] or types or [""])[-1],
                            family)
    r = 2 * int(inv.numel())
    if family is not None and family.rope_slice == "last":
        r = int(config.qk_rope_head_dim)
    if not 2 <= r <= d:
        raise UsageError(f"model: its rotary module turns {r} features, outside [2, head_dim={d}]")
    layout = family.layout if family is not None else "half"
    if family is None and not inv.is_meta:
        _check_rotation(model, rotary, r, layout)
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


def _verify_rope(encoding: PositionalEncoding, rotary: nn.Module, kind: str | None, family: Family | None,
                 model_type: Any = None) -> None:
    """posenc's RoPE (or M-RoPE) read from the config against the model's own tables: the same frequencies and
    attention factor (M-RoPE: and the same rotation on 3-axis ids, :func:`posenc.hf.mrope.check_axes`), or a
    UsageError naming the difference (never a silently wrong model)."""
    if isinstance(encoding, (MRoPE, XDRoPE)):
        check_axes(encoding, rotary, model_type, kind)
    elif not isinstance(encoding, RoPE):
        return
    held_inv, factor = _rotary_buffer(rotary, kind, family)
    if held_inv.is_meta or encoding.inv_freq.is_meta:  # a model being built by from_pretrained: checked once loaded
        return
    inv = held_inv.float().cpu()
    # At the buffer's own precision: a model cast with .to(torch.bfloat16) or .half() holds its
    # frequencies rounded to that dtype, so ours are rounded the same way and compared within its eps.
    held = held_inv.dtype if held_inv.is_floating_point() else torch.float32
    rtol = max(1e-5, torch.finfo(held).eps)
    ours = encoding.inv_freq.detach().to(held).float().cpu()
    name = family.name if family is not None else "this model"
    if (isinstance(encoding, RoPE) and family is not None and family.sincos_table is not None
            and ours.shape == inv.shape):  # every position of its table
        _check_table(encoding, _sincos_table(rotary, family), name, f"{type(rotary).__name__}.{family.sincos_table}")
    if ours.shape != inv.shape or not torch.allclose(ours, inv, rtol=rtol, atol=1e-9):
        raise UsageError(f"rope: posenc's RoPE read from the {name} config ({ours.numel()} frequencies) differs from the "
                         f"model's rotary module ({inv.numel()}) on layers of type {kind!r}; refusing a wrong model")
    ours_factor = encoding.attention_factor if isinstance(encoding, (RoPE, XDRoPE)) else 1.0
    if abs(ours_factor - factor) > 1e-6 * max(1.0, abs(factor)):
        raise UsageError(f"rope: posenc's attention factor {ours_factor} differs from the {name} model's "
                         f"{factor} on layers of type {kind!r}")


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
    if family is not None and family.mrope:  # what posenc cannot run on an M-RoPE backbone (posenc.hf.mrope)
        names = {layer.encoding for layer in layers} | ({encoding} if isinstance(encoding, str) else set())
        refuse_other(getattr(config, "model_type", None), encoding if isinstance(encoding, nn.Module) else None, names,
                     from_config)
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
            _verify_rope(enc, layer_rotary(rotary, model, family, config, i, attention), kind, family,
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
