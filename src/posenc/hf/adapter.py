"""posenc's attention inside Hugging Face ``transformers`` decoder models: :func:`use`.

How it plugs in (``transformers`` 5.x):

- An attention function and a mask function are registered under one name, ``"posenc"``, with
  ``AttentionInterface`` and ``AttentionMaskInterface``; the model's ``config._attn_implementation``
  is set to it. Without the mask function every mask the attention receives would be None; ours
  hands the attention the 2-D padding mask (B, Tk), True = real token, or None when nothing is
  padded.
- The model's rotary module is replaced by :class:`RotaryStandIn`, which returns cos = 1, sin = 0,
  so the model's own rotation is the identity (q * 1 + rotate_half(q) * 0 = q exactly); the
  attention function applies the encoding's rotation itself (``posenc.attend(..., rotate=True)``),
  so the KV cache holds un-rotated keys and every key is rotated at its position at every step.
  One exception, for speed: a plain RoPE in float32 (half layout, every feature rotated, no
  length-dependent scaling) hands the model posenc's own cos/sin tables instead, the keys enter
  the cache rotated, and the attention does not rotate again (``rotate=False``).
- HF passes the queries' ``position_ids`` but no key positions. Without a cache past (Tq == Tk),
  the keys are the queries. With one (Tq < Tk), the keys are taken as consecutive and ending at each
  row's last query position, and a key whose position would be negative is not attended: that is
  left padding in ``generate``, and, after a packed prefill, the earlier documents.
- Packed batches (several documents in one row, ``position_ids`` restarting): a document starts
  wherever a real token's position is not its predecessor's plus one, and attention never crosses
  documents, with or without a cache (HF itself detects packing only without a cache and without
  a mask). A cached call whose queries restart is a UsageError (their keys' documents are unknown).
- A static cache's unwritten slots (False in every row of the mask) are dropped from the keys.
- The layers of one model forward share one :class:`~posenc.geometry.Geometry` (positions,
  documents and padding, read once) and one :class:`~posenc.memo.ForwardMemo`; the stand-in rotary
  module, which the model calls once per forward, marks where a forward starts.

Encodings with parameters (T5's table, FIRE's MLP, ...) are modules of the model
(``<base>.posenc_encodings``: one shared by all layers, or one per layer when the method learns per
layer), so they train with the model, follow ``.to()``, and are saved by ``save_pretrained``; the
config records the encoding (``config.posenc``), and :func:`from_pretrained` rebuilds it.

Supported families: the ones in :data:`SUPPORTED` (Llama, Mistral, Qwen2, Qwen3 in transformers
5.24): decoder-only models whose attention modules have ``q_proj``/``k_proj``/``v_proj``, whose base
model has one ``rotary_emb`` and whose layers call the registered attention function.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any, Callable, TypeGuard, TypeVar, cast

import torch
import transformers
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from ..encodings import build, get_class, options_of
from ..encodings.base import PositionalEncoding
from ..encodings.protocol import Embeds, Gates, offers
from ..encodings.rope import RoPE
from ..errors import UsageError
from ..functional import attend
from ..geometry import Geometry
from ..memo import ForwardMemo, Workspace
from .saving import mark, recorded_options

NAME = "posenc"

_Model = TypeVar("_Model", bound=PreTrainedModel)

#: model_type -> family name, for the families :func:`use` supports.
SUPPORTED = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}


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
    if position_ids is None:
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


def posenc_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, *, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention function registered as ``"posenc"``: ``posenc.attend`` with the layer's
    encoding. query (B, H, Tq, D), key/value (B, Hkv, Tk, D) un-rotated (cache included); returns
    (out (B, Tq, H, D), None).

    The geometry (positions, documents, padding) is derived once per model forward and shared by
    its layers, with one :class:`~posenc.memo.ForwardMemo` (T5's bias is then computed once): the
    stand-in rotary module, which the model calls once per forward, starts a new forward. Under
    gradient checkpointing each layer gets its own memo (a recomputed layer must redo its work).

    Raises:
        UsageError: the model was not prepared with :func:`posenc.hf.use`, ``attention_dropout`` is
            not 0, the keys exceed a configured sliding window, or the mask is a prepared 4-D one.
    """
    encoding = module.__dict__.get("_posenc_encoding")
    forward = module.__dict__.get("_posenc_forward")
    if encoding is None or forward is None:
        raise UsageError(f"{type(module).__name__} {getattr(module, 'layer_idx', '')}: attn_implementation='posenc' "
                         "needs posenc.hf.use(model, encoding) first (a model saved after use: load it with posenc.hf.from_pretrained)")
    if dropout and module.training:
        raise UsageError(f"attention_dropout must be 0 with posenc.hf (got {dropout})")
    window = kwargs.get("sliding_window")
    if window is not None and key.shape[2] > window:
        raise UsageError(f"sliding_window={window}: posenc.hf runs full attention only; {key.shape[2]} keys exceed the window "
                         "(set config.sliding_window=None, or keep sequences within it)")
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.dtype != torch.bool):
        raise UsageError("attention_mask: posenc.hf takes a 2-D padding mask; a prepared 4-D mask is not supported")
    position_ids = kwargs.get("position_ids")
    sizes = (forward.serial, query.shape[2], key.shape[2])
    if (forward.key is None or forward.key[0] != sizes or forward.key[1] is not attention_mask
            or forward.key[2] is not position_ids):
        state = (sizes, attention_mask, position_ids)
        key_end = _key_end(query.shape[2], key.shape[2], attention_mask)
        forward.key, forward.key_end, forward.memo = state, key_end, ForwardMemo(forward.workspace)
        forward.geometry = _geometry(query, key_end, attention_mask, position_ids, bool(getattr(module, "is_causal", True)))
    if forward.key_end < key.shape[2]:  # a static cache's unwritten slots
        key, value = key[:, :, : forward.key_end], value[:, :, : forward.key_end]
    memo = forward.memo
    if module.training and getattr(forward.base, "gradient_checkpointing", False):
        # A checkpointed layer is run again in backward and must save the same tensors as in its
        # first run: nothing shared with the other layers (each computes its own bias).
        memo = ForwardMemo()
    out = attend(query, key, value, encoding, scale=scaling, geometry=forward.geometry, memo=memo,
                 causal=forward.geometry.causal, rotate=not forward.pre_rotated)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register posenc's attention and mask functions under the name ``"posenc"`` (idempotent)."""
    AttentionInterface.register(NAME, posenc_attention)
    AttentionMaskInterface.register(NAME, padding_mask)


# -- the rotary replacement ----------------------------------------------------------------------


class _Forward:
    """What the layers of one model forward share: the geometry, its memo, and what it was built from."""

    def __init__(self) -> None:
        self.base: nn.Module | None = None  # the decoder stack (its gradient_checkpointing flag)
        self.serial = 0
        self.key: tuple[tuple[int, int, int], torch.Tensor | None, torch.Tensor | None] | None = None
        self.key_end = 0
        self.geometry: Geometry | None = None
        self.memo: ForwardMemo | None = None
        # The single-query paths' buffers between decode steps (a relative bias vector, a padding
        # mask), kept across forwards as posenc's own KV cache keeps them: every entry is rebuilt
        # when what made it (sizes, padding, the encoding's parameter versions) changes.
        self.workspace = Workspace()
        self.pre_rotated = False  # q and k came rotated by the model (see RotaryStandIn)


class RotaryStandIn(nn.Module):
    """Stands in for a model's rotary module. No parameters, no buffers. The model calls it once
    per forward: that call starts a new forward for the attention layers (a fresh geometry and
    memo). It returns, of shape (*position_ids.shape, head_dim):

    - cos = 1, sin = 0 (the model's own rotation leaves q and k exactly as they are; the attention
      rotates them with the encoding), or
    - for a plain RoPE encoding that the model's rotation can apply (the "half" layout, every
      feature rotated, a rotation that does not depend on the length) and float32 inputs: the
      encoding's own float32 cos/sin tables at ``position_ids`` (times its attention factor, in
      the layout HF's ``rotate_half`` reads), so q and k enter the KV cache rotated and a decode
      step rotates one key, not the whole cache. The result equals posenc's in-attention rotation
      to rounding; in lower precision the attention rotates (in float32), as it does for every
      other rotary method.
    """

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.forward_state = _Forward()
        self.rope: RoPE | None = None  # a plain reference (the encoding lives in posenc_encodings)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        state = self.forward_state
        state.serial += 1
        state.key = state.geometry = state.memo = None  # nothing is kept across forwards
        shape = (*position_ids.shape, self.head_dim)
        rope = self.rope
        state.pre_rotated = rope is not None and x.dtype == torch.float32
        if rope is None or not state.pre_rotated:
            return x.new_ones(shape), x.new_zeros(shape)
        cos, sin = rope.cos_sin(position_ids.reshape(-1).to(x.device, torch.long).clamp(min=0))  # (N, D/2) float32
        factor = rope.attention_factor
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        return torch.cat((cos, cos), dim=-1).view(shape), torch.cat((sin, sin), dim=-1).view(shape)


def _pre_rotatable(encoding: nn.Module, head_dim: int) -> TypeGuard[RoPE]:
    """A RoPE encoding whose rotation the model's own ``apply_rotary_pos_emb`` can apply."""
    return (type(encoding) is RoPE and encoding.layout == "half" and encoding.rotary_dim == head_dim
            and not encoding.rotation_depends_on_length and encoding.attention_factor > 0)


# -- use ------------------------------------------------------------------------------------------


def _base_model(model: nn.Module) -> nn.Module:
    """The decoder stack (``LlamaModel`` & co.) of ``model``, after checking its family."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        raise UsageError(f"model: posenc.hf supports the {', '.join(SUPPORTED.values())} families "
                         f"(model_type {', '.join(repr(k) for k in SUPPORTED)}), got {type(model).__name__} "
                         f"with model_type {model_type!r}")
    base: nn.Module | None = model
    for _ in range(3):
        if base is None:
            break
        if isinstance(getattr(base, "layers", None), nn.ModuleList) and hasattr(base, "rotary_emb"):
            return base
        base = getattr(base, getattr(base, "base_model_prefix", "model"), None) or getattr(base, "model", None)
    raise UsageError(f"model: found no decoder stack with layers and rotary_emb in {type(model).__name__}")


def _installed(model: nn.Module) -> nn.ModuleList:
    """The encodings :func:`use` installed in ``model`` (its decoder stack's ``posenc_encodings``)."""
    return cast(nn.ModuleList, _base_model(model).posenc_encodings)


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _kv_heads(config: Any, cls: type[PositionalEncoding], options: dict[str, Any]) -> dict[str, int]:
    """The model's key heads, for an encoding whose parameters are per key head (RoPE-Mixed's
    frequencies); derived from the config on every build, so not recorded among the options."""
    if "num_kv_heads" not in options_of(cls) or "num_kv_heads" in options:
        return {}
    return {"num_kv_heads": int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)}


def _build_encodings(config: Any, encoding: str | nn.Module, options: dict[str, Any], layers: int) -> tuple[list[nn.Module], dict[str, Any]]:
    """The encoding modules (one, or one per layer) and the record kept in ``config.posenc``."""
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    if isinstance(encoding, nn.Module):
        if options:
            raise UsageError("options: give them to posenc.build, not with an encoding module")
        if not isinstance(encoding, PositionalEncoding) or encoding.num_heads != heads or encoding.head_dim != head_dim:
            raise UsageError(f"encoding: needs a posenc encoding for num_heads={heads}, head_dim={head_dim}, "
                             f"got {encoding!r}")
        if not encoding.causal:
            raise UsageError("encoding: a decoder needs a causal encoding (causal=True), got a bidirectional one "
                             "(for T5, import the decoder's table: t5_from_hf(model, stack='decoder'))")
        cls = type(encoding)
        recorded = {k: getattr(encoding, k) for k in options_of(cls) if hasattr(encoding, k) and _jsonable(getattr(encoding, k))}
        unrecorded = [k for k in options_of(cls) if hasattr(encoding, k) and k not in recorded]
        record = {"encoding": cls.name, "options": recorded, "causal": encoding.causal}
        if unrecorded:
            record["unrecorded"] = unrecorded
        first = encoding
    else:
        if not isinstance(encoding, str):
            raise UsageError(f"encoding must be a posenc encoding name or module, got {type(encoding).__name__}")
        cls = get_class(encoding)
        if not _jsonable(options):
            raise UsageError("options: posenc.hf records them in the model's config, so they must be JSON values")
        record = {"encoding": encoding, "options": dict(options), "causal": True}
        if encoding == "rope" and not options:
            from ..encodings.rope import rope_from_hf
            first = rope_from_hf(config)
            record["from_config"] = True
        else:
            first = build(encoding, num_heads=heads, head_dim=head_dim, causal=True, **options, **_kv_heads(config, cls, options))
    if offers(first, Gates):
        raise UsageError(f"encoding: {cls.name} computes forget gates from each layer's input (the Gates hook), which "
                         "HF's attention interface does not pass; use it in posenc.LM or posenc.Attention")
    if first.shares_across_layers:
        return [first], record
    if isinstance(encoding, str):  # a fresh initialisation per layer, as posenc's own model builds them
        rest = [build(encoding, num_heads=heads, head_dim=head_dim, causal=True, **options, **_kv_heads(config, cls, options))
                for _ in range(layers - 1)]
    else:  # a given module: every layer starts from its values
        rest = [copy.deepcopy(first) for _ in range(layers - 1)]
    return [first, *rest], record


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


def use(model: _Model, encoding: str | nn.Module, **options: Any) -> _Model:
    """Turn ``model``'s attention into posenc's attention with ``encoding``; returns ``model``.

    ``encoding``: a registry name (``posenc.available()``) built with ``options`` for the model's
    heads and head dim, or a built posenc encoding (e.g. from :func:`posenc.hf.t5_from_hf`).
    ``use(model, "rope")`` without options takes the model's own RoPE parameters (base, scaling,
    partial rotary: :func:`posenc.rope_from_hf`); ``use(model, "nope")`` drops positions (DroPE).
    The model's rotary module becomes the identity, and posenc's rotation (if the method rotates)
    is applied inside the attention; biases and score terms too. Calling it again replaces the
    encoding. See the module docstring for the positions, masks and documents it derives.

    Raises:
        UsageError: a model outside the supported families (or without a decoder stack with
            ``layers``, ``rotary_emb`` and ``self_attn.q_proj``), an unknown encoding name or
            option, options that are not JSON values or given with a built encoding, a built
            encoding for other heads or head dim or a bidirectional one, or a method with forget
            gates (which needs each layer's input).
    """
    base = _base_model(model)
    config: Any = model.config  # a transformers config, read by attribute (its fields are per model class)
    layers = list(cast(nn.ModuleList, base.layers))  # _base_model checked it
    attentions = [getattr(layer, "self_attn", None) for layer in layers]
    if any(a is None or not hasattr(a, "q_proj") for a in attentions):
        raise UsageError(f"model: every decoder layer of a {SUPPORTED[config.model_type]} model needs self_attn with q_proj")
    encodings, record = _build_encodings(config, encoding, options, len(layers))
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    modules = nn.ModuleList(encodings).to(device=device, dtype=dtype)
    base.posenc_encodings = modules
    head_dim = int(getattr(attentions[0], "head_dim"))
    if not isinstance(base.rotary_emb, RotaryStandIn):
        base.__dict__["_posenc_model_rotary"] = base.rotary_emb  # kept, not a submodule
        base.rotary_emb = RotaryStandIn(head_dim)
    only = modules[0]
    base.rotary_emb.rope = only if len(encodings) == 1 and _pre_rotatable(only, head_dim) else None
    for i, attention in enumerate(attentions):
        attention.__dict__["_posenc_encoding"] = modules[i if len(encodings) > 1 else 0]
        attention.__dict__["_posenc_forward"] = base.rotary_emb.forward_state
    base.rotary_emb.forward_state.base = base
    old_hook = base.__dict__.pop("_posenc_embed_hook", None)
    if old_hook is not None:
        old_hook.remove()
    if offers(encodings[0], Embeds):
        base.__dict__["_posenc_embed_hook"] = layers[0].register_forward_pre_hook(_embed_hook(encodings[0]), with_kwargs=True)
    register()
    model.set_attn_implementation(NAME)
    config.posenc = record
    mark(config)
    return model


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
    register()  # the saved config names attn_implementation="posenc" (posenc.hf.saving)
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


def recorded_encoding(config: Any, record: dict[str, Any]) -> nn.Module | str:
    """The encoding a ``config.posenc`` record describes: a built module, or "rope" for the model's
    own RoPE parameters (then :func:`use` reads them from the config)."""
    if record.get("from_config"):
        return "rope"
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return build(record["encoding"], num_heads=heads, head_dim=head_dim, causal=bool(record.get("causal", True)),
                 **recorded_options(config, record))


__all__ = ["RotaryStandIn", "NAME", "SUPPORTED", "from_pretrained", "padding_mask", "posenc_attention",
           "recorded_encoding", "register", "use"]
