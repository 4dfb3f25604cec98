"""posenc inside Hugging Face ``transformers`` models (an optional extra: ``pip install posenc[hf]``).

- :func:`use` turns a supported model's attention into posenc's attention with any posenc encoding.
- :mod:`posenc.hf.importers`: trained position parameters of HF checkpoints (T5's relative bias
  table, BLOOM's ALiBi) into posenc encodings, and back where there is something to export.
- :func:`export`: an extended model as a plain transformers checkpoint (``rope_parameters``, no posenc keys).
- :func:`deberta_from_hf`: one layer of a DeBERTa-v2/v3 encoder as a posenc attention module with
  the same weights and relative table.

Importing ``posenc`` never imports ``transformers``; importing ``posenc.hf`` does (the importers
themselves only read module attributes). :func:`posenc.study.hf_evaluation.evaluate` scores an HF causal LM
with the study's evaluation (used by the DroPE recipe in docs/hf.md).
"""

from __future__ import annotations

try:
    import transformers  # noqa: F401
except ImportError as error:  # an optional extra
    raise ImportError("posenc.hf needs Hugging Face transformers >= 5: pip install 'posenc[hf]'") from error

from .adapter import NAME, SUPPORTED, RotaryStandIn, from_pretrained, register, use
from .deberta import deberta_from_hf
from .export import export
from .importers import alibi_from_bloom, t5_attention, t5_from_hf, t5_to_hf

__all__ = ["NAME", "SUPPORTED", "RotaryStandIn", "alibi_from_bloom", "deberta_from_hf", "export", "from_pretrained",
           "register", "t5_attention", "t5_from_hf", "t5_to_hf", "use"]
