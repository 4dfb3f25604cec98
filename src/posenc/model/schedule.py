"""Layer schedules: per layer, the encoding with its options and the attention kind.

The models of 2025-26 give their layers different positions: Gemma 3 runs five local layers (RoPE
base 1e4, window 1024) for each global one (base 1e6), Llama 4 a NoPE layer with a query
temperature after three chunked RoPE layers, gpt-oss alternates windows of 128 with full layers and
adds sinks. A :class:`Schedule` says this per layer; ``LMConfig(schedule=...)`` builds it.

Text form (for the CLI and study rows), a pattern of groups repeated to the model's depth, the last
repetition cut short where the depth is not a multiple of the pattern::

    3x[rope:base=1e4 window=64] 1x[nope]             # 3 local RoPE layers, then a global NoPE layer
    5x[rope:base=10000 window=1024] 1x[rope:base=1e6] # Gemma 3
    3x[rope:layout=interleaved chunk=8192] 1x[nope temp=0.1/8192]   # Llama 4
    1x[rope window=128 sinks] 1x[rope sinks]         # gpt-oss

A group is ``Nx[LAYER]`` (``Nx`` may be left out for one layer); a LAYER is the method, then
space-separated items: ``KEY=VALUE`` options of the method (also allowed after the method as
``METHOD:KEY=VALUE,KEY=VALUE``, as a study row writes them), and the layer's own keys:

- ``window=W``: sliding window (a causal query at i sees i-W < j <= i; bidirectional |i-j| <= W//2);
- ``chunk=C``: chunked attention (a query sees its chunk of C positions, positions kept global);
- ``sinks``: one learned sink logit per head (:mod:`posenc.backends.parts.windows`);
- ``temp=A/F`` (Llama 4), ``beta=B/L`` (Ministral 3), ``ssmax=S`` (Scalable-Softmax): a per-query
  scale (:mod:`posenc.encodings.query_scale`).

Values read as true/false, integers, floats (``1e4``), or text; a RoPE scaling block is written
``scaling=TYPE(KEY=VALUE;KEY=VALUE)``, e.g. ``scaling=yarn(factor=32;original_max_position_embeddings=4096)``.
:meth:`Schedule.to_text` writes the shortest repeating pattern in this form (what ``parse`` reads
back to the same layers); :meth:`Schedule.to_list` is the json form an ``LMConfig`` keeps, one dict
per layer, which also holds what the text cannot (LongRoPE's factor lists).

Layers with the same method and options share one encoding instance when the method shares across
layers (T5's table, ALiBi's slopes, RoPE's tables): :attr:`Layer.sharing_key`.

A little over the usual ~300 lines: the text form's reader and writer sit beside the layer they
describe, so that what ``parse`` reads and ``to_text`` writes stay one definition.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from ..encodings import get_class, options_of
from ..encodings.protocol import Embeds, offers
from ..encodings.query_scale import KINDS as SCALE_KINDS
from ..encodings.query_scale import QueryScale, parse_query_scale, query_scale_from_dict
from ..encodings.query_scale import to_dict as scale_to_dict
from ..errors import UsageError, check_window_chunk

LAYER_KEYS = ("window", "chunk", "sinks", *SCALE_KINDS)
_GROUP = re.compile(r"\s*(?:(\d+)\s*x\s*)?\[([^\[\]]*)\]\s*")
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Layer:
    """One layer of a schedule: its encoding, that encoding's options, and its attention kind.

    Args:
        encoding: a registered method name (``posenc.available()``); an absolute method (one with
            ``embed``) cannot be a layer's: it acts on the input, not in a layer.
        options: the method's own options (``posenc.build(encoding, ..., **options)``).
        window: sliding window W, or None. chunk: chunk size C, or None (not both).
        sinks: one learned sink logit per head.
        query_scale: a per-query factor (:mod:`posenc.encodings.query_scale`), or None.

    Raises:
        UsageError: an unknown or absolute method, an option it rejects, a window or chunk that is
            not a positive integer (or both given), ``sinks`` not a bool, or a bad query scale.
    """

    encoding: str = "rope"
    options: dict = field(default_factory=dict)
    window: int | None = None
    chunk: int | None = None
    sinks: bool = False
    query_scale: QueryScale | None = None

    def __post_init__(self) -> None:
        cls = get_class(self.encoding)
        if not isinstance(self.options, dict):
            raise UsageError(f"schedule: options of {self.encoding!r} must be a dict, got {self.options!r}")
        accepted = options_of(cls)
        unknown = sorted(set(self.options) - set(accepted))
        if unknown:
            raise UsageError(f"schedule: encoding {self.encoding!r} has no option(s) {unknown}; accepted: {accepted or 'none'}")
        if offers(cls, Embeds):
            raise UsageError(f"schedule: {self.encoding!r} is an absolute method (it adds to the token embeddings); "
                             "a layer takes an attention-level encoding; use LMConfig(encoding=...) for it")
        check_window_chunk(self.window, self.chunk, "schedule: ")
        if not isinstance(self.sinks, bool):
            raise UsageError(f"schedule: sinks must be true or false, got {self.sinks!r}")
        object.__setattr__(self, "query_scale", query_scale_from_dict(self.query_scale))

    @property
    def kind(self) -> str:
        """'full', 'window' or 'chunk'."""
        return "window" if self.window is not None else "chunk" if self.chunk is not None else "full"

    @property
    def sharing_key(self) -> str:
        """Layers with equal keys may share one encoding instance (method and options)."""
        return self.encoding + json.dumps({k: _canonical(v) for k, v in self.options.items()}, sort_keys=True)

    def to_dict(self) -> dict:
        out: dict = {"encoding": self.encoding}
        if self.options:
            out["options"] = dict(self.options)
        for key in ("window", "chunk"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.sinks:
            out["sinks"] = True
        if self.query_scale is not None:
            out["query_scale"] = scale_to_dict(self.query_scale)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any] | Layer) -> Layer:
        if isinstance(data, Layer):
            return data
        if not isinstance(data, dict) or "encoding" not in data:
            raise UsageError(f"schedule: each layer must be a dict with an 'encoding' key, got {data!r}")
        unknown = sorted(set(data) - {"encoding", "options", "window", "chunk", "sinks", "query_scale"})
        if unknown:
            raise UsageError(f"schedule: unknown layer key(s) {unknown}; accepted: encoding, options, window, chunk, sinks, query_scale")
        options = data.get("options")
        if options is not None and not isinstance(options, dict):
            raise UsageError(f"schedule: the options of layer {data['encoding']!r} must be a dict of KEY: VALUE, "
                             f"got {type(options).__name__} {options!r}")
        return cls(data["encoding"], dict(options or {}), data.get("window"), data.get("chunk"),
                   data.get("sinks", False), data.get("query_scale"))

    def to_text(self) -> str:
        head = self.encoding
        if self.options:
            head += ":" + ",".join(f"{k}={_format(v)}" for k, v in self.options.items())
        items = [head]
        if self.window is not None:
            items.append(f"window={self.window}")
        if self.chunk is not None:
            items.append(f"chunk={self.chunk}")
        if self.query_scale is not None:
            items.append(self.query_scale.to_text())
        if self.sinks:
            items.append("sinks")
        return " ".join(items)


@dataclass(frozen=True)
class Schedule:
    """The layers of a model, in order (see the module docstring)."""

    layers: tuple[Layer, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(Layer.from_dict(layer) for layer in self.layers))
        if not self.layers:
            raise UsageError("schedule: needs at least one layer")

    def __len__(self) -> int:
        return len(self.layers)

    @classmethod
    def parse(cls, text: str, depth: int | None = None) -> Schedule:
        """The schedule a text form describes (see the module docstring), repeated to ``depth``.

        Raises:
            UsageError: text that does not read as groups ``Nx[METHOD KEY=VALUE ...]`` (quoting the
                part it cannot read), a layer :class:`Layer` rejects, or a pattern longer than ``depth``.
        """
        if not isinstance(text, str) or not text.strip():
            raise UsageError(f"schedule: expected a text such as '3x[rope window=64] 1x[nope]', got {text!r}")
        pattern, pos = [], 0
        while pos < len(text):
            m = _GROUP.match(text, pos)
            if not m:
                raise UsageError(f"schedule: cannot read {text[pos:]!r}; a schedule is groups 'Nx[METHOD KEY=VALUE ...]'")
            count = 1 if m.group(1) is None else int(m.group(1))
            if count < 1:
                raise UsageError(f"schedule: a group repeats at least once, got {m.group(0).strip()!r}")
            pattern += [_parse_layer(m.group(2))] * count
            pos = m.end()
        return cls.repeated(pattern, depth)

    @classmethod
    def repeated(cls, pattern, depth: int | None = None) -> Schedule:
        """``pattern`` (layers) repeated to ``depth`` layers, the last repetition cut short."""
        pattern = list(pattern)
        if depth is None:
            return cls(tuple(pattern))
        if len(pattern) > depth:
            raise UsageError(f"schedule: the pattern has {len(pattern)} layers, more than depth={depth}")
        return cls(tuple(pattern[i % len(pattern)] for i in range(depth)))

    @classmethod
    def of(cls, value, depth: int | None = None) -> Schedule:
        """A schedule from its text, its json list (one dict per layer) or itself; ``depth`` checked.

        Raises:
            UsageError: another type, a text or layer that does not parse (see :meth:`parse`), or
                a number of layers other than ``depth``.
        """
        if isinstance(value, Schedule):
            out = value
        elif isinstance(value, str):
            out = cls.parse(value, depth)
        elif isinstance(value, (list, tuple)):
            out = cls(tuple(value))
        else:
            raise UsageError(f"schedule must be a text, a list of layer dicts or a Schedule, got {type(value).__name__}")
        if depth is not None and len(out) != depth:
            raise UsageError(f"schedule has {len(out)} layers; the model's depth is {depth}")
        return out

    @property
    def period(self) -> int:
        """The length of the shortest pattern that repeats (cut at the end) to these layers."""
        n = len(self.layers)
        return next(p for p in range(1, n + 1) if all(self.layers[i] == self.layers[i % p] for i in range(n)))

    def to_text(self) -> str:
        """The shortest repeating pattern, groups of equal layers: ``parse(text, len(self))`` gives it back."""
        groups: list[list] = []
        for layer in self.layers[: self.period]:
            if groups and groups[-1][1] == layer:
                groups[-1][0] += 1
            else:
                groups.append([1, layer])
        return " ".join(f"{n}x[{layer.to_text()}]" for n, layer in groups)

    def to_list(self) -> list[dict]:
        return [layer.to_dict() for layer in self.layers]

    @property
    def shift_invariant(self) -> bool:
        """No layer reads absolute positions: every encoding is shift-invariant and no layer has
        chunks (their boundaries are absolute) or a query scale (a function of the position)."""
        return all(getattr(get_class(layer.encoding), "shift_invariant", False) and layer.chunk is None
                   and layer.query_scale is None for layer in self.layers)


def _canonical(value):
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return repr(value)


def _format(value) -> str:
    """An option's value in the text form, written so that :func:`_value` reads back the same
    value of the same type: ints as digits, floats with a point or an exponent (``8.0``, ``1e4``),
    booleans as true/false, a scaling block as ``TYPE(KEY=VALUE;...)``.

    Raises:
        UsageError: a value the text cannot hold (a list, None, a text that would read as a
            number or a boolean, or one holding the form's separators); the json form (to_list)
            holds them.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value.is_integer() and abs(value) >= 1e4:
            return _exponent(value)
        return repr(value)  # '8.0', '0.1', 'inf': read back as the same float
    if isinstance(value, dict):
        block = dict(value)
        kind = block.pop("rope_type", block.pop("type", "default"))
        if any(isinstance(v, (list, tuple, dict)) for v in block.values()):
            raise UsageError(f"schedule: scaling {value!r} holds a list; only the json form (to_list) can hold it")
        return f"{kind}(" + ";".join(f"{k}={_format(v)}" for k, v in block.items()) + ")"
    if isinstance(value, (list, tuple)):
        raise UsageError(f"schedule: option value {value!r} is a list; only the json form (to_list) can hold it")
    if not isinstance(value, str) or not value or _value(value) != value or re.search(r"[\s,;=()\[\]]", value):
        raise UsageError(f"schedule: option value {value!r} cannot be written in the text form (it would read back "
                         "as another value); only the json form (to_list) can hold it")
    return value


def _exponent(value: float) -> str:
    """10000.0 -> '1e4', 150000.0 -> '1.5e5' (exact: read back as the same float)."""
    exp = int(math.floor(math.log10(abs(value))))
    mantissa = value / 10**exp
    text = f"{mantissa:.15g}e{exp}"
    return text if float(text) == value else repr(value)


def _value(text: str):
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    m = re.fullmatch(r"([A-Za-z0-9_]+)\((.*)\)", text)
    if m:  # a scaling block: TYPE(KEY=VALUE;...)
        block = {"rope_type": m.group(1)}
        for item in filter(None, m.group(2).split(";")):
            key, eq, value = item.partition("=")
            if not eq or not _KEY.match(key):
                raise UsageError(f"schedule: {text!r}: a block is TYPE(KEY=VALUE;KEY=VALUE), got {item!r}")
            if key in block:
                raise UsageError(f"schedule: {text!r}: {key!r} is given twice; a block takes each key once")
            block[key] = _value(value)
        return block
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _split_options(text: str) -> list[str]:
    """'a=1,b=x(c=2;d=3)' -> ['a=1', 'b=x(c=2;d=3)']: commas outside parentheses."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    out.append(text[start:])
    return [item for item in out if item]


def _once(text: str, key: str, options: dict) -> None:
    """A UsageError when the option ``key`` was already given in the layer ``text``."""
    if key in options:
        raise UsageError(f"schedule: [{text}]: {key!r} is given twice; a layer takes each key once")


def _parse_layer(text: str) -> Layer:
    items = text.split()
    if not items:
        raise UsageError("schedule: an empty group '[]'; a layer starts with its method, e.g. [rope window=64]")
    method, _, head_options = items[0].partition(":")
    layer: dict = {"encoding": method, "options": {}, "sinks": False}
    seen: set[str] = set()  # the layer's own keys read so far
    for item in _split_options(head_options):
        key, eq, value = item.partition("=")
        if not eq or not _KEY.match(key):
            raise UsageError(f"schedule: [{text}]: options are KEY=VALUE, got {item!r}")
        _once(text, key, layer["options"])
        layer["options"][key] = _value(value)
    for item in items[1:]:
        key, eq, value = item.partition("=")
        if not _KEY.match(key):
            raise UsageError(f"schedule: [{text}]: cannot read {item!r}")
        if key in SCALE_KINDS and key not in seen and seen & set(SCALE_KINDS):
            raise UsageError(f"schedule: [{text}]: one query scale per layer (temp, beta or ssmax)")
        if key in seen:
            raise UsageError(f"schedule: [{text}]: {key!r} is given twice; a layer takes each key once")
        seen.add(key)
        if key == "sinks" and not eq:
            layer["sinks"] = True
        elif not eq:
            raise UsageError(f"schedule: [{text}]: {item!r} needs a value (KEY=VALUE); the one flag is 'sinks'")
        elif key in ("window", "chunk"):
            number = _value(value)
            if isinstance(number, bool) or not isinstance(number, int):
                raise UsageError(f"schedule: [{text}]: {key} must be a positive integer, got {value!r}")
            layer[key] = number
        elif key in SCALE_KINDS:
            layer["query_scale"] = parse_query_scale(key, value)
        else:
            _once(text, key, layer["options"])
            layer["options"][key] = _value(value)
    return Layer.from_dict(layer)


__all__ = ["LAYER_KEYS", "Layer", "Schedule"]
