"""What a checkpoint saved after :func:`posenc.hf.use` carries so that it loads right, or not at all.

- **A plain load fails.** ``use`` records ``attn_implementation = "posenc"`` in the config, and
  ``save_pretrained`` writes it to ``config.json``; ``transformers`` reads that key when it loads
  the config. ``AutoModelForCausalLM.from_pretrained(path)`` then stops: in a process where
  posenc's attention is not registered, transformers refuses the unknown ``attn_implementation``
  while building the model (ValueError naming "posenc"); where it is registered (posenc.hf was
  used), the model builds and its first forward is a UsageError saying to load it with
  :func:`posenc.hf.from_pretrained`. A model that silently runs its own RoPE in place of the
  trained encoding (ALiBi, NoPE, ... have no weights to warn about) cannot come out of it. Asking
  for the model's own attention explicitly (``from_pretrained(path, attn_implementation="sdpa")``)
  still builds it with its own RoPE, but not without a word: ``use`` puts a marker buffer
  (:data:`MARKER`, ``<decoder stack>.posenc_marker``, one int64) on the decoder stack, saved with
  the weights, which a plain class does not have, so transformers' load report lists
  ``model.posenc_marker`` as UNEXPECTED (a warning naming posenc) for every encoding, parameter-free
  ones (ALiBi, NoPE, Sandwich, ...) included. :func:`posenc.hf.export` leaves it out.
- **The encoding comes back whole.** :func:`recorded_options` adds to the recorded options what
  ``use`` derived from the model's config rather than recorded (the key/value head count of an
  encoding with per-key-head parameters, RoPE-Mixed's), so :func:`posenc.hf.from_pretrained`
  rebuilds the encoding that was saved.
"""

from __future__ import annotations

from typing import Any

from ..encodings import get_class, options_of
from ..errors import UsageError
from .attention import NAME

#: The name of the marker buffer :func:`posenc.hf.use` puts on the decoder stack (see the module docstring).
MARKER = "posenc_marker"


def mark(config: Any) -> None:
    """Record posenc's attention in ``config`` (written to config.json by ``save_pretrained``;
    read back by transformers as the model's ``attn_implementation``)."""
    config.attn_implementation = NAME


def recorded_options(config: Any, record: dict[str, Any]) -> dict[str, Any]:
    """The options to rebuild the encoding of ``record`` (a ``config.posenc``) with: the recorded
    ones, plus ``num_kv_heads`` from the config's ``num_key_value_heads`` (else its query heads)
    for a method that takes it and a record without it.

    Raises:
        UsageError: the recorded options are not a dict, or the config's head counts are not
            positive integers.
    """
    options = record.get("options") or {}
    if not isinstance(options, dict):
        raise UsageError(f"config.posenc: options must be a dict, got {options!r}")
    options = dict(options)
    if "num_kv_heads" in options_of(get_class(record["encoding"])) and "num_kv_heads" not in options:
        heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
            raise UsageError(f"config: num_key_value_heads must be a positive integer, got {heads!r}")
        options["num_kv_heads"] = heads
    return options


__all__ = ["MARKER", "NAME", "mark", "recorded_options"]
