"""What a study is: :class:`StudyConfig` and the presets it starts from.

``PRESETS`` is the one place where sizes are chosen. :class:`StudyConfig`'s size fields take their
defaults from ``PRESETS["default"]``, the command line derives its options (names, types, help,
per-preset defaults) from the fields below, and the tests read the presets from here too. Fields
that do not depend on the preset (optimizer details, seed, evaluation mode) have their one default
on the field itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..encodings import available
from ..errors import UsageError
from .data import DEFAULT_VALID_BYTES
from .rows import NATIVE, ROPE_VARIANTS, SCALINGS, SEARCHED, Row, expand, parse

# The classic line of methods, and the rows that only evaluate a trained RoPE model differently.
CLASSIC = ["nope", "sinusoidal", "learned", "shaw", "transformer_xl", "t5", "rope", "alibi"]
ROPE_SCALINGS = [f"rope+{s}" for s in SCALINGS]
MODERN = ["xpos", "xpos+blockwise", "kerple", "sandwich", "fire", "cope", "deberta", "fox", "pope", "inkling", "dpb",
          "rope", "rope+random", "rope+drop", "alibi", "nope"]
# The recall task asks the classic line and RoPE's scalings, and the two training protocols whose papers
# claim longer reach (DroPE, randomized positions).
RECALL = [*CLASSIC, *ROPE_SCALINGS, "rope+random", "rope+drop"]

# The layer-schedule question: does a NoPE layer every fourth layer, a sliding window, or
# a local/global split let RoPE run past its training length (64), and at what cost in recall? Rows
# in the schedule text form (posenc.model.schedule), depth 4: RoPE; RoPE + NoPE 3:1 (Llama 4's and
# SmolLM3's interleaving); the same with Llama 4's temperature on the NoPE layer, its floor at a
# quarter of the training length (the scale steps up at the 16th, 32nd, 48th and 64th token, from 1
# to 1.16 in training, and keeps rising past it, 1.42 at 1024, as Llama 4 trains far past its floor of 8192); RoPE with a
# window of half the training length on every layer; Gemma 3's local/global split (3 windowed
# layers of base 1e4, 1 full layer of base 1e6); ALiBi and NoPE as anchors.
SCHEDULES = ["rope", "3x[rope] 1x[nope]", "3x[rope] 1x[nope temp=0.1/16]", "[rope window=32]",
             "3x[rope:base=1e4 window=32] 1x[rope:base=1e6]", "alibi", "nope"]

# The extension question: a RoPE model trained at 64, extended to 256 (4x) by each RoPE
# scaling zero-shot and fine-tuned for about 5% of its pre-training steps (a +ft row each), DroPE
# with the positions dropped after 88% (the paper's), 70% and 50% of the steps, ALiBi and NoPE as
# anchors. LongRoPE twice: the default rule's factors and the factors of LongRoPE's search.
EXTEND = ["rope+linear", "rope+ntk", "rope+yarn", "rope+llama3", "rope+longrope", "rope+longrope_searched", "rope+drop@88",
          "rope+drop@70", "rope+drop@50", "alibi", "nope"]
EXTEND_LENGTHS = [64, 128, 256, 512, 1024, 2048]

# Model and training sizes per preset, and the rows each one studies (named here, not "every
# registered method": a new method must not change what a preset costs). smoke: CI, seconds per
# method, every registered method (so CI trains each new one). default: the README's main job
# (about 11 minutes on 2 CPU cores with --jobs auto, 16 serially). modern: the methods after ALiBi at the default sizes, with
# alibi and nope as anchors. recall: the associative-recall task at a size every method learns in
# a minute or two. paper: the ALiBi paper's setup (train at 512, evaluate to 16x) at a size for one
# GPU.
PRESETS: dict[str, dict[str, Any]] = {
    "smoke": dict(
        task="lm", methods=available(),
        dim=32, depth=2, num_heads=2, train_length=32, eval_lengths=[32, 64, 128], steps=60,
        batch_size=8, lr=1e-2, valid_bytes=4096, checkpoint_every=20,
    ),
    "default": dict(
        task="lm", methods=[*CLASSIC, *ROPE_SCALINGS],
        dim=128, depth=4, num_heads=4, train_length=64, eval_lengths=[64, 128, 256, 512, 1024],
        steps=800, batch_size=32, lr=2e-3, valid_bytes=DEFAULT_VALID_BYTES, checkpoint_every=100,
    ),
    "modern": dict(
        task="lm", methods=list(MODERN),
        dim=128, depth=4, num_heads=4, train_length=64, eval_lengths=[64, 128, 256, 512, 1024],
        steps=800, batch_size=32, lr=2e-3, valid_bytes=DEFAULT_VALID_BYTES, checkpoint_every=100,
    ),
    "recall": dict(
        task="recall", methods=list(RECALL),
        dim=128, depth=2, num_heads=4, train_length=64, eval_lengths=[64, 128, 256, 512],
        steps=1500, batch_size=32, lr=3e-3, valid_bytes=DEFAULT_VALID_BYTES, checkpoint_every=250,
    ),
    # schedules: the SCHEDULES rows at the default sizes, three seeds; run without a task, it is
    # followed by its recall companion (COMPANIONS), the same rows and model at the recall preset's
    # training (1500 steps, lr 3e-3), so one command gives perplexity and recall.
    "schedules": dict(
        task="lm", methods=list(SCHEDULES), seeds=3,
        dim=128, depth=4, num_heads=4, train_length=64, eval_lengths=[64, 128, 256, 512, 1024],
        steps=800, batch_size=32, lr=2e-3, valid_bytes=DEFAULT_VALID_BYTES, checkpoint_every=100,
    ),
    "schedules-recall": dict(
        task="recall", methods=list(SCHEDULES), seeds=3,
        dim=128, depth=4, num_heads=4, train_length=64, eval_lengths=[64, 128, 256, 512, 1024],
        steps=1500, batch_size=32, lr=3e-3, valid_bytes=DEFAULT_VALID_BYTES, checkpoint_every=250,
    ),
    # extend: the EXTEND rows (expanded: with rope and the +ft rows) at the default sizes, three
    # seeds, fine-tuned 40 steps (5% of 800) at 256; run without a task, it is followed by its recall
    # companion (far recall, the recall preset's training: 1500 steps, fine-tuned 75), without the
    # searched LongRoPE rows (the search scores perplexity on text).
    "extend": dict(
        task="lm", methods=expand(EXTEND, True), seeds=3, finetune_steps=40, finetune_length=256,
        dim=128, depth=4, num_heads=4, train_length=64, eval_lengths=list(EXTEND_LENGTHS),
        steps=800, batch_size=32, lr=2e-3, valid_bytes=DEFAULT_VALID_BYTES, checkpoint_every=100,
    ),
    "extend-recall": dict(
        task="recall", methods=expand([r for r in EXTEND if SEARCHED not in r], True), seeds=3, finetune_steps=75,
        finetune_length=256,
        dim=128, depth=4, num_heads=4, train_length=64, eval_lengths=list(EXTEND_LENGTHS),
        steps=1500, batch_size=32, lr=3e-3, valid_bytes=DEFAULT_VALID_BYTES, checkpoint_every=250,
    ),
    "paper": dict(
        task="lm", methods=[*CLASSIC, *ROPE_SCALINGS],
        dim=512, depth=8, num_heads=8, train_length=512, eval_lengths=[512, 1024, 2048, 4096, 8192],
        steps=5000, batch_size=32, lr=1e-3, valid_bytes=4 * DEFAULT_VALID_BYTES, checkpoint_every=250,
    ),
}
PRESET_DESCRIPTIONS = {
    "smoke": "CI, seconds",
    "default": "the main job, ~11 min on 2 CPU cores with --jobs auto",
    "modern": "the newer methods, ~20 min a seed on 2 CPU cores",
    "recall": "associative recall, ~15 min a seed on 2 CPU cores",
    "schedules": "layer schedules, 3 seeds, then its recall half: ~6-7 h on 2 CPU cores (21 runs of ~6 min, then 21 of ~12)",
    "schedules-recall": "the recall half of schedules alone",
    "extend": "context extension 64 -> 256: scalings zero-shot and fine-tuned, DroPE, anchors; 3 seeds, then its recall half",
    "extend-recall": "the recall half of extend alone",
    "paper": "train at 512, test to 16x, a GPU",
}
# A preset run without a task that is followed by a recall study of the same rows (one command,
# perplexity and recall): the first into OUT/lm, the companion into OUT/recall (PAIR_PARTS), each
# half given only the options of its task.
COMPANIONS = {"schedules": "schedules-recall", "extend": "extend-recall"}
PAIR_PARTS = ("lm", "recall")
LM_ONLY = ("data", "valid_bytes", "sliding", "pack_documents")  # options that only the lm task reads
RECALL_ONLY = ("recall_sequences",)  # and only the recall task
TASKS = ("lm", "recall")
MAX_RECALL_BYTES = 2**30  # one recall evaluation set or training batch of int64 tokens
DROP_DEFAULT = 0.12  # DroPE's share of training without positions
# Randomized positions draw from [0, RANDOM_SPAN x the longest evaluation length): the authors' code
# draws from 2048 positions for test lengths up to 500 (Ruoss et al. 2023), about four times.
RANDOM_SPAN = 4

# CPU threads per preset when the command line is not told: a smoke-sized model gains nothing from
# more than one, and several threads on a busy machine cost it 10x (threads wait for each other).
PRESET_THREADS = {"smoke": 1}

_DEFAULT = PRESETS["default"]


def _sized(name: str, help: str, **meta: Any) -> Any:
    """A field whose default is the default preset's value (the other presets differ)."""
    value = _DEFAULT[name]
    if isinstance(value, list):
        return field(default_factory=lambda: list(value), metadata={"help": help, "preset": True, **meta})
    return field(default=value, metadata={"help": help, "preset": True, **meta})


def _plain(default: Any, help: str, **meta: Any) -> Any:
    if callable(default):
        return field(default_factory=default, metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


@dataclass(frozen=True)
class StudyConfig:
    """Everything that determines a study's numbers (``methods`` aside, each method is independent).

    The metadata of each field is its documentation: ``help`` is the command line's help text,
    ``preset`` marks a field whose default differs between presets, ``metavar`` names its value.
    """

    preset: str = _plain("default", "starting sizes, one of PRESETS")
    task: str = _sized("task", "lm: perplexity of text; recall: accuracy of associative recall by distance",
                       choices=TASKS)
    methods: list[str] = _sized("methods", "rows to study: METHOD[:KEY=VALUE,...][+VARIANT...] (see posenc.study.rows)",
                                metavar="METHOD")
    data: str = _plain("default", "'default' (Python stdlib source), a text file or folder, or hf:NAME[:CONFIG]")
    dim: int | None = _sized("dim", "model width (not with hf_config: the file sets it)")
    depth: int | None = _sized("depth", "layers (not with hf_config)")
    num_heads: int | None = _sized("num_heads", "attention heads (not with hf_config)")
    train_length: int = _sized("train_length", "training sequence length in bytes")
    eval_lengths: list[int] = _sized("eval_lengths", "evaluation window lengths", metavar="L")
    steps: int = _sized("steps", "training steps per method")
    batch_size: int = _sized("batch_size", "sequences per step (split across processes under torchrun)")
    lr: float = _sized("lr", "peak AdamW learning rate (linear warmup, cosine decay)")
    warmup: int | None = _plain(None, "warmup steps (default: a tenth of the steps)")
    min_lr_ratio: float = _plain(0.1, "final learning rate as a fraction of lr")
    weight_decay: float = _plain(0.1, "AdamW weight decay of the weight matrices")
    grad_clip: float = _plain(1.0, "gradient norm clip")
    seed: int = _plain(0, "seed for initial weights and data order")
    valid_bytes: int = _sized("valid_bytes", "validation tokens scored at every length")
    sliding: int | None = _plain(None, "sliding-window evaluation with this stride (default: non-overlapping)",
                                 metavar="STRIDE")
    device: str = _plain("cpu", "cpu or cuda (command line default: cuda when available)")
    checkpoint_every: int = _sized("checkpoint_every", "steps between resumable checkpoints")
    seeds: int = _plain(1, "train every row this many times (seed, seed+1, ...): mean and spread across seeds")
    drop_positions_after: float | None = _plain(
        None, f"METHOD+drop rows train their last FRACTION of steps without positions (default {DROP_DEFAULT})",
        metavar="FRACTION")
    random_positions: int | None = _plain(
        None, "METHOD+random rows train and are evaluated on sorted random positions from [0, L_MAX) "
        f"(default: {RANDOM_SPAN} x the longest eval length, the paper's ratio)", metavar="L_MAX")
    finetune_steps: int = _plain(0, "fine-tune each rope scaling row this many steps at finetune_length, "
                                    "as a +ft row (PI/YaRN protocol; 0: off)")
    finetune_length: int | None = _plain(None, "fine-tuning length of +ft rows (default: twice train_length)")
    recall_sequences: int = _plain(64, "recall task: evaluation sequences per length and distance")
    hf_config: str | None = _plain(
        None, "a transformers config.json whose model_type is one of posenc.hf's causal families (posenc.hf.SUPPORTED: llama, "
        "mistral, qwen2, gemma3_text, ...): every row trains "
        "AutoModelForCausalLM.from_config(FILE) from random weights with posenc.hf.use(model, METHOD) (the row hf: "
        "the model's own attention, untouched); the sizes come from the file, so leave out dim, depth and num_heads; "
        "vocab_size must be >= 256 (bytes; 256 when the file has none); see docs/hf.md", metavar="FILE")
    pack_documents: bool = _plain(False, "lm task: each file of the corpus is a document; training windows that span "
                                         "files are packed rows (document_ids: no attention across files, no target "
                                         "across a boundary)")

    @classmethod
    def from_preset(cls, preset: str = "default", **overrides: Any) -> "StudyConfig":
        """The preset's sizes, then ``overrides`` (None values are ignored).

        Raises:
            UsageError: ``preset`` is not one of :data:`PRESETS` (listing them).
        """
        if preset not in PRESETS:
            raise UsageError(f"preset must be one of {list(PRESETS)}, got {preset!r}")
        values = {**PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None}}
        return cls(preset=preset, **values)

    def __post_init__(self) -> None:
        """Every value checked, once, as the config is made (UsageError naming the parameter), and
        the config put in its normal form: ``warmup`` filled in, ``eval_lengths`` sorted, ``methods``
        expanded with the rows they need (:func:`.rows.expand`), parsed once into :attr:`rows`, and
        the sizes None with ``hf_config``. What needs the model builders as well (every row built on
        the meta device, and whether an option that only some rows read has such a row in the
        study) is checked by the plan (:func:`posenc.study.plan.check`).

        Raises:
            UsageError: for any unusable value, naming the field and what it accepts.
        """
        if self.warmup is None and isinstance(self.steps, int):
            self._set("warmup", self.steps // 10)
        if self.preset not in PRESETS:
            raise UsageError(f"preset must be one of {list(PRESETS)}, got {self.preset!r}")
        if not self.methods:
            raise UsageError("methods must name at least one encoding")
        if self.task not in TASKS:
            raise UsageError(f"task must be one of {list(TASKS)}, got {self.task!r}")
        parsed = [parse(m) for m in self.methods]  # unknown methods, options and variants
        if len(set(self.methods)) != len(self.methods):
            raise UsageError(f"methods has duplicates: {self.methods}")
        sizes = ("dim", "depth", "num_heads")
        if self.hf_config is not None:
            self._validate_hf_sizes(sizes)
            scheduled = [r.name for r in parsed if r.schedule is not None]
            if scheduled:
                raise UsageError(f"methods: {scheduled[0]!r} is a layer schedule, a row of posenc's own model; with "
                                 "hf_config every layer of the transformers model takes one method (posenc.hf.use)")
        else:
            native = [r.name for r in parsed if r.method == NATIVE]
            if native:
                raise UsageError(f"methods: {native[0]!r} is the own attention of a transformers model; it needs "
                                 "hf_config (a config.json to build the model from)")
        for name in (*(() if self.hf_config is not None else sizes), "train_length", "steps", "batch_size", "valid_bytes", "checkpoint_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise UsageError(f"{name} must be an integer >= 1, got {v!r}")
        if not self.eval_lengths:
            raise UsageError("eval_lengths must list at least one length")
        for n in self.eval_lengths:
            if not isinstance(n, int) or n < 1:
                raise UsageError(f"eval_lengths must be integers >= 1, got {n!r}")
        if self.sliding is not None and not 1 <= self.sliding <= min(self.eval_lengths):
            raise UsageError(f"sliding stride must be between 1 and the smallest of eval_lengths "
                             f"({min(self.eval_lengths)}), got {self.sliding}")
        if not isinstance(self.lr, (int, float)) or not self.lr > 0 or not math.isfinite(self.lr):
            raise UsageError(f"lr must be a positive number, got {self.lr}")
        if not isinstance(self.warmup, int) or not 0 <= self.warmup < self.steps:
            raise UsageError(f"warmup must be an integer in [0, steps={self.steps}), got {self.warmup}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise UsageError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay < 0:
            raise UsageError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if not self.grad_clip > 0:
            raise UsageError(f"grad_clip must be > 0, got {self.grad_clip}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise UsageError(f"seed must be an integer >= 0, got {self.seed!r}")
        self._validate_rows(parsed)
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise UsageError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise UsageError("device 'cuda' was asked for but torch sees no CUDA device; use device 'cpu'")
        self._set("eval_lengths", sorted(set(self.eval_lengths)))
        self._set("methods", expand(self.methods, self.finetune_steps > 0))
        self._set("_rows", tuple(parse(m) for m in self.methods))
        stems: dict[str, str] = {}
        for row in self.rows:
            other = stems.setdefault(row.stem, row.name)
            if other != row.name:
                raise UsageError(f"methods: {other!r} and {row.name!r} would share the file name {row.stem!r}; "
                                 "write them apart (or give one of them once)")

    @property
    def rows(self) -> tuple[Row, ...]:
        """The rows of ``methods`` (expanded), parsed once, when the config was made."""
        rows: tuple[Row, ...] = self.__dict__["_rows"]  # set by __post_init__; not a field (not a key of the file)
        return rows

    def _set(self, name: str, value: Any) -> None:
        """Put a field in its normal form while the (frozen) config is made."""
        object.__setattr__(self, name, value)

    def _validate_hf_sizes(self, sizes: tuple[str, ...]) -> None:
        """With hf_config the model's sizes come from the file: a size set to anything but the
        preset's value (the command line refuses the options even then) is a UsageError, and the
        fields become None, so results.json does not show sizes the model does not have."""
        if not isinstance(self.hf_config, str) or not self.hf_config:
            raise UsageError(f"hf_config must be the path of a config.json, got {self.hf_config!r}")
        given = [n for n in sizes if getattr(self, n) is not None and getattr(self, n) != PRESETS[self.preset][n]]
        if given:
            raise UsageError(f"{given[0]}: the model's sizes come from hf_config ({self.hf_config}: hidden_size, "
                             f"num_hidden_layers, num_attention_heads); leave out {' and '.join(given)}")
        for n in sizes:
            self._set(n, None)

    def _validate_rows(self, parsed: list[Row]) -> None:
        """The options that only some rows read: their values (whether such a row is in the study
        is :meth:`check_applies`'s question)."""
        if not isinstance(self.seeds, int) or self.seeds < 1:
            raise UsageError(f"seeds must be an integer >= 1, got {self.seeds!r}")
        if not isinstance(self.recall_sequences, int) or self.recall_sequences < 1:
            raise UsageError(f"recall_sequences must be an integer >= 1, got {self.recall_sequences!r}")
        if self.task == "recall":
            self._validate_recall()
        if not isinstance(self.pack_documents, bool):
            raise UsageError(f"pack_documents must be true or false, got {self.pack_documents!r}")
        if self.pack_documents and self.task == "recall":
            raise UsageError("pack_documents applies to the lm task (files as documents); the recall task makes its own sequences")
        if self.drop_positions_after is not None and not 0 < self.drop_positions_after < 1:
            raise UsageError(f"drop_positions_after must be a fraction in (0, 1), got {self.drop_positions_after}")
        for r in parsed:
            if "drop" in r.train and not 1 <= self.drop_step_of(r) < self.steps:
                what = (f"+drop@{round(100 * r.drop_after)}" if r.drop_after is not None else
                        f"drop_positions_after={self.drop_fraction}")
                raise UsageError(f"methods: {r.name!r}: {what} of steps={self.steps} leaves no step with positions, or "
                                 "none without; use a fraction nearer 0.5 (or more steps)")
        if self.random_positions is not None and (
                not isinstance(self.random_positions, int) or self.random_positions < max(self.eval_lengths or [0])):
            raise UsageError(f"random_positions must be an integer >= the longest of eval_lengths "
                             f"({max(self.eval_lengths or [0])}), so every evaluated position is a possible training "
                             f"position; got {self.random_positions!r}")
        if not isinstance(self.finetune_steps, int) or self.finetune_steps < 0:
            raise UsageError(f"finetune_steps must be an integer >= 0, got {self.finetune_steps!r}")
        searched = [r.name for r in parsed if r.eval == SEARCHED]
        if searched and (self.task != "lm" or self.hf_config is not None):
            raise UsageError(f"methods: {searched[0]!r}: LongRoPE's search scores perplexity on text with posenc's LM; "
                             "it needs task lm without hf_config")
        explicit_ft = [r.name for r in parsed if r.finetune]
        if explicit_ft and not self.finetune_steps:
            raise UsageError(f"methods {explicit_ft} are fine-tuned rows; give finetune_steps (>= 1)")
        if self.finetune_length is not None:
            if not self.finetune_steps:
                raise UsageError("finetune_length applies to fine-tuned rows; give finetune_steps too")
            if not isinstance(self.finetune_length, int) or self.finetune_length <= self.train_length:
                raise UsageError(f"finetune_length must be an integer above train_length ({self.train_length}), "
                                 f"got {self.finetune_length!r}")

    def check_applies(self, rows: Sequence[Row]) -> None:
        """UsageError for an option that only some rows read when no row of the study reads it.
        ``rows`` are the study's rows: this config's, and on resume the saved study's too (a resume
        that names other rows keeps the options of the rows it does not name).

        Raises:
            UsageError: naming the option and a row that would read it.
        """
        if self.drop_positions_after is not None and not any("drop" in r.train and r.drop_after is None for r in rows):
            raise UsageError("drop_positions_after applies to METHOD+drop rows, and methods has none; "
                             "add one, e.g. rope+drop")
        if self.random_positions is not None and not any("random" in r.train for r in rows):
            raise UsageError("random_positions applies to METHOD+random rows, and methods has none; "
                             "add one, e.g. rope+random")
        if self.finetune_steps and not any(r.eval in ROPE_VARIANTS for r in rows):
            raise UsageError("finetune_steps fine-tunes the rope scaling rows (METHOD+SCALING), and methods has "
                             "none; add one, e.g. rope+yarn")

    def _validate_recall(self) -> None:
        """The recall task generates its sequences: the corpus options do not apply, and its
        evaluation sets (recall_sequences x the longest length, int64) must fit in memory."""
        given = [name for name, unset in (("data", self.data == "default"),
                                          ("valid_bytes", self.valid_bytes == PRESETS[self.preset]["valid_bytes"]),
                                          ("sliding", self.sliding is None)) if not unset]
        if given:
            raise UsageError(f"{given[0]} applies to the lm task (a corpus); the recall task generates its sequences, "
                             f"so leave out {' and '.join(given)}")
        longest = max(self.eval_lengths)
        most = MAX_RECALL_BYTES // (8 * (longest + 1))
        if self.recall_sequences > most:
            raise UsageError(f"recall_sequences must be at most {most} for eval lengths up to {longest} (one "
                             f"evaluation set of int64 tokens must fit in {MAX_RECALL_BYTES >> 30} GiB), "
                             f"got {self.recall_sequences}")
        most = MAX_RECALL_BYTES // (8 * (self.train_length + 1))
        if self.batch_size > most:
            raise UsageError(f"batch_size must be at most {most} for the recall task at train_length "
                             f"{self.train_length} (a batch of int64 tokens must fit in {MAX_RECALL_BYTES >> 30} GiB), "
                             f"got {self.batch_size}")

    @property
    def drop_fraction(self) -> float:
        return DROP_DEFAULT if self.drop_positions_after is None else self.drop_positions_after

    @property
    def drop_step(self) -> int:
        """The first step a +drop row trains without positions."""
        return self.steps - round(self.drop_fraction * self.steps)

    def drop_step_of(self, row: Row) -> int:
        """The first step ``row`` (a +drop or +drop@P row) trains without positions."""
        return self.drop_step if row.drop_after is None else round(row.drop_after * self.steps)

    @property
    def ft_length(self) -> int:
        return self.finetune_length or 2 * self.train_length

    def comparable(self) -> dict:
        """The fields a resumed run must share with the original (methods and seeds may be added;
        hf_config's path may change: the file itself is compared by its sha256, see run.py)."""
        d = asdict(self)
        d.pop("methods")
        d.pop("seeds")
        d.pop("hf_config")
        return d
