"""Running a study: check everything first, then train and evaluate each row in turn (every row
at the first seed, then every row at the next), saving as it goes, so that an interrupted run
continues with ``resume=True`` (``--resume``) exactly where it stopped: finished runs (a row at a
seed) are skipped, the one that was interrupted continues from its last saved step.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

import torch

from ..errors import UsageError
from ..files import MARKER, RunDir, WriteError, write_json
from ..version import __version__
from . import distributed, recall
from .config import StudyConfig
from .data import Corpus, load_corpus
from .events import Event, Report, StepDone
from .executors import Execution, executor
from .models import checked_models
from .pipeline import run_all
from .plan import Plan, plan
from .plan import shard as part_of
from .progress import Progress
from .results import SCHEMA, Paths, check_resumable, load_results
from .rows import expand, parse

# Called after every finished training step as on_step(method, step): a hook for callers (and how
# the tests interrupt a run at an exact step).
StepCallback = Callable[[str, int], None]


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


def prepare(cfg: StudyConfig, out: Path, resume: bool, ctx: distributed.Context, part: tuple[int, int] | None = None
            ) -> tuple[Plan, Corpus | None, dict, RunDir | None]:
    """Check the study, claim ``out``, load the data and plan the runs: every user error surfaces
    here, before training. In order: the options against the rows (a resumed study's saved rows
    count too), every row's model (:func:`.models.checked_models`), the task's data, the saved
    study (a resume), then the runs (:func:`.plan.plan`). Returns the plan, the corpus (None for
    the recall task: its sequences are generated), the results to fill, and on the main process the
    claimed (locked) directory. ``part``: ``(K, N)``, the K-th of N parts of the runs
    (:func:`.plan.shard`); a study saved as a part continues as that part.

    Raises:
        UsageError: ``batch_size`` not divisible by the number of processes; ``resume`` without a
            study in ``out``, or a new study where ``out`` already holds one, or one saved with
            other options, model or data (:func:`.results.check_resumable`); a ``train_length`` or
            ``eval_lengths`` longer than the corpus' training or validation split allows, or too
            short for the recall task; ``part`` other than the saved study's, or too many parts.
    """
    # The saved rows, read early for the option checks; read again below once the directory is
    # claimed (locked): that read is the one resumed, as another process may have written since.
    before = load_results(out) if resume and (out / "results.json").exists() else None
    also = [parse(m) for m in before["config"]["methods"]] if before else []
    cfg.check_applies([*cfg.rows, *also])
    comparable = cfg.comparable()
    models = checked_models(cfg)
    hf = models.architecture() if cfg.hf_config is not None else None
    if cfg.batch_size % ctx.world:
        raise UsageError(f"batch_size ({cfg.batch_size}) must be divisible by the number of processes ({ctx.world})")
    fingerprint = None  # (the recall task's now; the corpus' once it is loaded)
    if cfg.task == "recall":
        fingerprint = recall.fingerprint([cfg.train_length, *cfg.eval_lengths], cfg.recall_sequences)
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
            fingerprint = corpus.fingerprint
        assert fingerprint is not None  # (the recall task's, or the corpus')
        if saved is not None:
            check_resumable(saved, comparable, fingerprint, hf, out)
            part = _saved_part(saved, part, out)
        made = plan(cfg, models, Paths(out), ctx.world)
        if part is not None:
            made = replace(made, runs=part_of(made.runs, *part))
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
    if part is not None:
        results["shard"] = {"index": part[0], "count": part[1]}
    results["versions"] = environment(ctx)
    return made, corpus, results, rundir


def _saved_part(saved: dict, part: tuple[int, int] | None, out: Path) -> tuple[int, int] | None:
    """The part a resumed study continues as: the saved one (``part`` must agree with it).

    Raises:
        UsageError: ``part`` differs from the saved study's (a part, or the whole study).
    """
    kept = saved.get("shard")
    before = None if kept is None else (int(kept["index"]), int(kept["count"]))
    if part is not None and part != before:
        was = "the whole study" if before is None else f"part {before[0]}/{before[1]}"
        raise UsageError(f"shard: {out} holds {was}, not part {part[0]}/{part[1]}; resume it as it was, "
                         "or run the part into another out")
    return before


def run_experiment(cfg: StudyConfig, out: str | Path, *, resume: bool = False, progress: bool = True,
                   ctx: distributed.Context | None = None, on_step: StepCallback | None = None,
                   execution: Execution | None = None, shard: tuple[int, int] | None = None) -> dict:
    """Run (or continue) a study; returns the results dict (also in ``out/results.json``).

    Args:
        cfg: the study (checked when it was made; the checks that need its models run here,
            before anything is written).
        out: output directory (see :mod:`posenc.study.results` for its files).
        resume: continue the study already in ``out`` (finished methods are skipped).
        progress: bars or log lines on stderr.
        ctx: this process's place under torchrun (default: one process on ``cfg.device``).
        on_step: called as ``on_step(method, step)`` after every training step (runs in this
            process only: not with a parallel ``execution``).
        execution: how many runs at a time, at how many threads each, where (:mod:`.executors`);
            default: one after another in this process.
        shard: ``(K, N)``: only the K-th of N parts of the runs (:func:`.plan.shard`), to be merged
            with the others (:mod:`.merge`).

    Raises:
        UsageError: another process of a distributed study rejected the configuration (its own
            message names the option); a parallel ``execution`` under torchrun or with ``on_step``.
    """
    ctx = ctx or distributed.Context(torch.device(cfg.device))
    execution = execution or Execution()
    execution.check()
    if execution.parallel and ctx.distributed:
        raise UsageError("jobs: torchrun runs one study's every step in several processes (DDP); jobs and executor ray "
                         "run several runs at a time, each in one process: use one or the other")
    if execution.parallel and on_step is not None:
        raise UsageError("jobs: a step callback (on_step) is called in this process only; run serially (jobs 1) to use one")
    out = Path(out)
    started = time.perf_counter()
    failure = None
    rundir = None
    try:
        study, corpus, results, rundir = prepare(cfg, out, resume, ctx, shard)
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
    if execution.parallel:  # (the threads of each run: the workers')
        results["versions"].update(torch_threads=execution.threads or torch.get_num_threads(), jobs=execution.jobs,
                                   executor=execution.executor)
    try:
        if ctx.main:
            write_json(study.paths.results, results)
        ui = Progress(progress, main=ctx.main)
        if rundir is not None and rundir.notice:
            ui.warn(rundir.notice)
        execute = executor(execution, cfg, out, corpus, progress) if execution.parallel else None
        return run_all(study, corpus, results, ctx, _shown(ui, on_step), started, execute)
    except WriteError as err:
        raise WriteError(f"{err}; finished work is in {out}: make room, then continue with resume") from err
    finally:
        if rundir is not None:
            rundir.release()


def _shown(ui: Progress, on_step: StepCallback | None) -> Report:
    """Where the study's events go: ``ui``, and each finished step to ``on_step`` too."""
    if on_step is None:
        return ui

    def report(event: Event) -> None:
        ui(event)
        if isinstance(event, StepDone):
            on_step(event.label, event.step)

    return report


__all__ = ["environment", "prepare", "run_experiment"]
