"""posenc.hf on the M-RoPE text backbones (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V, Cosmos3 Edge,
Cohere Compass, and HunYuan-VL's four-axis XD-RoPE): what :func:`posenc.hf.use` checks and refuses
there (their rows in :data:`posenc.hf.families.FAMILIES` say ``mrope=True``; ``mrope_encoding``
names posenc's encoding of the rotation, ``"mrope"`` or ``"xdrope"``).

M-RoPE (Wang et al. 2024, arXiv 2409.12191, §2.1; :mod:`posenc.encodings.mrope`) rotates frequency
f of a token by ``p_{a(f)} * theta_f``, a(f) one of three position axes (temporal, height, width).
In these backbones the decoder stack hands its rotary module (3, B, T) ids (a vision token's three
differ) and its layers get the tables, not the ids (``position_ids`` None, or the text row of the
4-row packed form, or Glm4vMoe's three rows). The attention function therefore never sees a
token's 3-axis ids, nor those of the keys in a KV cache, so:

- ``use(model, "rope")``: the model rotates q and k itself with its own tables (the rotary module
  passes through, the layer's plan says ``rotate=False``), after :func:`check_axes` has verified,
  on ids whose axes (as many as the module's sections) all differ, that those tables rotate as
  posenc's :class:`~posenc.encodings.mrope.MRoPE` read from the config (:func:`posenc.mrope_from_hf`;
  HunYuan-VL: :class:`~posenc.encodings.xdrope.XDRoPE`): the same frequencies (within the buffer's
  dtype), the same axis of each frequency (contiguous or interleaved sections) or feature (XD-RoPE),
  pair layout, rotated features and no attention factor, per layer type where the module holds a
  table per type (Cohere Compass). The KV cache then holds rotated keys, and the model equals the
  untouched one on image rows too.
- another encoding sees each token at its text position (the sequence slot counted from the row's
  first real token, or the ``position_ids`` given as (B, T), or the text row of the 4-row form): an
  image token sits at its slot, as if it were a text token (docs/hf.md, "M-RoPE backbones").
- refused at use() (:func:`refuse_other`, for every row with ``Family.model_rotates``: these, and
  the families whose learned per-channel weight follows the rotation, HunYuan v1 and Dory): any
  other rotation (``"rope"`` with options, a remap of it, ``"mrope"`` or another multi-axis
  rotation, xPos, FoPE, PoPE, a RoPE module, a schedule's rope layer), which posenc would apply at
  1-D text positions, not at the image tokens' 3-axis ids (HunYuan v1, Dory: before the weight);
  and on an M-RoPE backbone absolute encodings, whose embedding needs the position ids the layers
  are not handed.
"""

from __future__ import annotations

import copy
import inspect
import sys
from typing import Any

import torch
from torch import nn

from ..encodings import get_class
from ..encodings.base import PositionalEncoding
from ..encodings.mrope import MRoPE
from ..encodings.protocol import Embeds, Remaps, Rotates, offers
from ..encodings.rope import RoPE, RotaryTable
from ..encodings.xdrope import XDRoPE
from ..errors import UsageError
from .families import Family

_PROBE_LENGTH = 7


def probe_ids(length: int = _PROBE_LENGTH, axes: int = 3) -> torch.Tensor:
    """(A, 1, T) ids whose ``axes`` axes all differ (axis a: (a + 1) i + a; three axes: t = i,
    h = 2i + 1, w = 3i + 2), so a frequency or feature read from the wrong axis is seen."""
    i = torch.arange(length)
    return torch.stack([(a + 1) * i + a for a in range(axes)])[:, None]  # (A, 1, T)


def _module_axes(rotary: nn.Module, kind: str | None) -> int | None:
    """The number of position axes the rotary module splits its tables over: the length of its
    ``mrope_section`` (of layer type ``kind`` where it holds one per type), None when it says none."""
    sections = getattr(rotary, "mrope_section", None)
    if isinstance(sections, dict):
        sections = sections.get(kind)
    return len(sections) if isinstance(sections, (list, tuple)) else None


def check_axes(encoding: MRoPE | XDRoPE, rotary: nn.Module, model_type: Any, kind: str | None = None) -> None:
    """The model's rotary module and ``apply_rotary_pos_emb`` against ``encoding`` (M-RoPE, or
    HunYuan-VL's XD-RoPE) on :func:`probe_ids` with as many axes as the module's sections (which
    must be the encoding's ``position_axes``): the rotation of a random head must agree with
    posenc's (its axes, layout and rotated features, at the frequencies the module holds; the
    frequencies themselves are compared by the caller, at the buffer's precision). ``kind``: the
    layer type whose table is checked, for a module with one per type (``<kind>_inv_freq``, called
    with the type: Cohere Compass). Nothing for a model on the meta device.

    Raises:
        UsageError: naming the model type: the module has no inverse-frequency buffer, its modeling
            module has no ``apply_rotary_pos_emb``, its sections split over another number of axes
            than the encoding's, or the rotations differ.
    """
    name = f"{kind}_inv_freq" if kind and getattr(rotary, f"{kind}_inv_freq", None) is not None else "inv_freq"
    held = getattr(rotary, name, None)
    if not isinstance(held, torch.Tensor):
        raise UsageError(f"model_type {model_type!r}: its rotary module {type(rotary).__name__} has no inv_freq buffer "
                         "to check its M-RoPE against the config")
    if held.is_meta:
        return
    apply = getattr(sys.modules.get(type(rotary).__module__), "apply_rotary_pos_emb", None)
    if apply is None:
        raise UsageError(f"model_type {model_type!r}: its modeling module has no apply_rotary_pos_emb(q, k, cos, sin) "
                         "to check its M-RoPE rotation against posenc's")
    axes = _module_axes(rotary, kind) or encoding.position_axes
    if axes != encoding.position_axes:
        raise UsageError(f"model_type {model_type!r}: its rotary module splits its tables over {axes} position axes "
                         f"(mrope_section), and posenc's {encoding.name} read from the config over {encoding.position_axes}")
    if held.numel() != encoding.inv_freq.numel():
        raise UsageError(f"model_type {model_type!r}: its rotary module turns {2 * held.numel()} features, and posenc's "
                         f"{encoding.name} read {2 * encoding.inv_freq.numel()} from the config")
    # Twice: at the module's own frequencies, and (a copy of the module) at frequencies 1 / (f + 1), whose
    # angles on the probe ids are all visible (a low frequency of a large base, ~1e-7, turns a probe id by
    # nothing, so its axis could not be seen at its own).
    twin = copy.deepcopy(rotary)
    setattr(twin, name, 1 / torch.arange(1, held.numel() + 1, dtype=torch.float32, device=held.device).to(held.dtype))
    for module in (rotary, twin):
        _compare(encoding, module, getattr(module, name), apply, axes, kind, model_type)


def _compare(encoding: MRoPE | XDRoPE, rotary: nn.Module, held: torch.Tensor, apply: Any, axes: int, kind: str | None,
             model_type: Any) -> None:
    """The rotation of ``rotary`` (holding frequencies ``held``) and ``apply`` against ``encoding``'s
    at the same frequencies, on :func:`probe_ids` of ``axes`` axes (see :func:`check_axes`)."""
    ids = probe_ids(axes=axes)  # (A, 1, T)
    x = torch.randn(1, 1, ids.shape[-1], encoding.head_dim, generator=torch.Generator().manual_seed(0))  # (1, 1, T, D)
    device = held.device
    typed = kind is not None and "layer_type" in inspect.signature(rotary.forward).parameters
    with torch.no_grad():
        try:
            cos, sin = rotary(x.to(device), ids.to(device), kind) if typed else rotary(x.to(device), ids.to(device))
            theirs = apply(x.to(device), x.to(device), cos, sin)[0].float().cpu()
        except Exception as error:  # their own signature or shapes
            raise UsageError(f"model_type {model_type!r}: posenc could not run its rotary module on ({axes}, B, T) ids to "
                             f"check its M-RoPE ({type(error).__name__}: {str(error)[:160]})") from error
        # posenc's rotation at the module's frequencies: a shallow copy of the encoding holding a table of them
        probe = copy.copy(encoding)
        probe._table = RotaryTable(held.detach().float().cpu(), int(ids.max()) + 1)
        ours = probe.rotate(x, x, ids, ids)[0]
    tol = 1e-5 * max(1.0, float(x.abs().max()))
    if theirs.shape != ours.shape or not torch.allclose(theirs, ours, atol=tol, rtol=0):
        raise UsageError(f"model_type {model_type!r}: its M-RoPE rotates otherwise than posenc's {encoding.name} read from "
                         f"the config ({encoding.extra_repr()}); refusing a wrong model")


def refuse_other(model_type: Any, family: Family, module: nn.Module | None, names: set[str], from_config: bool) -> None:
    """In a family whose model must rotate q and k itself (``Family.model_rotates``: the M-RoPE
    backbones, see the module docstring; HunYuan v1, whose learned q/k norm follows the rotation),
    refuse what posenc cannot run there: ``module`` the encoding module given to use() (or None),
    ``names`` the registry names of the encodings asked for (the name given, a schedule's layers).
    A rotation is any encoding that rotates q and k (``Rotates``: RoPE, xPos, FoPE, PoPE, the
    multi-axis rotations) or remaps a rotation (``Remaps``: SelfExtend, ReRoPE, STRING, DCA); on an
    M-RoPE backbone an absolute encoding is refused too (its layers are not handed position ids).

    Raises:
        UsageError: naming the model type, the encoding and the family's reason.
    """
    if from_config or not family.model_rotates:
        return
    classes: list[tuple[str, Any]] = [(n, get_class(n)) for n in sorted(names)]
    if module is not None:
        classes.append((getattr(module, "name", type(module).__name__), type(module)))
    for name, cls in classes:
        if isinstance(cls, type) and issubclass(cls, PositionalEncoding):
            rotary = (issubclass(cls, (RoPE, MRoPE)) or offers(cls, Rotates) or offers(cls, Remaps)
                      or int(getattr(cls, "position_axes", 1)) > 1)
            if rotary:
                raise UsageError(f"model_type {model_type!r} {family.model_rotates}; encoding {name!r} is a rotation, which "
                                 "posenc would apply inside the attention function. use(model, 'rope') without options runs "
                                 "the model's own rotation (verified against its config), and an encoding without a rotation "
                                 "(ALiBi, T5, NoPE, ...) replaces it")
            if family.mrope and offers(cls, Embeds):
                raise UsageError(f"model_type {model_type!r} is an M-RoPE backbone, and encoding {name!r} is absolute: its "
                                 "embedding needs each token's position ids, which this backbone does not hand its layers")


__all__ = ["check_axes", "probe_ids", "refuse_other"]
