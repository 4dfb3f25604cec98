"""How a study makes, saves and loads the model of each row.

Two kinds, one interface (:class:`Models`), so that the stages of :mod:`.pipeline` train,
checkpoint and score every row the same way whichever model it is:

- :class:`PosencModels` (the default): posenc's own byte-level decoder, :class:`posenc.LM`, built
  from :func:`lm_config`, saved as posenc checkpoints (:mod:`posenc.model.checkpoint`).
- ``posenc.study.hf_models.HFModels`` (``hf_config`` given): a Hugging Face ``transformers`` architecture
  built from a config file with random weights, posenc's encoding put in with ``posenc.hf.use``.
  It is imported only then: ``transformers`` is an optional extra (``posenc[hf]``).

Every kind builds a trained row's initial model from the seed alone (``initial``), so every row of
a seed starts from the same weights: only the encoding differs. Every kind also checks a row before
anything runs (``check``): its model built on the meta device, its variant applied at every
evaluation length.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import torch

from ..encodings import get_class
from ..encodings.rope import RoPE
from ..errors import UsageError, as_kind
from ..model.checkpoint import load_checkpoint, save_checkpoint
from ..model.lm import LM, LMConfig
from .config import RANDOM_SPAN, StudyConfig
from .rows import Row, fair_options, fair_schedule
from .studied import StudiedModel
from .variants import applied, scaling_block


class Models(Protocol):
    """What the study asks of a kind of model."""

    def check(self, row: Row) -> None:
        """UsageError now, before any file is written, when ``row`` could not be built or evaluated."""

    def build(self, row: Row, scaling: dict[str, Any] | None = None) -> StudiedModel:
        """``row``'s model before training, at the current RNG; a fine-tuned row's under its
        variant's scaling, or under ``scaling`` when given (the block a search found)."""

    def initial(self, row: Row, seed: int) -> StudiedModel:
        """A trained row's model at initialization: the same at every call for this seed."""

    def save(self, model: StudiedModel, path: Path) -> None:
        """Write the final weights of a row to ``path`` (and whatever it needs beside it)."""

    def load(self, path: Path, row: Row, device: torch.device) -> StudiedModel:
        """The model :meth:`save` wrote for ``row``; UsageError naming what does not match."""

    def record(self, model: StudiedModel) -> dict:
        """What the model is, for results.json (``run["model"]``)."""

    def planned(self, row: Row) -> dict:
        """What ``row``'s model would be, without building it (a diverged run's record)."""

    def architecture(self) -> dict | None:
        """The transformers architecture studied (results.json's ``hf``); None for posenc's LM."""


def lm_sizes(cfg: StudyConfig) -> tuple[int, int, int]:
    """(dim, depth, num_heads) of posenc's LM; a study of posenc's LM always has them (only
    hf_config leaves them to its file).

    Raises:
        UsageError: one of them is None (a config with hf_config).
    """
    if cfg.dim is None or cfg.depth is None or cfg.num_heads is None:
        raise UsageError("dim, depth and num_heads: posenc's LM needs all three (only hf_config leaves them out)")
    return cfg.dim, cfg.depth, cfg.num_heads


def _scaled(options: dict, kind: str, factor: float, cfg: StudyConfig, head_dim: int,
            block: dict[str, Any] | None) -> dict:
    """A RoPE layer's ``options`` with ``block`` added, or (None) the scaling block ``kind`` at
    ``factor``, its base and rotated features read from the options and RoPE's declared defaults
    (nothing is built)."""
    if block is None:
        base, rotary_dim = RoPE.geometry(head_dim, options.get("base"), options.get("rotary_dim"), options.get("scaling"))
        block = scaling_block(kind, factor, cfg.train_length, base, rotary_dim)
    return {**options, "scaling": block}


def lm_config(cfg: StudyConfig, row: Row, scaling: dict[str, Any] | None = None) -> LMConfig:
    """The model ``row`` trains (an evaluated row: its base's; a fine-tuned row: the base's with
    the scaling it is fine-tuned under, see :mod:`.variants`, or with ``scaling`` when given: the
    block a search found for a ``+longrope_searched`` row).

    Raises:
        UsageError: from :class:`~posenc.model.lm.LMConfig` for sizes or options it refuses.
    """
    if row.kind != "train":
        base = lm_config(cfg, row.parent)
        if row.kind == "eval":
            return base
        factor = cfg.ft_length / cfg.train_length
        # (LMConfig keeps a schedule as its json list)
        if isinstance(base.schedule, list):  # the scaling on every RoPE layer, from that layer's own base
            layers = [{**layer, "options": _scaled(dict(layer.get("options") or {}), row.variant, factor, cfg, base.head_dim,
                                                   scaling)
                       if issubclass(get_class(layer["encoding"]), RoPE) else dict(layer.get("options") or {})}
                      for layer in base.schedule]
            return LMConfig(**{**base.to_dict(), "schedule": layers})
        options = _scaled(base.encoding_options, row.variant, factor, cfg, base.head_dim, scaling)
        return LMConfig(**{**base.to_dict(), "encoding_options": options})
    dim, depth, heads = lm_sizes(cfg)
    extra: dict[str, Any] = {}
    if "random" in row.train:
        extra["random_positions"] = cfg.random_positions or RANDOM_SPAN * max(cfg.eval_lengths)
    if row.schedule is not None:
        layers = fair_schedule(row, cfg.train_length, depth)
        bounded = any(not get_class(layer["encoding"]).extrapolates for layer in layers)
        return LMConfig(schedule=layers, dim=dim, depth=depth, num_heads=heads,
                        max_positions=cfg.train_length if bounded else None, **extra)
    options = fair_options(row, cfg.train_length)
    # A bounded method (a learned table) gets exactly the training length: the paper's
    # setting, and what makes "cannot run past N" show at the first longer evaluation length.
    bounded = not get_class(row.method).extrapolates
    return LMConfig(
        encoding=row.method, dim=dim, depth=depth, num_heads=heads,
        max_positions=options.get("max_positions", cfg.train_length) if bounded else None,
        encoding_options=options, **extra,
    )


class PosencModels:
    """posenc's :class:`~posenc.model.lm.LM`, as :func:`lm_config` describes each row."""

    def __init__(self, cfg: StudyConfig) -> None:
        self.cfg = cfg

    def check(self, row: Row) -> None:
        """Its model (dim/heads combination, every encoding option) built on the meta device (no
        memory), and its evaluation variant applied at every evaluation length.

        Raises:
            UsageError: ``methods: 'ROW': ...`` naming what cannot be built or applied.
        """
        try:
            config = lm_config(self.cfg, row)  # dim/heads combination, encoding options
            with torch.device("meta"):
                model = LM(config)
                for length in self.cfg.eval_lengths:
                    with applied(model, row, length, self.cfg.train_length):
                        pass
        except UsageError as err:
            raise UsageError(f"methods: {row.name!r}: {err}") from None
        except (ValueError, TypeError) as err:
            raise UsageError(f"methods: {row.name!r}: {err}") from None

    def build(self, row: Row, scaling: dict[str, Any] | None = None) -> LM:
        return LM(lm_config(self.cfg, row, scaling))

    def initial(self, row: Row, seed: int) -> LM:
        torch.manual_seed(seed)
        return self.build(row)

    def save(self, model: StudiedModel, path: Path) -> None:
        save_checkpoint(as_kind(model, LM), path)

    def load(self, path: Path, row: Row, device: torch.device) -> LM:
        return load_checkpoint(path, device)

    def record(self, model: StudiedModel) -> dict:
        return as_kind(model, LM).config.to_dict()

    def planned(self, row: Row) -> dict:
        return lm_config(self.cfg, row).to_dict()

    def architecture(self) -> None:
        return None


def models_for(cfg: StudyConfig) -> Models:
    """The kind of model ``cfg`` studies: a transformers architecture with ``hf_config``, else posenc's LM."""
    if cfg.hf_config is None:
        return PosencModels(cfg)
    study = hf_study()
    return study.HFModels(cfg, study.check(cfg))  # the file, its family and vocab, checked now


def checked_models(cfg: StudyConfig) -> Models:
    """The model builder of ``cfg`` (:func:`models_for`), once every row of ``cfg`` is known to build
    (on the meta device) and to take its variant at every evaluation length.

    Raises:
        UsageError: naming the row (an ``hf_config`` file: the file) that cannot be used.
    """
    models = models_for(cfg)
    for row in cfg.rows:
        models.check(row)
    return models


def hf_study() -> ModuleType:
    """The module :mod:`posenc.study.hf_models`, imported now (it needs ``transformers``).

    Raises:
        UsageError: Hugging Face transformers (>= 5) is not installed.
    """
    try:
        from . import hf_models as study
    except ImportError:
        raise UsageError("hf_config needs Hugging Face transformers >= 5 (pip install 'posenc[hf]')") from None
    return study


__all__ = ["Models", "PosencModels", "checked_models", "hf_study", "lm_config", "lm_sizes", "models_for"]
