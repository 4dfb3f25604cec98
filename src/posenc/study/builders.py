"""How a study makes, saves and loads the model of each row.

Two kinds, one interface (:class:`Models`), so that :mod:`.execute` trains, checkpoints and
evaluates every row the same way whichever model it is:

- :class:`PosencModels` (the default): posenc's own byte-level decoder, :class:`posenc.LM`, built
  from :meth:`StudyConfig.lm_config`, saved as posenc checkpoints (:mod:`posenc.checkpoint`).
- ``posenc.hf.study.HFModels`` (``hf_config`` given): a Hugging Face ``transformers`` architecture
  built from a config file with random weights, posenc's encoding put in with ``posenc.hf.use``.
  It is imported only then: ``transformers`` is an optional extra (``posenc[hf]``).

Every kind builds a trained row's initial model from the seed alone (``initial``), so every row of
a seed starts from the same weights: only the encoding differs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from ..checkpoint import load_checkpoint, save_checkpoint
from ..errors import UsageError
from ..model import LM
from .config import StudyConfig


class Models(Protocol):
    """What the study asks of a kind of model."""

    def build(self, name: str) -> nn.Module:
        """Row ``name``'s model before training (a fine-tuned row: with its scaling), at the current RNG."""

    def initial(self, name: str, seed: int) -> nn.Module:
        """A trained row's model at initialization: the same at every call for this seed."""

    def save(self, model: nn.Module, path: Path) -> None:
        """Write the final weights of a row to ``path`` (and whatever it needs beside it)."""

    def load(self, path: Path, name: str, device: torch.device) -> nn.Module:
        """The model :meth:`save` wrote for row ``name``; UsageError naming what does not match."""

    def record(self, model: nn.Module) -> dict:
        """What the model is, for results.json (``run["model"]``)."""

    def planned(self, name: str) -> dict:
        """What row ``name``'s model would be, without building it (a diverged run's record)."""


class PosencModels:
    """posenc's :class:`~posenc.model.LM`, as :meth:`StudyConfig.lm_config` describes each row."""

    def __init__(self, cfg: StudyConfig) -> None:
        self.cfg = cfg

    def build(self, name: str) -> LM:
        return LM(self.cfg.lm_config(name))

    def initial(self, name: str, seed: int) -> LM:
        torch.manual_seed(seed)
        return self.build(name)

    def save(self, model: LM, path: Path) -> None:
        save_checkpoint(model, path)

    def load(self, path: Path, name: str, device: torch.device) -> LM:
        return load_checkpoint(path, device)

    def record(self, model: LM) -> dict:
        return model.config.to_dict()

    def planned(self, name: str) -> dict:
        return self.cfg.lm_config(name).to_dict()


def models_for(cfg: StudyConfig) -> Models:
    """The kind of model ``cfg`` studies: a transformers architecture with ``hf_config``, else posenc's LM."""
    if cfg.hf_config is None:
        return PosencModels(cfg)
    return hf_study().HFModels(cfg)


def hf_study():
    """The module :mod:`posenc.hf.study`, imported now (it needs ``transformers``)."""
    try:
        from ..hf import study
    except ImportError:
        raise UsageError("hf_config needs Hugging Face transformers >= 5 (pip install 'posenc[hf]')") from None
    return study


__all__ = ["Models", "PosencModels", "hf_study", "models_for"]
