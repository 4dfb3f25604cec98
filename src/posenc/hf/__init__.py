"""posenc inside Hugging Face ``transformers`` models (an optional extra: ``pip install posenc[hf]``).

- :func:`use` turns a supported model's attention into posenc's attention with any posenc encoding.
- :mod:`posenc.hf.importers`: trained position parameters of HF checkpoints (T5's relative bias
  table, BLOOM's ALiBi) into posenc encodings, and back where there is something to export.

``transformers`` is imported by :mod:`posenc.hf.adapter` only; the importers read module attributes.
"""

from __future__ import annotations

from .adapter import NAME, SUPPORTED, from_pretrained, register, use
from .importers import alibi_from_bloom, t5_attention, t5_from_hf, t5_to_hf

__all__ = ["NAME", "SUPPORTED", "alibi_from_bloom", "from_pretrained", "register", "t5_attention", "t5_from_hf", "t5_to_hf", "use"]
