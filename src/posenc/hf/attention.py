"""The functions ``transformers`` calls inside a model prepared by :func:`posenc.hf.use`: the
registered attention and mask functions, and the rotary stand-in that marks each forward.

One attention function serves every family (their differences are data: each layer's
:class:`LayerPlan`, made by :mod:`posenc.hf.layers` from the family's row). See
:mod:`posenc.hf.adapter` for how positions, documents, padding and caches are derived from what HF
passes.
"""


from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ..call.geometry import Geometry
from ..call.memo import ForwardMemo
from ..encodings.base import PositionalEncoding
from ..encodings.protocol import Curves, Gates, offers, require
from ..encodings.query_scale import QueryScale
from ..errors import UsageError
from ..functional import attend
from .forward_state import ForwardState

NAME = "posenc"


# -- the registered functions --------------------------------------------------------------------


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                 attention_mask: torch.Tensor | None = None, device: torch.device | str = "cpu", **more: Any) -> torch.Tensor | None:
    """The mask function registered as ``"posenc"``: the 2-D key mask (B, kv_length), bool, True =
    a real token, for the keys ``kv_offset .. kv_offset + kv_length - 1``; None when every key is
    real. A key slot past the last query (a static cache's unwritten slots) is not real. A 2-D mask
    of exactly ``kv_length`` columns with ``kv_offset`` > 0 is taken as one this function made
    (generate hands it back to the model with a static cache), already aligned to the keys.
    Causality, documents and positions are the attention function's business.

    Raises:
        UsageError: ``attention_mask`` is not a 2-D padding mask (B, T), or an encoder's mask carries a
            mask function of the model's own (``allow_is_bidirectional_skip`` False: ESM C's ``sequence_id``
            chains), which posenc's attention would not apply.
    """
    if more.get("allow_is_bidirectional_skip") is False:
        raise UsageError("attention_mask: the model adds a mask of its own to its bidirectional mask (a chain or packed-"
                         "sequence mask, e.g. ESM C's sequence_id), which posenc.hf does not apply; give position_ids "
                         "restarting at each sequence instead (posenc's packed rows)")
    slots = torch.arange(kv_offset, kv_offset + kv_length, device=device)
    written = slots < q_offset + q_length  # (Tk,); q_offset may be a tensor (static caches)
    mask = None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise UsageError(f"attention_mask: posenc.hf takes a 2-D padding mask (B, T), got shape {tuple(attention_mask.shape)}")
        mask = attention_mask.to(device=device, dtype=torch.bool)
        if kv_offset and mask.shape[-1] == kv_length:
            # Already the keys' columns: a mask this function made, handed back to the model by
            # generate with a static cache (create_masks_for_generate, then the model's own mask
            # call). A mask of the tokens has kv_offset + kv_length columns; slicing this one again at
            # kv_offset would shift it by kv_offset (a full sliding window layer lost its last key).
            mask = mask & written
        else:
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
    """(B, T) bool: a token whose position does not increase on its predecessor's (<= it), both
    real: the start of a packed document. Ids that increase by more than 1 (PoSE's chunks, skipping
    positions) stay in one document, each token at its own id, as :class:`Geometry` reads them."""
    step = positions[:, 1:] <= positions[:, :-1]  # (B, T-1)
    if real is not None:
        step = step & real[:, 1:] & real[:, :-1]
    return torch.nn.functional.pad(step, (1, 0), value=False)


def _gaps(positions: torch.Tensor) -> bool:
    """Whether any position is not its predecessor's + 1 (a restart or a skip)."""
    return bool((positions[:, 1:] != positions[:, :-1] + 1).any())


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
        if past >= 0 and (position_ids is None or tq == 1 or not _gaps(position_ids)):
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
        if tq > 1 and _gaps(q_pos):
            # The cached keys' positions are derived (consecutive, ending at the last query), so
            # queries after a cache past must be consecutive too.
            raise UsageError("position_ids: queries that restart (packed documents) or skip after a cache past are not "
                             "supported: their keys' documents and positions are unknown; run each document's chunks "
                             "with its own cache, with consecutive position ids")
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

    encoding: PositionalEncoding  # as installed; a call runs the one the model holds then (held_encoding)
    window: int | None = None
    chunk: int | None = None
    sinks: str | None = None  # the attention module's attribute holding (H,) sink logits
    query_scale: QueryScale | None = None
    rope_last: int = 0
    causal: bool = True
    rotate: bool = True  # False: q and k come rotated by the model's own rotary (see use)
    slot: int | None = None  # the encoding's index in the decoder stack's posenc_encodings
    query_sinks: str | None = None  # the keyword of the per-query sinks (B, H, Tq, 1) the layer passes (Inkling-2)
    curves_at_slots: bool = False  # the curves' positions are the queries' cache slots, not position_ids (Inkling)


class Encodings(nn.Module):
    """The encodings :func:`posenc.hf.use` installs, at ``<decoder stack>.posenc_encodings``: a
    list of modules with children ``0``, ``1``, ... (a ModuleList's state-dict keys), indexed,
    iterated and sized like one. Not a ModuleList, so that a trainer that wraps a module to train
    and save a copy of it (PEFT's ``modules_to_save=["posenc_encodings"]``) can wrap it whole; the
    attention then runs the copy (:func:`held_encoding`)."""

    def __init__(self, modules: list[nn.Module] | nn.ModuleList) -> None:
        super().__init__()
        for i, module in enumerate(modules):
            self.add_module(str(i), module)

    def __getitem__(self, index: int) -> nn.Module:
        n = len(self._modules)
        if not -n <= index < n:
            raise IndexError(f"posenc_encodings: index {index} out of range for {n} encoding(s)")
        module = self._modules[str(index % n)]
        assert module is not None
        return module

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(m for m in self._modules.values() if m is not None)


def active_copy(module: nn.Module) -> nn.Module:
    """``module``, or, where a trainer has wrapped it to train a copy (PEFT's ``modules_to_save``:
    a wrapper holding ``original_module`` and one copy per adapter in ``modules_to_save``), the
    module that wrapper runs now: the active adapter's copy, or the original while adapters are
    disabled or none of them has a copy."""
    copies = getattr(module, "modules_to_save", None)
    original = getattr(module, "original_module", None)
    if not isinstance(copies, nn.ModuleDict) or not isinstance(original, nn.Module):
        return module
    active = list(getattr(module, "active_adapters", None) or [])
    if getattr(module, "disable_adapters", False) or not active or active[0] not in copies:
        return original
    return copies[active[0]]


def installed_encodings(stack: nn.Module) -> Encodings | nn.ModuleList:
    """The encodings ``stack`` holds now (``posenc_encodings``, through a trainer's wrapper).

    Raises:
        UsageError: the stack holds none (posenc.hf.use never ran on it).
    """
    held = stack._modules.get("posenc_encodings")
    if held is None:
        raise UsageError(f"{type(stack).__name__} holds no posenc_encodings: run posenc.hf.use(model, encoding) first")
    found = active_copy(held)
    assert isinstance(found, (Encodings, nn.ModuleList))
    return found


def held_encoding(stack: nn.Module | None, plan: LayerPlan) -> PositionalEncoding:
    """The encoding a layer runs: the module ``stack`` holds at ``plan.slot`` at call time (a copy
    a trainer swapped in, a module replaced after a merge), not the one installed."""
    if stack is None or plan.slot is None:
        return plan.encoding
    found = active_copy(installed_encodings(stack)[plan.slot])
    if not isinstance(found, PositionalEncoding):
        raise UsageError(f"posenc_encodings[{plan.slot}]: holds a {type(found).__name__}, not a posenc encoding")
    return found


def posenc_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, *, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention function registered as ``"posenc"``: ``posenc.attend`` with the layer's
    encoding and attention kind (its :class:`LayerPlan`). query (B, H, Tq, D), key (B, Hkv, Tk, D)
    and value (B, Hkv, Tk, Dv) un-rotated, cache included; returns (out (B, Tq, H, Dv), None).

    The geometry (positions, documents, padding) is derived once per model forward and per key
    length (full and sliding layers keep caches of different lengths) and shared by the layers,
    with one :class:`~posenc.call.memo.ForwardMemo` (T5's bias is then computed once): the stand-in
    rotary call, which the model makes at the start of each forward, starts a new forward. Under
    gradient checkpointing each layer gets its own memo (a recomputed layer must redo its work).
    ``softcap`` (Gemma 2) arrives from the layer; sinks are read from the module.

    Raises:
        UsageError: the model was not prepared with :func:`posenc.hf.use`, ``attention_dropout`` is
            not 0 in training, or the mask is a prepared 4-D one.
    """
    plan: LayerPlan | None = module.__dict__.get("_posenc_plan")
    forward: ForwardState | None = module.__dict__.get("_posenc_forward")
    own = module.__dict__.get("_posenc_own")
    if plan is None and own is not None:  # not a layer's attention (Inkling-2's attention residuals over depth): its own
        return own(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if plan is None or forward is None:
        raise UsageError(f"{type(module).__name__} {getattr(module, 'layer_idx', '')}: attn_implementation='posenc' "
                         "needs posenc.hf.use(model, encoding) first (a model saved after use: load it with posenc.hf.from_pretrained)")
    if dropout and module.training:
        raise UsageError(f"attention_dropout must be 0 with posenc.hf (got {dropout})")
    encoding = held_encoding(forward.base, plan)
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.dtype != torch.bool):
        raise UsageError("attention_mask: posenc.hf takes a 2-D padding mask; a prepared 4-D mask is not supported")
    position_ids = kwargs.get("position_ids")
    if position_ids is not None and position_ids.dim() != 2:
        position_ids = None  # an M-RoPE backbone's (3, B, T) ids (Glm4vMoe passes them): not text positions
    if position_ids is None:
        position_ids = forward.position_ids  # families whose layers do not pass them (Llama 4, M-RoPE backbones)
    if position_ids is None and attention_mask is None:
        position_ids = forward.made_position_ids  # the model's own, made for a forward given none
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
    if plan.query_sinks is not None:  # per-query sink logits the layer computed (Inkling-2's sink_proj)
        given = kwargs.get(plan.query_sinks)
        if not isinstance(given, torch.Tensor) or given.dim() != 4 or given.shape[-1] != 1:
            raise UsageError(f"{plan.query_sinks}: the layer passed no per-query sink logits (batch, heads, queries, 1)")
        sinks = given[..., 0]  # (B, H, Tq)
    softcap = kwargs.get("softcap")
    log_gates = None
    if offers(encoding, Gates):
        log_gates = _gates(module, encoding, tq, key_end, plan.window is not None or plan.chunk is not None)
    curves = None
    if offers(encoding, Curves):  # the Inkling bias: the new queries' curves from the layer input (the cache keeps none)
        x = module.__dict__.get("_posenc_input")
        if x is None or x.shape[1] != tq:
            raise UsageError("inkling: the layer's input did not reach posenc's attention (its curves come from it)")
        at = torch.arange(key_end - tq, key_end, device=query.device) if plan.curves_at_slots else geometry.q_positions
        curves = require(encoding, Curves).query_curves(x, at)
    out = attend(query, key, value, encoding, scale=scaling, geometry=geometry, memo=memo, causal=geometry.causal, rotate=plan.rotate,
                 window=plan.window, chunk=plan.chunk, sinks=sinks, query_scale=plan.query_scale,
                 softcap=None if softcap is None else float(softcap), log_gates=log_gates, query_curves=curves)
    return out.transpose(1, 2).contiguous(), None


def _gates(module: nn.Module, encoding: PositionalEncoding, tq: int, tk: int, drops: bool = False) -> torch.Tensor:
    """The layer's per-key log forget gates (B, H, Tk): the new tokens' from the layer's input (kept
    by :func:`keep_input`), after the cached tokens' gates, which are kept on the KV cache object
    beside its keys (and reordered with them by beam search); a second call within one call of the
    layer (DiffLlama calls its attention function once per half of the values) gets the first's.
    ``drops``: the layer's cache drops its oldest keys (a sliding-window or chunked layer's keeps the
    last W - 1), so only the last of the kept gates are its keys'; c_i - c_j reads only the gates
    after key j, so dropping the oldest changes no score.

    Raises:
        UsageError: a cached call whose cache holds no gates for this layer, or gates of another
            batch or length than its keys (a cache grown or cut outside this model's calls).
    """
    x = module.__dict__.get("_posenc_input")
    if x is None or x.shape[1] != tq:
        raise UsageError("fox: the layer's input did not reach posenc's attention (its gates come from it)")
    made = module.__dict__.get("_posenc_made_gates")
    if made is not None and made.shape[-1] == tk:  # a layer calling its attention twice (DiffLlama: once per half of v)
        return made
    new = require(encoding, Gates).log_gates(x)  # (B, H, Tq)
    cache = module.__dict__.get("_posenc_cache")
    layer = getattr(module, "layer_idx", 0) + module.__dict__.get("_posenc_cache_offset", 0)  # its cache layer
    kept: dict[int, torch.Tensor] | None = None if cache is None else cache.__dict__.get("_posenc_gates")
    if tq == tk:
        gates = new
    else:
        past = None if kept is None else kept.get(layer)
        if drops and past is not None and past.shape[-1] > tk - tq:
            past = past[..., past.shape[-1] - (tk - tq):]  # the keys the cache still holds
        if past is None or past.shape[0] != new.shape[0] or past.shape[-1] + tq != tk:
            have = None if past is None else tuple(past.shape)
            raise UsageError(f"fox: the KV cache holds {tk - tq} keys but gates of shape {have} for layer {layer}: "
                             "a method with forget gates needs the cache its own calls filled (use_cache, generate)")
        gates = torch.cat((past, new), dim=-1)
    if cache is not None:
        if kept is None:
            kept = cache.__dict__["_posenc_gates"] = {}
            _reorder_with(cache, kept)
        kept[layer] = gates.detach() if not torch.is_grad_enabled() else gates
    module.__dict__["_posenc_made_gates"] = gates  # this module call's, for a second attention call in it
    return gates


def _reorder_with(cache: Any, kept: dict[int, torch.Tensor]) -> None:
    """Beam search reorders the cache's rows (``reorder_cache``): the kept gates follow."""
    reorder = getattr(cache, "reorder_cache", None)
    if reorder is None:
        return

    def reordered(beam_idx: torch.Tensor) -> Any:
        for key, value in kept.items():
            kept[key] = value.index_select(0, beam_idx.to(value.device))
        return reorder(beam_idx)

    cache.reorder_cache = reordered


def keep_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A forward pre-hook on an attention module: its input (the gates' source), its KV cache and
    the offset of its cache layer (a looped stack runs a layer once per pass, each pass with its own
    cache layer: Inkling-2-Loop's ``cache_offset``), held for this call only (:func:`drop_input`)."""
    module.__dict__["_posenc_input"] = args[0] if args else kwargs.get("hidden_states")
    module.__dict__.pop("_posenc_made_gates", None)
    cache = next((kwargs[k] for k in ("cache", "past_key_values", "past_key_value", "layer_past") if kwargs.get(k) is not None), None)
    module.__dict__["_posenc_cache"] = cache
    offset = kwargs.get("cache_offset")
    module.__dict__["_posenc_cache_offset"] = offset if isinstance(offset, int) else 0


def drop_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
    """A forward hook on an attention module: what :func:`keep_input` held is dropped once the call
    returns, so nothing of a forward (its graph) stays on the module (``copy.deepcopy`` of a model
    after a forward with gradients copies it; a recomputed checkpointed layer keeps it again)."""
    module.__dict__.pop("_posenc_input", None)
    module.__dict__.pop("_posenc_cache", None)
    module.__dict__.pop("_posenc_cache_offset", None)
    module.__dict__.pop("_posenc_made_gates", None)


def register() -> None:
    """Register posenc's attention and mask functions under the name ``"posenc"`` (idempotent)."""
    AttentionInterface.register(NAME, posenc_attention)
    AttentionMaskInterface.register(NAME, padding_mask)


__all__ = ["Encodings", "LayerPlan", "NAME", "active_copy", "drop_input", "held_encoding", "installed_encodings",
           "keep_input", "padding_mask", "posenc_attention", "register"]
