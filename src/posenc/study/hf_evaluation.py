"""The study's evaluation (:func:`posenc.study.evaluation.evaluate`) for a Hugging Face causal LM.

The model is scored on byte windows exactly as the study scores posenc's own models: every
validation target once, in non-overlapping windows of each length (or sliding ones with
``stride``), mean NLL, perplexity and bits per byte. The model's vocabulary must cover the 256 byte
values (token id = byte value), as for a model trained on posenc's corpora.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from ..errors import UsageError
from . import distributed
from .evaluation import evaluate as study_evaluate


@dataclass(frozen=True)
class _HeadCount:
    """The config the study's evaluation reads: the query heads (to size its batches)."""

    num_heads: int


class _Logits(nn.Module):
    """What the study's evaluation reads from a model: ``model(ids) -> logits`` and
    ``config.num_heads`` (to size its batches)."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model
        self.config = _HeadCount(num_heads=int(model.config.num_attention_heads))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids, use_cache=False).logits


def evaluate(model: PreTrainedModel, valid: torch.Tensor, lengths: Iterable[int], *,
             stride: int | None = None) -> dict[int, dict[str, Any]]:
    """{length: the study's result (loss, perplexity, bits_per_byte, tokens, windows)} for an HF
    causal LM on ``valid`` (uint8 bytes, inputs and the targets they predict) at each length.

    Raises:
        UsageError: the model's ``vocab_size`` is below 256 (the evaluation's tokens are bytes).
    """
    if getattr(model.config, "vocab_size", 0) < 256:
        raise UsageError(f"model: the byte evaluation needs vocab_size >= 256, got {getattr(model.config, 'vocab_size', None)}")
    device = next(model.parameters()).device
    ctx = distributed.Context(device)
    view = _Logits(model)
    was_training = model.training
    try:
        return {int(length): study_evaluate(view, valid, int(length), stride, ctx) for length in lengths}
    finally:
        model.train(was_training)


__all__ = ["evaluate"]
