"""What :func:`posenc.hf.use` checks in a model whose family has no row in
:data:`posenc.hf.families.FAMILIES` (the generic fallback) before accepting it.

The fallback reads such a model as the LLaMA pattern: one rotary module on the decoder stack, one
RoPE block from the config, every attention layer rotating its whole q/k heads (or the first r
features) with those tables, causal attention masked by posenc, windows from ``layer_types`` or
``sliding_window``. Anything else would run, and be silently wrong or crash at the first forward, so
it is refused here, naming the family and what posenc lacks for it:

- from the modules and config (:func:`check_structure`): attention that is not causal, per-head sink
  logits, several rotary modules (per-layer bases, a base of 0 for NoPE layers), one rotary table
  per layer type, sparse attention (an indexer's keys), multi-head latent attention (MLA) head dims,
  M-RoPE's 3-axis sections, KV sharing across layers, attention layers of different head dims;
- by running each attention module alone once on four tokens (:func:`probe`), twice: with the
  model's own (cos, sin) and with the identity rotation, through a recording attention function:
  queries and keys must be those of posenc's RoPE read from the config (NoPE layers, another
  rotation, head dims other than the config's are refused), the attention must receive no mask of
  its own making (posenc's mask function gives it none for an unpadded input), and no sink logits.

A model on the meta device (being built by ``from_pretrained``) is not probed; :func:`use` runs
again on the loaded model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import UsageError

_PROBE = "posenc_probe"
_TOKENS = 4


def refusal(config: Any, model: nn.Module, what: str) -> UsageError:
    """The fallback's refusal: the family (model_type and class) and what posenc lacks for it."""
    return UsageError(f"model: model_type {getattr(config, 'model_type', None)!r} ({type(model).__name__}) is not in "
                      f"posenc's family table, and the generic fallback cannot run it: {what}")


def _rotary_like(module: nn.Module) -> bool:
    name = type(module).__name__.lower()
    return "rotary" in name and "vision" not in name


def check_structure(model: nn.Module, stack: nn.Module, config: Any, attentions: list[nn.Module | None],
                    rotary: nn.Module) -> None:
    """The fallback's checks of a model's modules and config, and what running each attention module
    alone shows (see the module docstring).

    Raises:
        UsageError: naming the family and every property found that posenc's fallback lacks.
    """
    lacks = _structure(stack, config, attentions, rotary)
    seen = behaviour(model, config, attentions, rotary)
    # A layer that cannot be run alone is itself a refusal, unless a reason is known already.
    lacks += [lack for lack in seen if not (lacks and lack.startswith("posenc could not run"))]
    if lacks:
        raise refusal(config, model, "; ".join(lacks))


def _structure(stack: nn.Module, config: Any, attentions: list[nn.Module | None], rotary: nn.Module) -> list[str]:
    def get(key: str) -> Any:
        try:
            return config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        except Exception:  # a per-layer attribute that refuses a global read
            return None

    lacks = []
    present = [a for a in attentions if a is not None]
    if get("use_bidirectional_attention") or get("is_causal") is False or any(getattr(a, "is_causal", True) is False for a in present):
        lacks.append("its attention is bidirectional (is_causal False), and the fallback runs causal decoders (an "
                     "encoder needs a family row with causal=False)")
    sinks = sorted({n for a in present for n, _ in a.named_parameters(recurse=False) if "sink" in n.lower()})
    if sinks:
        lacks.append(f"its attention has per-head sink logits ({', '.join(sinks)}), which a family row names (Family.sinks)")
    others = [n for n, m in stack.named_modules() if m is not rotary and _rotary_like(m) and n.split(".")[0] not in ("rotary_emb", "pos_emb")]
    if others:
        lacks.append(f"more rotary modules on its decoder stack than rotary_emb ({', '.join(others[:3])}): per-layer RoPE "
                     "bases, which the fallback's one RoPE block does not describe")
    lacks.extend(_per_layer_lists(config, len(attentions)))
    block = get("rope_parameters") or {}
    blocks = block.values() if isinstance(block, dict) and all(isinstance(v, dict) for v in block.values()) else [block]
    if any(isinstance(b, dict) and any("mrope" in str(k) for k in b) for b in blocks) or hasattr(rotary, "mrope_section"):
        lacks.append("M-RoPE (3-axis positions, mrope_section), for which the fallback has no path")
    if "indexed_attention" in (get("layer_types") or ()) or any(getattr(a, "indexer", None) is not None for a in present):
        lacks.append("sparse attention (an indexer picks index_topk keys per query, handed to the attention function "
                     "as indices or a mask of its own: DeepSeek sparse attention), which posenc's attention does not run")
    if get("qk_rope_head_dim") is not None or get("kv_lora_rank") is not None:
        lacks.append("multi-head latent attention (qk_rope_head_dim, qk_nope_head_dim): the fallback does not know which "
                     "features rotate (a family row with rope_slice='last' and qk_head_dim describes them)")
    if get("num_kv_shared_layers") or any(getattr(a, "is_kv_shared_layer", False) for a in present):
        lacks.append("layers that share keys and values across layers (num_kv_shared_layers)")
    dims = {int(d) for a in present if isinstance(d := getattr(a, "head_dim", None), int)}
    if len(dims) > 1:
        lacks.append(f"attention layers of different head dims ({', '.join(map(str, sorted(dims)))})")
    typed = sorted(n[: -len("_inv_freq")] for n, _ in rotary.named_buffers(recurse=False)
                   if n.endswith("_inv_freq") and not n.endswith("original_inv_freq"))
    if not typed and getattr(rotary, "inv_freq", None) is None:
        held = sorted(n for n, _ in rotary.named_buffers(recurse=False))
        lacks.append(f"its rotary module {type(rotary).__name__} holds no inv_freq buffer (its buffers: {', '.join(held) or 'none'}: "
                     "a table of its own), so posenc can neither read its frequencies nor check them against the config")
    if typed and getattr(rotary, "inv_freq", None) is None:
        lacks.append(f"one rotary table per layer type ({', '.join(typed)}) in {type(rotary).__name__}, where the fallback "
                     "reads one RoPE block (a family row with rope_blocks='per_type' describes them)")
    return lacks


def _per_layer_lists(config: Any, depth: int) -> list[str]:
    """The config's per-layer RoPE lists (a key naming a RoPE base or RoPE, a list of numbers) that
    do not treat every layer alike: per-layer bases, a base of 0 (NoPE), NoPE or scaled layers."""
    lacks = []
    values = config.to_dict() if hasattr(config, "to_dict") else {}
    for key, value in values.items():
        name = key.lower()
        if not ("theta" in name or "rope" in name) or not isinstance(value, (list, tuple)) or not value:
            continue
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value):
            continue
        if len(set(value)) <= 1 or sorted(value) == list(range(depth)):  # alike, or an index list of every layer
            continue
        if "theta" in name:
            zero = " and a base of 0 (NoPE layers)" if 0 in value else ""
            lacks.append(f"per-layer RoPE bases ({key}){zero}, which the fallback's one RoPE block does not describe")
        elif "no_rope" in name or "nope" in name:
            lacks.append(f"NoPE layers ({key}), which the fallback's schedule does not describe")
        else:
            lacks.append(f"a per-layer RoPE setting ({key}) that differs between layers")
    return lacks


def _identity(out: Any) -> Any:
    if isinstance(out, tuple):
        return (torch.ones_like(out[0]), torch.zeros_like(out[1]), *out[2:])
    return torch.ones_like(out)


_Call = tuple[torch.Tensor, torch.Tensor, Any, dict[str, Any]]


def _record(model: nn.Module, config: Any, attentions: list[nn.Module | None],
            rotary: nn.Module) -> tuple[dict[int, list[tuple[_Call, _Call]]], list[str]]:
    """Each attention module run alone on four tokens with the model's own tables and with the
    identity rotation: per layer, its attention-function calls paired (own, identity), and what
    could not be run. Nothing for a model on the meta device."""
    from transformers import AttentionInterface

    present = [(i, a) for i, a in enumerate(attentions) if a is not None]
    if not present or any(p.is_meta for _, a in present for p in a.parameters()):
        return {}, []
    calls: list[_Call] = []

    def record(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        calls.append((query.detach(), key.detach(), attention_mask, kwargs))
        batch, h, t, _ = query.shape
        return query.new_zeros(batch, t, h, value.shape[-1]), None

    AttentionInterface.register(_PROBE, record)
    width = int(getattr(config, "hidden_size"))
    found: dict[int, list[tuple[_Call, _Call]]] = {}
    lacks: list[str] = []
    for i, attention in present:
        param = next(attention.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        # the layer input's dtype: a floating weight's (a quantized model's norms and embeddings)
        dtype = next((p.dtype for p in (*attention.parameters(), *model.parameters()) if p.is_floating_point()),
                     torch.float32)
        x = torch.randn(1, _TOKENS, width, generator=torch.Generator().manual_seed(i)).to(device, dtype)
        pos = torch.arange(_TOKENS, device=device)[None]
        held = getattr(attention, "config", None) or getattr(model, "config")
        before = held._attn_implementation_internal
        calls.clear()
        try:
            held._attn_implementation_internal = _PROBE
            with torch.no_grad():
                tables = rotary(x, pos)
                for embeddings in (tables, _identity(tables)):
                    attention(hidden_states=x, position_embeddings=embeddings, attention_mask=None, position_ids=pos)
        except Exception as error:  # its own signature or shapes
            lacks.append(f"posenc could not run layer {i}'s attention alone to check its rotation "
                         f"({type(error).__name__}: {str(error)[:160]})")
            return found, lacks
        finally:
            held._attn_implementation_internal = before
        if not calls or len(calls) % 2:
            lacks.append(f"layer {i}'s attention does not call transformers' attention interface (attn_implementation) "
                         "once per forward, so posenc's attention would not run there")
            return found, lacks
        half = len(calls) // 2  # the same calls with the model's own tables, then with the identity
        found[i] = list(zip(calls[:half], calls[half:]))
    return found, lacks


def _behaviour(found: dict[int, list[tuple[_Call, _Call]]]) -> list[str]:
    """What the recorded calls show that the fallback cannot run: a mask of the layer's own making,
    sink logits passed to the attention function, layers that do not rotate (NoPE)."""
    lacks: list[str] = []
    nope: list[int] = []
    for i, pairs in found.items():
        for (q_own, k_own, mask, kwargs), (q_plain, k_plain, _, _) in pairs:
            if mask is not None:
                shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
                lacks.append(f"layer {i}'s attention prepares its own mask ({shape}) and passes it to the attention "
                             "function, which posenc's attention cannot take (it masks by positions and padding)")
                return lacks
            sinks = [k for k, v in kwargs.items() if ("sink" in k.lower() or k == "s_aux") and isinstance(v, torch.Tensor)]
            if sinks and not any("sink logits" in lack for lack in lacks):
                lacks.append(f"sink logits passed to the attention function ({sinks[0]}, layer {i})")
            if torch.equal(q_own, q_plain) and torch.equal(k_own, k_plain) and i not in nope:
                nope.append(i)
    if nope and len(nope) < len(found):
        which = f"layers {', '.join(map(str, nope))} do" if len(nope) > 1 else f"layer {nope[0]} does"
        lacks.append(f"NoPE layers ({which} not rotate queries and keys), which the fallback's schedule does not describe")
    elif nope:
        lacks.append("no layer rotates its queries and keys with the tables of its rotary module")
    return lacks


def behaviour(model: nn.Module, config: Any, attentions: list[nn.Module | None], rotary: nn.Module) -> list[str]:
    """What running each attention module alone shows that the fallback cannot run (see the module
    docstring); empty when nothing (or a model on the meta device)."""
    found, lacks = _record(model, config, attentions, rotary)
    return lacks or _behaviour(found)


def probe(model: nn.Module, config: Any, attentions: list[nn.Module | None], rotary: nn.Module,
          expected: list[Any], head_dim: int, heads: int) -> None:
    """Run each attention module alone (see the module docstring) and compare its queries and keys
    with posenc's: ``expected[i]`` is the layer's RoPE encoding read from the config (None: NoPE).

    Raises:
        UsageError: naming the family, the layer and what differs.
    """
    found, lacks = _record(model, config, attentions, rotary)
    lacks = lacks or _behaviour(found)
    if lacks:
        raise refusal(config, model, "; ".join(lacks))
    for i, pairs in found.items():
        for (q_own, k_own, _, _), (q_plain, k_plain, _, _) in pairs:
            if q_plain.shape[1] != heads or q_plain.shape[-1] != head_dim:
                raise refusal(config, model, f"layer {i}'s queries have {q_plain.shape[1]} heads of head dim "
                                             f"{q_plain.shape[-1]}, and posenc read {heads} heads of head dim {head_dim} "
                                             "from the config")
            encoding = expected[i]
            positions = torch.arange(_TOKENS, device=q_plain.device)
            want_q = q_plain if encoding is None else encoding.rotate_one(q_plain.float(), positions)
            want_k = k_plain if encoding is None else encoding.rotate_one(k_plain.float(), positions)
            eps = torch.finfo(q_own.dtype).eps if q_own.is_floating_point() else 1e-6
            tol = max(1e-5, 16 * eps) * max(1.0, float(q_plain.abs().max()), float(k_plain.abs().max()))
            if not (torch.allclose(q_own.float(), want_q.float(), atol=tol, rtol=0)
                    and torch.allclose(k_own.float(), want_k.float(), atol=tol, rtol=0)):
                raise refusal(config, model, f"layer {i} rotates its queries and keys otherwise than posenc's RoPE read "
                                             "from the config (another layout, slice or table, or a norm after the "
                                             "rotation); a family row describes it")


__all__ = ["behaviour", "check_structure", "probe", "refusal"]
