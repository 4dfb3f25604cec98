"""Running a study: check everything first, then train and evaluate each row in turn (every row
at the first seed, then every row at the next), saving as it goes, so that an interrupted run
continues with ``resume=True`` (``--resume``) exactly where it stopped: finished runs (a row at a
seed) are skipped, the one that was interrupted continues from its last saved step.
"""

from __future__ import annotations

import contextlib
import json
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..errors import UsageError
from ..files import MARKER, RunDir, WriteError, write_json
from ..version import __version__
from . import distributed, recall, seeds
from .builders import Models
from .config import StudyConfig
from .data import Corpus, load_corpus
from .pipeline import Book, Stages
from .plan import checked_models, plan
from .progress import Progress
from .results import SCHEMA, Paths, load_results, write_outputs
from .rows import expand, parse
from .train import StepCallback


def environment(ctx: distributed.Context) -> dict:
    """The software and machine a study ran on (``results["versions"]``)."""
    import numpy
    import safetensors

    v = {
        "posenc": __version__, "python": platform.python_version(), "torch": torch.__version__,
        "numpy": numpy.__version__, "safetensors": safetensors.__version__, "platform": platform.platform(),
        "torch_threads": torch.get_num_threads(), "world_size": ctx.world, "device": str(ctx.device.type),
    }
    if ctx.device.type == "cuda":
        v["device_name"] = torch.cuda.get_device_name(ctx.device)
    return v


def _is_study(out: Path) -> bool:
    """A directory written by a posenc study from before run markers existed."""
    try:
        return json.loads((out / "results.json").read_text(encoding="utf-8")).get("schema") == SCHEMA
    except (OSError, ValueError, AttributeError):
        return False


# Fields a run from before they existed did not record: their value then was the default.
_ADDED = {"task": "lm", "drop_positions_after": None, "random_positions": None, "finetune_steps": 0,
          "finetune_length": None, "recall_sequences": 64}


def _check_same(saved: dict, cfg: StudyConfig, fingerprint: dict, out: Path, hf: dict | None) -> None:
    before = saved.get("hf") or {}
    if before.get("sha256") != (hf or {}).get("sha256"):
        was = (f"hf_config {before.get('path')} (model_type {before.get('model_type')!r}, sha256 {before.get('sha256')})"
               if before else "posenc's own model (no hf_config)")
        now = (f"hf_config {hf['path']} (model_type {hf['model_type']!r}, sha256 {hf['sha256']})" if hf
               else "posenc's own model (no hf_config)")
        raise UsageError(f"resume: {out} was trained on {was}, this run asks for {now}; use the original "
                         "config file or another out")
    old = {**_ADDED, **{k: v for k, v in saved["config"].items() if k not in ("methods", "seeds", "hf_config")}}
    new = cfg.comparable()
    diff = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    if diff:
        raise UsageError(f"resume: {out} was run with a different config ({'; '.join(diff)}); "
                         "use the original options or another out")
    if saved.get("corpus", {}).get("sha256") != fingerprint["sha256"]:
        raise UsageError(f"resume: the corpus differs from the one {out} was trained on "
                         f"(sha256 {saved.get('corpus', {}).get('sha256')} vs {fingerprint['sha256']})")


def _fingerprint_recall(cfg: StudyConfig) -> dict:
    from dataclasses import asdict as fields_of

    return {"source": "generated: associative recall (posenc.study.recall)", "task": fields_of(recall.TASK),
            "sha256": None, "eval_sequences": cfg.recall_sequences}


def prepare(cfg: StudyConfig, out: Path, resume: bool, ctx: distributed.Context
            ) -> tuple[Models, Corpus | None, dict, RunDir | None]:
    """Check the study (:func:`.plan.checked_models`), claim ``out`` and load the data: every user
    error surfaces here, before training. Returns the model builder, the corpus (None for the
    recall task: its sequences are generated), the results to fill, and on the main process the
    claimed (locked) directory.

    Raises:
        UsageError: ``batch_size`` not divisible by the number of processes; ``resume`` without a
            study in ``out``, or a new study where ``out`` already holds one; a ``train_length`` or
            ``eval_lengths`` longer than the corpus' training or validation split allows.
    """
    before = load_results(out) if resume and (out / "results.json").exists() else None
    # A resume checks the options against the saved study's rows too (it may name other rows).
    models = checked_models(cfg, [parse(m) for m in before["config"]["methods"]] if before else ())
    if cfg.batch_size % ctx.world:
        raise UsageError(f"batch_size ({cfg.batch_size}) must be divisible by the number of processes ({ctx.world})")
    if cfg.task == "recall":
        for n in (cfg.train_length, *cfg.eval_lengths):
            recall.TASK.check(n)
    if resume and not out.is_dir():
        raise UsageError(f"resume: {out} does not exist, so there is nothing to resume; "
                         "leave out resume to start a new study there")
    fresh = not (out / MARKER).exists()
    rundir = RunDir.claim(out, "study", owned=_is_study) if ctx.main else None
    try:
        saved = load_results(out)
        if saved is not None and not resume:
            raise UsageError(f"out: {out} already holds a study (results.json); continue it with resume "
                             "(--resume), or choose another out")
        if resume and saved is None and fresh:
            raise UsageError(f"resume: {out} holds no study (no results.json); leave out resume to start one")
        corpus = None
        if cfg.task == "lm":
            corpus = load_corpus(cfg.data, cfg.valid_bytes)
            if corpus.train.numel() < cfg.train_length + 2:
                raise UsageError(f"train_length ({cfg.train_length}) needs a training split longer than "
                                 f"{corpus.train.numel()} bytes")
            if max(cfg.eval_lengths) > corpus.valid_tokens:
                raise UsageError(
                    f"eval_lengths: {max(cfg.eval_lengths)} exceeds the {corpus.valid_tokens} validation tokens "
                    f"(valid_bytes={cfg.valid_bytes}, or a small corpus); use shorter eval_lengths or more data"
                )
        fingerprint = corpus.fingerprint if corpus is not None else _fingerprint_recall(cfg)
        hf = models.architecture() if cfg.hf_config is not None else None
        if saved is not None:
            _check_same(saved, cfg, fingerprint, out, hf)
    except BaseException:
        if rundir is not None:
            rundir.discard()  # a directory made for this run alone is removed again
        raise
    if saved is not None:
        results = saved
        results["config"]["methods"] = expand([*saved["config"]["methods"], *cfg.methods], cfg.finetune_steps > 0)
        results["config"]["seeds"] = max(saved["config"].get("seeds", 1), cfg.seeds)
        results["status"] = "running"
    else:
        results = {
            "schema": SCHEMA, "status": "running", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config": asdict(cfg), "seed": cfg.seed,
            "corpus": fingerprint, "methods": {},
        }
        if hf is not None:
            results["hf"] = hf  # the architecture: the file's path, sha256, model_type and contents
    results["versions"] = environment(ctx)
    return models, corpus, results, rundir


def run_experiment(cfg: StudyConfig, out: str | Path, *, resume: bool = False, progress: bool = True,
                   ctx: distributed.Context | None = None, on_step: StepCallback | None = None) -> dict:
    """Run (or continue) a study; returns the results dict (also in ``out/results.json``).

    Args:
        cfg: the study (checked when it was made; the checks that need its models run here,
            before anything is written).
        out: output directory (see :mod:`posenc.study.results` for its files).
        resume: continue the study already in ``out`` (finished methods are skipped).
        progress: bars or log lines on stderr.
        ctx: this process's place under torchrun (default: one process on ``cfg.device``).
        on_step: called as ``on_step(method, step)`` after every training step.

    Raises:
        UsageError: another process of a distributed study rejected the configuration (its own
            message names the option).
    """
    ctx = ctx or distributed.Context(torch.device(cfg.device))
    out = Path(out)
    started = time.perf_counter()
    failure = None
    try:
        models, corpus, results, rundir = prepare(cfg, out, resume, ctx)
    except UsageError as err:
        failure = err
    if ctx.distributed:  # every process stops together if any of them found a user error
        anyone, main_failed = distributed.flags(ctx, failure is not None, failure is not None and ctx.main)
        if anyone and failure is None:
            if rundir is not None:
                rundir.discard()
            raise UsageError("another process rejected the configuration (see its message)")
        if failure is not None and not ctx.main and not main_failed:
            print(f"posenc study (rank {ctx.rank}): error: {failure}", file=sys.stderr)
    if failure is not None:
        raise failure
    try:
        return _run(cfg, models, out, corpus, results, rundir, ctx, Progress(progress, main=ctx.main), on_step, started)
    except WriteError as err:
        raise WriteError(f"{err}; finished work is in {out}: make room, then continue with resume") from err
    finally:
        if rundir is not None:
            rundir.release()


def _run(cfg: StudyConfig, models: Models, out: Path, corpus: Corpus | None, results: dict, rundir: RunDir | None,
         ctx: distributed.Context, ui: Progress, on_step: StepCallback | None, started: float) -> dict:
    """The pipeline: plan the runs, then for each run the stages of :mod:`.pipeline` (model and
    training, scoring, writing), skipping the runs a resumed study finished."""
    paths = Paths(out)
    if rundir is not None and rundir.notice:
        ui.warn(rundir.notice)
    if ctx.main:
        write_json(paths.results, results)
    study = plan(cfg, models, paths, ctx.world)
    book = Book(results, paths, ctx, cfg)
    stages = Stages(study, corpus, book, ctx, ui, on_step)
    ui.study_bar(len(study.runs), sum(book.finished(run) for run in study.runs))
    what = (f"{cfg.steps} steps of {cfg.batch_size} x {cfg.train_length} bytes" if corpus is not None else
            f"{cfg.steps} steps of {cfg.batch_size} recall sequences of {cfg.train_length}")
    ui.log(f"posenc study: {len(cfg.rows)} row(s) x {cfg.seeds} seed(s), task {cfg.task}, train length "
           f"{cfg.train_length}, eval {cfg.eval_lengths}, {what}, out {out}")
    if results.get("hf"):
        hf = results["hf"]
        ui.log(f"model: {hf['model_type']} from {hf['path']} (sha256 {hf['sha256'][:12]}), "
               f"{hf['num_hidden_layers']} layers, hidden {hf['hidden_size']}, {hf['num_attention_heads']} heads "
               f"({hf['num_key_value_heads']} key/value), vocab {hf['vocab_size']}, random initialisation")
    if corpus is not None:
        ui.log(corpus.summary())
        for s in corpus.skipped:
            ui.warn(f"data: skipped {s['file']}: {s['reason']}")
    try:
        for run in study.runs:
            if book.finished(run):
                ui.log(f"[{run.label}] {(book.run_of(run) or {}).get('status')} already, skipped")
                continue
            stages.run(run)
            ui.method_done()
    finally:
        ui.finish()
    status = [seeds.run_of(results["methods"].get(name) or {}, i) if name in results["methods"] else None
              for name in results["config"]["methods"] for i in range(results["config"].get("seeds", 1))]
    results["status"] = "done" if all(s is not None and s.get("status") in ("done", "diverged") for s in status) \
        else "partial"
    # Wall time of the study: this run's, plus that of the earlier runs of a resumed study that finished.
    results["wall_s"] = round(results.get("wall_s", 0.0) + time.perf_counter() - started, 1)
    if ctx.main:
        write_json(paths.results, results)
        write_outputs(results, out, table=True)
        with contextlib.suppress(OSError):
            (out / "state").rmdir()  # only when empty: no method is mid-training
    return results
