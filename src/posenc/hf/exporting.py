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

The family's own layer pattern is all export writes besides the block: the plain model's layers
(read back from the config it writes, by :func:`posenc.schedule_from_hf`) must be NoPE where posenc's
are NoPE and attend with the same window, chunk, sinks and query scale (``use(model, "rope",
**options)`` keeps them; a schedule that changes them is refused, naming the layer). The block is
checked against the family's config class (Phi-3 keeps only ``default`` and ``longrope``), and keeps
the family's own keys in it (the partial rotary, Ministral 3's ``llama_4_scaling_beta``).

It reads only the contract of :func:`posenc.hf.use`: ``model.config.posenc`` (the record), the
installed encodings at ``<decoder stack>.posenc_encodings`` and each attention layer's plan.
"""

from __future__ import annotations

import copy
import os
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from ..encodings.rope import RoPE
from ..errors import UsageError
from .adapter import MARKER
from .attention import Encodings, LayerPlan, held_encoding
from .families import Family, family_of, qk_head_dim, text_config
from .forward_state import RotaryStandIn
from .layers import family_schedule
from .stack import attention_slots, decoder_stack, layer_list

# transformers' rope types (transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS, 5.24) posenc can write.
EXPRESSIBLE = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
DROPPED_KEYS = ("posenc", "_attn_implementation", "_attn_implementation_internal", "attn_implementation")


def _installed(model: nn.Module) -> Encodings | nn.ModuleList | None:
    """The ``posenc_encodings`` of ``model``'s decoder stack, or None when posenc.hf.use never ran."""
    for module in model.modules():
        found = getattr(module, "posenc_encodings", None)
        if isinstance(found, (Encodings, nn.ModuleList)):
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
    if cfg.rounds_wavelengths:  # transformers would drop the key and rotate without the rounding
        raise UsageError(f"model: its RoPE scaling {cfg.rope_type!r} rounds its wavelengths (resonance), which transformers "
                         "cannot express; export refuses it")
    block = {k: v for k, v in cfg.to_dict().items() if k not in ("partial_rotary_factor", "max_position_embeddings")}
    block["rope_theta"] = float(encoding.base)
    if cfg.rope_type == "dynamic":  # transformers reads the training length from max_position_embeddings
        block.pop("original_max_position_embeddings", None)
    return block


def _plans(model: nn.Module) -> list[LayerPlan | None]:
    """Each decoder layer's :class:`LayerPlan` as :func:`posenc.hf.use` installed it (None where a
    layer has no attention), with the encoding the model holds now (e.g. a trained copy after PEFT's
    merge_and_unload)."""
    plans: list[LayerPlan | None] = []
    stack = decoder_stack(model)
    # layers, Falcon's h, DBRX's blocks; a layer holding several attention modules: one plan each
    for attention in attention_slots(list(cast(nn.ModuleList, layer_list(stack))))[1]:
        plan = None if attention is None else attention.__dict__.get("_posenc_plan")
        plans.append(None if plan is None else replace(plan, encoding=held_encoding(stack, plan)))
    return plans


def _kind(window: int | None, chunk: int | None, sinks: bool, query_scale: Any) -> str:
    parts = [f"window={window}" if window else "", f"chunk={chunk}" if chunk else "", "sinks" if sinks else "",
             f"query scale {query_scale.to_text()}" if query_scale is not None else ""]
    return ", ".join(p for p in parts if p) or "full attention"


def _check_pattern(config: Any, family: Family | None, plans: list[LayerPlan | None], current: Any) -> None:
    """Each layer of the plain model that ``config`` describes against what posenc runs there: NoPE
    where posenc runs NoPE, RoPE where it runs RoPE, the same window, chunk, sinks and query scale
    (a ``log_beta`` family's model scales its queries itself, from its ``current`` config: the
    model's, before export writes its block).

    Raises:
        UsageError: a layer differs (naming it and both sides).
    """
    own = family_schedule(text_config(config), family, len(plans))
    kept = family_schedule(text_config(current), family, len(plans)) if family is not None and family.log_beta else None
    for i, (plan, layer) in enumerate(zip(plans, own.layers)):
        if plan is None:
            continue
        ours = getattr(plan.encoding, "name", type(plan.encoding).__name__)
        if (layer.encoding == "nope") != (ours == "nope"):
            raise UsageError(f"model: layer {i} runs {ours!r} in posenc, where the plain {type(config).__name__} runs "
                             f"{layer.encoding!r} (the family's own layer pattern); export writes only that pattern")
        theirs_kind = _kind(layer.window, layer.chunk, layer.sinks, layer.query_scale)
        ours_scale = plan.query_scale if kept is None else kept.layers[i].query_scale  # the model's own (log_beta)
        ours_kind = _kind(plan.window, plan.chunk, plan.sinks is not None, ours_scale)
        if theirs_kind != ours_kind:
            raise UsageError(f"model: layer {i} attends with {ours_kind} in posenc, where the plain "
                             f"{type(config).__name__} would attend with {theirs_kind}; export cannot write that "
                             "attention in the family's config, and refuses rather than write another model")


def _window_written(config: Any, values: dict[str, Any], block: dict[str, Any] | None, rotary_dim: int,
                    family: Family | None, plans: list[LayerPlan | None], refused: UsageError, current: Any) -> Any:
    """The plain config with the one window posenc's windowed layers share written to the family's
    window key (Mistral with a window of 4 where its config says 8), when the layers that config
    then describes are posenc's; else ``refused`` is raised."""
    windows = {p.window for p in plans if p is not None and p.window is not None}
    key = family.window_key if family is not None else "sliding_window"
    if len(windows) != 1 or values.get(key) is None:
        raise refused
    plain = _plain_config(config, {**values, key: windows.pop()}, block, rotary_dim)
    try:
        _check_pattern(plain, family, plans, current)
    except UsageError:
        raise refused from None
    return plain


def _allowed_rope_types(config_class: Any, values: dict[str, Any], rotary_dim: int) -> list[str]:
    """The rope types of :data:`EXPRESSIBLE` that ``config_class`` keeps as given (Phi-3 takes only
    ``default`` and ``longrope``, and turns ``yarn`` into ``longrope``)."""
    theta = float((values.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    original = int(values.get("max_position_embeddings") or 2048)
    extra: dict[str, dict[str, Any]] = {"linear": {"factor": 2.0}, "dynamic": {"factor": 2.0},
             "yarn": {"factor": 2.0, "original_max_position_embeddings": original},
             "llama3": {"factor": 2.0, "original_max_position_embeddings": original, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0},
             "longrope": {"factor": 2.0, "original_max_position_embeddings": original,
                          "short_factor": [1.0] * (rotary_dim // 2), "long_factor": [1.0] * (rotary_dim // 2)}}
    allowed = []
    for kind in EXPRESSIBLE:
        trial = {**values, "rope_parameters": {"rope_type": kind, "rope_theta": theta, **extra.get(kind, {})}}
        try:
            made = config_class.from_dict(trial)
        except Exception:  # noqa: BLE001  (the config class refuses it, in its own words)
            continue
        if (getattr(made, "rope_parameters", None) or {}).get("rope_type") == kind:
            allowed.append(kind)
    return allowed


def _plain_config(config: Any, values: dict[str, Any], block: dict[str, Any] | None, rotary_dim: int) -> Any:
    """The family's config class made from ``values``; with ``block`` (the ``rope_parameters`` export
    writes) checked to come out of the class as written.

    Raises:
        UsageError: the class refuses the block or changes it (its rope type, a key), naming the
            rope types it keeps.
    """
    config_class = type(config)
    error: Exception | None = None
    try:
        plain = config_class.from_dict(values)
    except Exception as caught:  # noqa: BLE001  (transformers' KeyError / ValueError / validation error)
        plain, error = None, caught
    if block is None:
        if error is not None:
            raise error
        return plain
    kept = None if plain is None else getattr(plain, "rope_parameters", None)
    changed = [k for k, v in block.items() if not isinstance(kept, dict) or kept.get(k) != v]
    if error is not None or changed:
        allowed = _allowed_rope_types(config_class, values, rotary_dim)
        why = f"refuses it ({type(error).__name__}: {str(error).splitlines()[0][:200]})" if error is not None else \
            f"changes its {', '.join(repr(k) for k in changed)}"
        raise UsageError(f"model: its RoPE scaling {block.get('rope_type')!r} as transformers' rope_parameters: "
                         f"{config_class.__name__} {why}; it keeps rope types {', '.join(allowed) or 'none of ' + str(EXPRESSIBLE)}")
    return plain


def export(model: nn.Module, path: str | os.PathLike[str]) -> Path:
    """Write ``model`` (a transformers causal LM, after :func:`posenc.hf.use` or not) as a plain
    transformers checkpoint in the new directory ``path``; returns it (see the module docstring).

    A ``dynamic`` scaling is written (transformers runs it) with a :class:`UserWarning`: vLLM serves
    that config with unscaled frequencies (docs/extend.md, ``posenc.hf.export``).

    Raises:
        UsageError: ``path`` is a file or a non-empty directory; the model's encoding is not one
            RoPE that transformers can express (named), or its layers hold different encodings; a
            layer's attention (window, chunk, sinks, query scale) or NoPE / RoPE differs from what
            the family's config says; the family's config class refuses or changes the scaling
            (naming the rope types it keeps).
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
    block: dict[str, Any] | None = None
    plans: list[LayerPlan | None] = []
    rotary_dim = head_dim
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
        plans = _plans(model)
        own = family_schedule(text_config(config), family, len(plans))
        # The family's own NoPE layers stay NoPE (checked by _check_pattern); every other layer's
        # encoding must be the one RoPE that transformers expresses.
        rotating = [p.encoding for p, layer in zip(plans, own.layers) if p is not None and layer.encoding != "nope"]
        rotating = rotating or [p.encoding for p in plans if p is not None]
        blocks = [rope_parameters(enc, head_dim, layout, rotary_dim) for enc in rotating]
        if any(b != blocks[0] for b in blocks[1:]):
            raise UsageError("model: its layers hold different RoPE encodings (a per-layer schedule), which one "
                             "rope_parameters block cannot say")
        block = blocks[0]
        if block["rope_type"] == "dynamic":
            first = rotating[0]
            original = first.scaling.original_length if isinstance(first, RoPE) else None
            if original is not None:
                config.max_position_embeddings = int(original)
            warnings.warn("posenc.hf.export: a 'dynamic' (dynamic NTK) scaling is written for transformers only; vLLM "
                          "serves this config with unscaled frequencies and a table of the original length (NaN past "
                          "it). Export a linear, yarn, llama3 or longrope scaling for vLLM (docs/extend.md, posenc.hf.export)",
                          UserWarning, stacklevel=2)
        elif block.get("factor") and block.get("original_max_position_embeddings"):  # the extended context
            extended = round(block["factor"] * block["original_max_position_embeddings"])
            config.max_position_embeddings = max(int(config.max_position_embeddings), extended)
        own_block = getattr(text_config(model.config), "rope_parameters", None) or {}
        if isinstance(own_block, dict):
            # The family's own keys in the block: the partial rotary, and what its config class reads
            # beside the rope type (Ministral 3's llama_4_scaling_beta).
            family_keys = {"partial_rotary_factor"} | set(getattr(type(config), "ignore_keys_at_rope_validation", ()) or ())
            block.update({k: own_block[k] for k in family_keys if k in own_block and k not in block})
        config.rope_parameters = block
    values = config.to_dict()
    for key in DROPPED_KEYS:
        values.pop(key, None)
    plain_config = _plain_config(config, values, block, rotary_dim)
    if plans:
        try:
            _check_pattern(plain_config, family, plans, model.config)
        except UsageError as refused:
            plain_config = _window_written(config, values, block, rotary_dim, family, plans, refused, model.config)
    state = {k: v for k, v in model.state_dict().items()
             if "posenc_encodings." not in k and ".rotary_emb." not in k and not k.endswith(MARKER)}
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
