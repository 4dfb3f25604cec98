"""Trained position parameters of Hugging Face checkpoints, into posenc encodings and back.

- **T5** (Raffel et al. 2020, §2.1): the ``relative_attention_bias`` table (buckets, heads) of a
  ``T5Attention`` becomes the table of posenc's ``t5`` encoding. HF's relative position is
  ``memory_position - query_position``, posenc's r = j - i: the same sign, and both use the Mesh
  TensorFlow bucket function (bidirectional in the encoder, keys after the query in the upper half;
  causal in the decoder), so the table is copied as it is. In T5 one layer of each stack owns the
  table (the first block's self-attention) and every layer of that stack reuses its bias; posenc's
  ``t5`` is one module shared by every layer, the same arrangement.
- **BLOOM** ALiBi (Press et al. 2021, §3): BLOOM adds ``m_h * j`` (the key's index among the
  row's real tokens) to the scores, which differs from ALiBi's ``-m_h * (i - j)`` by ``m_h * i``, a
  constant per query that softmax ignores. Its slopes (the ALiBi paper's recipe for every head
  count) and head order are those of posenc's ``alibi``, so :func:`alibi_from_bloom` only sizes the
  encoding. There is nothing to export back: ALiBi has no parameters.

Nothing here imports ``transformers``: the functions read the attributes of the modules and configs
they are given (``relative_attention_bias``, ``relative_attention_num_buckets``,
``relative_attention_max_distance``, ``is_decoder``, ``n_heads``, ``key_value_proj_dim``; BLOOM's
``n_head`` and ``hidden_size``).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, cast

import torch
from torch import nn

from ..encodings.alibi import ALiBi
from ..encodings.t5 import T5Bias
from ..errors import UsageError

STACKS = ("encoder", "decoder")


class _T5Owner(Protocol):
    """What is read of a ``T5Attention`` that owns a bias table (:func:`_owners` checked the table)."""

    relative_attention_bias: nn.Embedding
    n_heads: int
    key_value_proj_dim: int
    relative_attention_num_buckets: int
    relative_attention_max_distance: int
    is_decoder: bool


def _owners(module: nn.Module) -> list[nn.Module]:
    """The T5-style attention modules under ``module`` (itself included) that own a bias table."""
    return [
        m for m in module.modules()
        if getattr(m, "has_relative_attention_bias", False) and isinstance(getattr(m, "relative_attention_bias", None), nn.Embedding)
    ]


def t5_attention(model: nn.Module, *, stack: str | None = None, layer: int | None = None) -> nn.Module:
    """The attention module that owns the relative bias table in a Hugging Face T5-family model.

    ``model``: a ``T5Attention`` (returned as it is), one stack (``model.encoder``), or a whole model
    with ``encoder`` and/or ``decoder`` stacks; ``stack`` picks one of them ("encoder" or
    "decoder"; needed when the model has both). ``layer``: the block index, for models whose every
    layer owns a table (UMT5); by default the one owner of the stack.

    Raises:
        UsageError: ``stack`` is not one of :data:`STACKS` or names a stack the model lacks, the
            model holds no T5 bias table, or ``layer`` / ``stack`` is needed to choose one and missing
            or out of range.
    """
    if stack is not None and stack not in STACKS:
        raise UsageError(f"stack must be one of {STACKS}, got {stack!r}")
    if stack is not None:
        part = getattr(model, stack, None)
        if not isinstance(part, nn.Module):
            raise UsageError(f"stack={stack!r}: {type(model).__name__} has no {stack} stack")
        model = part
    elif all(isinstance(getattr(model, s, None), nn.Module) for s in STACKS):
        raise UsageError(f"{type(model).__name__} has an encoder and a decoder: pass stack='encoder' or stack='decoder'")
    elif isinstance(encoder := getattr(model, "encoder", None), nn.Module):
        model = encoder
    elif isinstance(decoder := getattr(model, "decoder", None), nn.Module):
        model = decoder
    if layer is not None:
        blocks = getattr(model, "block", None)
        if not isinstance(blocks, nn.ModuleList) or not -len(blocks) <= layer < len(blocks):
            count = len(blocks) if isinstance(blocks, nn.ModuleList) else 0
            raise UsageError(f"layer must be a block index in [0, {count}), got {layer!r}")
        model = blocks[layer]
    owners = _owners(model)
    if not owners:
        raise UsageError(f"{type(model).__name__} holds no T5 relative_attention_bias table")
    if len(owners) > 1:
        raise UsageError(f"{len(owners)} layers of {type(model).__name__} own a T5 bias table: pass layer=<block index>")
    return owners[0]


def t5_from_hf(model: nn.Module, *, stack: str | None = None, layer: int | None = None) -> T5Bias:
    """posenc's ``t5`` encoding holding a copy of a Hugging Face T5 bias table.

    Heads, buckets, max distance and direction come from the owning attention (see
    :func:`t5_attention` for ``model``, ``stack`` and ``layer``): an encoder's table gives a
    bidirectional encoding (``causal=False``), a decoder's a causal one. The result's ``bias(i, j)``
    equals HF's ``compute_bias`` for the same positions (tests/hf/test_importers.py).

    Raises:
        UsageError: the table's shape is not (num_buckets, n_heads) of ``encoding``.
    """
    owner = cast(_T5Owner, t5_attention(model, stack=stack, layer=layer))
    table = owner.relative_attention_bias.weight  # (buckets, H)
    encoding = T5Bias(
        int(owner.n_heads), int(owner.key_value_proj_dim), bool(owner.is_decoder),
        num_buckets=int(owner.relative_attention_num_buckets), max_distance=int(owner.relative_attention_max_distance),
    )
    if tuple(table.shape) != tuple(encoding.relative_attention_bias.weight.shape):
        raise UsageError(f"T5 table has shape {tuple(table.shape)}, expected (num_buckets, n_heads) = "
                         f"{tuple(encoding.relative_attention_bias.weight.shape)}")
    with torch.no_grad():
        encoding.relative_attention_bias.weight.copy_(table.detach().to(torch.float32))
    return encoding.to(table.device)


def t5_to_hf(encoding: nn.Module, model: nn.Module, *, stack: str | None = None, layer: int | None = None) -> nn.Module:
    """Copy posenc ``t5`` ``encoding``'s table into a Hugging Face T5 model, in place; returns the
    owning attention module.

    The owner (see :func:`t5_attention`) must agree with the encoding on heads, buckets, max distance
    and direction (a decoder takes a causal encoding, an encoder a bidirectional one); otherwise a
    UsageError names the parameter that differs.

    Raises:
        UsageError: ``encoding`` is not posenc's t5, or its buckets, distance or heads differ from
            the T5 layer's.
    """
    if not isinstance(encoding, T5Bias):
        raise UsageError(f"encoding must be posenc's t5 encoding, got {type(encoding).__name__}")
    attention = t5_attention(model, stack=stack, layer=layer)
    owner = cast(_T5Owner, attention)
    checks = (
        ("num_heads", encoding.num_heads, int(owner.n_heads)),
        ("num_buckets", encoding.num_buckets, int(owner.relative_attention_num_buckets)),
        ("max_distance", encoding.max_distance, int(owner.relative_attention_max_distance)),
        ("causal", encoding.causal, bool(owner.is_decoder)),
    )
    for name, ours, theirs in checks:
        if ours != theirs:
            raise UsageError(f"{name}: the encoding has {ours!r}, the T5 layer needs {theirs!r}")
    weight = owner.relative_attention_bias.weight
    with torch.no_grad():
        weight.copy_(encoding.relative_attention_bias.weight.detach().to(weight.device, weight.dtype))
    return attention


def _bloom_sizes(config_or_model: Any) -> tuple[int, int]:
    """(heads, head dim) of a BLOOM config, a config dict, or a model holding one (``.config``)."""
    config = getattr(config_or_model, "config", config_or_model)
    get: Callable[[str, Any], Any]
    if isinstance(config, dict):
        get = config.get
    else:
        def get(key: str, default: Any = None) -> Any:
            return getattr(config, key, default)
    heads = get("n_head", None) or get("num_attention_heads", None)
    hidden = get("hidden_size", None) or get("n_embed", None)
    if not isinstance(heads, int) or heads < 1:
        raise UsageError(f"BLOOM config: n_head must be a positive integer, got {heads!r}")
    if not isinstance(hidden, int) or hidden % heads:
        raise UsageError(f"BLOOM config: hidden_size={hidden!r} must be a multiple of n_head={heads}")
    return heads, hidden // heads


def alibi_from_bloom(config_or_model: Any, *, causal: bool = True) -> ALiBi:
    """posenc's ``alibi`` for a BLOOM config (or model): heads from ``n_head``, head dim from
    ``hidden_size / n_head``. BLOOM computes its slopes from the head count with the ALiBi paper's
    recipe, in head order, as posenc's ``alibi`` does: tests/hf/test_importers.py checks BLOOM's
    ``build_alibi_tensor`` term against this encoding's bias for 1..64 heads."""
    heads, head_dim = _bloom_sizes(config_or_model)
    return ALiBi(heads, head_dim, causal)


__all__ = ["alibi_from_bloom", "t5_attention", "t5_from_hf", "t5_to_hf"]
