"""LongRoPE's search: per-frequency rescale factors found by an evolutionary search (Ding et al.
2024, "LongRoPE: Extending LLM Context Window Beyond 2 Million Tokens", §3.2, Algorithm 1).

The search space (§3.2, Eq. 3): one rescale factor ``lambda_k`` per rotated pair, the pair's
frequency becoming ``theta_k / lambda_k`` past the original length ``L``, and ``n``, the number of
initial positions left unscaled (they rotate with the trained frequencies). The constraint the
authors' ``dim_mono`` algorithm keeps: ``1 <= lambda_0 <= lambda_1 <= ... <= max_factor``, the
factors non-decreasing over the pairs (low frequencies, which a training sequence never turned
fully, are interpolated at least as much as high ones). The fitness is the perplexity at the target
length on a few validation windows, lower being better.

The algorithm, written here from the paper's description:

1. The first population: the factors of PI (every pair ``s``), NTK (``s^(2k/(r-2))``) and YaRN
   (NTK-by-parts), each read as ``lambda_k = theta_k / theta'_k`` from posenc's own schedules
   (:mod:`posenc.encodings.rope_scaling`), then mutations of them up to ``population``.
2. Each generation: the ``parents`` fittest individuals give ``mutations`` children (each factor
   multiplied by ``exp(step * N(0, 1))`` with probability ``mutation_rate``, ``n`` redrawn from
   ``start_tokens`` with the same probability) and ``crossovers`` children (each pair's factor,
   and ``n``, from one of two parents at random). A child that breaks the constraint is drawn
   again (up to :data:`RETRIES` times), then repaired (clipped, then a running maximum), so no
   evaluated individual breaks it; a child already evaluated is drawn again too.
3. The next population is the ``population`` fittest of the old one and the children.

Every draw of generation ``g`` comes from a generator seeded by ``(seed, g)``, and every evaluated
individual is kept in the state file with its perplexity and generation (written atomically after
each one): a search interrupted and continued (``resume``) evaluates nothing twice and gives the
factors an unbroken one gives, and a search with the same seed gives the same factors. A resumed
generation ``g`` draws its children against what was evaluated before ``g`` only (the state may
hold individuals that the interrupted run evaluated in ``g`` and later), so it draws what the
unbroken search drew.

The result is a Hugging Face ``longrope`` block (:meth:`SearchResult.block`): ``short_factor`` all
1 (the model rotates as trained up to ``L``), ``long_factor`` the best factors,
``original_max_position_embeddings`` ``L``, ``factor`` ``s`` and LongRoPE's attention factor
``sqrt(1 + ln s / ln L)`` (§3.3 of the paper; transformers' default for longrope). That block is
read by :func:`posenc.build` ("rope", ``scaling=``), :func:`posenc.rope_from_hf` and transformers'
``ROPE_INIT_FUNCTIONS["longrope"]``. A search with ``n > 0`` in its best individual has no such
block (transformers' longrope has no unscaled start): :meth:`SearchResult.block` refuses it, and
searching ``n`` is opt-in (``start_tokens``).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..encodings.rope import RoPE, RotaryTable
from ..encodings.rope_frequencies import inverse_frequencies
from ..encodings.rope_scaling import default_frequencies, parse_scaling
from ..errors import UsageError
from ..files import write_json
from ..model.lm import LM
from . import distributed
from .evaluation import evaluate
from .events import Report, SearchScored, ignore
from .variants import encodings

RETRIES = 20  # draws of a child before it is repaired
STATE_FORMAT = "posenc-longrope-search-1"
DIGITS = 4  # factors are rounded to this many decimals (stable keys, exact JSON)


@dataclass(frozen=True)
class SearchSettings:
    """What one search reads besides its model and data.

    Args:
        train_length: L, the length the model was trained at.
        target_length: the length the factors are searched for (``s = target / L``).
        sequences: validation windows of ``target_length`` scored per individual.
        population: individuals kept between generations.
        generations: generations after the first population.
        parents: the fittest individuals that breed each generation.
        mutations, crossovers: children per generation of each kind.
        mutation_rate: the probability that a factor (and ``n``) mutates.
        step: the spread of a mutation in log-factor.
        max_factor: the largest factor (default ``1.25 s``, the paper's upper bound).
        start_tokens: the candidates for ``n`` (default ``(0,)``: not searched).
        seed: the seed of every draw.
    """

    train_length: int
    target_length: int
    sequences: int = 4
    population: int = 16
    generations: int = 8
    parents: int = 4
    mutations: int = 8
    crossovers: int = 4
    mutation_rate: float = 0.3
    step: float = 0.3
    max_factor: float | None = None
    start_tokens: tuple[int, ...] = (0,)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("train_length", "target_length", "sequences", "population", "parents"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UsageError(f"{name} must be an integer >= 1, got {v!r}")
        for name in ("generations", "mutations", "crossovers", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise UsageError(f"{name} must be an integer >= 0, got {v!r}")
        if self.target_length <= self.train_length:
            raise UsageError(f"target_length must be above train_length ({self.train_length}), got {self.target_length}")
        if self.parents > self.population:
            raise UsageError(f"parents must be at most population ({self.population}), got {self.parents}")
        if not 0 <= self.mutation_rate <= 1:
            raise UsageError(f"mutation_rate must be in [0, 1], got {self.mutation_rate}")
        if not 0 < self.step < 10 or not math.isfinite(self.step):
            raise UsageError(f"step must be in (0, 10), got {self.step}")
        if self.max_factor is not None and not (math.isfinite(self.max_factor) and self.max_factor >= self.scale):
            raise UsageError(f"max_factor must be a finite number >= the scale {self.scale:g}, got {self.max_factor}")
        starts = self.start_tokens
        if not starts or any(isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < self.train_length for n in starts):
            raise UsageError(f"start_tokens must be integers in [0, train_length={self.train_length}), got {starts!r}")
        object.__setattr__(self, "start_tokens", tuple(sorted(set(starts))))

    @property
    def scale(self) -> float:
        """s = target_length / train_length."""
        return self.target_length / self.train_length

    @property
    def upper(self) -> float:
        return self.max_factor if self.max_factor is not None else 1.25 * self.scale


@dataclass(frozen=True)
class Individual:
    """One point of the search space: the factors (one per pair) and ``n`` (``start``)."""

    factors: tuple[float, ...]
    start: int = 0

    @property
    def key(self) -> str:
        return json.dumps([self.start, list(self.factors)])


def monotone(factors: Sequence[float], upper: float) -> bool:
    """The search's constraint: ``1 <= f_0 <= f_1 <= ... <= upper``."""
    return all(1.0 <= a <= b for a, b in zip(factors, factors[1:])) and 1.0 <= factors[0] and factors[-1] <= upper


def repaired(factors: Sequence[float], upper: float) -> tuple[float, ...]:
    """``factors`` clipped to [1, upper], rounded, then made non-decreasing (a running maximum)."""
    out, peak = [], 1.0
    for f in factors:
        peak = max(peak, round(min(max(float(f), 1.0), upper), DIGITS))
        out.append(peak)
    return tuple(out)


def seed_factors(kind: str, base: float, rotary_dim: int, train_length: int, scale: float) -> tuple[float, ...]:
    """``lambda_k = theta_k / theta'_k`` of the scaling ``kind`` (linear, ntk, yarn, llama3) at
    ``scale`` for a model trained at ``train_length``, from posenc's own schedules."""
    block: dict[str, Any] = {"rope_type": kind, "factor": scale}
    if kind in ("yarn", "llama3"):
        block["original_max_position_embeddings"] = train_length
    if kind == "llama3":
        block.update(low_freq_factor=1.0, high_freq_factor=4.0)
    theta = default_frequencies(base, rotary_dim)
    scaled, _ = inverse_frequencies(parse_scaling(block), base, rotary_dim)
    return tuple(float(v) for v in (theta / scaled).tolist())


def longrope_block(factors: Sequence[float], train_length: int, scale: float, base: float) -> dict[str, Any]:
    """The Hugging Face ``longrope`` block of ``factors`` (see the module docstring)."""
    return {
        "rope_type": "longrope", "rope_theta": float(base), "short_factor": [1.0] * len(factors),
        "long_factor": [float(f) for f in factors], "original_max_position_embeddings": int(train_length),
        "factor": float(scale), "attention_factor": math.sqrt(1 + math.log(scale) / math.log(train_length)),
    }


class _KeptStart(RotaryTable):
    """A rotary table whose first ``start`` positions rotate with the trained frequencies ``theta``
    and the rest with the scaled ones (LongRoPE's ``n``, Eq. 3)."""

    def __init__(self, inv_freq: torch.Tensor, theta: torch.Tensor, start: int, length: int, device: torch.device) -> None:
        self.theta, self.start = theta.to(torch.float32), start
        super().__init__(inv_freq, length, device)

    def build(self, length: int, device: torch.device) -> None:
        super().build(length, device)
        keep = min(self.start, length)
        positions = torch.arange(keep, dtype=torch.float64, device=device)
        angles = positions[:, None] * self.theta.to(device, torch.float64)[None, :]  # (n, r/2)
        self.cos[:keep], self.sin[:keep] = angles.cos().to(torch.float32), angles.sin().to(torch.float32)


def _ropes(model: nn.Module) -> list[RoPE]:
    ropes = [enc for enc in encodings(model) if isinstance(enc, RoPE)]
    if not ropes:
        raise UsageError("model: LongRoPE's search needs a model with a RoPE encoding (posenc's LM, or a transformers "
                         "model after posenc.hf.use(model, 'rope'))")
    geometry = {(enc.base, enc.rotary_dim) for enc in ropes}
    if len(geometry) > 1:
        raise UsageError(f"model: its RoPE layers differ in base or rotary_dim ({sorted(geometry)}); the search finds one "
                         "set of factors for one geometry")
    return ropes


@contextlib.contextmanager
def _applied(ropes: list[RoPE], block: dict[str, Any], start: int, theta: torch.Tensor, target: int) -> Iterator[None]:
    old = [enc.scaling for enc in ropes]
    try:
        for enc in ropes:
            enc.set_scaling(block)
            if start:  # (posenc's longrope table past L, with its first positions unscaled)
                long, _ = inverse_frequencies(enc.scaling, enc.base, enc.rotary_dim, target)
                enc._long = _KeptStart(long, theta, start, target, enc.inv_freq.device)
        yield
    finally:
        for enc, scaling in zip(ropes, old):
            enc.set_scaling(scaling)


@dataclass
class SearchResult:
    """The search's outcome: the best individual, its perplexity, every evaluated one."""

    settings: SearchSettings
    base: float
    best: Individual
    perplexity: float
    evaluated: list[dict] = field(default_factory=list)  # {"factors", "start", "perplexity", "generation"} in order
    seconds_per_individual: float = 0.0
    baselines: dict[str, float] = field(default_factory=dict)  # the perplexity of each seed (pi, ntk, yarn)

    def block(self) -> dict[str, Any]:
        """The best factors as a Hugging Face ``longrope`` block.

        Raises:
            UsageError: the best individual leaves initial positions unscaled (n > 0), which a
                longrope block cannot say.
        """
        if self.best.start:
            raise UsageError(f"start_tokens: the best individual leaves {self.best.start} initial positions unscaled, "
                             "which a longrope block (transformers' or posenc's) cannot express; search with "
                             "start_tokens=(0,) for a block")
        return longrope_block(self.best.factors, self.settings.train_length, self.settings.scale, self.base)

    def to_json(self) -> dict:
        out = {"settings": {**asdict(self.settings), "start_tokens": list(self.settings.start_tokens)},
               "best": {"factors": list(self.best.factors), "start": self.best.start}, "perplexity": self.perplexity,
               "baselines": self.baselines, "seconds_per_individual": self.seconds_per_individual,
               "evaluated": len(self.evaluated)}
        if not self.best.start:
            out["block"] = self.block()
        return out


def _settings_json(settings: SearchSettings) -> dict:
    return {**asdict(settings), "start_tokens": list(settings.start_tokens)}


class _Search:
    """One search's state: what was evaluated (in order), written to ``state`` after each."""

    def __init__(self, model: nn.Module, valid: torch.Tensor, settings: SearchSettings, state: Path | None,
                 resume: bool, report: Report) -> None:
        self.model, self.settings, self.state, self.report = model, settings, state, report
        self.ropes = _ropes(model)
        enc = self.ropes[0]
        self.base, self.pairs = enc.base, enc.rotary_dim // 2
        self.theta = default_frequencies(enc.base, enc.rotary_dim)
        need = settings.sequences * settings.target_length + 1
        if valid.numel() < need:
            raise UsageError(f"valid: {settings.sequences} sequences of target_length {settings.target_length} need "
                             f"{need} tokens, got {valid.numel()}")
        self.valid = valid[:need]
        self.memo: dict[str, dict] = {}
        self.order: list[dict] = []
        self.seconds = 0.0
        if state is not None and state.exists():
            if not resume:
                raise UsageError(f"state: {state} holds a search already; continue it with resume, or remove it")
            self._load(state)

    def _load(self, state: Path) -> None:
        try:
            saved = json.loads(state.read_text(encoding="utf-8"))
            same = saved["format"] == STATE_FORMAT and saved["settings"] == _settings_json(self.settings)
            evaluated = list(saved["evaluated"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise UsageError(f"state: {state} is not a readable search state ({err})") from None
        if not same:
            raise UsageError(f"state: {state} was written by a search with other settings; remove it or use another path")
        for record in evaluated:
            ppl = record.get("perplexity") if isinstance(record, dict) else "missing"
            if ppl is not None and (isinstance(ppl, bool) or not isinstance(ppl, (int, float)) or not math.isfinite(ppl) or ppl < 1):
                raise UsageError(f"state: {state} holds an individual with perplexity {ppl!r}; a perplexity is a finite "
                                 "number >= 1 (or null where the model's was not finite): remove the file or restore it")
            generation = record.get("generation")
            if isinstance(generation, bool) or not isinstance(generation, int) or not 0 <= generation <= self.settings.generations:
                raise UsageError(f"state: {state} holds an individual with generation {generation!r}; a generation is an "
                                 f"integer in [0, {self.settings.generations}]: remove the file or restore it")
            self.memo[Individual(tuple(record["factors"]), record["start"]).key] = record
            self.order.append(record)
        self.seconds = float(saved.get("seconds", 0.0))

    def _save(self) -> None:
        if self.state is not None:
            write_json(self.state, {"format": STATE_FORMAT, "settings": _settings_json(self.settings),
                                    "evaluated": self.order, "seconds": round(self.seconds, 3)})

    def fitness(self, ind: Individual, generation: int) -> float:
        """The perplexity of ``ind`` at the target length (memoised; the state written after a new one)."""
        if ind.key in self.memo:  # null: an individual whose perplexity was not finite
            kept = self.memo[ind.key]["perplexity"]
            return math.inf if kept is None else float(kept)
        if not monotone(ind.factors, self.settings.upper) or len(ind.factors) != self.pairs:
            raise AssertionError(f"an individual breaks the search's constraint: {ind}")
        s = self.settings
        t0 = time.perf_counter()
        block = longrope_block(ind.factors, s.train_length, s.scale, self.base)
        with _applied(self.ropes, block, ind.start, self.theta, s.target_length):
            ppl = self._perplexity()
        elapsed = time.perf_counter() - t0
        self.seconds += elapsed
        record = {"factors": list(ind.factors), "start": ind.start, "perplexity": ppl if math.isfinite(ppl) else None,
                  "generation": generation}
        self.memo[ind.key] = record
        self.order.append(record)
        self._save()
        best = min((r["perplexity"] for r in self.order if r["perplexity"] is not None), default=math.nan)
        self.report(SearchScored(generation, s.generations, len(self.order), ppl, best, elapsed))
        return ppl if math.isfinite(ppl) else math.inf

    def _perplexity(self) -> float:
        model = self.model
        if isinstance(model, LM):
            device = next(model.parameters()).device
            out = evaluate(model, self.valid, self.settings.target_length, None, distributed.Context(device))
            return float(out["perplexity"])
        from .hf_evaluation import evaluate as hf_evaluate  # (a transformers model: needs transformers)

        length = self.settings.target_length
        return float(hf_evaluate(model, self.valid, [length])[length]["perplexity"])  # type: ignore[arg-type]


def _mutate(parent: Individual, s: SearchSettings, g: torch.Generator) -> Individual:
    factors = list(parent.factors)
    for k in range(len(factors)):
        if float(torch.rand((), generator=g)) < s.mutation_rate:
            factors[k] = round(factors[k] * math.exp(s.step * float(torch.randn((), generator=g))), DIGITS)
    start = parent.start
    if len(s.start_tokens) > 1 and float(torch.rand((), generator=g)) < s.mutation_rate:
        start = s.start_tokens[int(torch.randint(len(s.start_tokens), (), generator=g))]
    return Individual(tuple(factors), start)


def _cross(a: Individual, b: Individual, g: torch.Generator) -> Individual:
    pick = torch.rand(len(a.factors) + 1, generator=g) < 0.5
    factors = tuple(x if bool(p) else y for x, y, p in zip(a.factors, b.factors, pick[:-1]))
    return Individual(factors, a.start if bool(pick[-1]) else b.start)


def _child(make: Any, s: SearchSettings, seen: set[str]) -> Individual:
    """A child from ``make()`` that keeps the constraint and is new (drawn again up to RETRIES
    times, then repaired); an already-seen child after repair is returned as it is."""
    child = make()
    for _ in range(RETRIES):
        if monotone(child.factors, s.upper) and child.key not in seen:
            return child
        child = make()
    return Individual(repaired(child.factors, s.upper), child.start)


def search(model: nn.Module, valid: torch.Tensor, settings: SearchSettings, *, state: str | Path | None = None,
           resume: bool = False, report: Report = ignore) -> SearchResult:
    """LongRoPE's evolutionary search of ``model``'s rescale factors (see the module docstring).

    Args:
        model: posenc's :class:`~posenc.model.lm.LM` with a RoPE encoding, or a ``transformers`` causal
            LM after ``posenc.hf.use(model, "rope")`` (its vocabulary covering the 256 bytes).
        valid: (N,) uint8 validation bytes: the first ``sequences`` windows of ``target_length``
            are scored.
        settings: the search (:class:`SearchSettings`).
        state: a JSON file holding every evaluated individual, written atomically after each one.
        resume: continue the search in ``state``.
        report: gets a :class:`~.events.SearchScored` after every evaluated individual.

    Raises:
        UsageError: a model without RoPE, too little validation data, or ``state`` holding a search
            (without ``resume``) or another search's settings.
    """
    s = settings
    run = _Search(model, valid, s, Path(state) if state is not None else None, resume, report)
    pairs = run.pairs
    seeds = {kind: repaired(seed_factors(kind, run.base, 2 * pairs, s.train_length, s.scale), s.upper)
             for kind in ("linear", "ntk", "yarn")}
    population = [Individual(f, 0) for f in dict.fromkeys(seeds.values())]
    g = torch.Generator().manual_seed(s.seed * 1_000_003)
    seen = {ind.key for ind in population}
    while len(population) < s.population:
        parent = population[int(torch.randint(len(population), (), generator=g))]
        child = _child(lambda parent=parent: _mutate(parent, s, g), s, seen)
        seen.add(child.key)
        population.append(child)
    scored = [(run.fitness(ind, 0), i, ind) for i, ind in enumerate(population)]
    baselines = {("pi" if k == "linear" else k): run.fitness(Individual(f, 0), 0) for k, f in seeds.items()}
    for generation in range(1, s.generations + 1):
        g = torch.Generator().manual_seed(s.seed * 1_000_003 + generation)
        ranked = sorted(scored, key=lambda t: (t[0], t[1]))
        parents = [ind for _, _, ind in ranked[: s.parents]]
        # what an unbroken search had evaluated when this generation began: a resumed state also
        # holds the killed run's later generations, which must not steer this one's draws
        before = [r for r in run.order if r["generation"] < generation]
        seen = {Individual(tuple(r["factors"]), r["start"]).key for r in before}
        children: list[Individual] = []
        for _ in range(s.mutations):
            parent = parents[int(torch.randint(len(parents), (), generator=g))]
            children.append(child := _child(lambda parent=parent: _mutate(parent, s, g), s, seen))
            seen.add(child.key)
        for _ in range(s.crossovers if len(parents) > 1 else 0):
            i, j = torch.randperm(len(parents), generator=g)[:2].tolist()
            children.append(child := _child(lambda i=i, j=j: _cross(parents[i], parents[j], g), s, seen))
            seen.add(child.key)
        offset = len(before)
        pool = ranked + [(run.fitness(ind, generation), offset + i, ind) for i, ind in enumerate(children)]
        unique: dict[str, tuple[float, int, Individual]] = {}
        for item in sorted(pool, key=lambda t: (t[0], t[1])):
            unique.setdefault(item[2].key, item)
        scored = list(unique.values())[: s.population]
    best_ppl, _, best = min(scored, key=lambda t: (t[0], t[1]))
    count = max(1, len(run.order))
    return SearchResult(s, run.base, best, best_ppl, list(run.order), round(run.seconds / count, 4), baselines)


__all__ = ["Individual", "SearchResult", "SearchSettings", "longrope_block", "monotone", "repaired", "search",
           "seed_factors"]
