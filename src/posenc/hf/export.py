"""``posenc.hf.export``: a transformers model that posenc extended, written as a plain transformers
checkpoint that loads without posenc.

What is written (``save_pretrained`` of a fresh model of the same class): the model's weights
without posenc's modules (``posenc_encodings``, the stand-in rotary module), and a config.json with
the encoding's RoPE as transformers' own ``rope_parameters`` (transformers 5's key: ``rope_type``,
``rope_theta`` and the type's keys) and no posenc key (``posenc``, the attention implementation).
``AutoModelForCausalLM.from_pretrained(path)`` then computes what posenc computed.

What transformers can express in the Llama family (Llama, Mistral, Qwen2, Qwen3) is one RoPE for
every layer, in the half layout, rotating every feature of the head, with one of its scalings:
``default``, ``linear``, ``dynamic``, ``yarn``, ``longrope``, ``llama3``. Anything else (ALiBi, NoPE,
T5, a per-layer schedule, posenc's static ``ntk``, partial rotary, xPos, ...) is refused with a
:class:`~posenc.errors.UsageError` that names it, never written as something else.

It reads only the contract of :func:`posenc.hf.use`: ``model.config.posenc`` (the record) and the
installed encodings at ``<decoder stack>.posenc_encodings``.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..encodings.rope import RoPE
from ..errors import UsageError
from .attention import RotaryStandIn
from .families import family_of, qk_head_dim

# transformers' rope types (transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS, 5.24) posenc can write.
EXPRESSIBLE = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
DROPPED_KEYS = ("posenc", "_attn_implementation", "_attn_implementation_internal", "attn_implementation")


def _installed(model: nn.Module) -> nn.ModuleList | None:
    """The ``posenc_encodings`` of ``model``'s decoder stack, or None when posenc.hf.use never ran."""
    for module in model.modules():
        found = getattr(module, "posenc_encodings", None)
        if isinstance(found, nn.ModuleList):
            return found
    return None


def rope_parameters(encoding: nn.Module, head_dim: int, layout: str = "half", rotary_dim: int | None = None) -> dict[str, Any]:
    """transformers' ``rope_parameters`` block for ``encoding``, in a family whose rotation pairs
    features in ``layout`` over its first ``rotary_dim`` (default: ``head_dim``) features.

    Raises:
        UsageError: an encoding, layout, rotated width or scaling the family cannot express (naming it).
    """
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if type(encoding) is not RoPE:
        name = getattr(encoding, "name", type(encoding).__name__)
        raise UsageError(f"model: its encoding {name!r} has no transformers equivalent in this family (transformers' "
                         "Llama family rotates with RoPE only); export writes RoPE models")
    if encoding.layout != layout:
        raise UsageError(f"model: its RoPE uses layout {encoding.layout!r}; this family's transformers code rotates in the "
                         f"{layout!r} layout")
    if encoding.rotary_dim != rotary_dim:
        raise UsageError(f"model: its RoPE rotates {encoding.rotary_dim} of {head_dim} features; this family's transformers "
                         f"code rotates {rotary_dim}")
    cfg = encoding.scaling
    if cfg.rope_type not in EXPRESSIBLE:
        raise UsageError(f"model: its RoPE scaling {cfg.rope_type!r} has no transformers rope_type (transformers has "
                         f"{', '.join(EXPRESSIBLE)}); export refuses it")
    block = {k: v for k, v in cfg.to_dict().items() if k not in ("partial_rotary_factor", "max_position_embeddings")}
    block["rope_theta"] = float(encoding.base)
    if cfg.rope_type == "dynamic":  # transformers reads the training length from max_position_embeddings
        block.pop("original_max_position_embeddings", None)
    return block


def export(model: nn.Module, path: str | os.PathLike[str]) -> Path:
    """Write ``model`` (a transformers causal LM, after :func:`posenc.hf.use` or not) as a plain
    transformers checkpoint in the new directory ``path``; returns it (see the module docstring).

    Raises:
        UsageError: ``path`` is a file or a non-empty directory; the model's encoding is not one
            RoPE that transformers can express (named), or its layers hold different encodings.
    """
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise UsageError(f"model: export needs a transformers model, got {type(model).__name__}")
    out = Path(path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"path: {out} exists and is not an empty directory; export writes a new one")
    config = copy.deepcopy(model.config)
    record = getattr(config, "posenc", None)
    encodings = _installed(model)
    family = family_of(getattr(config, "model_type", None))
    head_dim = qk_head_dim(config, family)
    if record is not None or encodings is not None:
        if encodings is None or not len(encodings):
            raise UsageError("model: its config records a posenc encoding but the model holds none (posenc_encodings)")
        if family is not None and (family.rope_blocks == "per_type" or family.rope_slice != "first"):
            raise UsageError(f"model: export writes one rope_parameters block; {family.name} keeps "
                             f"{'one per layer type' if family.rope_blocks == 'per_type' else 'its rope part apart (MLA)'}, "
                             "which export does not write")
        rotary = next((m.original for m in model.modules() if isinstance(m, RotaryStandIn)), None)
        inv = getattr(rotary, "inv_freq", None)
        rotary_dim = 2 * int(inv.numel()) if isinstance(inv, torch.Tensor) else head_dim
        layout = family.layout if family is not None else "half"
        blocks = [rope_parameters(enc, head_dim, layout, rotary_dim) for enc in encodings]
        if any(b != blocks[0] for b in blocks[1:]):
            raise UsageError("model: its layers hold different RoPE encodings (a per-layer schedule), which one "
                             "rope_parameters block cannot say")
        block = blocks[0]
        if block["rope_type"] == "dynamic":
            first = encodings[0]
            original = first.scaling.original_length if isinstance(first, RoPE) else None
            if original is not None:
                config.max_position_embeddings = int(original)
        elif block.get("factor") and block.get("original_max_position_embeddings"):  # the extended context
            extended = round(block["factor"] * block["original_max_position_embeddings"])
            config.max_position_embeddings = max(int(config.max_position_embeddings), extended)
        own = getattr(model.config, "rope_parameters", None) or {}
        if isinstance(own, dict) and "partial_rotary_factor" in own:  # the family's partial rotary stays
            block["partial_rotary_factor"] = own["partial_rotary_factor"]
        config.rope_parameters = block
    values = config.to_dict()
    for key in DROPPED_KEYS:
        values.pop(key, None)
    plain_config = type(config).from_dict(values)
    state = {k: v for k, v in model.state_dict().items()
             if "posenc_encodings." not in k and ".rotary_emb." not in k}
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    with torch.device("meta"):
        plain = type(model)(plain_config)
    plain = plain.to_empty(device="cpu")
    missing, unexpected = plain.load_state_dict(state, strict=False)
    missing = [k for k in missing if ".rotary_emb." not in k]
    if missing or unexpected:
        raise UsageError(f"model: its weights do not fit a plain {type(model).__name__} (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    plain.to(dtype)  # type: ignore[call-arg, arg-type]  # (transformers wraps .to)
    plain.save_pretrained(out)
    return out


__all__ = ["EXPRESSIBLE", "export", "rope_parameters"]
