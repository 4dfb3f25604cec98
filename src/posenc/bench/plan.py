"""Options checked before any work, and the jobs of a table in rounds.

:func:`configure` turns the user's options into a :class:`Config` or raises
:class:`~posenc.errors.UsageError` naming the parameter; :func:`plan` lists the jobs in run order.

Run order. Round after round, every cell of the table runs once: per length and mode, NoPE, every
method with every implementation, and the control (NoPE again). The order of those entries is
rotated from round to round (by len / rounds places), so each method runs early in some rounds and
late in others, and a drift within a round does not favour one method.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from .. import backends
from ..encodings import available, build
from ..errors import UsageError
from .job import BASELINE, POSENC, Job
from .levels import LEVELS
from .levels.base import schedule_of
from .libraries import LIBRARIES, impls

DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16")
SIZE_NAMES = ("dim", "heads", "batch", "depth", "vocab")


@dataclass
class Config:
    """Every option of a ``posenc bench`` run, checked (see :func:`configure`)."""

    level: str
    methods: list[str]  # NoPE first
    lengths: list[int]  # sorted, unique
    modes: list[str]
    compare: list[str] = field(default_factory=list)
    rounds: int = 5
    repeats: int = 3
    warmup: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    backend: str = "auto"
    threads: int | None = None
    timeout: float | None = None
    seed: int = 0
    sizes: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _integer(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UsageError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def configure(
    methods: list[str] | None = None,
    lengths: Sequence[int] = (512, 1024, 2048, 4096),
    level: str = "attention",
    mode: str = "both",
    compare: list[str] | None = None,
    rounds: int = 5,
    repeats: int = 3,
    warmup: int = 1,
    device: str = "cpu",
    backend: str = "auto",
    dtype: str = "float32",
    threads: int | None = None,
    timeout: float | None = None,
    seed: int = 0,
    **sizes: int,
) -> Config:
    """Check every option before any work; ``sizes`` override the level's dim, heads, batch, depth, vocab."""
    if level not in LEVELS:
        raise UsageError(f"level must be one of {list(LEVELS)}, got {level!r}")
    spec = LEVELS[level]
    if mode not in (*spec.modes, "both"):
        raise UsageError(f"mode must be one of {[*spec.modes, 'both']}, got {mode!r}")
    methods = list(available()) if not methods else list(methods)
    for m in methods:
        if m not in available() and "[" not in m:
            raise UsageError(f"methods: unknown encoding {m!r}; available: {', '.join(available())}, "
                             "or a layer schedule such as '3x[rope window=256] 1x[rope]'")
    methods = [BASELINE] + [m for m in dict.fromkeys(methods) if m != BASELINE]  # NoPE is the baseline
    lengths = list(lengths)
    if not lengths:
        raise UsageError("lengths must name at least one sequence length")
    for n in lengths:
        _integer("each of lengths", n)
    for name, value, minimum in (("rounds", rounds, 1), ("repeats", repeats, 1), ("warmup", warmup, 0), ("seed", seed, 0)):
        _integer(name, value, minimum)
    if threads is not None:
        _integer("threads", threads)
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0):
        raise UsageError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if device not in DEVICES:
        raise UsageError(f"device must be one of {list(DEVICES)}, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("device 'cuda' requested but torch.cuda.is_available() is False")
    backends.check_name(backend)
    if dtype not in DTYPES:
        raise UsageError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    unknown = sorted(set(sizes) - set(SIZE_NAMES))
    if unknown:
        raise UsageError(f"unknown size option(s) {unknown}; accepted: {', '.join(SIZE_NAMES)}")
    full = dict(spec.sizes) | {k: v for k, v in sizes.items() if v is not None}
    for name in SIZE_NAMES:
        _integer(name, full[name])
    if full["dim"] % full["heads"]:
        raise UsageError(f"dim ({full['dim']}) must be divisible by heads ({full['heads']})")
    head_dim = full["dim"] // full["heads"]
    for m in methods:  # every method at these sizes, before any job (meta device: no memory)
        try:
            schedule = schedule_of(m, full["depth"])  # the attention level's depth is 1: one layer
        except UsageError as err:
            raise UsageError(f"methods: {m!r}: {err} (level {level}, depth {full['depth']})") from None
        layers = [(m, {})] if schedule is None else [(layer.encoding, layer.options) for layer in schedule.layers]
        try:
            with torch.device("meta"):
                for name, options in layers:
                    build(name, num_heads=full["heads"], head_dim=head_dim, **options)
        except (UsageError, ValueError) as err:
            raise UsageError(f"methods: {m} cannot run with dim {full['dim']} and heads {full['heads']} "
                             f"(head dim {head_dim}): {err}") from None
    compare = list(dict.fromkeys(compare or []))
    for c in compare:
        if c not in LIBRARIES:
            raise UsageError(f"compare must name libraries among {list(LIBRARIES)}, got {c!r}")
        if c not in spec.compare:
            able = [name for name, other in LEVELS.items() if c in other.compare]
            raise UsageError(f"compare={c!r} needs level in {able}, got level={level!r}")
        if importlib.util.find_spec(LIBRARIES[c].PACKAGE) is None:
            raise UsageError(f"compare={c!r} needs the {c} package (pip install {c})")
    return Config(
        level=level, methods=methods, lengths=sorted(set(lengths)), modes=list(spec.modes) if mode == "both" else [mode],
        compare=compare, rounds=rounds, repeats=repeats, warmup=warmup, device=device, dtype=dtype, backend=backend,
        threads=threads, timeout=timeout, seed=seed, sizes=full,
    )


def entries(config: Config) -> list[tuple[str, str, bool]]:
    """(method, impl, control) of one length and mode in run order (before rotation).

    The control sits half the list away from NoPE, so its ratio sees the drift between two jobs as
    far apart as a typical method is from its NoPE, not only between neighbours.
    """
    rows = [(m, impl, False) for m in config.methods for impl in [POSENC, *impls(config.compare)]]
    rows.insert((len(rows) + 1) // 2, (BASELINE, POSENC, True))
    return rows


def rotated(items: list, round_: int, rounds: int) -> list:
    """``items`` rotated left by round_ * len / rounds places: positions spread evenly over the rounds."""
    shift = (round_ * len(items)) // rounds % max(len(items), 1)
    return items[shift:] + items[:shift]


def plan(config: Config) -> list[Job]:
    """Every job of the table in run order: rounds, then lengths and modes, then rotated entries."""
    common = dict(
        config.sizes, level=config.level, repeats=config.repeats, warmup=config.warmup, device=config.device,
        dtype=config.dtype, backend=config.backend, threads=config.threads, seed=config.seed,
    )
    table = entries(config)
    jobs = []
    for r in range(config.rounds):
        for n in config.lengths:
            for mode in config.modes:
                for method, impl, control in rotated(table, r, config.rounds):
                    jobs.append(Job(mode=mode, method=method, length=n, impl=impl, control=control, round=r, **common))
    return jobs
