"""The first stage of a study: its checked config becomes a list of typed runs, before anything runs.

A *run* is one row at one seed (:class:`Run`): the row (parsed once, :class:`.rows.Row`), its seed,
the files it writes (checkpoint, training state) and, for a row that trains (from scratch, or a
fine-tune of its base's model), everything its training reads (:class:`.train.TrainSettings`). An
evaluated row trains nothing: it scores its base's model another way. Runs are in the order the
study takes them: every row at the first seed, then every row at the next.

:func:`check` is the plan's check of a study, the one that needs the model builders: every row built
on the meta device and its variant applied at every evaluation length, and every option that only
some rows read read by one of the study's rows (on resume: the saved study's rows count too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .config import StudyConfig
from .models import Models, checked_models
from .results import Paths
from .rows import Row
from .train import TrainSettings

# A fine-tune draws its batches from another stream than pre-training (the same text, other windows).
FINETUNE_STREAM = 1_000_000


@dataclass(frozen=True)
class Run:
    """One row at one seed, as the stages after the plan take it."""

    row: Row
    index: int  # 0: the study's first seed (the row's entry itself in results.json)
    seed: int
    label: str  # the row's name, with " seed S" after the first seed
    checkpoint: Path  # the final weights of the row's model at this seed (an evaluated row: its base's)
    state: Path  # the training state while it trains
    settings: TrainSettings | None  # None: an evaluated row (no training of its own)
    base: Run | None = None  # the run whose model this one starts from (an evaluated or fine-tuned row)

    @property
    def parent(self) -> Run:
        """The run an evaluated or fine-tuned row's run starts from (:func:`plan` sets it).

        Raises:
            UsageError: for a run without one (a trained row's).
        """
        if self.base is None:
            raise UsageError(f"{self.label}: a trained row's run has no base run")
        return self.base

    @property
    def stored_seed(self) -> int | None:
        """The seed in a file name: None for the first seed (the names a one-seed study always had)."""
        return None if self.index == 0 else self.seed


@dataclass(frozen=True)
class Plan:
    """A checked study as a list of runs."""

    cfg: StudyConfig
    models: Models  # how each row's model is made, saved and loaded
    paths: Paths  # the study's files
    runs: tuple[Run, ...]  # the runs to do now, seeds outermost


def check(cfg: StudyConfig, also: Sequence[Row] = ()) -> StudyConfig:
    """The plan's checks of the study of ``cfg``'s rows and ``also`` (a resumed study's saved rows):
    every option that only some rows read has such a row (:meth:`.config.StudyConfig.check_applies`),
    every row builds and takes its variant (:func:`.models.checked_models`); returns ``cfg``.

    Raises:
        UsageError: naming the row or option (an ``hf_config`` file: the file) that cannot be used.
    """
    cfg.check_applies([*cfg.rows, *also])
    checked_models(cfg)
    return cfg


def settings_of(cfg: StudyConfig, row: Row, seed: int, world: int) -> TrainSettings | None:
    """What ``row``'s training at ``seed`` reads (None: an evaluated row trains nothing).

    A fine-tune (``+ft``): ``finetune_steps`` at ``finetune_length`` from a batch of about as many
    tokens as pre-training's (a multiple of ``world``), a tenth of its steps of warmup to
    ``lr * min_lr_ratio`` (where pre-training ended), then held. A ``+drop`` row: positions dropped
    at ``cfg.drop_step_of(row)``, with DroPE's schedules.
    """
    common: dict[str, Any] = dict(weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip, checkpoint_every=cfg.checkpoint_every,
                  min_lr_ratio=cfg.min_lr_ratio)
    if row.kind == "eval":
        return None
    if row.kind == "finetune":
        length = cfg.ft_length
        size = max(world, cfg.batch_size * cfg.train_length // length // world * world)
        return TrainSettings(steps=cfg.finetune_steps, lr=cfg.lr * cfg.min_lr_ratio, warmup=max(1, cfg.finetune_steps // 10),
                             batch_size=size, length=length, data_seed=seed + FINETUNE_STREAM, constant=True, **common)
    if cfg.warmup is None:  # (StudyConfig sets it: a tenth of the steps unless given)
        raise UsageError("warmup must be an integer in [0, steps), got None")
    return TrainSettings(steps=cfg.steps, lr=cfg.lr, warmup=cfg.warmup, batch_size=cfg.batch_size,
                         length=cfg.train_length, data_seed=seed,
                         drop_at=cfg.drop_step_of(row) if "drop" in row.train else None, **common)


def plan(cfg: StudyConfig, models: Models, paths: Paths, world: int) -> Plan:
    """Every run of ``cfg`` (each of its rows at each of its seeds), in order: seeds outermost, so
    after the first pass every row has a number and later seeds refine them."""
    runs: list[Run] = []
    for index in range(cfg.seeds):
        seed = cfg.seed + index
        made: dict[str, Run] = {}

        def run_of(row: Row, index: int = index, seed: int = seed, made: dict[str, Run] = made) -> Run:
            if row.name in made:
                return made[row.name]
            base = run_of(row.base_row) if row.base_row is not None else None
            stored = None if index == 0 else seed
            checkpoint = run_of(row.parent).checkpoint if row.kind == "eval" else paths.checkpoint(row.stem, stored)
            made[row.name] = run = Run(row, index, seed, row.name if index == 0 else f"{row.name} seed {seed}",
                                       checkpoint, paths.state(row.stem, stored), settings_of(cfg, row, seed, world), base)
            return run

        runs.extend(run_of(row) for row in cfg.rows)
    return Plan(cfg, models, paths, tuple(runs))


def root(run: Run) -> Run:
    """The trained-from-scratch run at the start of ``run``'s chain of bases (``run`` itself for one)."""
    while run.base is not None:
        run = run.base
    return run


def groups(runs: Sequence[Run]) -> list[tuple[Run, ...]]:
    """``runs`` in groups that share a model: each run trained from scratch with every run of
    ``runs`` evaluated or fine-tuned from it (at the same seed), in plan order, the groups ordered by
    their first run."""
    out: dict[tuple[str, int], list[Run]] = {}
    for run in runs:
        first = root(run)
        out.setdefault((first.row.name, first.index), []).append(run)
    return [tuple(g) for g in out.values()]


def parse_shard(text: str) -> tuple[int, int]:
    """``K/N`` (1 <= K <= N) as ``(K, N)``.

    Raises:
        UsageError: ``text`` is not two positive integers ``K/N`` with K <= N.
    """
    k, sep, n = text.partition("/")
    digits = set("0123456789")  # str.isdigit also passes superscripts ('²'), which int() refuses
    if not (sep and k and n and set(k) <= digits and set(n) <= digits and 1 <= int(k) <= int(n)):
        raise UsageError(f"shard must be K/N with integers 1 <= K <= N (the K-th of N parts), got {text!r}")
    return int(k), int(n)


def shard(runs: Sequence[Run], index: int, count: int) -> tuple[Run, ...]:
    """The runs of part ``index`` (1-based) of ``count``: the groups of :func:`groups` dealt in
    turn (group g to part g mod count + 1), so a base and the runs evaluated or fine-tuned from it
    stay in one part, and the split depends only on the study's rows and seeds.

    Raises:
        UsageError: ``count`` exceeds the number of groups (a part would have nothing to run).
    """
    found = groups(runs)
    if count > len(found):
        raise UsageError(f"shard: {count} parts exceed the study's {len(found)} groups of runs (a trained run with "
                         f"the rows evaluated or fine-tuned from it, at each seed); use at most {len(found)} parts")
    return tuple(r for g, group in enumerate(found) if g % count == index - 1 for r in group)


__all__ = ["FINETUNE_STREAM", "Plan", "Run", "check", "groups", "parse_shard", "plan", "root", "settings_of", "shard"]
