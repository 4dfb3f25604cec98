"""Inkling and Inkling-2 in :func:`posenc.hf.use`: the families whose attention has no RoPE.

Their text attention (transformers 5.25, ``models/inkling/modeling_inkling.py`` and
``models/inkling2/modeling_inkling2.py``) is the Inkling bias (:mod:`posenc.encodings.inkling`):
each token mixes a learned bank of curves over backward distance into its own bias. What each
layer holds and does, read from those modules:

- **Inkling** (``inkling_text``): ``r_proj`` (hidden -> H*K, no bias) gives each token's K weights
  per head, unclipped, which mix ``rel_logits_proj.proj`` (K, R); R is ``rel_extent`` on the full
  (``hybrid``) layers and ``sliding_window_size`` on the sliding (``hybrid_sliding``) ones, which
  also have a window of that size. With ``log_scaling_n_floor`` set, the full layers scale their
  queries and the bias by 1 + alpha log(max((n + 1) / n_floor, 1)) at n, the query's *cache slot*
  (its index among the keys held, padding included), not its position id.
- **Inkling-2** (``inkling2_text``): ``relative_position_bias.linear`` gives the weights, its
  ``norm`` scales them per head (a learned (H, K) scale), clips their L2 norm at
  ``rel_l2_clip_threshold`` and, on the full layers, log-scales them at the position ids; they mix
  ``relative_position_bias.proj``. Every layer adds a sink logit per query and head,
  ``sink_proj`` of the layer input, which reaches the attention function as ``sinks`` (B, H, T, 1).

Both compute queries, keys and values with their own projections, convolutions, norms and the
query log scaling before the attention function, and posenc leaves all of that as it is.

``use(model, "inkling")`` with no options gives each layer a :class:`HeldInkling`, the Inkling
bias with the layer's own options that reads the layer's parameters at each call (it holds none of
its own: training it trains the model's; a checkpoint holds them once, under the model's names).
With the windows and per-query sinks of the layer (:class:`~posenc.hf.attention.LayerPlan`) the
result is the untouched model. Any other registry encoding (or ``"inkling"`` with options: fresh
curves) is built for each layer's heads and replaces the bias, keeping the windows and sinks. What
posenc does not run here is refused at :func:`use`: a layer schedule, absolute encodings (the
Inkling-2 layers' inputs are mixed by block attention residuals), selective attention and remaps
with per-query sinks. Forget gates (FoX) run with the windows and per-query sinks.

Shape legend: B batch, H query heads, T tokens, K curves in a bank, R distances.
"""

from __future__ import annotations

import copy
import json
import sys
from typing import Any

import torch
from torch import nn

from ..encodings import build, get_class, options_of
from ..encodings.base import PositionalEncoding
from ..encodings.inkling import Inkling, mixed_curves
from ..encodings.protocol import Embeds, Remaps, Selects, offers
from ..errors import UsageError
from ..model.schedule import Schedule
from .attention import LayerPlan
from .families import Family, family_of, text_config


class HeldInkling(Inkling):
    """The Inkling bias of one attention layer of an Inkling or Inkling-2 model, reading that
    layer's parameters at each call (the module docstring says which).

    Args:
        attention: the layer's attention module (``InklingAttention``, ``Inkling2SlidingAttention``
            or ``Inkling2FullAttention``); held, not registered, so its parameters are the model's alone.
        config: the text model's config (hidden size, log scaling).

    Raises:
        UsageError: the module holds neither Inkling's nor Inkling-2's bias parameters.
    """

    def __init__(self, attention: Any, config: Any) -> None:
        bias: Any = getattr(attention, "relative_position_bias", None)
        second = bias is not None
        if not second and not (hasattr(attention, "r_proj") and hasattr(attention, "rel_logits_proj")):
            raise UsageError(f"model: {type(attention).__name__} holds no Inkling bias (r_proj and rel_logits_proj, or "
                             "relative_position_bias)")
        bank = bias.proj if second else attention.rel_logits_proj.proj  # (K, R)
        full = getattr(attention, "sliding_window", None) is None
        floor = getattr(config, "log_scaling_n_floor", None)
        alpha = float(getattr(config, "log_scaling_alpha", 0.0)) if full and floor is not None else 0.0
        clip = None
        if second:
            norm = bias.norm
            clip = float(getattr(norm, "threshold", None) or norm.l2_clip.threshold)
            alpha = alpha if hasattr(norm, "log_scale") else 0.0
        super().__init__(int(attention.num_heads), int(attention.head_dim), True, distances=int(bank.shape[1]),
                         rank=int(bank.shape[0]), clip=clip, log_scaling=alpha, log_floor=int(floor or 1),
                         input_dim=int(config.hidden_size))
        for name in ("weights", "scale", "bank"):  # nothing of its own: the layer's are read at each call
            delattr(self, name)
        self.__dict__["held"] = attention  # not a submodule (a deep copy of the model maps it to the copy's)
        self.second = second
        self.at_slots = not second and alpha > 0  # Inkling's log scaling reads cache slots

    def query_curves(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """As :meth:`Inkling.query_curves`, with the held layer's parameters: (B, H, T, R).

        Raises:
            UsageError: ``x`` is not a float (B, T, hidden) tensor.
        """
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.input_dim or not x.is_floating_point():
            raise UsageError(f"x: the Inkling curves read the layer input, a float (batch, length, {self.input_dim}) tensor, "
                             f"got {getattr(x, 'shape', type(x).__name__)}")
        held = self.__dict__["held"]
        if self.second:
            bias = held.relative_position_bias
            return mixed_curves(self, x, positions, bias.linear.weight, bias.linear.bias, bias.norm.scale, bias.proj)
        return mixed_curves(self, x, positions, held.r_proj.weight, held.r_proj.bias, None, held.rel_logits_proj.proj)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, reads {type(self.__dict__['held']).__name__} {getattr(self.__dict__['held'], 'layer_idx', '')}"


def without_rope(family: Family | None) -> bool:
    """The family's own attention is not RoPE (the Inkling families)."""
    return family is not None and family.own != "rope"


def layer_stack(model: nn.Module) -> nn.Module | None:
    """The decoder stack (``layers``) of a model whose family has no RoPE, or None."""
    frontier: list[nn.Module] = [model]
    for _ in range(4):
        found: list[nn.Module] = []
        for node in frontier:
            config = getattr(node, "config", None)
            if isinstance(getattr(node, "layers", None), nn.ModuleList) and config is not None:
                return node if without_rope(family_of(getattr(text_config(config), "model_type", None))) else None
            for name in (getattr(node, "base_model_prefix", None), "model", "language_model"):
                child = getattr(node, name, None) if isinstance(name, str) else None
                if isinstance(child, nn.Module) and child is not node:
                    found.append(child)
        frontier = found
    return None


def _built(name: str, options: dict[str, Any], attention: Any, config: Any) -> PositionalEncoding:
    """A registry encoding for one layer's heads (and key/value heads, and the hidden size for a
    method that reads the layer input)."""
    accepted = options_of(get_class(name))
    extra: dict[str, Any] = {}
    if "num_kv_heads" in accepted and "num_kv_heads" not in options:
        extra["num_kv_heads"] = int(attention.num_key_value_heads)
    if "input_dim" in accepted and "input_dim" not in options:
        extra["input_dim"] = int(config.hidden_size)
    return build(name, num_heads=int(attention.num_heads), head_dim=int(attention.head_dim), causal=True, **options, **extra)


def _refuse(enc: PositionalEncoding, family: Family, i: int, window: int | None) -> None:
    """What posenc does not run on an Inkling family's layer (see the module docstring)."""
    name = getattr(enc, "name", type(enc).__name__)
    if offers(enc, Selects):
        raise UsageError(f"{name}: posenc.hf does not run selective attention (a transformers KV cache keeps no "
                         "per-key selection sums); use posenc.LM")
    if offers(enc, Embeds):
        raise UsageError(f"{name}: an absolute encoding adds to the first layer's input, and the {family.name} layers' "
                         "inputs are mixed by their own residual paths; posenc has no place for it there")
    if offers(enc, Remaps) and family.query_sinks:
        raise UsageError(f"{name}: {family.name}'s per-query sinks (sink_proj) do not run with a remap (posenc's "
                         "remapped attention takes one sink logit per head)")


def inkling_plans(config: Any, family: Family, attentions: list[Any], encoding: str | nn.Module | Schedule,
                  options: dict[str, Any]) -> tuple[list[LayerPlan | None], nn.ModuleList, dict[str, Any]]:
    """One plan per layer of an Inkling family (None where a layer has no attention), the encoding
    modules, and the record for ``config.posenc``.

    Raises:
        UsageError: a layer schedule, options that are not JSON values or beside a module, a module
            for other heads, or an encoding posenc does not run here (:func:`_refuse`).
    """
    if isinstance(encoding, Schedule) or (isinstance(encoding, str) and "[" in encoding):
        raise UsageError(f"encoding: a layer schedule is not supported on {family.name} (its layers differ in heads and "
                         "window; posenc.hf plans them from the family row): give one encoding name")
    if isinstance(encoding, nn.Module) and options:
        raise UsageError("options: give them to posenc.build, not with an encoding module")
    if isinstance(encoding, str):
        get_class(encoding)  # an unknown name: the registry's own error
        try:
            json.dumps(options)
        except (TypeError, ValueError) as error:
            raise UsageError("options: posenc.hf records them in the model's config, so they must be JSON values") from error
    own = encoding == family.own and not options
    plans: list[LayerPlan | None] = []
    modules: list[nn.Module] = []
    shared: dict[tuple[int, int, int], PositionalEncoding] = {}
    for i, attention in enumerate(attentions):
        if attention is None:
            plans.append(None)
            continue
        window = getattr(attention, "sliding_window", None)
        key = (int(attention.num_heads), int(attention.num_key_value_heads), int(attention.head_dim))
        enc: PositionalEncoding
        if own:
            enc = HeldInkling(attention, config)
        elif isinstance(encoding, nn.Module):
            if not isinstance(encoding, PositionalEncoding) or (encoding.num_heads, encoding.head_dim) != (key[0], key[2]):
                raise UsageError(f"encoding: layer {i} of this {family.name} model needs a posenc encoding for num_heads={key[0]}, "
                                 f"head_dim={key[2]}, got {encoding!r}")
            enc = encoding if not modules or encoding.shares_across_layers else copy.deepcopy(encoding)
        else:
            held = shared.get(key)
            enc = held if held is not None and held.shares_across_layers else _built(str(encoding), dict(options), attention, config)
            shared[key] = enc
        _refuse(enc, family, i, window)
        if enc not in modules:
            modules.append(enc)
        plans.append(LayerPlan(enc, window=int(window) if window is not None else None, query_sinks=family.query_sinks,
                               curves_at_slots=bool(getattr(enc, "at_slots", False))))
    name = encoding if isinstance(encoding, str) else getattr(encoding, "name", type(encoding).__name__)
    record: dict[str, Any] = {"encoding": name, "options": dict(options), "causal": True}
    if own:
        record["from_config"] = True
    return plans, nn.ModuleList(modules), record


def keep_other_attention(model: nn.Module, attentions: list[Any]) -> None:
    """The modules of ``model`` other than its layers' attention that call transformers' attention
    interface (Inkling-2's attention residuals over the layers' outputs, ``*BlockAttentionResidual``)
    keep their family's own eager attention under posenc's name (``_posenc_own``)."""
    layers = {id(a) for a in attentions if a is not None}
    for module in model.modules():
        if id(module) in layers or not hasattr(module, "num_key_value_groups"):
            continue
        own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if callable(own):
            module.__dict__["_posenc_own"] = own


__all__ = ["HeldInkling", "inkling_plans", "keep_other_attention", "layer_stack", "without_rope"]
