"""posenc's attention inside Hugging Face ``transformers`` models: :func:`use`.

One adapter for the decoder families, driven by their rows in :data:`posenc.families.FAMILIES`
(what differs between families is data there; this module is the same for all of them):

- An attention function and a mask function are registered under one name, ``"posenc"``, with
  ``AttentionInterface`` and ``AttentionMaskInterface``; the model's ``config._attn_implementation``
  is set to it. Without the mask function every mask the attention receives would be None; ours
  hands the attention the 2-D padding mask (B, Tk), True = real token, or None when nothing is
  padded. Windows, chunks and documents are posenc's, read from the layer's plan, not from masks.
- The model's rotary module is wrapped by :class:`RotaryStandIn`, which returns the original's
  output as the identity rotation, so the model's own rotation leaves q and k exactly as they are;
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
  wherever a real token's position is not its predecessor's plus one, and attention never crosses
  documents, with or without a cache. A cached call whose queries restart is a UsageError (their
  keys' documents are unknown).
- A static cache's unwritten slots (False in every row of the mask) are dropped from the keys.
- The layers of one model forward share one :class:`~posenc.geometry.Geometry` per key length
  (positions, documents and padding, read once) and one :class:`~posenc.memo.ForwardMemo`.

Encodings with parameters (T5's table, FIRE's MLP, ...) are modules of the model
(``<decoder stack>.posenc_encodings``: one shared by all layers, or one per layer when the method
learns per layer), so they train with the model, follow ``.to()``, and are saved by
``save_pretrained``; the config records the encoding (``config.posenc``), and
:func:`from_pretrained` rebuilds it.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, replace
from typing import Any, Callable, TypeVar, cast

import torch
import transformers
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from ..encodings import build, get_class, options_of
from ..encodings.base import PositionalEncoding
from ..encodings.protocol import Embeds, Gates, offers, require
from ..encodings.rope import RoPE
from ..errors import UsageError
from ..families import FAMILIES, Family, family_of, qk_head_dim, text_config
from ..functional import attend
from ..geometry import Geometry
from ..memo import ForwardMemo, Workspace
from ..query_scale import QueryScale
from ..schedule import Layer, Schedule
from ..schedule_hf import schedule_from_hf

NAME = "posenc"

_Model = TypeVar("_Model", bound=PreTrainedModel)

#: model_type -> family name, for the families of the table (:data:`posenc.families.FAMILIES`).
SUPPORTED = {t: f.name for f in FAMILIES if f.causal for t in f.model_types}


# -- the registered functions --------------------------------------------------------------------


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                 attention_mask: torch.Tensor | None = None, device: torch.device | str = "cpu", **_: Any) -> torch.Tensor | None:
    """The mask function registered as ``"posenc"``: the 2-D key mask (B, kv_length), bool, True =
    a real token, for the keys ``kv_offset .. kv_offset + kv_length - 1``; None when every key is
    real. A key slot past the last query (a static cache's unwritten slots) is not real.
    Causality, documents and positions are the attention function's business.

    Raises:
        UsageError: ``attention_mask`` is not a 2-D padding mask (B, T).
    """
    slots = torch.arange(kv_offset, kv_offset + kv_length, device=device)
    written = slots < q_offset + q_length  # (Tk,); q_offset may be a tensor (static caches)
    mask = None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise UsageError(f"attention_mask: posenc.hf takes a 2-D padding mask (B, T), got shape {tuple(attention_mask.shape)}")
        mask = attention_mask.to(device=device, dtype=torch.bool)
        short = kv_offset + kv_length - mask.shape[-1]
        if short > 0:  # keys past the mask are not real
            mask = torch.nn.functional.pad(mask, (0, short), value=False)
        mask = mask[:, kv_offset: kv_offset + kv_length] & written
        if mask.shape[0] != batch_size:
            mask = mask.expand(batch_size, -1)
    elif not bool(written.all()):
        mask = written.expand(batch_size, -1)
    return None if mask is None or bool(mask.all()) else mask


def _restarts(positions: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """(B, T) bool: a token whose position is not its predecessor's + 1, both real."""
    step = positions[:, 1:] != positions[:, :-1] + 1  # (B, T-1)
    if real is not None:
        step = step & real[:, 1:] & real[:, :-1]
    return torch.nn.functional.pad(step, (1, 0), value=False)


def _key_end(tq: int, tk: int, real: torch.Tensor | None) -> int:
    """How many key slots hold keys: a static cache's unwritten slots end every row (their mask is
    False in every row) and are dropped; Tk otherwise."""
    if real is None or tq == tk:
        return tk
    written = real.any(dim=0)  # (Tk,)
    end = int(torch.nonzero(written).max()) + 1 if bool(written.any()) else tk
    return max(end, tq)


def _geometry(query: torch.Tensor, tk: int, attention_mask: torch.Tensor | None,
              position_ids: torch.Tensor | None, causal: bool) -> Geometry:
    """The call's geometry from what HF passes: the queries' ``position_ids`` and the padding mask
    (see the module docstring for the key positions and documents derived from them)."""
    batch, _, tq, _ = query.shape
    real = None if attention_mask is None else attention_mask[:, :tk]  # (B, Tk) or None
    device = query.device
    shared = position_ids is None or position_ids.shape[0] == 1
    if real is None and shared and tq < tk:
        # A decode step of rows that share positions (no padding): plain consecutive positions,
        # built without the general planning (one host read of the first query position).
        first = tk - tq if position_ids is None else int(position_ids[0, 0])
        past = first - (tk - tq)  # the first key's position
        if past >= 0 and (position_ids is None or tq == 1 or not bool(_restarts(position_ids, None).any())):
            q_pos = torch.arange(first, first + tq, device=device)
            k_pos = torch.arange(past, past + tk, device=device)
            return Geometry(batch, tq, tk, causal, q_pos, k_pos, True, None, first, past, True)
    if position_ids is None and real is not None:
        # positions counted from each row's first real key (as HF's generate derives them)
        q_pos = (real.long().cumsum(-1) - 1)[:, tk - tq:]
    elif position_ids is None:
        q_pos = torch.arange(tk - tq, tk, device=device).expand(batch, tq)
    else:
        q_pos = position_ids.to(device=device, dtype=torch.long).expand(batch, tq)
    document_ids = None
    if tq == tk:
        k_pos = q_pos
        restarts = _restarts(q_pos, real) if tq > 1 else None
        if restarts is not None and bool(restarts.any()):
            document_ids = restarts.long().cumsum(-1)  # (B, T)
    else:
        if tq > 1 and bool(_restarts(q_pos, None).any()):
            raise UsageError("position_ids: queries that restart (packed documents) after a cache past are not "
                             "supported: their keys' documents are unknown; run each document's chunks with its own cache")
        k_pos = q_pos[:, -1:] - torch.arange(tk - 1, -1, -1, device=device)  # (B, Tk): consecutive, ending at the last query
        before = k_pos < 0  # left padding, or an earlier document of a packed prefill
        if bool(before.any()):
            real = ~before if real is None else real & ~before
            k_pos = k_pos.clamp(min=0)
    if real is not None:  # positions at padding slots do not matter; keep them in range
        q_pos = q_pos.clamp(min=0)
        k_pos = k_pos.clamp(min=0)
    same_rows = position_ids is None or position_ids.shape[0] == 1
    if same_rows and real is None:
        q_pos, k_pos = q_pos[0], k_pos[0]
    return Geometry.of(batch, tq, tk, device, positions=q_pos, k_positions=k_pos, causal=causal,
                       document_ids=document_ids, key_padding_mask=real)


@dataclass
class LayerPlan:
    """What one attention layer runs: its encoding and its attention kind (see :func:`use`).

    ``rope_last``: r > 0 when the model's rotated features are the last r of each q/k head (MLA);
    they are moved to the front before the encoding sees them (the same move on q and k leaves
    q . k unchanged), so a RoPE with ``rotary_dim=r`` rotates exactly them.
    """

    encoding: PositionalEncoding
    window: int | None = None
    chunk: int | None = None
    sinks: str | None = None  # the attention module's attribute holding (H,) sink logits
    query_scale: QueryScale | None = None
    rope_last: int = 0
    causal: bool = True
    rotate: bool = True  # False: q and k come rotated by the model's own rotary (see use)


def posenc_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, *, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention function registered as ``"posenc"``: ``posenc.attend`` with the layer's
    encoding and attention kind (its :class:`LayerPlan`). query (B, H, Tq, D), key (B, Hkv, Tk, D)
    and value (B, Hkv, Tk, Dv) un-rotated, cache included; returns (out (B, Tq, H, Dv), None).

    The geometry (positions, documents, padding) is derived once per model forward and per key
    length (full and sliding layers keep caches of different lengths) and shared by the layers,
    with one :class:`~posenc.memo.ForwardMemo` (T5's bias is then computed once): the stand-in
    rotary call, which the model makes at the start of each forward, starts a new forward. Under
    gradient checkpointing each layer gets its own memo (a recomputed layer must redo its work).
    ``softcap`` (Gemma 2) arrives from the layer; sinks are read from the module.

    Raises:
        UsageError: the model was not prepared with :func:`posenc.hf.use`, ``attention_dropout`` is
            not 0 in training, or the mask is a prepared 4-D one.
    """
    plan: LayerPlan | None = module.__dict__.get("_posenc_plan")
    forward: _Forward | None = module.__dict__.get("_posenc_forward")
    if plan is None or forward is None:
        raise UsageError(f"{type(module).__name__} {getattr(module, 'layer_idx', '')}: attn_implementation='posenc' "
                         "needs posenc.hf.use(model, encoding) first")
    if dropout and module.training:
        raise UsageError(f"attention_dropout must be 0 with posenc.hf (got {dropout})")
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.dtype != torch.bool):
        raise UsageError("attention_mask: posenc.hf takes a 2-D padding mask; a prepared 4-D mask is not supported")
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        position_ids = forward.position_ids  # families whose layers do not pass them (Llama 4)
    tq, tk = query.shape[2], key.shape[2]
    entry = forward.find(tq, tk, attention_mask, position_ids)
    if entry is None:
        key_end = _key_end(tq, tk, attention_mask)
        geometry = _geometry(query, key_end, attention_mask, position_ids, plan.causal)
        entry = forward.add(tq, tk, attention_mask, position_ids, key_end, geometry)
    key_end, geometry = entry[4], entry[5]
    if key_end < tk:  # a static cache's unwritten slots
        key, value = key[:, :, :key_end], value[:, :, :key_end]
    memo = forward.memo
    if module.training and getattr(forward.base, "gradient_checkpointing", False):
        # A checkpointed layer is run again in backward and must save the same tensors as in its
        # first run: nothing shared with the other layers (each computes its own bias).
        memo = ForwardMemo()
    r = plan.rope_last if plan.rotate else 0
    if r:  # MLA: the rope features to the front, for a rotation of the first r
        query = torch.cat((query[..., -r:], query[..., :-r]), dim=-1)
        key = torch.cat((key[..., -r:], key[..., :-r]), dim=-1)
    sinks = None if plan.sinks is None else getattr(module, plan.sinks)
    softcap = kwargs.get("softcap")
    log_gates = None
    if offers(plan.encoding, Gates):
        log_gates = _gates(module, plan.encoding, tq, tk)
    out = attend(query, key, value, plan.encoding, scale=scaling, geometry=geometry, memo=memo, causal=geometry.causal, rotate=plan.rotate,
                 window=plan.window, chunk=plan.chunk, sinks=sinks, query_scale=plan.query_scale,
                 softcap=None if softcap is None else float(softcap), log_gates=log_gates)
    return out.transpose(1, 2).contiguous(), None


def _gates(module: nn.Module, encoding: PositionalEncoding, tq: int, tk: int) -> torch.Tensor:
    """The layer's per-key log forget gates (B, H, Tk) from its input (kept by a pre-hook)."""
    x = module.__dict__.get("_posenc_input")
    if tq != tk or x is None or x.shape[1] != tk:
        raise UsageError("use_cache: a method with forget gates (fox) runs inside HF models without a KV cache "
                         "(use_cache=False): the cached keys' gates are not kept by HF's cache")
    return require(encoding, Gates).log_gates(x)


def _keep_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    hidden = args[0] if args else kwargs.get("hidden_states")
    module.__dict__["_posenc_input"] = hidden


def register() -> None:
    """Register posenc's attention and mask functions under the name ``"posenc"`` (idempotent)."""
    AttentionInterface.register(NAME, posenc_attention)
    AttentionMaskInterface.register(NAME, padding_mask)


# -- the rotary stand-in -------------------------------------------------------------------------


class _Forward:
    """What the layers of one model forward share: geometries (one per key length and mask), their
    memo, the model-level position_ids, and the decode steps' workspace."""

    def __init__(self) -> None:
        self.base: nn.Module | None = None  # the decoder stack (its gradient_checkpointing flag)
        self.entries: list[tuple[Any, ...]] = []
        self.memo: ForwardMemo = ForwardMemo()
        self.position_ids: torch.Tensor | None = None
        # The single-query paths' buffers between decode steps (a relative bias vector, a padding
        # mask), kept across forwards as posenc's own KV cache keeps them: every entry is rebuilt
        # when what made it (sizes, padding, the encoding's parameter versions) changes.
        self.workspace = Workspace()

    def start(self) -> None:
        self.entries = []
        self.memo = ForwardMemo(self.workspace)

    def find(self, tq: int, tk: int, mask: torch.Tensor | None, pos: torch.Tensor | None) -> tuple[Any, ...] | None:
        for entry in self.entries:
            if entry[0] == tq and entry[1] == tk and entry[2] is mask and entry[3] is pos:
                return entry
        return None

    def add(self, tq: int, tk: int, mask: torch.Tensor | None, pos: torch.Tensor | None, key_end: int,
            geometry: Geometry) -> tuple[Any, ...]:
        entry = (tq, tk, mask, pos, key_end, geometry)
        self.entries.append(entry)
        return entry


class RotaryStandIn(nn.Module):
    """Stands in for a model's rotary module, holding it (``original``, a submodule, so it follows
    ``.to()``; its tables are not persistent buffers, so checkpoints do not change). Each call
    starts a new forward for the attention layers, calls the original and returns its output's
    types and shapes as the identity rotation (cos = 1, sin = 0; a complex table of ones), so the
    model's own rotation leaves q and k exactly as they are, whatever its layout, slice or dtype.
    """

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        self.original = original
        self.forward_state = _Forward()
        self.identity = True  # False: the original's own tables pass through (the model rotates)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.forward_state.start()
        out = self.original(*args, **kwargs)
        if not self.identity:
            return out
        if isinstance(out, tuple):
            return (torch.ones_like(out[0]), torch.zeros_like(out[1]), *out[2:])
        return torch.ones_like(out)


# -- the plan: family, sizes, schedule -----------------------------------------------------------


def _decoder_stack(model: nn.Module) -> nn.Module:
    """The module holding ``layers`` and ``rotary_emb`` (``LlamaModel`` & co.).

    Raises:
        UsageError: no such module within three levels (base model prefix, ``model``, ``language_model``).
    """
    frontier: list[nn.Module] = [model]
    for _ in range(4):
        found: list[nn.Module] = []
        for node in frontier:
            if isinstance(getattr(node, "layers", None), nn.ModuleList) and isinstance(getattr(node, "rotary_emb", None), nn.Module):
                return node
            for name in (getattr(node, "base_model_prefix", None), "model", "language_model"):
                child = getattr(node, name, None) if isinstance(name, str) else None
                if isinstance(child, nn.Module) and child is not node:
                    found.append(child)
        frontier = found
    raise UsageError(f"model: {type(model).__name__} has no decoder stack with `layers` and one `rotary_emb` module "
                     "(posenc.hf needs the model's rotary embedding computed once per forward on the decoder stack)")


def _attention_of(layer: nn.Module) -> nn.Module | None:
    """A decoder layer's attention module (the one with ``layer_idx``), or None (a linear-attention layer)."""
    for name in ("self_attn", "attention", "attn"):
        module = getattr(layer, name, None)
        if isinstance(module, nn.Module) and hasattr(module, "layer_idx"):
            return module
    return None


def _layer_types(config: Any) -> list[str] | None:
    types = getattr(config, "layer_types", None)
    return list(types) if types is not None else None


def _rotary_tables(rotary: nn.Module, kind: str | None) -> tuple[torch.Tensor, float]:
    """The model's own inverse frequencies (r/2,) and attention factor for layers of ``kind``."""
    inv = getattr(rotary, f"{kind}_inv_freq", None) if kind else None
    factor = getattr(rotary, f"{kind}_attention_scaling", None) if kind else None
    if inv is None:
        inv = getattr(rotary, "inv_freq", None)
        factor = getattr(rotary, "attention_scaling", 1.0)
    if not isinstance(inv, torch.Tensor):
        raise UsageError(f"model: its rotary module {type(rotary).__name__} has no inv_freq buffer to read the rotated "
                         "features from")
    inv = inv.detach()
    return (inv if inv.is_meta else inv.float().cpu()), float(1.0 if factor is None else factor)


def _family_schedule(config: Any, family: Family | None, depth: int) -> Schedule:
    """The model's own schedule: its table row read by :func:`posenc.schedule_from_hf`, or for a
    model outside the table the LLaMA pattern: RoPE from the config on every layer, windowed
    where ``layer_types`` says sliding or, without them, everywhere when ``sliding_window`` is set."""
    if family is not None:
        return schedule_from_hf(config)
    from ..encodings.rope_scaling import options_from_hf

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
                         "(posenc.families.FAMILIES) to describe it")


def _rotate_with(layout: str, x: torch.Tensor, inv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x (1, 1, T, r) rotated at ``positions`` by frequencies ``inv`` (r/2,) in ``layout``."""
    from ..encodings.rope import apply_rotation

    angles = positions[:, None].float() * inv[None]
    return apply_rotation(x, angles.cos(), angles.sin(), layout)


@dataclass
class _Sizes:
    heads: int
    kv_heads: int
    head_dim: int  # D, the q/k head dim the attention function sees
    rotary_dim: int  # r, read from the model's rotary module
    layout: str
    rope_last: bool


def _sizes(model: Any, config: Any, family: Family | None, rotary: nn.Module) -> _Sizes:
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    d = qk_head_dim(config, family)
    types = _layer_types(config)
    inv, _ = _rotary_tables(rotary, types[-1] if types else None)
    r = 2 * int(inv.numel())
    if family is not None and family.rope_slice == "last":
        r = int(config.qk_rope_head_dim)
    if not 2 <= r <= d:
        raise UsageError(f"model: its rotary module turns {r} features, outside [2, head_dim={d}]")
    layout = family.layout if family is not None else "half"
    if family is None and not inv.is_meta:
        _check_rotation(model, rotary, r, layout)
    return _Sizes(heads, kv_heads, d, r, layout, family is not None and family.rope_slice == "last")


def _build(name: str, options: dict[str, Any], sizes: _Sizes, causal: bool) -> PositionalEncoding:
    """A registry encoding for the model's heads, the family's layout and rotated features by default."""
    cls = get_class(name)
    accepted = options_of(cls)
    extra: dict[str, Any] = {}
    if "layout" in accepted and "layout" not in options and sizes.layout != "half":
        extra["layout"] = sizes.layout
    if "rotary_dim" in accepted and "rotary_dim" not in options and sizes.rotary_dim != sizes.head_dim:
        extra["rotary_dim"] = sizes.rotary_dim
    if "num_kv_heads" in accepted and "num_kv_heads" not in options:
        extra["num_kv_heads"] = sizes.kv_heads
    return build(name, num_heads=sizes.heads, head_dim=sizes.head_dim, causal=causal, **options, **extra)


def _verify_rope(encoding: PositionalEncoding, rotary: nn.Module, kind: str | None, family: Family | None) -> None:
    """posenc's RoPE read from the config against the model's own tables: the same frequencies
    and attention factor, or a UsageError naming the difference (never a silently wrong model)."""
    if not isinstance(encoding, RoPE):
        return
    inv, factor = _rotary_tables(rotary, kind)
    if inv.is_meta or encoding.inv_freq.is_meta:  # a model being built by from_pretrained: checked once loaded
        return
    ours = encoding.inv_freq.detach().float().cpu()
    name = family.name if family is not None else "this model"
    if ours.shape != inv.shape or not torch.allclose(ours, inv, rtol=1e-5, atol=1e-9):
        raise UsageError(f"rope: posenc's RoPE read from the {name} config ({ours.numel()} frequencies) differs from the "
                         f"model's rotary module ({inv.numel()}) on layers of type {kind!r}; refusing a wrong model")
    if abs(encoding.attention_factor - factor) > 1e-6 * max(1.0, abs(factor)):
        raise UsageError(f"rope: posenc's attention factor {encoding.attention_factor} differs from the {name} model's "
                         f"{factor} on layers of type {kind!r}")


def _plans(model: Any, config: Any, family: Family | None, attentions: list[nn.Module | None], rotary: nn.Module,
           encoding: str | nn.Module | Schedule, options: dict[str, Any]) -> tuple[list[LayerPlan | None], nn.ModuleList, dict[str, Any]]:
    """One plan per layer (None where a layer has no attention), the encoding modules, the record."""
    depth = len(attentions)
    sizes = _sizes(model, config, family, rotary)
    causal = family.causal if family is not None else True
    own = _family_schedule(config, family, depth)
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
        else:
            _build(encoding, dict(options), sizes, causal)  # the registry's own errors for a bad option, first
            layers = [Layer(encoding, dict(options), o.window, o.chunk, o.sinks, o.query_scale) for o in own.layers]
        record = {"encoding": encoding, "options": dict(options), "causal": causal}
        if from_config:
            record["from_config"] = True
    else:
        raise UsageError(f"encoding must be a posenc encoding name, a schedule or an encoding module, got {type(encoding).__name__}")
    built: dict[str, PositionalEncoding] = {}
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
            key = layer.sharing_key
            cached = built.get(key)
            if cached is not None and cached.shares_across_layers:
                enc = cached
            else:
                enc = _build(layer.encoding, dict(layer.options), sizes, causal)
                built[key] = enc
        if from_config:
            _verify_rope(enc, rotary, kind, family)
        if layer.sinks and (family is None or family.sinks is None):
            raise UsageError(f"schedule: layer {i} asks for sinks, but the {type(attention).__name__} of this model has no "
                             "sink logits")
        if enc not in modules:
            modules.append(enc)
        plans.append(LayerPlan(enc, layer.window, layer.chunk, family.sinks if layer.sinks and family is not None else None,
                               layer.query_scale, sizes.rotary_dim if sizes.rope_last else 0, causal))
    return plans, nn.ModuleList(modules), record


def _with_own_rope(layer: Layer, own: Layer) -> Layer:
    """A schedule layer of ``rope`` without a base takes the model's own RoPE options for that layer."""
    if layer.encoding != "rope" or "base" in layer.options or own.encoding != "rope":
        return layer
    return Layer("rope", {**own.options, **layer.options}, layer.window, layer.chunk, layer.sinks, layer.query_scale)


def _module_record(encoding: nn.Module, options: dict[str, Any], sizes: _Sizes, causal: bool) -> dict[str, Any]:
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


_PreHook = Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]]


def _embed_hook(encoding: Embeds) -> _PreHook:
    """A forward pre-hook for the first decoder layer that adds an absolute encoding's ``embed`` to
    its input, at each row's own positions."""

    def hook(layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
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


def _positions_hook(state: _Forward) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
    """A forward pre-hook on the decoder stack: the forward's ``position_ids`` as given (None when
    the model makes them), for layers that are not passed them."""

    def hook(stack: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        pos = kwargs.get("position_ids")
        state.position_ids = pos if isinstance(pos, torch.Tensor) and pos.dim() == 2 else None

    return hook


def _remove_hooks(holder: nn.Module) -> None:
    for key in [k for k in holder.__dict__ if k.startswith("_posenc_hook")]:
        holder.__dict__.pop(key).remove()


def use(model: _Model, encoding: str | nn.Module | Schedule, **options: Any) -> _Model:
    """Turn ``model``'s attention into posenc's attention with ``encoding``; returns ``model``.

    ``encoding``:

    - ``"rope"`` without options: the model's own schedule (:func:`posenc.schedule_from_hf` of its
      family row in :data:`posenc.families.FAMILIES`): per-layer RoPE bases and scaling, windows,
      chunks, sinks, NoPE layers, partial and interleaved rotation, MLA's rope part, the YaRN /
      LongRoPE attention factor; checked at once against the model's own rotary tables. The result
      equals the untouched model.
    - another registry name (``posenc.available()``) built with ``options`` for the model's heads
      and head dim (the family's pair layout and rotated features by default), on every layer, each
      layer keeping the family's window, chunk and sinks.
    - a layer schedule (its text, ``"3x[rope window=512] 1x[nope]"``, or a
      :class:`~posenc.schedule.Schedule`): each layer as it says; a ``rope`` layer without a base
      takes the model's own RoPE parameters for that layer.
    - a built posenc encoding module (e.g. from :func:`posenc.hf.t5_from_hf`).

    The model's rotary module is made the identity (its output's types and shapes kept), and the
    rotation, biases and score terms are applied inside the attention, so the KV cache holds
    un-rotated keys. FoX's gates come from each layer's input (without a KV cache). The config
    records the choice (``config.posenc``); :func:`from_pretrained` restores it. Calling ``use``
    again replaces the encoding.

    Raises:
        UsageError: a model without a decoder stack of ``layers`` and one ``rotary_emb``, a model
            outside the family table whose rotation is not LLaMA's, an unknown encoding name or
            option, options that are not JSON values or given with a module or schedule, a built
            encoding for other heads or head dim or of the other causality, a schedule of another
            depth or asking for sinks the model lacks, or a RoPE read from the config that differs
            from the model's own tables.
    """
    config: Any = model.config
    inner = text_config(config)
    family = family_of(getattr(inner, "model_type", None))
    stack = _decoder_stack(model)
    layers = list(cast(nn.ModuleList, stack.layers))
    attentions = [_attention_of(layer) for layer in layers]
    if not any(a is not None for a in attentions):
        raise UsageError(f"model: no decoder layer of {type(model).__name__} has an attention module with layer_idx")
    if getattr(inner, "use_bidirectional_attention", None):
        raise UsageError("model: use_bidirectional_attention is not supported by posenc.hf (a decoder with causal masks)")
    current = stack.rotary_emb
    stand_in = current if isinstance(current, RotaryStandIn) else RotaryStandIn(cast(nn.Module, current))
    stack.rotary_emb = stand_in
    rotary = stand_in.original
    plans, modules, record = _plans(model, inner, family, attentions, rotary, encoding, options)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    stack.posenc_encodings = modules.to(device=device, dtype=dtype)
    # The model's own RoPE, verified equal to posenc's (use(model, "rope")), whose rotation does not
    # depend on the length: the model rotates q and k itself, so the cache keeps rotated keys and a
    # decode step rotates one key, not the whole cache. Everything else rotates in the attention.
    stand_in.identity = not (record.get("from_config") and not any(
        isinstance(p.encoding, RoPE) and p.encoding.rotation_depends_on_length for p in plans if p is not None))
    if not stand_in.identity:
        plans = [None if p is None else replace(p, rotate=not isinstance(p.encoding, RoPE)) for p in plans]
    state = stand_in.forward_state
    state.base = stack
    for attention, plan in zip(attentions, plans):
        if attention is None:
            continue
        if family is not None and family.temperature and getattr(attention, "attn_temperature_tuning", False):
            setattr(attention, "attn_temperature_tuning", False)  # the layer's plan applies it (posenc.families: temperature)
        _remove_hooks(attention)
        attention.__dict__["_posenc_plan"] = plan
        attention.__dict__["_posenc_forward"] = state
        if plan is not None and offers(plan.encoding, Gates):
            attention.__dict__["_posenc_hook_input"] = attention.register_forward_pre_hook(_keep_input, with_kwargs=True)
    _remove_hooks(stack)
    stack.__dict__["_posenc_hook_positions"] = stack.register_forward_pre_hook(_positions_hook(state), with_kwargs=True)
    _remove_hooks(layers[0])
    if offers(modules[0], Embeds):
        hook = _embed_hook(cast(Embeds, modules[0]))
        layers[0].__dict__["_posenc_hook_embed"] = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    register()
    model.set_attn_implementation(NAME)
    config.posenc = record
    return model


def _installed(model: nn.Module) -> nn.ModuleList:
    """The encodings :func:`use` installed in ``model`` (its decoder stack's ``posenc_encodings``)."""
    return cast(nn.ModuleList, _decoder_stack(model).posenc_encodings)


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
    mapping = getattr(model_class, "_model_mapping", None)
    if mapping is not None:  # an Auto class: its concrete class for this config
        model_class = mapping[type(config)]

    def post_init(self: Any) -> None:
        model_class.post_init(self)
        use(self, encoding if encoding is not None else recorded_encoding(self.config, record))

    loading: Any = type(model_class.__name__, (model_class,), {"post_init": post_init})
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
    if record.get("from_config"):
        return "rope"
    if record.get("schedule") is not None:
        return Schedule.of(record["schedule"])
    inner = text_config(config)
    heads = int(inner.num_attention_heads)
    head_dim = qk_head_dim(inner, family_of(getattr(inner, "model_type", None)))
    return build(record["encoding"], num_heads=heads, head_dim=head_dim, causal=bool(record.get("causal", True)),
                 **dict(record.get("options") or {}))


__all__ = ["LayerPlan", "RotaryStandIn", "NAME", "SUPPORTED", "from_pretrained", "padding_mask", "posenc_attention",
           "recorded_encoding", "register", "use"]
