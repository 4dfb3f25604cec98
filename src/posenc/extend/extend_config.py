"""What one ``posenc extend`` run reads besides the checkpoint: :class:`ExtendConfig`, every field
checked when it is made, and the fine-tune's training settings it gives (:mod:`.extend` runs it).
"""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import dataclass, field
from typing import Any

from ..encodings import available, get_class
from ..encodings.protocol import Remaps, offers
from ..errors import UsageError
from ..study.data import DEFAULT_VALID_BYTES
from ..study.longrope_search import SearchSettings
from ..study.plan import FINETUNE_STREAM
from ..study.train import RECALIBRATION_WARMUP, TrainSettings

KINDS = ("linear", "ntk", "yarn", "llama3", "longrope", "ntk_alpha", "resonance", "resonance_yarn", "drope")

# A remap keeps the model's own RoPE: these options are the RoPE's, never the remap's.
_ROPE_OPTIONS = ("num_heads", "head_dim", "causal", "base", "layout", "rotary_dim", "scaling", "cache_length")


def remap_names() -> list[str]:
    """The training-free position remaps of RoPE (``posenc.available()`` offering ``Remaps``)."""
    return [n for n in available() if offers(get_class(n), Remaps)]


def parse_remap(spec: str | dict[str, Any]) -> dict[str, Any]:
    """A remap as ``{"name": NAME, "options": {...}}``, from ``"NAME"`` or ``"NAME:KEY=VALUE,KEY=VALUE"``
    (a value is read as JSON when it parses, else as a string) or from such a dict; checked by
    building the encoding.

    Raises:
        UsageError: naming ``remap``: an unknown name or option, an option of the model's RoPE
            (base, layout, rotary_dim, scaling, cache_length: a remap keeps the model's own), or a
            value the method rejects.
    """
    if isinstance(spec, str):
        name, _, rest = spec.strip().partition(":")
        options: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in rest.split(","))):
            key, eq, text = item.partition("=")
            if not eq or not key.strip():
                raise UsageError(f"remap: {spec!r}: options are KEY=VALUE separated by commas (e.g. selfextend:group=4,window=1024)")
            try:
                value = json.loads(text)
            except ValueError:
                value = text
            options[key.strip()] = value
    elif isinstance(spec, dict) and set(spec) <= {"name", "options"} and isinstance(spec.get("options", {}), dict):
        name, options = str(spec.get("name")), dict(spec.get("options", {}))
    else:
        raise UsageError(f"remap: a text NAME[:KEY=VALUE,...] or {{'name': ..., 'options': {{...}}}}, got {spec!r}")
    names = remap_names()
    if name not in names:
        raise UsageError(f"remap: {name!r} is not a position remap; one of {names}")
    cls = get_class(name)
    own = [k for k in inspect.signature(cls.__init__).parameters if k != "self" and k not in _ROPE_OPTIONS]
    for key in options:
        if key in _ROPE_OPTIONS:
            raise UsageError(f"remap: {name} keeps the model's own RoPE; {key!r} is not an option of the remap "
                             f"(its options: {own})")
        if key not in own:
            raise UsageError(f"remap: {name} has no option {key!r}; its options: {own}")
    try:
        cls(1, 2, **options)
    except UsageError as err:
        raise UsageError(f"remap: {name}: {err}") from None
    return {"name": name, "options": options}


def remap_label(remap: dict[str, Any]) -> str:
    """A remap's column name: ``NAME`` and its options, ``selfextend group=4 window=1024``."""
    return " ".join([remap["name"], *(f"{k}={v}" for k, v in remap["options"].items())])


@dataclass(frozen=True)
class ExtendConfig:
    """One extension: what ``extend`` reads besides the checkpoint (every field checked when made).

    Args:
        scaling: one of :data:`KINDS`.
        length: the fine-tuning (target) length.
        steps: fine-tuning steps (0: the scaling zero-shot only, nothing trained).
        train_length: the length the model was trained at (a study's checkpoint: its study's).
        lr: the learning rate (a scaling: held after the warmup; DroPE: the peak).
        batch_size: sequences per step (default: as many tokens as ``tokens_per_step``).
        warmup: warmup steps (default: a tenth of the steps, at least 1).
        longrope: a given ``longrope`` block (``scaling="longrope"``); None: LongRoPE's search finds
            the factors (``search`` its settings, target ``length``), or with ``search=None`` the
            study's default rule (:func:`posenc.study.variants.scaling_block`).
        task: "lm" (perplexity of ``data``) or "recall" (the study's associative recall).
        eval_lengths: the lengths of the before/after table.
        pose: PoSE (Zhu et al. 2024, :mod:`.pose`): the fine-tune trains on windows of
            ``train_length`` whose position ids skip over ``length`` (``pose_chunks`` chunks, each
            example's own), instead of windows of ``length``; the model is the scaling's for
            ``length`` all the same. Not with ``drope`` (no positions) or ``pack_documents``.
        pose_chunks: PoSE's chunks per window, in ``[1, window]`` (the paper's default 2).
        pose_window: PoSE's training window N, in ``[1, train_length]``; None: ``train_length`` (the
            paper trains at the original length; a shorter window costs less per step).
        remaps: training-free position remaps of the model's own RoPE (:func:`parse_remap`: texts
            ``"selfextend:group=4,window=1024"`` or ``{"name", "options"}`` dicts), each a zero-shot
            column of the table: the base model under the remap at every evaluation length.
    """

    scaling: str
    length: int
    steps: int
    train_length: int
    lr: float = 2e-4
    batch_size: int | None = None
    tokens_per_step: int = 2048
    warmup: int | None = None
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    checkpoint_every: int = 100
    seed: int = 0
    data: str = "default"
    valid_bytes: int = DEFAULT_VALID_BYTES
    pack_documents: bool = False
    task: str = "lm"
    recall_sequences: int = 64
    eval_lengths: list[int] = field(default_factory=list)
    longrope: dict[str, Any] | None = None
    search: SearchSettings | None = None
    pose: bool = False
    pose_chunks: int = 2
    remaps: list[Any] = field(default_factory=list)
    pose_window: int | None = None

    def __post_init__(self) -> None:
        if self.scaling not in KINDS:
            raise UsageError(f"scaling must be one of {list(KINDS)}, got {self.scaling!r}")
        for name in ("length", "train_length", "checkpoint_every", "tokens_per_step", "recall_sequences", "valid_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UsageError(f"{name} must be an integer >= 1, got {v!r}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 0:
            raise UsageError(f"steps must be an integer >= 0, got {self.steps!r}")
        if self.length <= self.train_length:
            raise UsageError(f"length must be above train_length ({self.train_length}), got {self.length}")
        if self.batch_size is not None and (isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int)
                                            or self.batch_size < 1):
            raise UsageError(f"batch_size must be an integer >= 1, got {self.batch_size!r}")
        if not isinstance(self.lr, (int, float)) or not math.isfinite(self.lr) or self.lr <= 0:
            raise UsageError(f"lr must be a positive number, got {self.lr!r}")
        if self.warmup is not None and not (isinstance(self.warmup, int) and 0 <= self.warmup <= max(self.steps, 1)):
            raise UsageError(f"warmup must be an integer in [0, steps={self.steps}], got {self.warmup!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise UsageError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.task not in ("lm", "recall"):
            raise UsageError(f"task must be 'lm' or 'recall', got {self.task!r}")
        if self.longrope is not None and self.scaling != "longrope":
            raise UsageError(f"longrope (a given block) applies to scaling longrope, not {self.scaling!r}")
        if self.longrope is not None:
            self._check_longrope(self.longrope)
        if self.search is not None and (self.scaling != "longrope" or self.longrope is not None):
            raise UsageError("search applies to scaling longrope without a given block")
        if self.search is not None and (self.search.target_length, self.search.train_length) != (self.length, self.train_length):
            raise UsageError(f"search: its target_length and train_length ({self.search.target_length}, "
                             f"{self.search.train_length}) must be length and train_length ({self.length}, {self.train_length})")
        if not isinstance(self.pose, bool):
            raise UsageError(f"pose must be True or False, got {self.pose!r}")
        if self.pose_window is not None and (isinstance(self.pose_window, bool) or not isinstance(self.pose_window, int)
                                             or not 1 <= self.pose_window <= self.train_length or not self.pose):
            raise UsageError(f"pose_window must be an integer in [1, train_length={self.train_length}] with pose, "
                             f"got {self.pose_window!r}")
        window = self.train_length if self.pose_window is None else self.pose_window
        if isinstance(self.pose_chunks, bool) or not isinstance(self.pose_chunks, int) or not (
                1 <= self.pose_chunks <= (window if self.pose else self.pose_chunks)):
            raise UsageError(f"pose_chunks must be an integer in [1, window={window}], got {self.pose_chunks!r}")
        if self.pose and self.scaling == "drope":
            raise UsageError("pose: PoSE trains position ids, and drope drops the positions; use another scaling")
        if self.pose and self.pack_documents:
            raise UsageError("pose: PoSE's position ids skip within one window; leave out pack_documents")
        if not isinstance(self.remaps, (list, tuple)):
            raise UsageError(f"remaps must be a list of remaps (NAME:KEY=VALUE,...), got {self.remaps!r}")
        remaps = [parse_remap(r) for r in self.remaps]
        labels = [remap_label(r) for r in remaps]
        if len(set(labels)) != len(labels):
            raise UsageError(f"remap: the same remap twice ({labels})")
        object.__setattr__(self, "remaps", remaps)
        lengths = self.eval_lengths or sorted({self.train_length, self.length, 2 * self.length})
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):
            raise UsageError(f"eval_lengths must be integers >= 1, got {lengths!r}")
        object.__setattr__(self, "eval_lengths", sorted(set(lengths)))

    def _check_longrope(self, block: object) -> None:
        """A given longrope block fits this run: a ``longrope`` block (not another type's), whose
        ``original_max_position_embeddings`` (where the long factors start) is the train length.

        Raises:
            UsageError: not a JSON object, another rope_type, or another original length.
        """
        if not isinstance(block, dict):
            raise UsageError(f"longrope: a block is a JSON object, got {type(block).__name__}")
        kind = block.get("rope_type", block.get("type"))
        if kind != "longrope":
            raise UsageError(f"longrope: the block's rope_type is {kind!r}; --scaling longrope takes a longrope block "
                             "(rope_type 'longrope', short_factor, long_factor, original_max_position_embeddings)"
                             + (f"; for a {kind} block use --scaling {kind}" if kind in KINDS else ""))
        original = block.get("original_max_position_embeddings")
        if original is not None and (isinstance(original, bool) or not isinstance(original, (int, float))
                                     or original != self.train_length):
            raise UsageError(f"longrope: the block's original_max_position_embeddings ({original!r}) must be the train "
                             f"length ({self.train_length}): the long factors apply past it, so a longer one never "
                             "scales the fine-tuning length and a shorter one rescales positions the model was trained at")

    @property
    def factor(self) -> float:
        return self.length / self.train_length

    def settings(self) -> TrainSettings:
        """The fine-tune's training settings (see the module docstring)."""
        window = (self.pose_window or self.train_length) if self.pose else self.length  # PoSE: short windows, positions over length
        size = self.batch_size or max(1, self.tokens_per_step // window)
        common: dict[str, Any] = dict(steps=max(1, self.steps), batch_size=size, length=window, grad_clip=self.grad_clip,
                                      checkpoint_every=self.checkpoint_every, data_seed=self.seed + FINETUNE_STREAM,
                                      min_lr_ratio=self.min_lr_ratio, weight_decay=self.weight_decay)
        if self.scaling == "drope":
            warmup = self.warmup if self.warmup is not None else max(1, round(RECALIBRATION_WARMUP * self.steps))
            return TrainSettings(lr=self.lr, warmup=warmup, drop_at=0, **common)
        warmup = self.warmup if self.warmup is not None else max(1, self.steps // 10)
        return TrainSettings(lr=self.lr, warmup=warmup, constant=True, **common)


__all__ = ["KINDS", "ExtendConfig", "parse_remap", "remap_label", "remap_names"]
