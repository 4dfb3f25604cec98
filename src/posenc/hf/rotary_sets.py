"""Decoder stacks that rotate with several rotary modules (``Family.rotary_list``): one per RoPE base,
or one without the RoPE block's scaling (Molmo2's ``rotary_emb_unscaled``, for the layers outside
``rope_scaling_layers``).

A family whose rotary modules sit inside its attention modules (``Family.attention_rotary``:
RecurrentGemma, Moshi; the decoder stack holds none) is handled here as well: :func:`stack_rotary`
is the first attention's module (the rotated features are read from it), :func:`layer_rotary` each
layer's own; :func:`place_rotaries` puts the stand-in in the first attention module and
:func:`install_rotaries` wraps the others' modules, all sharing one forward state that the decoder
stack's pre-hook starts (a rotary call there is one layer's, not a new forward). An attention module
without one (a layer the model leaves unrotated) is refused.

Granite-SWA and GraniteMoE-SWA give each layer its own base (``config.layer_rope_theta``, 0 for a
NoPE layer) and hold one rotary module per distinct non-zero base in a ``ModuleList``
(``rotary_embs``), each built from a copy of the config whose ``rope_parameters["rope_theta"]`` is
that base; the stack calls every one of them once per forward and hands each layer the tables of its
base. Their ``rotary_emb`` is built and never called. For :func:`posenc.hf.use`:

- :func:`layer_rotary`: the module a layer's RoPE read from the config is verified against (the one
  of the layer's base), so ``use(model, "rope")`` is checked per layer as for any family;
- :func:`install_rotaries`: each module of the list is wrapped by a
  :class:`~posenc.hf.forward_state.RotaryStandIn` sharing the stack's forward state and identity
  flag, so any of them starts the forward for the attention layers and, under another encoding,
  leaves q and k as they are.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, cast

from torch import nn

from ..errors import UsageError
from .families import Family, layer_config, qk_head_dim
from .forward_state import RotaryStandIn
from .stack import ROTARY_NAMES


def _holder(model: nn.Module, family: Family) -> nn.Module:
    """The module holding the family's other rotary modules (a list, or one module: Molmo2's)."""
    name = str(family.rotary_list)
    found = next((m for m in model.modules() if isinstance(getattr(m, name, None), nn.Module)), None)
    if found is None:
        raise UsageError(f"model: the {family.name} family rotates with the modules of {name!r}, and "
                         f"{type(model).__name__} has no such module")
    return found


def _held(model: nn.Module, family: Family) -> list[nn.Module]:
    return _modules(getattr(_holder(model, family), str(family.rotary_list)))


def _modules(held: nn.Module) -> list[nn.Module]:
    """The rotary modules ``held`` (a list of them, or one)."""
    return list(held) if isinstance(held, nn.ModuleList) else [held]


def _own(module: Any) -> nn.Module:
    return cast(nn.Module, module.original if isinstance(module, RotaryStandIn) else module)


def _attention_rotaries(family: Family, attentions: list[nn.Module | None]) -> list[tuple[nn.Module, nn.Module]]:
    """(attention, its rotary module as held now) for each attention module of a family with
    ``attention_rotary``.

    Raises:
        UsageError: an attention module without one (posenc could not tell what it rotates with).
    """
    name = str(family.attention_rotary)
    found = []
    for attention in attentions:
        if attention is None:
            continue
        module = getattr(attention, name, None)
        if not isinstance(module, nn.Module):
            raise UsageError(f"model: the {family.name} family rotates inside each attention module with its {name!r}, and "
                             f"{type(attention).__name__} (layer_idx {getattr(attention, 'layer_idx', None)!r}) holds "
                             f"{type(module).__name__}; posenc cannot check its RoPE")
        found.append((attention, module))
    return found


def stack_rotary(stack: nn.Module, family: Family | None, attentions: list[nn.Module | None]) -> nn.Module:
    """The rotary module as held now (a stand-in after an earlier :func:`posenc.hf.use`): the decoder
    stack's (``rotary_emb``, LFM2-MoE's ``pos_emb``), or for a family with ``attention_rotary`` the
    first attention module's.

    Raises:
        UsageError: an attention module of such a family without its rotary module.
    """
    if family is not None and family.attention_rotary is not None:
        return _attention_rotaries(family, attentions)[0][1]
    return cast(nn.Module, next(getattr(stack, n) for n in ROTARY_NAMES if isinstance(getattr(stack, n, None), nn.Module)))


def stand_in_for(current: nn.Module, family: Family | None) -> RotaryStandIn:
    """``current`` if it is a stand-in already, else a new stand-in for it: (sin, cos) for a family with a
    ``[sin | cos]`` table (GPT-J), not starting the forward for a family with ``attention_rotary``."""
    if isinstance(current, RotaryStandIn):
        return current
    return RotaryStandIn(current, sin_first=family is not None and family.sincos_table is not None,
                         starts=family is None or family.attention_rotary is None)


def place_rotaries(stack: nn.Module, family: Family | None, attentions: list[nn.Module | None], stand_in: RotaryStandIn) -> None:
    """Put ``stand_in`` where the model holds its rotary module: on the decoder stack, or, for a family
    with ``attention_rotary``, in the first attention module (:func:`install_rotaries` wraps the others)."""
    if family is None or family.attention_rotary is None:
        setattr(stack, next(n for n in ROTARY_NAMES if isinstance(getattr(stack, n, None), nn.Module)), stand_in)
        return
    setattr(_attention_rotaries(family, attentions)[0][0], str(family.attention_rotary), stand_in)


def layer_rotary(rotary: nn.Module, model: nn.Module, family: Family | None, config: Any, layer: int,
                 attention: nn.Module | None = None) -> nn.Module:
    """The rotary module layer ``layer`` is rotated with: ``rotary`` (the stack's); for a family with
    ``attention_rotary`` the one its ``attention`` holds; for a family with ``rotary_list`` the module
    of the list built for the layer's ``layer_rope_theta``.

    Raises:
        UsageError: no module of the list has the layer's base.
    """
    if family is not None and family.attention_rotary is not None and attention is not None:
        return _own(getattr(attention, family.attention_rotary, rotary))
    if family is None or family.rotary_list is None:
        return rotary
    if family.scaled_layers is not None:  # Molmo2: the listed layers take the stack's (scaled) module, the others the list's
        if layer in getattr(config, family.scaled_layers):
            return rotary
        other = _held(model, family)[0]
        return other.original if isinstance(other, RotaryStandIn) else other
    theta = float(config.layer_rope_theta[layer])
    if theta == 0:  # a NoPE layer: nothing of it is verified
        return rotary
    for module in _held(model, family):
        own: Any = module.original if isinstance(module, RotaryStandIn) else module
        if float(own.config.rope_parameters["rope_theta"]) == theta:
            return own
    raise UsageError(f"model: layer {layer}'s base {theta} (layer_rope_theta) has no rotary module in "
                     f"{family.rotary_list!r}; refusing to guess its tables")


def per_layer(sizes: Any, config: Any, family: Family | None, layer: int, attention: nn.Module | None = None) -> Any:
    """``sizes`` (posenc.hf.layers' head counts and dims) for layer ``layer`` of a family whose
    layers differ in head dim and key/value heads (``Family.per_layer_config``: Gemma 4), each layer
    rotating its whole head unless its RoPE block names a partial rotary; of a family whose layers
    differ in key/value heads only (``Family.kv_heads_per_layer``: MiMo-V2-Flash), the layer's
    attention module's (heads // ``num_key_value_groups``); else ``sizes``."""
    groups = getattr(attention, "num_key_value_groups", None)
    if family is not None and family.kv_heads_per_layer and isinstance(groups, int) and groups > 0:
        return replace(sizes, kv_heads=sizes.heads // groups)
    if family is None or not family.per_layer_config:
        return sizes
    own = layer_config(config, family, layer)
    d = qk_head_dim(config, family, layer)
    return replace(sizes, head_dim=d, rotary_dim=d, kv_heads=int(getattr(own, "num_key_value_heads", None) or sizes.heads))


def install_rotaries(model: nn.Module, family: Family | None, stand_in: RotaryStandIn | None,
                     attentions: list[nn.Module | None] | None = None) -> None:
    """Wrap each module of the family's ``rotary_list`` (none without one), or for a family with
    ``attention_rotary`` each attention's module but the first (``stand_in``, :func:`place_rotaries`),
    by a stand-in that shares ``stand_in``'s forward state and identity flag (a module already wrapped
    is re-pointed)."""
    if family is not None and family.attention_rotary is not None and stand_in is not None:
        for attention, module in _attention_rotaries(family, attentions or [])[1:]:
            extra = stand_in_for(module, family)
            extra.forward_state = stand_in.forward_state
            extra.identity = stand_in.identity
            setattr(attention, str(family.attention_rotary), extra)
        return
    if family is None or family.rotary_list is None or stand_in is None:
        return
    holder, name = _holder(model, family), str(family.rotary_list)
    held = getattr(holder, name)
    for i, module in enumerate(_modules(held)):  # (the holder found once)
        extra = module if isinstance(module, RotaryStandIn) else RotaryStandIn(module)
        extra.forward_state = stand_in.forward_state
        extra.identity = stand_in.identity
        if isinstance(held, nn.ModuleList):
            held[i] = extra
        else:
            setattr(holder, name, extra)


__all__ = ["install_rotaries", "layer_rotary", "per_layer", "place_rotaries", "stack_rotary", "stand_in_for"]
