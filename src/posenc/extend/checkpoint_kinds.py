"""The checkpoint :func:`posenc.extend.extend.extend` extends: what it does to the model (scale it,
remap its positions, drop them, train and save the result), as :class:`Checkpoint` says, for
posenc's own checkpoints (:class:`PosencCheckpoint`); :mod:`.extend_hf` has the transformers kind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, cast

import torch

from ..encodings.rope import RoPE
from ..errors import UsageError
from ..model.checkpoint import load_checkpoint, save_checkpoint
from ..model.lm import LM, LMConfig
from ..study.data import Corpus
from ..study.studied import StudiedModel
from ..study.variants import one_encoding, rebuilt, scaled
from .extend_config import ExtendConfig

# -- the model under the scaling -------------------------------------------------------------------


def rope_of(model: LM) -> RoPE:
    """The one RoPE every attention layer of ``model`` shares.

    Raises:
        UsageError: a layer whose encoding is not RoPE.
    """
    encs = {id(a.encoding): a.encoding for a in model.attentions()}
    ropes = [e for e in encs.values() if isinstance(e, RoPE)]
    if not ropes or len(ropes) != len(encs):
        raise UsageError("checkpoint: posenc extend needs a RoPE model (every attention layer RoPE); this one has "
                         f"{sorted({type(e).__name__ for e in encs.values()})}")
    return ropes[0]


def remapped(model: LM, remap: dict[str, Any]) -> LM:
    """A new :class:`LM` with ``model``'s weights and its RoPE (base, layout, rotary dim, scaling)
    under the training-free position remap ``remap`` (``{"name", "options"}``, :func:`.extend_config.parse_remap`).

    Raises:
        UsageError: a checkpoint with a layer schedule.
    """
    one_encoding(model, "remap", "remaps one RoPE shared by every layer")
    rope = rope_of(model)
    own: dict[str, Any] = {"base": rope.base, "layout": rope.layout, "rotary_dim": rope.rotary_dim}
    if rope.scaling.rope_type != "default":
        own["scaling"] = model.config.encoding_options.get("scaling")
    return rebuilt(model, encoding=remap["name"], encoding_options={**model.config.encoding_options, **own, **remap["options"]})


def dropped(model: LM) -> LM:
    """A copy of ``model`` with its positions dropped (DroPE, before the recalibration)."""
    out = rebuilt(model)
    out.drop_positions()
    return out


class PosencCheckpoint:
    """What :func:`extend` does to a posenc checkpoint's model: score it, scale it, drop its
    positions, train and save the result (:mod:`.extend_hf` has the same for a transformers model)."""

    weights = "model.safetensors"

    def __init__(self, base: LM) -> None:
        self.base = base
        self.rope = rope_of(base)
        if self.rope.scaling.rope_type != "default":
            raise UsageError(f"checkpoint: its RoPE already has a {self.rope.scaling.rope_type!r} scaling; extend a "
                             "model trained without one")

    @property
    def device(self) -> torch.device:
        return next(self.base.parameters()).device

    def check(self, cfg: ExtendConfig) -> None:
        """Nothing to refuse beyond the config's own checks."""

    def scaled(self, block: dict[str, Any] | None) -> LM:
        """The base model under ``block`` (None: its positions dropped)."""
        return scaled(self.base, block) if block is not None else dropped(self.base)

    def remapped(self, remap: dict[str, Any]) -> LM:
        """The base model under a position remap of its own RoPE (a zero-shot column)."""
        return remapped(self.base, remap)

    def trainable(self, block: dict[str, Any] | None) -> LM:
        """The model the fine-tune starts from: scaled, or (DroPE) the base, dropped at step 0."""
        if block is not None:
            return scaled(self.base, block)
        fresh = LM(LMConfig(**self.base.config.to_dict()))
        fresh.load_state_dict(self.base.state_dict())
        return fresh

    def searchable(self) -> LM:
        """The model LongRoPE's search scores (it sets each individual's factors, then restores them)."""
        return self.base

    def save(self, model: StudiedModel, out: Path) -> dict[str, Any]:
        save_checkpoint(cast(LM, model), out / self.weights)
        return {"weights": self.weights, "format": "posenc"}

    def load(self, out: Path, saved: dict[str, Any]) -> StudiedModel | None:
        path = out / saved.get("weights", self.weights)
        return load_checkpoint(path, self.device) if path.exists() else None

    def corpus(self, corpus: Corpus) -> Corpus:
        """The data as it is: a posenc model's tokens are bytes."""
        return corpus


class Checkpoint(Protocol):
    """The checkpoint :func:`extend` extends, by kind: :class:`PosencCheckpoint`, or a transformers model
    (:class:`posenc.extend.extend_hf.HFCheckpoint`)."""

    @property
    def base(self) -> StudiedModel: ...
    @property
    def rope(self) -> RoPE: ...
    @property
    def device(self) -> torch.device: ...
    def check(self, cfg: ExtendConfig) -> None: ...
    def scaled(self, block: dict[str, Any] | None) -> StudiedModel: ...
    def remapped(self, remap: dict[str, Any]) -> StudiedModel: ...
    def trainable(self, block: dict[str, Any] | None) -> StudiedModel: ...
    def searchable(self) -> torch.nn.Module: ...
    def save(self, model: StudiedModel, out: Path) -> dict[str, Any]: ...
    def load(self, out: Path, saved: dict[str, Any]) -> StudiedModel | None: ...
    def corpus(self, corpus: Corpus) -> Corpus: ...  # the data in the model's tokens


def is_transformers(checkpoint: Any) -> bool:
    """A transformers model: a ``PreTrainedModel``, a folder ``save_pretrained`` wrote (config.json),
    a GGUF file or a folder holding one."""
    if isinstance(checkpoint, (str, Path)):
        p = Path(checkpoint)
        if p.is_file():
            return p.suffix.lower() == ".gguf"
        return p.is_dir() and ((p / "config.json").is_file() or any(p.glob("*.gguf")))
    return isinstance(checkpoint, torch.nn.Module) and hasattr(checkpoint, "config") and hasattr(checkpoint, "save_pretrained")


__all__ = ["Checkpoint", "PosencCheckpoint", "dropped", "is_transformers", "remapped", "rope_of"]
