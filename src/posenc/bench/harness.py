"""The parent process: launch one fresh worker per job, round after round, and collect.

:func:`bench` is the whole run from Python: check the options, plan the rounds, run every job in
its own interpreter (``python -m posenc.bench.worker JOB_JSON``), summarize. Each result is handed
to ``on_result`` as it comes, so a caller can save the measurements before the run ends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .job import POSENC, Job, cell_key, label
from .levels import LEVELS
from .libraries import library_of
from .machine import describe_machine
from .plan import Config, configure, entries, plan
from .stats import summarize
from .worker import RESULT_TAG, run_worker


@dataclass
class Results:
    """A finished (or interrupted) run: its options, machine, every job's record and the table's rows."""

    config: Config
    meta: dict
    jobs: list[dict] = field(default_factory=list)  # one record per job and round, in run order
    cells: list[dict] = field(default_factory=list)  # one row per table cell, in table order

    def summarize(self) -> Results:
        order = {(m, impl, c): i for i, (m, impl, c) in enumerate(sorted(entries(self.config), key=_table_order(self.config)))}
        rows = summarize(self.jobs)
        rows.sort(key=lambda r: (r["length"], self.config.modes.index(r["mode"]), order[(r["method"], r["impl"], r["control"])]))
        self.cells = rows
        return self


def _table_order(config: Config) -> Callable:
    """Rows of one length and mode: methods as given (NoPE first, then its control), each implementation."""
    methods = {m: i for i, m in enumerate(config.methods)}
    return lambda e: (methods[e[0]], e[2], e[1] != POSENC)


def _package_root() -> str:
    return str(Path(__file__).resolve().parents[2])  # the folder that holds posenc/ (src/)


def launch(job: Job, timeout: float | None = None, isolate: bool = True) -> dict:
    """Run ``job`` in a fresh interpreter; a worker that gives no result becomes a failed record.

    ``isolate=False`` runs it in this process instead: for tests of the harness only, since the
    memory figures then include everything this process did before.
    """
    if job.impl != POSENC and not library_of(job.impl).has_counterpart(job.method):
        return dict(job.to_dict(), status="n/a", error=f"{library_of(job.impl).NAME} has no counterpart of {job.method!r}")
    start = time.perf_counter()
    if not isolate:
        return dict(run_worker(job), wall_s=time.perf_counter() - start)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_package_root(), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "posenc.bench.worker", job.to_json()]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return dict(job.to_dict(), status="failed", error=f"timed out after {timeout} s", wall_s=time.perf_counter() - start)
    wall = time.perf_counter() - start
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return dict(json.loads(line[len(RESULT_TAG):]), wall_s=wall)
    tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
    why = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit status {proc.returncode}"
    if proc.returncode == -9:
        why += " (out of memory?)"
    return dict(job.to_dict(), status="failed", error=f"worker {why}: {tail}".strip(), wall_s=wall)


def progress_line(r: dict) -> str:
    """One progress line for a job's record."""
    head = f"round {r['round'] + 1} {r['level']}/{r['mode']} {label(r)} N={r['length']} {r['impl']}"
    if r.get("status") != "ok":
        return f"{head}: {r.get('status')}: {r.get('error', '')[:200]}"
    return (
        f"{head} [{r.get('backend_used')}]: {r['median_s']:.4g} s, {r['tokens_per_s']:,.0f} tok/s, "
        f"peak {r['peak_mb']:.0f} MB (+{r['increase_mb']:.0f})"
    )


def title(config: Config) -> str:
    spec = LEVELS[config.level]
    return (
        f"posenc bench, {config.level} level ({spec.describe(config.sizes)}); {config.dtype}, {config.device}, "
        f"backend {config.backend}; {config.rounds} rounds, each job the median of {config.repeats} "
        f"after {config.warmup} warm-up"
    )


def run(
    config: Config,
    on_result: Callable[[list[dict]], None] | None = None,
    progress: bool = True,
    isolate: bool = True,
    kept: list[dict] | None = None,
) -> Results:
    """Run every job of ``config`` (see :func:`posenc.bench.plan.plan`) and summarize.

    A refusal by a compared library does not change between rounds: it is measured (built) once
    and copied to the later rounds. ``kept``: records of an interrupted run of the same options
    (its journal); a job with a record there is not run again (``--resume``).
    """
    done = {(cell_key(r), r["round"]): r for r in kept or []}
    meta = {"title": title(config), "machine": describe_machine(), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "options": config.to_dict()}
    if config.compare:
        from importlib.metadata import version

        meta["versions"] = {name: version(name) for name in config.compare}
    results = Results(config, meta)
    jobs = plan(config)
    refused: dict[tuple, dict] = {}
    for i, job in enumerate(jobs, 1):
        if (job.cell, job.round) in done:
            record = done[(job.cell, job.round)]
            if record.get("status") == "refused":
                refused[cell_key(record)] = record
            results.jobs.append(record)
            if progress:
                print(f"[{i:>{len(str(len(jobs)))}}/{len(jobs)}] kept: {progress_line(record)}", file=sys.stderr, flush=True)
            continue
        if job.cell in refused:
            record = dict(refused[job.cell], round=job.round, wall_s=0.0)
        else:
            record = launch(job, config.timeout, isolate)
            if record.get("status") == "refused":
                refused[cell_key(record)] = record
        results.jobs.append(record)
        if on_result is not None:
            on_result(results.jobs)
        if progress:
            print(f"[{i:>{len(str(len(jobs)))}}/{len(jobs)}] {progress_line(record)}", file=sys.stderr, flush=True)
    return results.summarize()


def bench(progress: bool = True, isolate: bool = True, on_result: Callable | None = None, **options: Any) -> Results:
    """Check ``options`` (see :func:`posenc.bench.plan.configure`), run the table, return its results.

    ``isolate=False`` measures in this process (tests only; see :func:`launch`).
    """
    return run(configure(**options), on_result=on_result, progress=progress, isolate=isolate)
