"""The RoPE of a whole Hugging Face config: heads, head dim, ``rope_theta`` and the scaling block,
each key resolved as ``transformers`` 5.x resolves it, and the :class:`~posenc.encodings.rope.RoPE`
built from them, the M-RoPE of a Qwen2-VL / Qwen3-VL config (:func:`mrope_from_hf`) and the XD-RoPE
of a Hunyuan-VL config (:func:`xdrope_from_hf`). Reads config
objects and ``config.json`` dicts only; needs no ``transformers``.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..encodings.mrope import MRoPE
from ..encodings.rope import RoPE
from ..encodings.rope_scaling import MAX_BASE, ROPE_TYPES
from ..encodings.xdrope import XDRoPE
from ..errors import UsageError


@dataclass(frozen=True)
class HFRope:
    """What a Hugging Face config says about its RoPE, resolved the way ``transformers`` resolves it.

    ``source`` is the key the scaling block was read from (``"rope_scaling"``, ``"rope_parameters"``,
    or None when the config has neither), ``ignored`` the other key when the config has both and it
    was not read.
    """

    num_heads: int
    head_dim: int
    base: float
    scaling: dict[str, Any]
    source: str | None = None
    ignored: str | None = None

    def options(self) -> dict[str, Any]:
        """Keyword arguments of :class:`~posenc.encodings.rope.RoPE`."""
        return {"num_heads": self.num_heads, "head_dim": self.head_dim, "base": self.base, "scaling": dict(self.scaling)}

    def which(self) -> str:
        """One phrase saying which key was read, e.g. for a message."""
        if self.source is None:
            return "no rope_scaling or rope_parameters block (plain RoPE)"
        if self.ignored is None:
            return f"the {self.source} block"
        return f"the {self.source} block ({self.ignored} ignored, as transformers does)"


def _hf_int(key: str, value: Any, reader: str = "rope_from_hf") -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise UsageError(f"{reader}: {key} must be a positive integer, got {value!r}")
    return int(value)


def _hf_block(key: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise UsageError(f"rope_from_hf: {key} must be a JSON object (a dict of RoPE keys), got {value!r}")
    return dict(value)


def resolve_hf(config: object) -> HFRope:
    """Heads, head dim, base and scaling block of a ``transformers`` config object or its
    ``config.json`` dict, resolved as ``transformers`` 5.x does (``LlamaConfig(**d)``):

    - the block: ``rope_scaling`` when it is given and not empty, else ``rope_parameters`` (a config
      object holds the already resolved ``rope_parameters``);
    - ``rope_theta``: the block's, else the top level's, else 10000; ``partial_rotary_factor``: the
      block's, else the top level's;
    - yarn, llama3 and longrope's ``original_max_position_embeddings``: the block's, else the top
      level's (Phi-3 and DeepSeek-V3 keep it there; their config classes read it), else
      ``max_position_embeddings``. Both given and different is a UsageError: the config classes
      disagree on which one wins (``LlamaConfig`` keeps the block's, ``Phi3Config`` the top level's);
    - dynamic NTK's training length: ``max_position_embeddings`` only (what HF's dynamic update reads);
    - the head dim: ``head_dim``, else ``hidden_size / num_attention_heads`` (which must divide).

    Every number is checked (type and range); a bad one is a UsageError naming its key.
    """
    def get(key: str) -> Any:
        return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)

    if get("num_attention_heads") is None:
        raise UsageError("rope_from_hf: the config has no num_attention_heads")
    num_heads = _hf_int("num_attention_heads", get("num_attention_heads"))
    if get("head_dim") is not None:
        head_dim = _hf_int("head_dim", get("head_dim"))
    else:
        if get("hidden_size") is None:
            raise UsageError("rope_from_hf: the config has neither head_dim nor hidden_size")
        hidden = _hf_int("hidden_size", get("hidden_size"))
        if hidden % num_heads:
            raise UsageError(f"rope_from_hf: hidden_size ({hidden}) must be a multiple of num_attention_heads "
                             f"({num_heads}) when the config gives no head_dim")
        head_dim = hidden // num_heads
    source: str | None = None
    ignored: str | None = None
    if isinstance(config, Mapping):
        given = [k for k in ("rope_scaling", "rope_parameters") if config.get(k) is not None]
        for key in given:
            _hf_block(key, config[key])
        # transformers: `rope_parameters = rope_scaling or rope_parameters`
        source = "rope_scaling" if config.get("rope_scaling") else ("rope_parameters" if config.get("rope_parameters") else None)
        if source is not None and len([k for k in given if config[k]]) == 2:
            ignored = "rope_parameters"
    elif get("rope_parameters"):
        source = "rope_parameters"
        _hf_block(source, get(source))
    block: dict[str, Any] = dict(get(source)) if source else {}
    base: Any = block.pop("rope_theta", None)
    if base is None:
        base = get("rope_theta") if get("rope_theta") is not None else 10000.0
    if isinstance(base, bool) or not isinstance(base, numbers.Real) or not math.isfinite(base) or not 1 < float(base) <= MAX_BASE:
        raise UsageError(f"rope_from_hf: rope_theta must be a number in (1, {MAX_BASE:g}], got {base!r}")
    if get("partial_rotary_factor") is not None:
        block.setdefault("partial_rotary_factor", get("partial_rotary_factor"))
    rope_type = block.get("rope_type", block.get("type", "default"))
    if not isinstance(rope_type, str):
        raise UsageError(f"rope scaling: rope_type must be one of {list(ROPE_TYPES)}, got {rope_type!r}")
    max_positions = get("max_position_embeddings")
    if max_positions is not None:
        max_positions = _hf_int("max_position_embeddings", max_positions)
    if rope_type in ("yarn", "llama3", "longrope"):
        top = get("original_max_position_embeddings")
        inner = block.get("original_max_position_embeddings")
        if top is not None and inner is not None and top != inner:
            raise UsageError(
                f"rope_from_hf: original_max_position_embeddings is {top!r} at the top level and {inner!r} in "
                f"{source}; transformers' config classes disagree on which wins (LlamaConfig: the block's, "
                "Phi3Config: the top level's), so give one"
            )
        if inner is None and top is not None:
            block["original_max_position_embeddings"] = top
        elif inner is None and max_positions is not None:
            block["original_max_position_embeddings"] = max_positions
    if rope_type in ("yarn", "longrope") and block.get("factor") is None:
        block.pop("factor", None)
        if max_positions is not None:
            block["max_position_embeddings"] = max_positions
    if rope_type == "dynamic" and block.get("alpha") is None:  # (with alpha: Hunyuan's ntk_alpha, length-free)
        if max_positions is None:
            raise UsageError("rope_from_hf: dynamic scaling needs the config's max_position_embeddings")
        block.pop("original_max_position_embeddings", None)  # HF ignores it for dynamic
        block["original_max_position_embeddings"] = max_positions
    return HFRope(num_heads, head_dim, float(base), block, source, ignored)


def options_from_hf(config: object) -> dict[str, Any]:
    """``RoPE`` keyword arguments (num_heads, head_dim, base, scaling) of :func:`resolve_hf`."""
    return resolve_hf(config).options()


def rope_from_hf(config: object, **options: Any) -> RoPE:
    """A :class:`~posenc.encodings.rope.RoPE` built from a Hugging Face ``transformers`` config object or its dict:
    heads, head dim, ``rope_theta`` and the scaling block, each key resolved as ``transformers``
    resolves it (:func:`resolve_hf`: ``rope_scaling`` wins over
    ``rope_parameters`` when both are given). The encoding's ``hf_source`` says which block was read
    (``"rope_scaling"``, ``"rope_parameters"`` or None), and a config with both warns which one.
    ``options`` go to :class:`~posenc.encodings.rope.RoPE` (``layout``, ``causal``, ``cache_length``); HF's LLaMA family
    uses the default ``layout="half"``."""
    resolved = resolve_hf(config)
    if resolved.ignored is not None:
        warnings.warn(f"rope_from_hf: the config has both rope_scaling and rope_parameters; read {resolved.which()}",
                      UserWarning, stacklevel=2)
    encoding = RoPE(**resolved.options(), **options)
    encoding.hf_source = resolved.source
    return encoding


#: transformers' default ``rope_theta`` of each M-RoPE config class, by ``model_type`` (of the
#: text config or the whole one): Qwen2VLTextConfig and Qwen2_5_VLTextConfig 1e6,
#: Qwen3VLTextConfig 5e5 (``default_theta``); tests/encodings/test_mrope.py checks them.
DEFAULT_THETA = {"qwen2_vl": 1e6, "qwen2_vl_text": 1e6, "qwen2_5_vl": 1e6, "qwen2_5_vl_text": 1e6,
                 "qwen3_vl": 5e5, "qwen3_vl_text": 5e5, "cosmos3_edge": 1e8, "cosmos3_edge_text": 1e8}

#: The M-RoPE model types (besides those starting with ``qwen3``) whose rotary module always
#: interleaves the sections (Qwen3-VL's rule), whatever ``mrope_interleaved`` says or when the config
#: has no such key, and whose default sections are Qwen3-VL's (24, 20, 20): Cosmos3 Edge's
#: ``Cosmos3EdgeTextRotaryEmbedding`` and Cohere Compass's ``CohereCompassRotaryEmbedding``.
INTERLEAVED_SECTIONS = ("cosmos3_edge", "cosmos3_edge_text", "cohere_compass", "cohere_compass_text")


def _get(cfg: object, key: str) -> Any:
    """``key`` of a config object or of its dict form (None when absent)."""
    return cfg.get(key) if isinstance(cfg, Mapping) else getattr(cfg, key, None)


#: The M-RoPE model types whose rotation pairs feature 2i with 2i + 1 (GLM-4V, GLM-4.6V and GLM-OCR:
#: ``rotate_half_llm`` on tables repeated pairwise); the other M-RoPE models pair i with i + r/2.
INTERLEAVED_PAIRS = ("glm4v", "glm4v_text", "glm46v", "glm_ocr", "glm_ocr_text")


def _text_rope_block(config: Any, caller: str) -> tuple[Any, Mapping]:
    """(the text config: ``text_config`` or the config itself, its RoPE block: ``rope_parameters`` or
    ``rope_scaling``, {} when none).

    Raises:
        UsageError: the block is not a dict (naming ``caller``).
    """
    text = _get(config, "text_config") or config
    block = _get(text, "rope_parameters") or _get(text, "rope_scaling") or {}
    if not isinstance(block, Mapping):
        raise UsageError(f"{caller}: rope_parameters must be a JSON object (a dict of RoPE keys), got {block!r}")
    return text, block


def _head_sizes(text: object, caller: str, head_dim_keys: tuple[str, ...]) -> tuple[int, int]:
    """(num_attention_heads, head_dim) of a text config: the head dim from the first of
    ``head_dim_keys`` it gives, else hidden_size / num_attention_heads.

    Raises:
        UsageError: no num_attention_heads; a size that is not a positive integer; a hidden_size that
            the heads do not divide when no head dim is given.
    """
    if _get(text, "num_attention_heads") is None:
        raise UsageError(f"{caller}: the config has no num_attention_heads")
    heads = _hf_int("num_attention_heads", _get(text, "num_attention_heads"), caller)
    given = next((_get(text, key) for key in head_dim_keys if _get(text, key) is not None), None)
    if given is not None:
        return heads, _hf_int("head_dim", given, caller)
    hidden = _hf_int("hidden_size", _get(text, "hidden_size"), caller)
    if hidden % heads:
        raise UsageError(f"{caller}: hidden_size ({hidden}) must be a multiple of num_attention_heads ({heads}) "
                         "when the config gives no head_dim")
    return heads, hidden // heads


def mrope_from_hf(config: object, **options: Any) -> MRoPE:
    """An :class:`MRoPE` from a ``transformers`` Qwen2-VL / Qwen2.5-VL / Qwen3-VL / GLM-4V config (the
    whole config or its ``text_config``, object or ``config.json`` dict): heads, head dim,
    ``rope_theta``, ``mrope_section``, ``mrope_interleaved`` and ``partial_rotary_factor`` from
    ``rope_parameters`` (or ``rope_scaling``; the factor also from the top level).

    As Hugging Face's config and rotary classes do: ``"type": "mrope"`` (the published Qwen2-VL
    config.json form) is the default frequencies; ``rope_theta`` is the block's, else the top
    level's, else the config class's default (:data:`DEFAULT_THETA`: 1e6 for Qwen2-VL and
    Qwen2.5-VL, 5e5 for Qwen3-VL, 1e8 for Cosmos3 Edge; another ``model_type`` must give it); a
    ``model_type`` starting with ``qwen3`` or in :data:`INTERLEAVED_SECTIONS` always interleaves (their
    rotary classes interleave whatever the flag says), any other interleaves only with ``mrope_interleaved``;
    without ``mrope_section``, (24, 20, 20) for those,
    (8, 12, 12) for a ``model_type`` starting with ``glm``, (16, 24, 24) otherwise. GLM-4V and
    GLM-OCR (:data:`INTERLEAVED_PAIRS`) pair features interleaved (``layout="interleaved"``), the
    others (GLM-4.5V's ``glm4v_moe`` included) half.
    A ``partial_rotary_factor`` rotates the first ``int(head_dim * factor)`` features (GLM-4.1V), as
    the rotary module computes it. ``options`` go to :class:`MRoPE` (``causal``, ``cache_length``,
    ``layout``).

    Raises:
        UsageError: a scaled ``rope_type`` (the default frequencies only), a missing or non-integer
            size (a numeric text such as ``"4"`` included), a ``rope_theta`` that is not a number
            (``"1e6"`` included) or is missing for an unknown ``model_type``, or a bad section.
    """
    text, block = _text_rope_block(config, "mrope_from_hf")
    rope_type = block.get("rope_type", block.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise UsageError(f"mrope_from_hf: rope_type {rope_type!r} is not supported (default frequencies only: "
                         "'default', or 'mrope' as Qwen2-VL's config.json writes it)")
    model_type = str(_get(text, "model_type") or _get(config, "model_type") or "")
    qwen3 = model_type.startswith("qwen3") or model_type in INTERLEAVED_SECTIONS
    heads, head_dim = _head_sizes(text, "mrope_from_hf", ("head_dim",))
    base = block.get("rope_theta", _get(text, "rope_theta"))
    if base is None:
        base = _get(config, "rope_theta")
    if base is None:
        default = DEFAULT_THETA.get(model_type) or DEFAULT_THETA.get(str(_get(config, "model_type") or ""))
        if default is None:
            raise UsageError(f"mrope_from_hf: the config gives no rope_theta and model_type {model_type!r} has no known "
                             f"default (known: {sorted(DEFAULT_THETA)}); give rope_theta")
        base = default
    if isinstance(base, bool) or not isinstance(base, numbers.Real) or not math.isfinite(base) or not float(base) > 1:
        raise UsageError(f"mrope_from_hf: rope_theta must be a number > 1, got {base!r}")
    glm = model_type.startswith("glm")
    section = block.get("mrope_section") or ([24, 20, 20] if qwen3 else [8, 12, 12] if glm else [16, 24, 24])
    interleaved = block.get("mrope_interleaved", False)
    if not isinstance(interleaved, bool):
        raise UsageError(f"mrope_from_hf: mrope_interleaved must be true or false, got {interleaved!r}")
    factor = block.get("partial_rotary_factor", _get(text, "partial_rotary_factor"))
    if factor is not None and factor != 1.0:
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            raise UsageError(f"mrope_from_hf: partial_rotary_factor must be a number in (0, 1], got {factor!r}")
        options.setdefault("rotary_dim", int(head_dim * float(factor)))
    if model_type in INTERLEAVED_PAIRS or str(_get(config, "model_type") or "") in INTERLEAVED_PAIRS:
        options.setdefault("layout", "interleaved")
    return MRoPE(heads, head_dim, base=float(base), mrope_section=list(section) if isinstance(section, (list, tuple)) else section,
                 mrope_interleaved=qwen3 or interleaved, **options)


def xdrope_from_hf(config: object, **options: Any) -> XDRoPE:
    """An :class:`XDRoPE` from a ``transformers`` Hunyuan-VL config (the whole config or its
    ``text_config``, object or ``config.json`` dict): heads, head dim (``head_dim``, else
    ``attention_head_dim``, else hidden_size / heads), ``rope_theta`` (the block's, else the top
    level's, else 10000), the section (``xdrope_section`` or its new name ``mrope_section``; equal if
    both) and Hunyuan's NTK-alpha (``alpha`` in a block of type ``xdrope`` or ``dynamic``), from
    ``rope_parameters`` (or ``rope_scaling``), as transformers' ``HunYuanVLRotaryEmbedding`` reads them.
    The keys Hunyuan's blocks carry beside ``alpha`` (``factor``, ``beta_fast``, ...) are not read, as
    there. ``options`` go to :class:`XDRoPE` (``causal``, ``cache_length``).

    Raises:
        UsageError: a block that is not a dict, another ``rope_type`` (``default``, ``xdrope`` or
            ``dynamic`` with ``alpha``), two sections that differ, or a missing or bad size.
    """
    text, block = _text_rope_block(config, "xdrope_from_hf")
    legacy, section = block.get("xdrope_section"), block.get("mrope_section")
    if legacy is not None and section is not None and list(legacy) != list(section):
        raise UsageError(f"xdrope_from_hf: xdrope_section {list(legacy)} and mrope_section {list(section)} differ; give one")
    section = section if section is not None else legacy
    rope_type = block.get("rope_type", block.get("type", "default"))
    alpha = block.get("alpha")
    if rope_type in ("xdrope", "dynamic") and alpha:
        scaling: dict[str, Any] | None = {"rope_type": "ntk_alpha", "alpha": alpha}
    elif rope_type in ("default", "xdrope"):
        scaling = None
    else:
        raise UsageError(f"xdrope_from_hf: rope_type {rope_type!r} is not supported ('default', or 'xdrope' / 'dynamic' "
                         "with Hunyuan's alpha)")
    heads, head_dim = _head_sizes(text, "xdrope_from_hf", ("head_dim", "attention_head_dim"))
    base = block.get("rope_theta", _get(text, "rope_theta"))
    base = 10000.0 if base is None else base
    if isinstance(base, bool) or not isinstance(base, numbers.Real) or not math.isfinite(base) or not float(base) > 1:
        raise UsageError(f"xdrope_from_hf: rope_theta must be a number > 1, got {base!r}")
    return XDRoPE(heads, head_dim, base=float(base), xdrope_section=None if section is None else list(section),
                  scaling=scaling, **options)


__all__ = ["DEFAULT_THETA", "HFRope", "INTERLEAVED_PAIRS", "INTERLEAVED_SECTIONS",
           "mrope_from_hf", "options_from_hf", "resolve_hf", "rope_from_hf", "xdrope_from_hf"]
