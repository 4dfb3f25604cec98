"""results.json as a study's stages fill it: :class:`ResultsWriter`, its one writer, and what a record is.

Per row an entry, the run of its first seed, with the runs of later seeds in ``entry["seeds"]``
(:mod:`.seeds`, the one reader of where a seed's record lives); a run not started yet where a later
seed needs its place is a ``pending`` record. The entry's ``row`` says what the row is
(:func:`row_record`). The file is written whole after each step (atomically, :func:`posenc.files.write_json`),
so an interrupted study continues exactly where it stopped.
"""

from __future__ import annotations

from typing import Any

from ..files import write_json
from ..model.schedule import Schedule
from . import distributed, seeds
from .config import StudyConfig
from .models import lm_config, lm_sizes
from .plan import Run
from .results import Paths, write_outputs
from .rows import Row, fair_options, fair_schedule


def pending(seed: int) -> dict:
    """The record of a run that has not started, where a later seed's record needs a place."""
    return {"seed": seed, "status": "pending", "train": {}, "eval": []}


def record_of(results: dict, row: str, index: int) -> dict | None:
    """The record of ``row`` at its ``index``-th seed in ``results`` (0: the row's entry itself, later
    seeds in its ``seeds`` list), or None when that run has not started."""
    entry = results["methods"].get(row)
    if entry is None:
        return None
    kept = seeds.runs(entry)  # (seeds.runs: the one reader of where a seed's record lives)
    record = kept[index] if index < len(kept) else None
    return None if record is None or record.get("status") == "pending" else record


class ResultsWriter:
    """results.json as the stages fill it: per row an entry, the run of its first seed, with the
    runs of later seeds in ``entry["seeds"]`` (:mod:`.seeds`)."""

    def __init__(self, results: dict, paths: Paths, ctx: distributed.Context, cfg: StudyConfig) -> None:
        self.results, self.paths, self.ctx, self.cfg = results, paths, ctx, cfg
        for entry in results["methods"].values():  # (a study from before seeds: its one seed)
            entry.setdefault("seed", results.get("seed", 0))

    def save(self, outputs: bool = False) -> None:
        if self.ctx.main:
            write_json(self.paths.results, self.results)
            if outputs:
                write_outputs(self.results, self.paths.root)

    def run_of(self, run: Run) -> dict | None:
        """The stored record of ``run``, or None when it has not started."""
        return record_of(self.results, run.row.name, run.index)

    def finished(self, run: Run) -> bool:
        """Done, or diverged (a run that would diverge again at the same step: not retried)."""
        record = self.run_of(run)
        return record is not None and record.get("status") in ("done", "diverged")

    def set(self, run: Run, record: dict) -> dict:
        """Store ``record`` as ``run``'s; returns the stored dict."""
        methods = self.results["methods"]
        if run.row.name not in methods:  # (rows in the config's order, whichever run finishes first)
            order = {name: i for i, name in enumerate(self.results.get("config", {}).get("methods", []))}
            methods[run.row.name] = pending(self.cfg.seed)
            self.results["methods"] = methods = dict(sorted(methods.items(), key=lambda kv: order.get(kv[0], len(order))))
        if run.index == 0:
            old = methods.get(run.row.name, {})
            methods[run.row.name] = entry = {**record, "row": row_record(run.row, self.cfg)}
            if old.get("seeds"):
                entry["seeds"] = old["seeds"]
            return entry
        entry = methods[run.row.name]
        if entry.get("status") == "pending":  # (a later seed finished first: in another worker, or shard)
            entry["row"] = row_record(run.row, self.cfg)
        later = entry.setdefault("seeds", [])
        while len(later) < run.index:
            later.append(pending(self.cfg.seed + len(later) + 1))
        later[run.index - 1] = record
        return record

    def aggregate(self, run: Run) -> None:
        """The row's mean over its finished seeds, and results.json with its tables and figures."""
        seeds.aggregate(self.results["methods"][run.row.name], run.row.stem, self.paths, self.cfg.task == "recall")
        self.save(outputs=True)


def row_record(row: Row, cfg: StudyConfig) -> dict:
    """What a row is, for results.json."""
    out: dict[str, Any] = {"method": row.method, "kind": row.kind, "options": fair_options(row, cfg.train_length)}
    if row.schedule is not None:  # per layer, as trained (its first layer's method is "method")
        layers = fair_schedule(row, cfg.train_length, lm_sizes(cfg)[1])
        out["schedule"] = Schedule.of(layers).to_text()
        out["layers"] = layers
    if row.train:
        out["train_variants"] = list(row.train)
    if "drop" in row.train:
        out["positions_dropped_after"] = cfg.drop_fraction if row.drop_after is None else round(1 - row.drop_after, 6)
        out["recalibration"] = "own warmup + cosine schedule, no weight decay (DroPE)"
    if "random" in row.train:
        out["random_positions"] = lm_config(cfg, row).random_positions
    if row.eval:
        out["variant"] = row.eval
    if row.base:
        out["base"] = row.base
    if row.finetune:
        out["finetune"] = {"steps": cfg.finetune_steps, "length": cfg.ft_length}
    return out


__all__ = ["ResultsWriter", "pending", "record_of", "row_record"]
