"""``posenc study`` on the command line.

Every :class:`StudyConfig` field is an option (``train_length`` -> ``--train-length``) whose type,
help and per-preset defaults are read from the dataclass and :data:`PRESETS`, so a new field is a
new option with nothing else to edit. Options not given stay None: the value then comes from the
resumed run's config, else from the preset.
"""

from __future__ import annotations

import argparse
import sys
import time
import types
import typing
from dataclasses import fields
from pathlib import Path

import torch

from ..encodings import available
from ..errors import UsageError
from . import distributed
from .config import COMPANIONS, LM_ONLY, PAIR_PARTS, PRESET_DESCRIPTIONS, PRESET_THREADS, PRESETS, RECALL_ONLY, StudyConfig
from .executors import EXECUTORS, Execution, cores
from .merge import merge
from .plan import parse_shard
from .report import run_report
from .results import load_results, markdown_table
from .run import StepCallback, run_experiment

_SPECIAL = {"preset"}  # an option of its own: its choices are the presets


def _option_type(annotation: typing.Any) -> tuple[type, bool]:  # (a type expression)
    """(element type, is a list) of a field annotation such as ``int``, ``int | None``, ``list[str]``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is list:
        return typing.get_args(annotation)[0], True
    return annotation, False


def _preset_values(name: str) -> str:
    values = [PRESETS[p][name] for p in PRESETS]
    show = [" ".join(map(str, v)) if isinstance(v, list) else str(v) for v in values]
    return ", ".join(f"{p} {s}" for p, s in zip(PRESETS, show))


def add_study_arguments(p: argparse.ArgumentParser) -> None:
    presets = "; ".join(f"{name} ({text})" for name, text in PRESET_DESCRIPTIONS.items())
    p.add_argument("--preset", choices=list(PRESETS), default=None,
                   help=f"starting sizes and rows: {presets} (default: default; recall with task recall)")
    hints = typing.get_type_hints(StudyConfig)
    for f in fields(StudyConfig):
        if f.name in _SPECIAL:
            continue
        kind, many = _option_type(hints[f.name])
        help_text = f.metadata.get("help", "")
        if f.name == "methods":
            help_text += (f"; per preset: {_preset_values(f.name)}; registered methods: {', '.join(available())}")
        elif f.metadata.get("preset"):
            help_text += f" (per preset: {_preset_values(f.name)})"
        elif f.default is not None and not callable(f.default) and "default" not in help_text:
            help_text += f" (default {f.default})"
        if kind is bool:  # a flag: given means True (None: not given, the preset's or saved value stands)
            p.add_argument(f"--{f.name.replace('_', '-')}", action="store_const", const=True, default=None, help=help_text)
            continue
        p.add_argument(f"--{f.name.replace('_', '-')}", type=kind, nargs="+" if many else None,
                       metavar=f.metadata.get("metavar"), choices=f.metadata.get("choices"), default=None,
                       help=help_text)
    p.add_argument("--out", default=None, help="output directory (default runs/PRESET)")
    p.add_argument("--resume", action="store_true", help="continue the study in --out: finished methods are skipped")
    p.add_argument("--threads", type=int, help="CPU threads of each run (default: 1 for smoke and for executor ray, "
                   "else the cores / jobs)")
    p.add_argument("--jobs", default="1", metavar="N|auto", help="runs at a time, each in a worker process of its own (a "
                   "row at a seed; a run evaluated or fine-tuned from another waits for it); numbers equal a serial "
                   "study's at the same threads; auto: one per core, at 1 thread each (default 1: one after another "
                   "in this process)")
    p.add_argument("--executor", choices=EXECUTORS, default="local",
                   help="where runs go: local (worker processes, --jobs) or ray (each run a Ray task needing --threads "
                   "CPUs, or a GPU; pip install 'posenc[ray]') (default local)")
    p.add_argument("--ray-address", default=None, help="an existing Ray cluster (ray.init's address; default: start a "
                   "local Ray instance)")
    p.add_argument("--shard", default=None, metavar="K/N", help="only the K-th of N parts of the runs, for a job array; "
                   "`posenc study merge` joins the parts' folders")
    p.add_argument("merge", nargs="*", metavar="merge DIR", help="posenc study merge DIR... --out DIR: join the folders "
                   "of a study's parts (--shard) into one, checked, with the tables and figures across seeds")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def preset_of(args: argparse.Namespace, saved: dict | None = None) -> str:
    """The preset a run takes: ``--preset``, else the resumed run's, else the task's own (recall),
    else default. ``--task recall`` with a preset that has a recall companion (:data:`COMPANIONS`)
    takes the companion: the recall half of that study alone."""
    task = getattr(args, "task", None)
    task_preset = "recall" if task == "recall" else None  # the task's own sizes
    preset = args.preset or (saved or {}).get("preset") or task_preset or "default"
    return COMPANIONS[preset] if task == "recall" and preset in COMPANIONS else preset


def config_from_args(args: argparse.Namespace, saved: dict | None = None) -> StudyConfig:
    """Preset defaults, then (when resuming) the saved run's config, then the options given.

    Raises:
        UsageError: a model size (dim, depth, num_heads) is given together with ``--hf-config``,
            which sets them.
    """
    names = [f.name for f in fields(StudyConfig) if f.name not in _SPECIAL]
    given = {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}
    if given.get("hf_config") or (saved or {}).get("hf_config"):
        sizes = [k for k in ("dim", "depth", "num_heads") if k in given]
        if sizes:  # (even at the preset's values, which StudyConfig cannot tell from not given)
            flags = " and ".join("--" + k.replace("_", "-") for k in sizes)
            raise UsageError(f"{sizes[0]}: with --hf-config the model's sizes come from the config file (hidden_size, "
                             f"num_hidden_layers, num_attention_heads); leave out {flags}")
    preset = preset_of(args, saved)
    base = dict(PRESETS.get(preset, {}))
    if saved is not None:
        base.update({k: v for k, v in saved.items() if k in names})
    base.update(given)
    if "device" not in base:
        base["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    return StudyConfig.from_preset(preset, **base)


def default_out(args: argparse.Namespace) -> Path:
    """``--out``, or ``runs/PRESET`` with the preset the run takes (:func:`preset_of`)."""
    return Path(args.out) if args.out else Path("runs") / preset_of(args)


def _saved_config(out: Path) -> dict | None:
    """The config of the study in ``out``, or of the first half of a paired study there (``out/lm``)."""
    for where in (out, out / PAIR_PARTS[0]):
        if (where / "results.json").exists():
            return (load_results(where) or {}).get("config")
    return None


def study_parts(args: argparse.Namespace, out: Path) -> list[tuple[StudyConfig, Path, bool]]:
    """The studies one command runs, each ``(config, out, resume)``, every config checked (as it is
    made: the device string is valid before a process group is joined).

    One, usually. A preset with a recall companion (:data:`COMPANIONS`, ``schedules``) run without
    ``--task`` is two: the language-model study into ``out/lm``, then the recall study of the same
    rows into ``out/recall``; each half takes only the options that apply to its task.

    Raises:
        UsageError: ``resume`` names a folder that holds neither a study nor a pair of study parts.
    """
    saved = _saved_config(out) if args.resume else None
    preset = preset_of(args, saved)
    if getattr(args, "task", None) is not None or preset not in COMPANIONS:
        if saved is not None and not (out / "results.json").exists():
            saved = None  # (out holds a paired study; this command names one task of it: out/TASK)
        return [(config_from_args(args, saved), out, args.resume)]
    parts = []
    for part, (name, drop) in zip(PAIR_PARTS, ((preset, RECALL_ONLY), (COMPANIONS[preset], LM_ONLY))):
        where = out / part
        resume = bool(args.resume) and (where / "results.json").exists()
        mine = argparse.Namespace(**{**vars(args), "preset": name, **{k: None for k in drop}})
        cfg = config_from_args(mine, _saved_config(where) if resume else None)
        parts.append((cfg, where, resume))
    if args.resume and not any(resume for _, _, resume in parts):
        raise UsageError(f"resume: {out} holds no study (neither {out / PAIR_PARTS[0]} nor {out / PAIR_PARTS[1]}); "
                         "leave out resume to start one")
    return parts


def _print_table(cfg: StudyConfig, results: dict, out: Path, wall: float) -> None:
    if cfg.task == "recall":
        print(f"\nrecall accuracy with the queried pairs far away (the start of each sequence), "
              f"{cfg.recall_sequences} sequences per length; trained at {cfg.train_length} (*)")
    else:
        print(f"\nperplexity (bytes) of {results['corpus'].get('valid_bytes_used')} validation tokens at each "
              f"evaluation length; trained at {cfg.train_length} (*)")
    print("[95% bootstrap interval over the scored windows]" + (
          f"; mean of {cfg.seeds} seeds (min-max of the seeds)" if cfg.seeds > 1 else "") + "\n")
    print(markdown_table(results, intervals=True))
    print(f"\nresults in {out}/ (results.json, results.csv, extrapolation.png, checkpoints/); "
          f"`posenc report {out}` makes an HTML page; wall time {_minutes(wall)}")


def threads_of(args: argparse.Namespace, cfg: StudyConfig, threads: int) -> int:
    """The threads of each run: ``--threads``, else the preset's (smoke: 1), else 1 on Ray, else the
    cores / ``--jobs`` (``threads``: torch's own choice, for one job)."""
    if args.threads:
        return int(args.threads)
    if cfg.preset in PRESET_THREADS:
        return PRESET_THREADS[cfg.preset]
    if args.executor == "ray":
        return 1
    jobs = jobs_of(args.jobs)
    return threads if jobs == 1 else max(1, cores() // jobs)


def jobs_of(text: str | int) -> int:
    """``--jobs``: a positive integer, or ``auto`` (the cores this process may use).

    Raises:
        UsageError: neither a positive integer nor auto.
    """
    if text == "auto":
        return cores()
    try:
        jobs = int(text)
    except ValueError:
        jobs = 0
    if jobs < 1:
        raise UsageError(f"jobs must be an integer >= 1 or auto, got {text!r}")
    return jobs


def _merge(args: argparse.Namespace) -> int:
    """``posenc study merge DIR... --out DIR``.

    Raises:
        UsageError: not ``merge`` first, no folders or no ``--out``, or a study option beside them.
    """
    if args.merge[0] != "merge":
        raise UsageError(f"unexpected argument {args.merge[0]!r}: the one word `posenc study` takes is merge "
                         "(posenc study merge DIR... --out DIR)")
    if len(args.merge) < 2 or args.out is None:
        raise UsageError("merge needs the folders to join and --out: posenc study merge DIR... --out DIR")
    other = sorted(k for k, v in vars(args).items() if k not in ("merge", "out", "quiet", "command", "_run", "jobs",
                                                                    "executor") and v not in (None, False))
    if other or str(args.jobs) != "1" or args.executor != "local":
        names = other + (["jobs"] if str(args.jobs) != "1" else []) + (["executor"] if args.executor != "local" else [])
        raise UsageError(f"merge takes the folders and --out only, not --{names[0].replace('_', '-')} (the study's "
                         "options come from the folders)")

    results = merge([Path(d) for d in args.merge[1:]], Path(args.out), progress=not args.quiet)
    print(markdown_table(results, intervals=True))
    print(f"\nmerged {len(args.merge) - 1} folders into {args.out}/ (status {results['status']}); "
          f"`posenc report {args.out}` makes an HTML page")
    return 0


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def run_study(args: argparse.Namespace, on_step: StepCallback | None = None) -> int:
    """``posenc study``: every study part the arguments name, trained and evaluated; the exit status.

    Raises:
        UsageError: ``threads`` is below 1 (and every error of the study's config and run, naming
            the option).
    """
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"threads must be >= 1, got {args.threads}")
    if args.merge:
        return _merge(args)
    jobs = jobs_of(args.jobs)
    part = parse_shard(args.shard) if args.shard is not None else None
    out = default_out(args)
    parts = study_parts(args, out)
    ctx = distributed.setup(parts[0][0].device)
    code = 0
    threads = torch.get_num_threads()
    try:
        started = time.perf_counter()
        for cfg, where, resume in parts:
            execution = Execution(jobs, threads_of(args, cfg, threads), args.executor, args.ray_address)
            torch.set_num_threads(execution.threads or threads)
            t0 = time.perf_counter()
            results = run_experiment(cfg, where, resume=resume, progress=not args.quiet, ctx=ctx, on_step=on_step,
                                     execution=execution, shard=part)
            if ctx.main:
                _print_table(cfg, results, where, time.perf_counter() - t0)
        if len(parts) > 1 and ctx.main:

            first, second = parts[0][1], parts[1][1]
            run_report(argparse.Namespace(run_dir=str(first), other=str(second), out=str(out / "report.html")))
            print(f"perplexity and recall of the same rows: {out / 'report.html'} "
                  f"(`posenc report {first} {second}`); wall time of both {_minutes(time.perf_counter() - started)}")
    except UsageError as err:
        if not ctx.distributed:
            raise
        code = 2
        if ctx.main:  # (a rank that alone rejected the configuration printed its line already)
            print(f"posenc study: error: {err}", file=sys.stderr)
        own = ctx.main and not str(err).startswith("another process")
        distributed.record_failure(ctx, f"posenc study (rank {ctx.rank}): error: {err}", root=own)
    except KeyboardInterrupt:
        if not ctx.distributed:
            print(f"posenc study: interrupted; finished work is in {out}, continue with --resume", file=sys.stderr)
            return 130
        code = 130
    except BaseException as err:
        if not ctx.distributed:
            raise
        code = 1
        if distributed.peer_failed(err):  # not this process's fault: one line, the other one explains
            line = (f"posenc study (rank {ctx.rank}): stopped: another process failed (see its message); "
                    f"finished work is in {out}, continue with --resume")
            print(line, file=sys.stderr)
            distributed.record_failure(ctx, line, root=False)
        else:
            import traceback

            traceback.print_exc()
            line = f"posenc study (rank {ctx.rank}): failed: {type(err).__name__}: {err}"
            print(line, file=sys.stderr)
            distributed.record_failure(ctx, line, root=True)
    finally:
        torch.set_num_threads(threads)
    return distributed.finish(ctx, code)
