"""Running a study: check everything first, then train and evaluate each method in turn, saving
as it goes, so that an interrupted run continues with ``resume=True`` (``--resume``) exactly where
it stopped.
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

from .. import distributed
from ..checkpoint import load_checkpoint, save_checkpoint
from ..data import Corpus, load_corpus
from ..errors import UsageError
from ..files import MARKER, RunDir, WriteError, write_json
from ..model import LM
from ..version import __version__
from .config import StudyConfig
from .evaluation import cannot_run, evaluate
from .progress import Progress
from .results import SCHEMA, Paths, load_results, write_outputs
from .train import StateError, StepCallback, train_method


def versions(ctx: distributed.Context) -> dict:
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


def _check_same(saved: dict, cfg: StudyConfig, corpus: Corpus, out: Path) -> None:
    old = {k: v for k, v in saved["config"].items() if k != "methods"}
    new = cfg.comparable()
    diff = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    if diff:
        raise UsageError(f"resume: {out} was run with a different config ({'; '.join(diff)}); "
                         "use the original options or another out")
    if saved.get("corpus", {}).get("sha256") != corpus.fingerprint["sha256"]:
        raise UsageError(f"resume: the corpus differs from the one {out} was trained on "
                         f"(sha256 {saved.get('corpus', {}).get('sha256')} vs {corpus.fingerprint['sha256']})")


def prepare(cfg: StudyConfig, out: Path, resume: bool, ctx: distributed.Context
            ) -> tuple[Corpus, dict, RunDir | None]:
    """Validate everything, claim ``out`` and load the data: every user error surfaces here,
    before training. The main process returns the claimed (locked) directory."""
    cfg.validate()
    if cfg.batch_size % ctx.world:
        raise UsageError(f"batch_size ({cfg.batch_size}) must be divisible by the number of processes ({ctx.world})")
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
        corpus = load_corpus(cfg.data, cfg.valid_bytes)
        if corpus.train.numel() < cfg.train_length + 2:
            raise UsageError(f"train_length ({cfg.train_length}) needs a training split longer than "
                             f"{corpus.train.numel()} bytes")
        if max(cfg.eval_lengths) > corpus.valid_tokens:
            raise UsageError(
                f"eval_lengths: {max(cfg.eval_lengths)} exceeds the {corpus.valid_tokens} validation tokens "
                f"(valid_bytes={cfg.valid_bytes}, or a small corpus); use shorter eval_lengths or more data"
            )
        if saved is not None:
            _check_same(saved, cfg, corpus, out)
    except BaseException:
        if rundir is not None:
            rundir.discard()  # a directory made for this run alone is removed again
        raise
    if saved is not None:
        results = saved
        results["config"]["methods"] = list(dict.fromkeys([*saved["config"]["methods"], *cfg.methods]))
        results["status"] = "running"
    else:
        results = {
            "schema": SCHEMA, "status": "running", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config": asdict(cfg), "seed": cfg.seed,
            "corpus": corpus.fingerprint, "methods": {},
        }
    results["versions"] = versions(ctx)
    return corpus, results, rundir


def _final_model(method: str, cfg: StudyConfig, corpus: Corpus, results: dict, paths: Paths,
                 ctx: distributed.Context, ui: Progress, on_step: StepCallback | None) -> LM:
    """The trained model of ``method``: its final checkpoint, or trained now (continuing from
    its saved state) and checkpointed."""
    entry = results["methods"].get(method)
    checkpoint = paths.checkpoint(method)
    if entry is not None and entry.get("status") in ("trained", "done"):
        if checkpoint.exists():
            try:
                return load_checkpoint(checkpoint, ctx.device)
            except UsageError as err:
                raise UsageError(f"{err}; delete {checkpoint} and continue with resume to train {method} "
                                 "again") from None
        ui.warn(f"[{method}] its checkpoint {checkpoint} is missing: training it again")
    state = paths.state(method)
    try:
        model, record = train_method(method, cfg, corpus, state, ctx, ui, on_step)
    except StateError as err:
        raise UsageError(f"{err}; delete it and continue with resume: {method} then trains again from step 0, "
                         "other methods keep their results") from None
    results["methods"][method] = {
        "status": "trained", "model": model.config.to_dict(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "checkpoint": str(checkpoint.relative_to(paths.root)),
        "train": record, "eval": [],
    }
    if ctx.main:
        save_checkpoint(model, checkpoint)
        write_json(paths.results, results)
        state.unlink(missing_ok=True)  # the final checkpoint replaces it
    ui.log(f"[{method}] trained {record['steps']} steps in {record['time_s']:.1f}s "
           f"({record['tokens_per_s']:,.0f} tok/s), final loss {record['final_loss']:.3f}")
    return model


def run_method(method: str, cfg: StudyConfig, corpus: Corpus, results: dict, paths: Paths,
               ctx: distributed.Context, ui: Progress, on_step: StepCallback | None = None) -> None:
    """Train ``method`` (unless its checkpoint is final already), then evaluate every length not
    yet in results.json, saving after each."""
    model = _final_model(method, cfg, corpus, results, paths, ctx, ui, on_step)
    if ctx.main:  # a kill right after the final checkpoint can leave the last state behind
        paths.state(method).unlink(missing_ok=True)
    entry = results["methods"][method]
    done_lengths = {e["length"] for e in entry["eval"]}
    todo = [n for n in cfg.eval_lengths if n not in done_lengths]
    bar = ui.eval_bar(method, len(cfg.eval_lengths), len(cfg.eval_lengths) - len(todo))
    for length in todo:
        ui.evaluating(bar, length)
        t0 = time.perf_counter()
        reason = cannot_run(model, length)
        if reason:
            row = {"length": length, "perplexity": None, "bits_per_byte": None, "loss": None,
                   "tokens": corpus.valid_tokens, "status": reason}
        else:
            on_batch, done = ui.windows(method, length)
            try:
                row = {"length": length, **evaluate(model, corpus.valid, length, cfg.sliding, ctx, on_batch),
                       "status": "ok"}
            finally:
                done()
        row["time_s"] = round(time.perf_counter() - t0, 3)
        entry["eval"].append(row)
        entry["eval"].sort(key=lambda e: e["length"])
        ui.log(f"[{method}] L={length}: " + (reason or f"perplexity {row['perplexity']:.3f}, {row['bits_per_byte']:.3f} bits/byte"))
        ui.advance(bar)
        if ctx.main:
            write_json(paths.results, results)
    ui.close(bar)
    entry["status"] = "done"
    if ctx.main:
        write_json(paths.results, results)
        write_outputs(results, paths.root)


def run_experiment(cfg: StudyConfig, out: str | Path, *, resume: bool = False, progress: bool = True,
                   ctx: distributed.Context | None = None, on_step: StepCallback | None = None) -> dict:
    """Run (or continue) a study; returns the results dict (also in ``out/results.json``).

    Args:
        cfg: the study; validated here, before anything is written.
        out: output directory (see :mod:`posenc.study.results` for its files).
        resume: continue the study already in ``out`` (finished methods are skipped).
        progress: bars or log lines on stderr.
        ctx: this process's place under torchrun (default: one process on ``cfg.device``).
        on_step: called as ``on_step(method, step)`` after every training step.
    """
    ctx = ctx or distributed.Context(torch.device(cfg.device))
    out = Path(out)
    failure = None
    try:
        corpus, results, rundir = prepare(cfg, out, resume, ctx)
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
        return _run(cfg, out, corpus, results, rundir, ctx, Progress(progress, main=ctx.main), on_step)
    except WriteError as err:
        raise WriteError(f"{err}; finished work is in {out}: make room, then continue with resume") from err
    finally:
        if rundir is not None:
            rundir.release()


def _run(cfg: StudyConfig, out: Path, corpus: Corpus, results: dict, rundir: RunDir | None,
         ctx: distributed.Context, ui: Progress, on_step: StepCallback | None) -> dict:
    paths = Paths(out)
    if rundir is not None and rundir.notice:
        ui.warn(rundir.notice)
    if ctx.main:
        write_json(paths.results, results)
    todo = cfg.methods
    ui.study_bar(len(todo), sum(results["methods"].get(m, {}).get("status") == "done" for m in todo))
    ui.log(f"posenc study: {len(todo)} method(s), train length {cfg.train_length}, eval {cfg.eval_lengths}, "
           f"{cfg.steps} steps of {cfg.batch_size} x {cfg.train_length} bytes, out {out}")
    ui.log(corpus.summary())
    for s in corpus.skipped:
        ui.warn(f"data: skipped {s['file']}: {s['reason']}")
    try:
        for method in todo:
            if results["methods"].get(method, {}).get("status") == "done":
                ui.log(f"[{method}] done already, skipped")
                continue
            run_method(method, cfg, corpus, results, paths, ctx, ui, on_step)
            ui.method_done()
    finally:
        ui.finish()
    results["status"] = "done" if all(results["methods"].get(m, {}).get("status") == "done"
                                      for m in results["config"]["methods"]) else "partial"
    if ctx.main:
        write_json(paths.results, results)
        write_outputs(results, out, table=True)
        with contextlib.suppress(OSError):
            (out / "state").rmdir()  # only when empty: no method is mid-training
    return results
