"""The rows of a study: what each entry of ``methods`` names, and how it is trained or evaluated.

A row is ``METHOD[:KEY=VALUE,...][+VARIANT...]`` or ``SCHEDULE[+VARIANT...]``:

- ``METHOD`` is a registered encoding; ``KEY=VALUE`` are its own options (``t5:max_distance=128``,
  ``rope:base=500000``), values read as int, float, true/false, or text.
- ``SCHEDULE`` is a layer schedule in the text form of :mod:`posenc.model.schedule`, read by its parser
  (``Schedule.parse``, the one reader of that form): ``3x[rope] 1x[nope temp=0.1/16]`` trains a
  model whose layers follow the pattern, repeated to the study's depth. A row is a schedule when it
  holds ``[``; its name, as written, is its label in every table, and what follows the last ``]``
  is its variants. The fair-table rule applies to each layer's options.
- Training variants, each a training run of its own:
  ``+drop``: positions removed for the last ``drop_positions_after`` of the steps, which recalibrate
  with their own warmup + cosine schedule and no weight decay (DroPE: Gelberg et al. 2025, Sakana
  AI, "Extending the Context of Pretrained LLMs by Dropping their Positional Embeddings"); the
  trained model is then a NoPE model.
  ``+drop@P``: the same with the positions dropped after P% of the steps (P in 1..99), whatever
  ``drop_positions_after`` says: ``rope+drop@70`` trains its last 30% without positions.
  ``+random``: randomized positions in training and evaluation (Ruoss et al. 2023, "Randomized
  Positional Encodings Boost Length Generalization of Transformers"), through
  ``LMConfig.random_positions`` (training) and ``evaluation.eval_positions``.
- Evaluation variants, no training: the base row's trained model evaluated another way.
  ``+linear``, ``+ntk``, ``+dynamic``, ``+yarn``, ``+llama3``, ``+longrope``: a RoPE model under that
  scaling, its factor set from evaluation length / training length (:mod:`.variants`).
  ``+longrope_searched``: LongRoPE with the factors its search finds for this model at each
  evaluation length (:mod:`.longrope_search`, scored on training-split windows, never on the
  validation bytes); its ``+ft`` row fine-tunes under the factors searched for ``finetune_length``.
  ``+blockwise``: an encoding with a ``block_size`` option (xPos) evaluated with blockwise causal
  attention, blocks of half the training length (Sun et al. 2022, §3.3).
- ``+ft`` after a scaling (``rope+yarn+ft``): the PI / YaRN protocol, a short fine-tune of the base
  model at ``finetune_length`` under the scaling, then evaluated (Chen et al. 2023, "Extending Context
  Window of Large Language Models via Positional Interpolation"; Peng et al. 2023, "YaRN").

Which variant applies to which method is decided by what the method is (a RoPE class, an option it
accepts), never by its name.

``hf`` (:data:`NATIVE`) is not an encoding: on a study of a ``transformers`` architecture
(``hf_config``, :mod:`posenc.study.hf_models`) it is the model's own attention, untouched, the baseline of
the posenc rows; it takes no options and no variants, and a study of posenc's own model refuses it.

The fair-table rule (:func:`fair_options`): an option that bounds a relative distance range,
T5's ``max_distance`` (where the last, shared bucket starts) and Shaw's ``max_relative_position``
(the clip), is capped so that the range fits in the training length. Otherwise the entries for
distances longer than any training sequence (T5's last buckets with max_distance 128 at length 64)
never receive a gradient, and at evaluation they decide the bias with their initial values: that
measures the set-up, not the method. A row that sets the option itself (``t5:max_distance=128``,
the paper's setting) keeps it, and the study reports which parameters it used untrained
(:mod:`.fairness`).
"""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass, field, replace

from ..encodings import get_class, options_of
from ..encodings.rope import RoPE
from ..errors import UsageError
from ..model.schedule import Schedule

TRAIN_VARIANTS = ("random", "drop")
SEARCHED = "longrope_searched"  # LongRoPE with the factors of its search (posenc.study.longrope_search)
SCALINGS = ("linear", "ntk", "dynamic", "yarn", "llama3", "longrope")  # the scalings of one formula
ROPE_VARIANTS = (*SCALINGS, SEARCHED)  # every RoPE scaling a row can take (and fine-tune under, +ft)
EVAL_VARIANTS = (*ROPE_VARIANTS, "blockwise")
FINETUNE = "ft"
NATIVE = "hf"  # the row of a transformers model's own attention (hf_config studies only)

# Options bounding a relative distance range, and the largest value that still lets every entry be
# reached by a training sequence of length T (distances 0..T-1).
DISTANCE_BOUNDS = {"max_distance": lambda t: t, "max_relative_position": lambda t: t - 1}

_NAME = re.compile(r"^[a-z0-9_]+$")


def _value(name: str, key: str, text: str) -> bool | int | float | str:
    """An option's value: true/false, an int, a finite float, or the text itself."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        return text
    if not math.isfinite(value):
        raise UsageError(f"methods: {name!r}: option {key} must be a finite number, got {text!r}")
    return value


@dataclass(frozen=True)
class Row:
    """One entry of ``methods``, parsed."""

    name: str
    method: str
    options: dict = field(default_factory=dict)
    train: tuple[str, ...] = ()  # training variants, in order
    eval: str | None = None  # evaluation variant
    finetune: bool = False
    schedule: str | None = None  # a schedule row: its text form, as written (repeated to the depth)
    pattern: Schedule | None = field(default=None, compare=False, repr=False)  # that text, read once
    base_row: Row | None = field(default=None, compare=False, repr=False)  # :attr:`base`, parsed with this row
    drop_after: float | None = None  # ``+drop@P``: positions dropped after P% of the steps (None: the study's)

    @property
    def parent(self) -> Row:
        """The parsed base row of an evaluated or fine-tuned row (:func:`parse` sets it).

        Raises:
            UsageError: for a row without one (a trained row, or one made without :func:`parse`).
        """
        if self.base_row is None:
            raise UsageError(f"methods: {self.name!r} has no parsed base row (a trained row, or not made by rows.parse)")
        return self.base_row

    @property
    def variant(self) -> str:
        """The evaluation variant of an evaluated or fine-tuned row (``eval``, which such a row has).

        Raises:
            UsageError: for a trained row (it has none).
        """
        if self.eval is None:
            raise UsageError(f"methods: {self.name!r} is a trained row: it has no evaluation variant")
        return self.eval

    @property
    def trained(self) -> Row:
        """The row whose training run makes this row's model: itself, or its base's (an evaluated
        row's base is a trained or fine-tuned row; a fine-tuned row trains itself)."""
        return self.parent.trained if self.kind == "eval" else self

    @property
    def ancestor(self) -> Row:
        """The trained-from-scratch row at the root of this one (its initial weights)."""
        return self if self.base_row is None else self.base_row.ancestor

    @property
    def kind(self) -> str:
        """'train' (trained from scratch), 'eval' (a base model evaluated another way) or
        'finetune' (a base model fine-tuned, then evaluated)."""
        if self.finetune:
            return "finetune"
        return "eval" if self.eval else "train"

    @property
    def base(self) -> str | None:
        """The row whose trained model this one starts from (None for a trained row)."""
        if self.kind == "train":
            return None
        if self.schedule is not None:  # (a "+" inside the schedule's text is not a variant)
            return self.schedule + self.name[len(self.schedule):].split("+" + self.variant)[0]
        return self.name.split("+" + self.variant)[0]

    @property
    def stem(self) -> str:
        """A file name for this row (``:`` ``=`` ``,`` would trouble some file systems), never a path:
        a separator in an option value (``t5:x=../..``) becomes ``_``, so a row name read from a file
        cannot point outside its run directory. A schedule row's brackets become parentheses and
        its spaces and any other character outside ``[A-Za-z0-9._()+-]`` ``_``."""
        if self.schedule is not None:
            name = self.name.replace("[", "(").replace("]", ")").replace("=", "-")
            return re.sub(r"[^A-Za-z0-9._()+-]", "_", name)
        return self.name.replace(":", "_").replace("=", "-").replace(",", "_").replace("/", "_").replace("\\", "_")


def parse(name: str) -> Row:
    """The :class:`Row` of a ``methods`` entry, with its base row parsed too (``base_row``): the
    one reader of the row text form; UsageError naming what is wrong."""
    row = _parse(name)
    if row.base is None:
        return row
    return replace(row, base_row=parse(row.base))


def _parse(name: str) -> Row:
    if not isinstance(name, str) or not name:
        raise UsageError(f"methods: each entry must be a method name, got {name!r}")
    if "[" in name:
        return _parse_schedule(name)
    head, *suffixes = name.split("+")
    method, _, opts = head.partition(":")
    if method == NATIVE:
        if opts or suffixes:
            raise UsageError(f"methods: {name!r}: the row {NATIVE} is the model's own attention as its config builds it, "
                             "with no options or variants; for variants use rope (posenc's RoPE with the model's own "
                             "parameters, equal to hf at initialisation), e.g. rope+yarn or rope+drop")
        return Row(name, NATIVE)
    try:
        cls = get_class(method)
    except ValueError as err:
        raise UsageError(f"methods: {err}") from None
    options = {}
    if opts:
        accepted = options_of(cls)
        for item in opts.split(","):
            key, eq, value = item.partition("=")
            if not eq or not _NAME.match(key):
                raise UsageError(f"methods: {name!r}: options are KEY=VALUE separated by commas, got {item!r}")
            if key not in accepted:
                raise UsageError(f"methods: {name!r}: {method} has no option {key!r}; accepted: {accepted or 'none'}")
            if key in options:
                raise UsageError(f"methods: {name!r}: option {key} is given twice; give it once")
            options[key] = _value(name, key, value)
    train, evaluation, finetune = _variants(name, suffixes)
    row = Row(name, method, options, tuple(train), evaluation, finetune, drop_after=_drop_after(name, suffixes))
    _check_applies(row, cls)
    return row


DROP_AT = re.compile(r"^drop@(\d{1,2})$")


def _drop_after(name: str, suffixes: list[str]) -> float | None:
    """The fraction of ``+drop@P`` (P in 1..99: positions dropped after P% of the steps), or None."""
    for s in suffixes:
        match = DROP_AT.match(s)
        if match:
            percent = int(match[1])
            if not 1 <= percent <= 99:
                raise UsageError(f"methods: {name!r}: +drop@P drops the positions after P% of the steps, P in 1..99; "
                                 f"got {percent}")
            return percent / 100
    return None


def _variants(name: str, suffixes: list[str]) -> tuple[list[str], str | None, bool]:
    """(training variants, evaluation variant, fine-tuned) of a row's ``+`` suffixes, in order
    (``drop@P`` is the training variant ``drop``)."""
    train, evaluation, finetune = [], None, False
    for s in suffixes:
        if DROP_AT.match(s):
            s = "drop"
        if s in TRAIN_VARIANTS and evaluation is None and not finetune and s not in train:
            train.append(s)
        elif s in EVAL_VARIANTS and evaluation is None and not finetune:
            evaluation = s
        elif s == FINETUNE and evaluation in ROPE_VARIANTS and not finetune:
            finetune = True
        else:
            order = (f"METHOD[:KEY=VALUE,...][+{'|+'.join(TRAIN_VARIANTS)}|+drop@P][+SCALING|+blockwise]"
                     f"[+{FINETUNE} after a scaling]")
            raise UsageError(f"methods: {name!r}: unknown or misplaced variant {s!r}; a row is {order}, "
                             f"SCALING one of {', '.join(ROPE_VARIANTS)}")
    return train, evaluation, finetune


def _parse_schedule(name: str) -> Row:
    """A schedule row: the text up to its last ``]`` read by ``Schedule.parse``, then variants."""
    end = name.rindex("]") + 1
    text, tail = name[:end], name[end:]
    if tail and not tail.startswith("+"):
        raise UsageError(f"methods: {name!r}: after a schedule's last ']' come its variants (+VARIANT), got {tail!r}")
    try:
        pattern = Schedule.parse(text)
    except UsageError as err:
        raise UsageError(f"methods: {name!r}: {err}") from None
    train, evaluation, finetune = _variants(name, tail.split("+")[1:])
    row = Row(name, pattern.layers[0].encoding, {}, tuple(train), evaluation, finetune, schedule=text, pattern=pattern,
              drop_after=_drop_after(name, tail.split("+")[1:]))
    _check_applies(row, *(get_class(layer.encoding) for layer in pattern.layers))
    return row


def _check_applies(row: Row, *classes: type) -> None:
    """UsageError when a variant cannot apply to the model it would act on: ``classes`` are the
    row's encodings (a schedule's: every layer's; a variant acts on the layers it applies to, and
    at least one must be such a layer)."""
    if row.eval is None:
        return
    what = "no layer of its schedule is" if row.schedule is not None else f"{row.method} is not"
    if "drop" in row.train:
        raise UsageError(f"methods: {row.name!r}: a +drop model has no positions left for +{row.eval} to act on")
    if row.eval in ROPE_VARIANTS and not any(issubclass(cls, RoPE) for cls in classes):
        raise UsageError(f"methods: {row.name!r}: +{row.eval} is a RoPE scaling; {what} a RoPE encoding")
    if row.eval == "blockwise" and not any("block_size" in options_of(cls) for cls in classes):
        what = "no layer of its schedule has one" if row.schedule is not None else f"{row.method} has none"
        raise UsageError(f"methods: {row.name!r}: +blockwise needs an encoding with a block_size option (xpos); {what}")


def fair_options(row: Row, train_length: int) -> dict:
    """The encoding options a row trains with: its own, and every distance bound the method has
    capped at what the training length reaches (see the module docstring). A schedule row has none
    of its own (:func:`fair_schedule` has each layer's), nor has the native row."""
    if row.schedule is not None or row.method == NATIVE:
        return {}
    return _capped(row.method, row.options, train_length)


def fair_schedule(row: Row, train_length: int, depth: int) -> list[dict]:
    """A schedule row's layers at ``depth`` (the json form, one dict per layer), each layer's
    options under the fair-table rule. UsageError when the pattern is longer than ``depth``, or
    for a row that is not a schedule row."""
    if row.pattern is None:
        raise UsageError(f"methods: {row.name!r} is not a schedule row")
    layers = Schedule.repeated(row.pattern.layers, depth).to_list()
    for layer in layers:
        options = _capped(layer["encoding"], layer.get("options") or {}, train_length)
        if options:
            layer["options"] = options
    return layers


def _capped(method: str, given: dict, train_length: int) -> dict:
    cls = get_class(method)
    options = dict(given)
    params = inspect.signature(cls.__init__).parameters
    for key, bound in DISTANCE_BOUNDS.items():
        if key in options or key not in params:
            continue
        default = params[key].default
        if isinstance(default, int) and default > bound(train_length):
            options[key] = max(1, bound(train_length))
    return options


def expand(names: list[str], finetune: bool) -> list[str]:
    """``names`` with the rows they need added: an evaluated or fine-tuned row's base before it,
    and with ``finetune`` each scaling row's ``+ft`` companion after it; order kept, no duplicates."""
    out: list[str] = []

    def add(n: str) -> None:
        if n in out:
            return
        row = parse(n)
        base = row.base
        if base is not None:
            add(base)
            if row.kind == "finetune":  # (a fine-tuned row has a base)
                add(base + "+" + row.variant)
        if n not in out:
            out.append(n)
        if finetune and row.kind == "eval" and row.eval in ROPE_VARIANTS and n + "+" + FINETUNE not in out:
            out.append(n + "+" + FINETUNE)

    for n in names:
        add(n)
    return out


__all__ = ["DISTANCE_BOUNDS", "EVAL_VARIANTS", "FINETUNE", "NATIVE", "ROPE_VARIANTS", "Row", "SCALINGS", "SEARCHED", "TRAIN_VARIANTS", "expand",
           "fair_options", "fair_schedule", "parse"]
