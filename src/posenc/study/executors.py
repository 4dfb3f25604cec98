"""Several runs of a study at a time: local worker processes (``jobs``) or Ray tasks.

The main process keeps the plan and results.json (:class:`.results_writer.ResultsWriter`, the one writer of it).
It hands out the runs in plan order, a run evaluated or fine-tuned from another only once that
base has finished, applies each record a worker sends back, and shows the one progress display
(the workers' log lines pass through it). A worker (:mod:`.worker`) makes the stages of a serial
study over the same plan, writes its run's own files and sends the run's record after each step
with its log lines.

A run's numbers depend only on the config, its seed and the threads it runs at (``threads``, each
worker's; the batches are a function of the step, the initial model of the seed), so a study run
this way equals a serial study at the same threads, number for number.

An interrupt (Ctrl-C reaches the workers too: a training finishes its step and checkpoints) stops
every worker; what they sent is in results.json, their training states are on disk, and
``--resume`` continues, serially or with workers again.
"""

from __future__ import annotations

import copy
import importlib.util
import multiprocessing
import os
import queue
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import torch

from ..errors import UsageError
from . import seeds
from .config import StudyConfig
from .data import Corpus
from .events import Log, Report, RunDone, Warn
from .plan import Run
from .results_writer import ResultsWriter
from .worker import Key, Message, Setup, Task, key_of, local_worker, ray_task

EXECUTORS = ("local", "ray")
RAY_MISSING = "executor ray needs the ray package: pip install 'posenc[ray]'"

@dataclass(frozen=True)
class Execution:
    """How a study's runs are spread: ``jobs`` at a time, each at ``threads`` threads, in local
    processes or Ray tasks (``executor``; ``address``: an existing Ray cluster, None: a local one)."""

    jobs: int = 1
    threads: int | None = None  # None: this process's torch threads
    executor: str = "local"
    address: str | None = None

    @property
    def parallel(self) -> bool:
        """Runs go to workers (jobs > 1, or Ray): not one after another in this process."""
        return self.jobs > 1 or self.executor == "ray"

    def check(self) -> None:
        """Raises:
            UsageError: ``jobs`` or ``threads`` below 1, an unknown ``executor``, an ``address``
                without Ray, or executor ``ray`` where the ray package is not installed.
        """
        if self.jobs < 1:
            raise UsageError(f"jobs must be >= 1, got {self.jobs}")
        if self.threads is not None and self.threads < 1:
            raise UsageError(f"threads must be >= 1, got {self.threads}")
        if self.executor not in EXECUTORS:
            raise UsageError(f"executor must be one of {', '.join(EXECUTORS)}, got {self.executor!r}")
        if self.address is not None and self.executor != "ray":
            raise UsageError("ray_address needs executor ray (--executor ray)")
        if self.executor == "ray" and importlib.util.find_spec("ray") is None:  # (before the study's folder is made)
            raise UsageError(RAY_MISSING)


def chain(run: Run) -> list[Run]:
    """``run`` and its bases, nearest first."""
    out = [run]
    while out[-1].base is not None:
        out.append(out[-1].parent)
    return out


# -- the main process's side -----------------------------------------------------------------------------


class Pool(Protocol):
    def submit(self, task: Task) -> None: ...

    def receive(self, timeout: float) -> list[Message]:
        """The messages that arrived, waiting up to ``timeout`` seconds for the first."""

    def stop(self) -> list[Message]:
        """End every worker now; the messages they sent before."""

    def close(self) -> None: ...


def _context() -> Any:  # (a multiprocessing context)
    """Fresh worker processes: forked from a server process that has imported posenc and torch but
    run nothing (``forkserver``: no thread pool is forked, the imports are paid once per study
    command, not per worker), or started anew (``spawn``) where there is no fork."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        mp = multiprocessing.get_context("forkserver")
        mp.set_forkserver_preload([__name__])
        return mp
    return multiprocessing.get_context("spawn")


class LocalPool:
    """``jobs`` worker processes (:func:`_context`), fed through one task queue."""

    def __init__(self, setup: Setup, jobs: int) -> None:
        mp = _context()
        self.tasks, self.messages = mp.Queue(), mp.Queue()
        self.procs = [mp.Process(target=local_worker, args=(setup, self.tasks, self.messages, os.getpid()), daemon=True,
                                 name=f"posenc-study-worker-{i}") for i in range(jobs)]
        for p in self.procs:
            p.start()

    def submit(self, task: Task) -> None:
        self.tasks.put(task)

    def _drain(self) -> list[Message]:
        out = []
        while True:
            try:
                out.append(self.messages.get(timeout=0.05))
            except queue.Empty:
                return out

    def receive(self, timeout: float) -> list[Message]:
        try:
            first = self.messages.get(timeout=timeout)
        except queue.Empty:
            dead = [p for p in self.procs if p.exitcode is not None]
            if dead:
                out = self._drain()
                if out:
                    return out
                raise RuntimeError(f"a study worker (pid {dead[0].pid}) ended with exit code {dead[0].exitcode} without a "
                                   "word: killed or out of memory, or its error is printed above (a script that starts a "
                                   "study with jobs > 1 must do so under `if __name__ == \"__main__\":`, as the workers "
                                   "import it); finished work is kept: continue with resume")
            return []
        return [first, *self._drain()]

    def stop(self) -> list[Message]:
        for p in self.procs:  # a Ctrl-C reached them too: a training finishes its step and checkpoints
            p.join(timeout=5)
        for p in self.procs:
            if p.is_alive():
                p.terminate()  # (SIGTERM: the same, for a worker the Ctrl-C did not reach)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
        return self._drain()

    def close(self) -> None:
        for _ in self.procs:
            self.tasks.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()


class RayPool:
    """Each run a Ray task needing ``threads`` CPUs (and one GPU on a cuda device), on a local Ray
    instance (started here and shut down after) or the cluster at ``address``."""

    def __init__(self, setup: Setup, address: str | None) -> None:
        try:
            import ray
        except ImportError:
            raise UsageError(RAY_MISSING) from None
        self.ray = ray
        self.owned = not ray.is_initialized()
        if self.owned:
            try:
                ray.init(address=address, include_dashboard=False, log_to_driver=True)
            except (ConnectionError, ValueError, RuntimeError) as err:
                raise UsageError(f"ray_address: cannot start or join Ray at {address or 'a local instance'} ({err})") from None
        gpus = 1 if torch.device(setup.cfg.device).type == "cuda" else 0
        self.setup = ray.put(setup)
        self.remote = ray.remote(num_cpus=setup.threads, num_gpus=gpus, max_retries=0)(ray_task)
        self.pending: dict[Any, Key] = {}

    def submit(self, task: Task) -> None:
        self.pending[self.remote.remote(self.setup, task)] = task.key

    def receive(self, timeout: float) -> list[Message]:
        if not self.pending:
            return []
        ready, _ = self.ray.wait(list(self.pending), num_returns=1, timeout=timeout)
        out: list[Message] = []
        for ref in ready:
            key = self.pending.pop(ref)
            try:
                out.extend(self.ray.get(ref))
            except self.ray.exceptions.RayError as err:
                out.append(("failed", key, "error", str(err)))
        return out

    def stop(self) -> list[Message]:
        for ref in self.pending:
            self.ray.cancel(ref)  # (a KeyboardInterrupt in the task: a training checkpoints its step)
        out: list[Message] = []
        for ref in list(self.pending):
            try:
                out.extend(self.ray.get(ref, timeout=60))
            except Exception:  # (cancelled: its records are lost, its training state is on disk)
                pass
        self.pending.clear()
        return out

    def close(self) -> None:
        if self.owned:
            self.ray.shutdown()


def cores() -> int:
    """The CPU cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not on Linux)
        return os.cpu_count() or 1


def executor(execution: Execution, cfg: StudyConfig, out: Path, corpus: Corpus | None, progress: bool
             ) -> Callable[[ResultsWriter, Sequence[Run], Report], None]:
    """What :func:`.pipeline.run_all` calls to run the runs not yet finished with ``execution``."""
    setup = Setup(cfg, str(out), corpus, execution.threads or torch.get_num_threads(), progress)

    def execute(writer: ResultsWriter, runs: Sequence[Run], report: Report) -> None:
        if not runs:
            return
        pool: Pool = RayPool(setup, execution.address) if execution.executor == "ray" else LocalPool(setup, min(execution.jobs, len(runs)))
        slots = execution.jobs if execution.jobs > 1 or execution.executor == "local" else len(runs)
        try:
            schedule(pool, writer, runs, slots, report)
        finally:
            pool.close()

    return execute


def schedule(pool: Pool, writer: ResultsWriter, runs: Sequence[Run], slots: int, report: Report) -> None:
    """Run ``runs`` on ``pool``, up to ``slots`` at a time, each once its base has finished; every
    record into ``writer`` (results.json) as it arrives, the workers' lines and finished runs to
    ``report`` (as :class:`~.events.Log`, :class:`~.events.Warn`, :class:`~.events.RunDone`).

    Raises:
        UsageError: a worker's run raised one (its message; the other workers are stopped).
        KeyboardInterrupt: an interrupt here or in a worker (every worker is stopped).
        RuntimeError: a worker failed (its traceback) or died.
    """
    by_key = {key_of(r): r for run in runs for r in chain(run)}
    waiting, running = list(runs), set()

    def ready(run: Run) -> bool:
        return run.base is None or (key_of(run.base) not in running and writer.finished(run.base))

    def snapshot(run: Run) -> dict:
        methods = writer.results["methods"]
        return {r.row.name: copy.deepcopy(methods[r.row.name]) for r in chain(run) if r.row.name in methods}

    def handle(message: Message, records_only: bool = False) -> None:
        kind = message[0]
        if kind == "record":
            writer.set(by_key[message[1]], message[2])
            writer.save()
        elif records_only:
            return
        elif kind == "log":
            report(Log(message[1]))
        elif kind == "warn":
            report(Warn(message[1]))
        elif kind == "done":
            run = by_key[message[1]]
            running.discard(message[1])
            for base in chain(run)[1:]:  # (a base's record that came again: its seeds' mean again)
                seeds.aggregate(writer.results["methods"][base.row.name], base.row.stem, writer.paths, writer.cfg.task == "recall")
            writer.aggregate(run)
            report(RunDone(run.label))
        elif kind == "failed":
            label = by_key[message[1]].label
            if message[2] == "interrupt":
                raise KeyboardInterrupt
            if message[2] == "usage":
                raise UsageError(message[3])
            raise RuntimeError(f"[{label}] failed in a worker:\n{message[3]}")

    try:
        while waiting or running:
            while len(running) < slots:
                run = next((r for r in waiting if ready(r)), None)
                if run is None:
                    break
                waiting.remove(run)
                running.add(key_of(run))
                pool.submit(Task(key_of(run), snapshot(run)))
            if not running:  # (a base that is neither finished nor among the runs: a bug)
                raise RuntimeError(f"[{waiting[0].label}] waits for a base run that will not run")
            for message in pool.receive(1.0):
                handle(message)
    except BaseException:
        for message in pool.stop():
            handle(message, records_only=True)
        raise


__all__ = ["EXECUTORS", "Execution", "LocalPool", "RayPool", "cores", "executor", "schedule"]
