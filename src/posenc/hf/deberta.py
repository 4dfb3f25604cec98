"""Import one layer of a Hugging Face DeBERTa-v2/v3 encoder as a posenc attention module.

``deberta_from_hf(encoder, layer=i)`` takes a ``transformers`` ``DebertaV2Encoder`` (or a
``DebertaV2Model``, whose ``.encoder`` is used) and returns a :class:`posenc.Attention` with the
``deberta`` encoding (:mod:`posenc.encodings.deberta`), bidirectional, holding copies of that
layer's weights and of the encoder's relative table:

- the content projections (query, key and value, biases included) as the attention's ``qkv``
  (a biased ``nn.Linear``, since DeBERTa's projections have biases);
- the encoder's relative table ``rel_embeddings`` (its first 2k rows) and, when ``norm_rel_ebd``
  says ``layer_norm``, its LayerNorm, as the encoding's table and norm;
- the position projections: the layer's own key/query projections when the config has
  ``share_att_key`` (Hugging Face then uses them for the relative table), otherwise its
  ``pos_key_proj`` / ``pos_query_proj``;
- the buckets (``position_buckets``, ``max_relative_positions``) and ``pos_att_type``.

The attention's output projection is the identity: Hugging Face applies its output dense layer in
a separate module (``DebertaV2SelfOutput``), so ``attn(hidden_states, attention_mask=mask)``
(B, T, dim) equals that layer's ``DisentangledSelfAttention`` output at every real token (padding
queries give 0 here; Hugging Face gives them an average of all values, used by nothing).
Where Hugging Face's query and key lengths differ (its swapped ``build_rpos`` arguments), posenc
follows the authors' code instead (see :mod:`posenc.encodings.deberta`).

The copies are tensors of the module's own (``torch.no_grad`` copies), so training one model does
not move the other.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from ..encodings.deberta import DeBERTa
from ..errors import UsageError
from ..model.attention import Attention


def _copy(dst: nn.Linear, src: nn.Linear) -> None:
    dst.weight.copy_(src.weight)
    if src.bias is None:
        dst.bias.zero_()
    else:
        dst.bias.copy_(src.bias)


def deberta_from_hf(encoder: nn.Module, layer: int = 0, backend: str = "auto") -> Attention:
    """posenc's attention for layer ``layer`` of a ``transformers`` DeBERTa-v2 encoder.

    Args:
        encoder: a ``DebertaV2Encoder`` or ``DebertaV2Model`` (random or pretrained weights).
        layer: which layer's ``DisentangledSelfAttention`` to import (0-based).
        backend: the attention backend ("auto" or a name of :func:`posenc.backends.names`).

    Returns:
        ``posenc.Attention(dim, H, deberta, causal=False)`` with the layer's weights, on the
        encoder's device and dtype; call it on hidden states (B, T, dim), with
        ``attention_mask`` (B, T) for a padded batch.

    Raises:
        UsageError: not a DeBERTa-v2 encoder (DeBERTa v1 included), a layer outside it, or a configuration posenc does
            not express (no relative attention, no position term, a head size that does not
            divide the width).
    """
    encoder = getattr(encoder, "encoder", encoder)
    layers = getattr(encoder, "layer", None)
    if layers is None or not hasattr(encoder, "get_rel_embedding"):
        raise UsageError(f"encoder must be a transformers DebertaV2Encoder or DebertaV2Model, got {type(encoder).__name__}")
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < len(layers):
        raise UsageError(f"layer must be an integer in [0, {len(layers) - 1}], got {layer!r}")
    att = layers[layer].attention.self
    if not all(hasattr(att, name) for name in ("query_proj", "key_proj", "value_proj", "pos_att_type")):
        raise UsageError(f"encoder: a DeBERTa-v2/v3 encoder has separate query_proj, key_proj and value_proj; this "
                         f"{type(encoder).__name__}'s {type(att).__name__} (module {type(att).__module__}) has none "
                         "(DeBERTa v1 projects q, k and v with one in_proj and is not supported)")
    if not getattr(att, "relative_attention", False) or not getattr(encoder, "relative_attention", False):
        raise UsageError("the encoder has relative_attention=False: no disentangled position terms to import")
    terms = [t for t in ("c2p", "p2c") if t in att.pos_att_type]
    if not terms:
        raise UsageError(f"pos_att_type must name c2p and/or p2c, got {att.pos_att_type!r}")
    heads, head_dim = att.num_attention_heads, att.attention_head_size
    dim = att.query_proj.in_features
    if heads * head_dim != dim:
        raise UsageError(f"attention_head_size x num_attention_heads ({heads} x {head_dim}) must equal hidden_size ({dim})")
    buckets = att.position_buckets if att.position_buckets > 0 else 0
    norm = getattr(encoder, "LayerNorm", None) if "layer_norm" in getattr(encoder, "norm_rel_ebd", []) else None
    enc = DeBERTa(heads, head_dim, causal=False, position_buckets=buckets, max_relative_positions=att.max_relative_positions,
                  pos_att_type="|".join(terms), layer_norm=norm is not None,
                  layer_norm_eps=norm.eps if norm is not None else 1e-7)
    table = cast(nn.Embedding, encoder.rel_embeddings).weight  # (rows, dim): a DebertaV2Encoder's relative table
    if table.shape[0] < 2 * enc.span:
        raise UsageError(f"the encoder's relative table has {table.shape[0]} rows, the layer needs {2 * enc.span}")
    attn = Attention(dim, heads, enc, causal=False, backend=backend)
    qkv = attn.qkv = nn.Linear(dim, 3 * dim, bias=True)
    attn.proj = nn.Identity()  # DeBERTa's output dense layer is a separate module
    with torch.no_grad():
        qkv.weight.copy_(torch.cat([att.query_proj.weight, att.key_proj.weight, att.value_proj.weight]))
        qkv.bias.copy_(torch.cat([att.query_proj.bias, att.key_proj.bias, att.value_proj.bias]))
        enc.rel_embeddings.copy_(table[: 2 * enc.span])
        if norm is not None and enc.norm is not None:  # enc has a norm when norm is given (layer_norm=True)
            enc.norm.weight.copy_(norm.weight)
            enc.norm.bias.copy_(norm.bias)
        if enc.pos_key_proj is not None:
            _copy(enc.pos_key_proj, att.key_proj if att.share_att_key else att.pos_key_proj)
        if enc.pos_query_proj is not None:
            _copy(enc.pos_query_proj, att.query_proj if att.share_att_key else att.pos_query_proj)
    return attn.to(device=table.device, dtype=table.dtype)


__all__ = ["deberta_from_hf"]
