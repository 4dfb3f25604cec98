"""``posenc bench``: speed and memory of every method, as ratios to NoPE measured in the same round.

Options are checked, then the output folder, before any job runs; the table is printed (stdout) and
written with the CSV, JSON, command and plot under ``--out``; progress goes to stderr, one line per
job. See :mod:`posenc.bench` for what is measured.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from .. import backends
from ..errors import UsageError
from .harness import run as run_jobs
from .levels import LEVELS
from .libraries import LIBRARIES
from .output import JOURNAL, Journal, claim_out, clear_outputs, journal_header, journal_jobs, save_fallback, write_outputs
from .plan import DEVICES, DTYPES, SIZE_NAMES, Config, configure
from .tables import markdown_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    levels = "; ".join(f"{name}: {level.summary}" for name, level in LEVELS.items())
    parser.add_argument("--methods", nargs="+", default=None,
                        help="encodings to run (default all; nope is always included), or layer schedules in their text form, "
                        "quoted: '[rope window=256]' (attention level: one layer), '3x[rope window=256] 1x[rope]'")
    parser.add_argument("--lengths", nargs="+", type=int, default=[512, 1024, 2048, 4096], help="sequence lengths (default 512 1024 2048 4096)")
    parser.add_argument("--level", default="attention", help=f"what is timed (default attention). {levels}")
    parser.add_argument("--mode", default="both", help="train (forward+backward / training step), infer (forward) or both")
    able = "; ".join(f"{name} (level {', '.join(n for n, lv in LEVELS.items() if name in lv.compare)})" for name in LIBRARIES)
    parser.add_argument("--compare", nargs="+", default=None, metavar="LIB", help=f"also build the same model with: {able}")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default bench-results/LEVEL)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds: every job runs once per round, each ratio is to the NoPE of its round; "
                             "the median over rounds is reported with its min-max (default 5)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per job; their median is that round's time (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed warm-up steps per job (default 1)")
    parser.add_argument("--device", default="cpu", help=f"{' or '.join(DEVICES)} (default cpu)")
    parser.add_argument("--backend", default="auto", help=f"posenc attention backend, one of {', '.join(backends.names())} (default auto)")
    parser.add_argument("--dtype", default="float32", help=f"{' or '.join(DTYPES)} (default float32)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: torch's default)")
    parser.add_argument("--dim", type=int, default=None, help="model width (default 512 attention, 256 model)")
    parser.add_argument("--heads", type=int, default=None, help="attention heads (default 8)")
    parser.add_argument("--depth", type=int, default=None, help="layers, model level (default 4)")
    parser.add_argument("--batch", type=int, default=None, help="batch size (default 1)")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary, model level (default 256)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds before a worker is abandoned (default none)")
    parser.add_argument("--seed", type=int, default=0, help="torch seed of every worker (default 0)")
    parser.add_argument("--resume", action="store_true",
                        help=f"continue the interrupted run in --out: the jobs its {JOURNAL} holds are kept, the rest run "
                             "(the options must be the same)")


def command_line(config: Config, methods: list[str] | None, out: Path) -> str:
    """The command that reproduces this run, every option spelled out."""
    level = LEVELS[config.level]
    options = {
        "methods": methods or config.methods, "lengths": config.lengths, "level": config.level,
        "mode": "both" if list(level.modes) == config.modes else config.modes[0], "compare": config.compare or None,
        "rounds": config.rounds, "repeats": config.repeats, "warmup": config.warmup, "device": config.device,
        "backend": config.backend, "dtype": config.dtype, "threads": config.threads, "timeout": config.timeout,
        "seed": config.seed, **{k: config.sizes[k] for k in SIZE_NAMES}, "out": out,
    }
    words = ["posenc", "bench"]
    for key, value in options.items():
        if value is not None:
            words += ["--" + key, *(str(v) for v in (value if isinstance(value, (list, tuple)) else [value]))]
    return shlex.join(words)


def run(args: argparse.Namespace) -> int:
    sizes = {k: getattr(args, k) for k in SIZE_NAMES}
    config = configure(
        methods=args.methods, lengths=args.lengths, level=args.level, mode=args.mode, compare=args.compare,
        rounds=args.rounds, repeats=args.repeats, warmup=args.warmup, device=args.device, backend=args.backend,
        dtype=args.dtype, threads=args.threads, timeout=args.timeout, seed=args.seed, **sizes,
    )
    out = args.out if args.out is not None else Path("bench-results") / config.level
    resume = getattr(args, "resume", False)
    if resume and not (Path(out) / JOURNAL).is_file():
        raise UsageError(f"resume: {str(out)!r} holds no {JOURNAL} (no interrupted run to continue); leave out --resume")
    claim = claim_out(out)
    try:
        kept = journal_jobs(claim.path / JOURNAL, config) if resume else None
        if not resume and (claim.path / JOURNAL).exists():
            raise UsageError(f"out: {claim.path / JOURNAL} holds the measurements of an interrupted run; continue it "
                             "with --resume, or choose another out (posenc never deletes it)")
        if claim.notice:
            print(f"posenc bench: {claim.notice}", file=sys.stderr)
        if not resume:
            replaced = clear_outputs(claim.path)  # an interrupted run must not sit beside an earlier run's results
            if replaced:
                print(f"posenc bench: replacing the earlier results in {claim.path} ({', '.join(replaced)})", file=sys.stderr)
        return _run(config, args, claim.path, kept)
    finally:
        claim.release()


def _run(config: Config, args: argparse.Namespace, out: Path, kept: list[dict] | None = None) -> int:
    command = command_line(config, args.methods, out)
    journal = Journal(out / JOURNAL, journal_header(config, command))
    try:
        results = run_jobs(config, on_result=journal, kept=kept)
    except KeyboardInterrupt:
        if journal.path.exists() and journal.error is None:
            print(f"posenc bench: the measurements so far are in {journal.path}; continue with the same command and "
                  "--resume", file=sys.stderr)
        raise
    results.meta["command"] = command
    print(markdown_table(results), end="")
    try:
        paths = write_outputs(results, out)
    except OSError as err:  # the folder was fine before the run: keep the measurements elsewhere
        saved = save_fallback(results)
        print(f"posenc bench: error: cannot write the results in {str(out)!r} ({err}); "
              f"all {len(results.jobs)} measurements are saved in {saved}", file=sys.stderr)
        return 1
    print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return 0
