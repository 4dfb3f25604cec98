"""Decoder stacks that rotate with several rotary modules (``Family.rotary_list``): one per RoPE base,
or one without the RoPE block's scaling (Molmo2's ``rotary_emb_unscaled``, for the layers outside
``rope_scaling_layers``).

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
from typing import Any

from torch import nn

from ..errors import UsageError
from .families import Family, layer_config, qk_head_dim
from .forward_state import RotaryStandIn


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


def layer_rotary(rotary: nn.Module, model: nn.Module, family: Family | None, config: Any, layer: int) -> nn.Module:
    """The rotary module layer ``layer`` is rotated with: ``rotary`` (the stack's), or for a family
    with ``rotary_list`` the module of the list built for the layer's ``layer_rope_theta``.

    Raises:
        UsageError: no module of the list has the layer's base.
    """
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


def install_rotaries(model: nn.Module, family: Family | None, stand_in: RotaryStandIn | None) -> None:
    """Wrap each module of the family's ``rotary_list`` (none without one) by a stand-in that shares
    ``stand_in``'s forward state and identity flag (a module already wrapped is re-pointed)."""
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


__all__ = ["install_rotaries", "layer_rotary", "per_layer"]
