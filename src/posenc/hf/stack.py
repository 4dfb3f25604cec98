"""The decoder stack of a ``transformers`` model: where it keeps its layers, rotary module and
attention modules (by attribute name), and finding them (:func:`decoder_stack`, :func:`attention_slots`).

Most families hold their layers in ``layers`` (``LlamaModel`` & co.); Falcon in ``h``; DBRX in
``blocks``, with each block's attention one module further in (``norm_attn_norm.attn``). Zamba2's
hybrid layers hold their attention in a shared transformer block (``shared_transformer``). A layer
may hold several attention modules in a ``ModuleList`` under one of :data:`ATTENTION_NAMES`, each its
own cache layer (LongCat-Flash's ``self_attn``: two sublayers, ``layer_idx`` 2i and 2i + 1). A BERT-style
encoder keeps its layers one module further in (ESM-2's ``encoder.layer``), its rotary module beside it
on the model (``rotary_embeddings``), and each layer's attention module inside ``attention``
(``attention.self``).
"""

from __future__ import annotations

import re
from typing import Any, cast

from torch import nn

from ..errors import UsageError
from .families import family_of, text_config

#: The names a decoder stack's rotary module goes by (LFM2-MoE's is ``pos_emb``, ESM-2's ``rotary_embeddings``).
ROTARY_NAMES = ("rotary_emb", "pos_emb", "rotary_embeddings")
#: The names (dotted paths) a decoder stack's list of layers goes by, in the order they are looked for
#: (a BERT-style encoder's: ``encoder.layer``, ESM-2).
LAYER_LISTS = ("layers", "h", "blocks", "encoder.layer")
#: The sub-modules of a layer its attention may be held in (besides the layer itself; a BERT-style
#: layer's ``attention`` holds the attention module as ``self``, with the output projection beside it).
ATTENTION_HOLDERS = ("shared_transformer", "norm_attn_norm", "attention")
#: The names a layer's attention module (or ``ModuleList`` of them) goes by, in the order they are looked for
#: (RecurrentGemma's ``temporal_block``: attention on its attention layers, the RG-LRU recurrent block,
#: without ``layer_idx``, on the others; a BERT-style ``attention``'s ``self``).
ATTENTION_NAMES = ("self_attn", "attention", "attn", "self_attention", "temporal_block", "self")


def layer_list(stack: nn.Module) -> nn.ModuleList | None:
    """The first of ``stack``'s :data:`LAYER_LISTS` that is a ``ModuleList``, or None."""
    for name in LAYER_LISTS:
        found: Any = stack
        for part in name.split("."):  # a dotted path (encoder.layer)
            found = getattr(found, part, None)
        if isinstance(found, nn.ModuleList):
            return found
    return None


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
                         "is None: NoPE attention or absolute positions, e.g. position_embedding_type=None or 'absolute'), and "
                         "posenc.hf runs only models "
                         "whose decoder stack computes a rotary embedding once per forward")
    if plain is not None and _rotary_in_attention(plain):  # each attention's own (RecurrentGemma, Moshi)
        return plain
    source = next((f"{n} ({type(m).__name__})" for n, m in model.named_modules() if re.search("rotary|sinusoidal", type(m).__name__, re.I)), None)
    if plain is not None and source is not None and not getattr(type(model), "_supports_attention_backend", False):
        raise UsageError(f"model: {type(model).__name__}'s attention computes its scores itself, not through transformers' "
                         f"attention interface ({type(model).__name__} does not set _supports_attention_backend), so posenc's "
                         f"attention cannot take it over; its layers rotate q and k with the tables of {source}, handed "
                         "to each layer, where posenc.hf needs a rotary module whose tables it can verify and stand in for")
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
    raise UsageError(f"model: {type(model).__name__} has no decoder stack with `layers` and one `rotary_emb` module"
                     f"{f', its positions come from {source}' if source else ''} (posenc.hf needs the model's rotary "
                     "embedding computed once per forward on the decoder stack, and each layer's attention taking its tables)")


def _is_attention(module: Any) -> bool:
    """An attention module: one with ``layer_idx`` (its KV cache layer), or an encoder's (``is_causal``
    False: GTE, Nomic BERT and Jina v3 give theirs no index)."""
    return isinstance(module, nn.Module) and (hasattr(module, "layer_idx") or getattr(module, "is_causal", None) is False)


def attentions_of(layer: nn.Module) -> list[nn.Module]:
    """A decoder layer's attention modules: the one with ``layer_idx`` (or an encoder's), or, where the
    layer holds a ``ModuleList`` of them under one of :data:`ATTENTION_NAMES`,
    each of them, every one with an int ``layer_idx`` (its own KV cache layer: LongCat-Flash's two
    sublayers, 2i and 2i + 1); empty for a layer without attention (a linear-attention layer). A hybrid
    layer's shared transformer block (Zamba2's ``shared_transformer``, see :func:`check_shared`) and a
    DBRX block's ``norm_attn_norm`` are looked in too (:data:`ATTENTION_HOLDERS`)."""
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


__all__ = ["ATTENTION_HOLDERS", "ATTENTION_NAMES", "LAYER_LISTS", "ROTARY_NAMES", "attention_of", "attention_slots", "attentions_of",
           "decoder_stack", "layer_list", "rotary_name"]
