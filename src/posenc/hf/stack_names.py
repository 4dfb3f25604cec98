"""Where a decoder stack keeps its layers, rotary module and attention modules, by attribute name.

Most families hold their layers in ``layers`` (``LlamaModel`` & co.); Falcon in ``h``; DBRX in
``blocks``, with each block's attention one module further in (``norm_attn_norm.attn``). Zamba2's
hybrid layers hold their attention in a shared transformer block (``shared_transformer``). A layer
may hold several attention modules in a ``ModuleList`` under one of :data:`ATTENTION_NAMES`, each its
own cache layer (LongCat-Flash's ``self_attn``: two sublayers, ``layer_idx`` 2i and 2i + 1).
"""

from __future__ import annotations

from torch import nn

#: The names a decoder stack's rotary module goes by (LFM2-MoE's is ``pos_emb``).
ROTARY_NAMES = ("rotary_emb", "pos_emb")
#: The names a decoder stack's list of layers goes by, in the order they are looked for.
LAYER_LISTS = ("layers", "h", "blocks")
#: The sub-modules of a layer its attention may be held in (besides the layer itself).
ATTENTION_HOLDERS = ("shared_transformer", "norm_attn_norm")
#: The names a layer's attention module (or ``ModuleList`` of them) goes by, in the order they are looked for
#: (RecurrentGemma's ``temporal_block``: attention on its attention layers, the RG-LRU recurrent block,
#: without ``layer_idx``, on the others).
ATTENTION_NAMES = ("self_attn", "attention", "attn", "self_attention", "temporal_block")


def layer_list(stack: nn.Module) -> nn.ModuleList | None:
    """The first of ``stack``'s :data:`LAYER_LISTS` that is a ``ModuleList``, or None."""
    for name in LAYER_LISTS:
        found = getattr(stack, name, None)
        if isinstance(found, nn.ModuleList):
            return found
    return None


__all__ = ["ATTENTION_HOLDERS", "ATTENTION_NAMES", "LAYER_LISTS", "ROTARY_NAMES", "layer_list"]
