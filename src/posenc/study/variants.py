"""Evaluation variants: a trained model evaluated another way, with no training.

RoPE scalings (``rope+linear``, ``+ntk``, ``+dynamic``, ``+yarn``, ``+llama3``, ``+longrope``): the
trained RoPE model is evaluated at length ``l`` under the scaling, with the factor a user would set
to run a model trained at ``T`` on inputs of ``l``: ``s = l / T`` (1 at the training length, where
every scaling is the plain rotation). Per type, the block handed to
:meth:`posenc.encodings.rope.RoPE.set_scaling`:

- ``linear``, ``ntk``: ``factor = s``.
- ``dynamic``: ``factor = 1`` and ``original_max_position_embeddings = T``: dynamic NTK reads the
  current length itself, and with factor 1 its scale at length ``l`` is exactly ``l / T``.
- ``yarn``: ``factor = s``, ``original_max_position_embeddings = T``, Hugging Face's other defaults
  (beta_fast 32, beta_slow 1, attention factor 0.1 ln s + 1).
- ``llama3``: ``factor = s``, ``original_max_position_embeddings = T``, Llama 3.1's
  ``low_freq_factor = 1`` and ``high_freq_factor = 4``.
- ``longrope``: LongRoPE's factors come from a search (Ding et al. 2024, §3.2) that a study cannot
  run for each model; they are derived here from one rule instead: ``short_factor`` all 1 (at
  lengths up to T the model rotates as it was trained), and ``long_factor_k = 1`` for a pair whose
  wavelength ``2 pi / theta_k`` is at most T (the model saw it turn fully: keep it) and ``s`` for a
  pair whose wavelength is longer (it never turned fully in training: interpolate it). This is the
  non-uniform, frequency-dependent shape LongRoPE's search finds (low frequencies interpolated
  more), without the search; ``factor = s`` and ``original_max_position_embeddings = T`` set
  longrope's attention factor ``sqrt(1 + ln s / ln T)``.
- ``ntk_alpha``, ``resonance``, ``resonance_yarn`` (``posenc extend`` only, no study row):
  ``alpha = s``; the default frequencies rounded to integer wavelengths; the ``yarn`` block with
  ``resonance: true``.

A fine-tuned row (``+ft``, the PI / YaRN protocol) uses the same blocks with one fixed factor,
``finetune_length / T``, for its fine-tune and for every evaluation length.

Blockwise (``xpos+blockwise``): the encoding's ``block_size`` set to half the training length while
evaluating (Sun et al. 2022, §3.3): a query sees its own block and the previous one only.

In a schedule row's model, a scaling acts on its RoPE layers (each with a block from its own base)
and blockwise on the layers with a ``block_size``; the other layers are left as they are.

Each variant is applied to the model's own encodings for the duration of a ``with`` block and undone
after it, so one loaded model serves its base row and every variant.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator

from torch import nn

from ..encodings.base import PositionalEncoding
from ..encodings.rope import RoPE
from ..errors import UsageError
from ..model.lm import LM, LMConfig
from .rows import SEARCHED, Row

# Scalings ``posenc extend`` takes beyond the study's rows (rows.SCALINGS, whose presets they would
# change): their blocks come from :func:`scaling_block` too.
EXTRA_SCALINGS = ("ntk_alpha", "resonance", "resonance_yarn")

# length -> the searched longrope block a +longrope_searched row evaluates with at that length
Searched = Callable[[int], dict[str, Any]]


def scaling_block(kind: str, factor: float, train_length: int, base: float, rotary_dim: int) -> dict[str, Any]:
    """The Hugging Face style scaling block of ``kind`` with scale ``factor`` for a model trained at
    ``train_length`` (see the module docstring)."""
    s = max(1.0, float(factor))
    t = train_length
    if kind in ("linear", "ntk"):
        return {"rope_type": kind, "factor": s}
    if kind == "dynamic":
        return {"rope_type": "dynamic", "factor": 1.0, "original_max_position_embeddings": t}
    if kind == "yarn":
        return {"rope_type": "yarn", "factor": s, "original_max_position_embeddings": t}
    if kind == "llama3":
        return {"rope_type": "llama3", "factor": s, "original_max_position_embeddings": t,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    if kind == "ntk_alpha":  # Hunyuan's NTK-alpha: the static NTK formula with alpha = s
        return {"rope_type": "ntk_alpha", "alpha": s}
    if kind == "resonance":  # Resonance RoPE: integer wavelengths, no stretch
        return {"rope_type": "resonance"}
    if kind == "resonance_yarn":  # Resonance YaRN: YaRN's frequencies, then rounded
        return {**scaling_block("yarn", s, t, base, rotary_dim), "resonance": True}
    if kind in ("longrope", SEARCHED):  # (a searched row's stand-in: the shape its search's block has)
        pairs = rotary_dim // 2
        wavelengths = [2 * math.pi * base ** (2 * k / rotary_dim) for k in range(pairs)]
        return {"rope_type": "longrope", "factor": s, "original_max_position_embeddings": t,
                "short_factor": [1.0] * pairs, "long_factor": [1.0 if w <= t else s for w in wavelengths]}
    raise ValueError(f"not a scaling: {kind!r}")


def encodings(model: nn.Module) -> list[PositionalEncoding]:
    """The distinct encoding instances of the model's attention layers (one when shared): those of
    its blocks for posenc's :class:`~posenc.model.lm.LM`, else every
    :class:`~posenc.encodings.base.PositionalEncoding` module it holds (a ``transformers`` model
    after ``posenc.hf.use``, whose encodings sit in ``posenc_encodings``)."""
    seen: dict[int, PositionalEncoding] = {}
    if isinstance(model, LM):
        for attn in model.attentions():
            seen.setdefault(id(attn.encoding), attn.encoding)
    else:
        for module in model.modules():
            if isinstance(module, PositionalEncoding):
                seen.setdefault(id(module), module)
    return list(seen.values())


@contextlib.contextmanager
def applied(model: nn.Module, row: Row, length: int, train_length: int, searched: Searched | None = None
            ) -> Iterator[dict[str, Any]]:
    """Within the block, ``model`` evaluates as ``row``'s evaluation variant at ``length``; yields
    what was applied (recorded with the row's results). A row without one changes nothing. A
    ``+longrope_searched`` row takes its block from ``searched`` (None: the default rule's block
    of the same shape, as the meta-device checks use)."""
    if row.kind != "eval":
        yield {}
        return
    encs = encodings(model)
    undo: list[tuple[PositionalEncoding, str, Any]] = []
    try:
        if row.eval == "blockwise":
            size = max(1, train_length // 2)
            for enc in encs:
                if hasattr(enc, "block_size"):  # (a schedule's other layers keep their attention)
                    undo.append((enc, "block_size", enc.block_size))
                    setattr(enc, "block_size", size)
            yield {"block_size": size}
        else:
            blocks: list[dict[str, Any]] = []
            for enc in encs:
                if isinstance(enc, RoPE):  # (a schedule's other layers have no rotation to scale)
                    if row.variant == SEARCHED and searched is not None:
                        block = searched(length)
                    else:
                        block = scaling_block(row.variant, length / train_length, train_length, enc.base, enc.rotary_dim)
                    undo.append((enc, "scaling", enc.scaling))
                    enc.set_scaling(block)
                    if block not in blocks:
                        blocks.append(block)
            yield {"scaling": blocks[0] if len(blocks) == 1 else blocks}
    finally:
        for enc, what, old in reversed(undo):
            if what == "scaling" and isinstance(enc, RoPE):
                enc.set_scaling(old)
            else:
                setattr(enc, what, old)


# -- a model rebuilt under another scaling (posenc extend's checkpoints) ------------------------------


def rebuilt(model: LM, **config: Any) -> LM:
    """A new :class:`LM` with ``model``'s config changed by ``config`` and a copy of its weights."""
    out = LM(LMConfig(**{**model.config.to_dict(), **config}))
    out.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def one_encoding(model: LM, option: str, why: str) -> None:
    """Refuses a checkpoint with a layer schedule (extend rebuilds one encoding for every layer).

    Raises:
        UsageError: naming ``option`` and the schedule, with ``why``.
    """
    if getattr(model.config, "schedule", None):
        raise UsageError(f"{option}: posenc extend {why}; this checkpoint has a layer schedule ({model.config.schedule}), "
                         "whose layers would each need their own")


def scaled(model: LM, block: dict[str, Any]) -> LM:
    """A new :class:`LM` with ``model``'s weights and its RoPE under ``block`` (recorded in its config).

    Raises:
        UsageError: a checkpoint with a layer schedule (one scaling for every layer is all extend writes).
    """
    one_encoding(model, "checkpoint", "scales one RoPE shared by every layer")
    return rebuilt(model, encoding_options={**model.config.encoding_options, "scaling": block})


__all__ = ["EXTRA_SCALINGS", "applied", "encodings", "one_encoding", "rebuilt", "scaled", "scaling_block"]
