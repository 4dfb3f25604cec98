"""``posenc study merge DIR... --out DIR``: the folders of a study's parts (``--shard K/N``, or any
studies of one config that ran different runs) joined into one study folder.

Checked first, before anything is written: every folder holds a finished-writing study (no live
process holds its lock) of the same config (every option, the rows and seeds too), the same model
(``hf_config``'s sha256), the same data (the corpus' sha256), run at the same threads and device
(a run's numbers depend on them), and each run (a row at a seed) is finished in at most one of
them, with its checkpoint where its record says it was trained; ``out`` is a new or empty folder (a study already there is never
overwritten). Then every run's record is taken from the folder that has it furthest along (done or
diverged, else trained, else a training state on disk), with its checkpoint (and its config file)
and its window scores (training state: its state file), and the across-seed means, tables and
figure are computed again from them (:mod:`.seeds`, :func:`.results.write_outputs`). A run no
folder has leaves the merged study ``partial``: ``--resume`` on ``out`` runs what is missing.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import fields
from pathlib import Path

import torch

from ..errors import UsageError
from ..files import RunDir, lock_holder, write_json
from . import distributed, seeds
from .config import StudyConfig
from .models import models_for
from .plan import Run, plan
from .progress import Progress
from .results import ADDED_FIELDS, SCHEMA, Paths, load_results, write_outputs
from .results_writer import ResultsWriter
from .rows import parse

_RANK = {"done": 3, "diverged": 3, "trained": 2}  # how far along a run's record is


def _config(results: dict) -> dict:
    """A saved config with the fields older studies did not record at their defaults."""
    return {**ADDED_FIELDS, **results["config"]}


def _check_same(first: Path, a: dict, other: Path, b: dict) -> None:
    """Raises:
        UsageError: ``a`` and ``b`` differ in config (each option named with both values), model, corpus,
            threads or device.
    """
    ca, cb = _config(a), _config(b)
    diff = [f"{k}: {ca.get(k)!r} in {first} vs {cb.get(k)!r} in {other}" for k in sorted(set(ca) | set(cb))
            if ca.get(k) != cb.get(k)]
    if diff:
        raise UsageError(f"merge: the studies differ in config ({'; '.join(diff[:4])}); only parts of one study "
                         "(the same command, with --shard K/N) can be merged")
    ha, hb = (a.get("hf") or {}).get("sha256"), (b.get("hf") or {}).get("sha256")
    if ha != hb:
        raise UsageError(f"merge: {first} and {other} trained different models (hf_config sha256 {ha} vs {hb})")
    sa, sb = a.get("corpus", {}).get("sha256"), b.get("corpus", {}).get("sha256")
    if sa != sb:
        raise UsageError(f"merge: {first} and {other} were trained on different data (corpus sha256 {sa} vs {sb})")
    va, vb = a.get("versions") or {}, b.get("versions") or {}
    for key, what in (("torch_threads", "threads (--threads)"), ("device", "device")):
        if key in va and key in vb and va[key] != vb[key]:
            raise UsageError(f"merge: {first} and {other} ran at different {what}: {va[key]!r} vs {vb[key]!r}; a "
                             "run's numbers depend on them, so the parts are not one study's: run the parts again "
                             "with the same --threads and --device")


def _load(folders: list[Path], out: Path) -> list[dict]:
    """Each folder's results, checked to be one study's and not in use.

    Raises:
        UsageError: fewer than one folder, one named twice or as ``out``, one without a study,
            one still running, or studies that differ (:func:`_check_same`).
    """
    if not folders:
        raise UsageError("merge needs at least one study folder")
    resolved = [f.resolve() for f in folders]
    if len(set(resolved)) < len(resolved):
        raise UsageError("merge: a folder is named twice")
    if out.resolve() in resolved:
        raise UsageError(f"out: {out} is one of the folders to merge; merge writes a new folder")
    loaded = []
    for folder in folders:
        results = load_results(folder)
        if results is None:
            raise UsageError(f"merge: {folder} holds no study (no results.json)")
        holder = lock_holder(folder)
        if holder is not None:
            raise UsageError(f"merge: {folder} is still being written (pid {holder.get('pid', '?')}); "
                             "merge it once that run has ended")
        loaded.append(results)
    for folder, results in zip(folders[1:], loaded[1:]):
        _check_same(folders[0], loaded[0], folder, results)
    return loaded


def _study_config(saved: dict) -> StudyConfig:
    """The StudyConfig of a saved config."""
    names = {f.name for f in fields(StudyConfig)}
    kept = {k: v for k, v in saved.items() if k in names and k != "preset"}
    return StudyConfig.from_preset(saved.get("preset") or "default", **kept)


def _copy(src: Path, dst: Path) -> None:
    if src.is_file():
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)


def _take(run: Run, record: dict | None, src: Paths, dst: Paths) -> None:
    """Copy ``run``'s files from ``src`` to ``dst``: checkpoint (with its sidecar files), window
    scores, or its training state when it has no record yet."""
    if record is None:
        _copy(src.state(run.row.stem, run.stored_seed), dst.state(run.row.stem, run.stored_seed))
        return
    if run.settings is not None:  # (an evaluated row's checkpoint is its base's)
        ckpt, to = src.checkpoint(run.row.stem, run.stored_seed), dst.checkpoint(run.row.stem, run.stored_seed)
        _copy(ckpt, to)
        _copy(ckpt.with_suffix(".json"), to.with_suffix(".json"))  # (its config: posenc.load_checkpoint reads it)
    for row in record.get("eval", []):
        _copy(src.window_scores(run.row.stem, run.seed, row["length"]), dst.window_scores(run.row.stem, run.seed, row["length"]))


def merge(folders: list[Path], out: Path, progress: bool = True) -> dict:
    """Join the study folders ``folders`` into the new study folder ``out``; returns its results.

    Raises:
        UsageError: the folders cannot be merged (:func:`_load`), a run is finished in two of
            them, a trained run's checkpoint is missing, or ``out`` already holds files.
    """
    ui = Progress(progress)
    loaded = _load(folders, out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"out: {out} already exists and is not empty; merge writes into a new folder only "
                         "(its results are never overwritten): choose another out")
    cfg = _study_config(loaded[0]["config"])
    whole = plan(cfg, models_for(cfg), Paths(out), 1)
    chosen: list[tuple[Run, int | None]] = []  # each run and the folder it comes from (None: no folder has it)
    for run in whole.runs:
        best, where = 0, 0
        for i, results in enumerate(loaded):
            writer = ResultsWriter(results, Paths(folders[i]), distributed.Context(torch.device("cpu")), cfg)
            record = writer.run_of(run)
            rank = _RANK.get(record.get("status", ""), 1) if record is not None else (
                1 if Paths(folders[i]).state(run.row.stem, run.stored_seed).is_file() else 0)
            if rank == 3 and best == 3:
                raise UsageError(f"merge: {run.label} is finished in both {folders[where]} and {folders[i]}; "
                                 "each run must come from one folder (merge the parts of one study)")
            if rank > best:
                best, where = rank, i
        chosen.append((run, where if best else None))
    for run, at in chosen:  # a record without its checkpoint would be merged as finished, its model gone
        if at is None or run.settings is None:
            continue
        record = ResultsWriter(loaded[at], Paths(folders[at]), distributed.Context(torch.device("cpu")), cfg).run_of(run)
        if record is None or record.get("status") not in ("trained", "done"):
            continue
        ckpt = Paths(folders[at]).checkpoint(run.row.stem, run.stored_seed)
        if not ckpt.is_file():
            raise UsageError(f"merge: {folders[at]} records {run.label} as {record['status']} but its checkpoint {ckpt} "
                             "is missing; restore it, or run that part again with --resume (it trains the run again) "
                             "before merging")
    rundir = RunDir.claim(out, "study")
    try:
        results = {
            "schema": SCHEMA, "status": "running", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config": loaded[0]["config"], "seed": loaded[0].get("seed", cfg.seed), "corpus": loaded[0]["corpus"],
            "methods": {},
        }
        if loaded[0].get("hf"):
            results["hf"] = loaded[0]["hf"]
        results["versions"] = loaded[0].get("versions", {})
        results["merged_from"] = [{"folder": str(f), "shard": r.get("shard"), "wall_s": r.get("wall_s"),
                                   "versions": r.get("versions")} for f, r in zip(folders, loaded)]
        writer = ResultsWriter(results, Paths(out), distributed.Context(torch.device("cpu")), cfg)
        missing = []
        for run, at in chosen:
            source = None if at is None else ResultsWriter(loaded[at], Paths(folders[at]),
                                                  distributed.Context(torch.device("cpu")), cfg).run_of(run)
            if at is not None:
                _take(run, source, Paths(folders[at]), Paths(out))
            if source is None:
                missing.append(run.label)
                continue
            writer.set(run, {k: v for k, v in source.items() if k not in ("row", "seeds", "across_seeds")})
        for name, entry in results["methods"].items():
            seeds.aggregate(entry, parse(name).stem, Paths(out), cfg.task == "recall")
        done = all(writer.finished(run) for run, _ in chosen)
        results["status"] = "done" if done else "partial"
        results["wall_s"] = round(sum(r.get("wall_s") or 0.0 for r in loaded), 1)
        write_json(Paths(out).results, results)
        write_outputs(results, out, table=True)
        if missing:
            ui.warn(f"merge: no folder has {', '.join(missing)}: {out} is partial; `posenc study --out {out} --resume` "
                    "runs what is missing")
    finally:
        rundir.release()
    return results


__all__ = ["merge"]
