"""A worker of a study run several runs at a time (:mod:`.executors`): a local process or a Ray task.

It makes the stages of a serial study (:class:`.pipeline.Stages`) over the main process's plan (the
same config), runs the tasks it is given, writes each run's own files (checkpoint, training state,
window scores), and sends the rest as messages: the run's record after each step
(:class:`WorkerResultsWriter`), its log lines (:class:`WorkerProgress`), then ``done`` or ``failed``. The
main process applies them, the one writer of results.json.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import UsageError
from . import distributed
from .config import StudyConfig
from .data import Corpus
from .models import models_for
from .pipeline import Stages
from .plan import Run, plan
from .progress import Progress
from .results import Paths
from .results_writer import ResultsWriter

Key = tuple[str, int]  # a run: its row's name and its seed's index
Message = tuple  # ("log" | "warn", text), ("record", key, record), ("done", key), ("failed", key, kind, text)
Emit = Callable[[Message], None]


@dataclass(frozen=True)
class Setup:
    """What a worker needs to make the stages of a study (sent to it once)."""

    cfg: StudyConfig
    out: str
    corpus: Corpus | None
    threads: int
    progress: bool


@dataclass(frozen=True)
class Task:
    """One run for a worker: its key and the results.json entries of its row and its bases' rows
    as they are when it starts (its record, if resumed, and its base's)."""

    key: Key
    methods: dict


def key_of(run: Run) -> Key:
    return run.row.name, run.index


class WorkerResultsWriter(ResultsWriter):
    """A worker's view of results.json: the entries its task brought; each save sends the task's
    run's record (set now, or brought and added to) and any other record this task set (a base's,
    trained again when its checkpoint was missing) to the main process instead of writing the file."""

    def __init__(self, paths: Paths, ctx: distributed.Context, cfg: StudyConfig, runs: dict[Key, Run], emit: Emit) -> None:
        super().__init__({"methods": {}}, paths, ctx, cfg)
        self.runs, self.emit = runs, emit
        self.touched: dict[Key, Run] = {}  # the runs this task set a record of

    def set(self, run: Run, record: dict) -> dict:
        self.touched[key_of(run)] = run
        return super().set(run, record)

    def save(self, outputs: bool = False) -> None:
        for key, run in self.touched.items():
            record = self.run_of(run)
            if record is not None:
                self.emit(("record", key, {k: v for k, v in record.items() if k not in ("row", "seeds", "across_seeds")}))

    def aggregate(self, run: Run) -> None:  # (the main process aggregates the seeds)
        self.save()


class WorkerProgress(Progress):
    """A worker's run's events as the lines a serial study shows (:class:`.progress.Progress`
    without bars), sent to the main process, which shows them."""

    def __init__(self, enabled: bool, emit: Emit) -> None:
        super().__init__(enabled, bars=False)
        self.emit = emit

    def log(self, msg: str) -> None:
        if self.enabled:
            self.emit(("log", msg))

    def warn(self, msg: str) -> None:
        self.emit(("warn", msg))


def make_stages(setup: Setup, emit: Emit) -> Stages:
    """The stages of ``setup``'s study in this worker (its plan is the main process's: the same config)."""
    torch.set_num_threads(setup.threads)
    cfg = setup.cfg
    paths = Paths(Path(setup.out))
    study = plan(cfg, models_for(cfg), paths, 1)
    ctx = distributed.Context(torch.device(cfg.device))
    writer = WorkerResultsWriter(paths, ctx, cfg, {key_of(r): r for r in study.runs}, emit)
    return Stages(study, setup.corpus, writer, ctx, WorkerProgress(setup.progress, emit))


def run_task(stages: Stages, task: Task, emit: Emit) -> bool:
    """Run ``task`` through ``stages``, sending its records, then ``done`` (True) or ``failed`` (False)."""
    writer = stages.writer
    assert isinstance(writer, WorkerResultsWriter)
    writer.emit = emit
    assert isinstance(stages.report, WorkerProgress)
    stages.report.emit = emit
    run = writer.runs[task.key]
    writer.results["methods"] = copy.deepcopy(task.methods)
    # The task's own run is sent after every save, whichever stage changed its record: a resumed
    # run trained but not evaluated has its evaluations added to the record it brought, not set anew
    writer.touched = {task.key: run}
    try:
        stages.run(run)
    except KeyboardInterrupt:
        emit(("failed", task.key, "interrupt", ""))
        return False
    except UsageError as err:
        emit(("failed", task.key, "usage", str(err)))
        return False
    except BaseException:
        emit(("failed", task.key, "error", traceback.format_exc()))
        return False
    emit(("done", task.key))
    return True


def exit_with(parent: int, every: float = 1.0) -> threading.Thread:
    """A daemon thread that ends this process (exit status 1) once process ``parent`` is gone: a
    study's workers die with its main process, even one killed by SIGKILL (which runs no cleanup).
    The worker's own parent is the forkserver, so the main process's pid is given."""
    def watch() -> None:
        while True:
            time.sleep(every)
            try:
                os.kill(parent, 0)  # signal 0: only asks whether the process exists
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:  # exists, owned by another user (cannot be ours): keep watching
                pass

    thread = threading.Thread(target=watch, name="posenc-parent-watch", daemon=True)
    thread.start()
    return thread


def local_worker(setup: Setup, tasks: Any, messages: Any, parent: int | None = None) -> None:  # (multiprocessing queues)
    """A local worker process: runs tasks until told to stop (None) or one fails; exits when the
    study's main process ``parent`` is gone."""
    if parent is not None:
        exit_with(parent)
    try:
        stages = make_stages(setup, messages.put)
        while (task := tasks.get()) is not None:
            if not run_task(stages, task, messages.put):
                break
    except KeyboardInterrupt:  # (between tasks: the main process stops the study)
        return


_RAY_STAGES: dict[str, Stages] = {}  # a Ray worker process's stages, per study (Ray reuses its workers)


def ray_task(setup: Setup, task: Task) -> list[Message]:
    """One run as a Ray task: log lines printed here (Ray forwards them), records returned."""
    sent: list[Message] = []

    def emit(message: Message) -> None:
        if message[0] in ("log", "warn"):
            print(message[1], file=sys.stderr, flush=True)
        else:
            sent.append(message)

    name = setup.out + json.dumps(asdict(setup.cfg), sort_keys=True, default=str)
    if name not in _RAY_STAGES:
        _RAY_STAGES[name] = make_stages(setup, emit)
    run_task(_RAY_STAGES[name], task, emit)
    return sent


__all__ = ["Emit", "Key", "Message", "Setup", "Task", "WorkerResultsWriter", "WorkerProgress", "key_of", "local_worker", "make_stages",
           "ray_task", "run_task"]
