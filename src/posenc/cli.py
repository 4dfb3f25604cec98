"""The ``posenc`` command line: one subcommand per module, each with ``add_arguments`` and ``run``.

A :class:`~posenc.errors.UsageError` is printed as one line (exit 2); any other exception is a bug or
a fault of the machine and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import UsageError
from .version import __version__

# subcommand -> (module, one-line help). Modules are imported when the parser is built.
COMMANDS: dict[str, tuple[str, str]] = {
    "list": ("posenc.show.describe", "list the encodings: description, parameters, extrapolation"),
    "buckets": ("posenc.show.describe", "print the T5 relative-position bucket table"),
    "show": ("posenc.show.scores", "heatmap of what an encoding adds to the attention scores"),
    "study": ("posenc.study.cli", "train short, test long: train every method, evaluate at many lengths"),
    "report": ("posenc.study.report", "turn a study's output directory into one self-contained HTML page"),
    "bench": ("posenc.bench.cli", "speed and memory of every method, as ratios to NoPE (optionally vs x-transformers)"),
    "extend": ("posenc.extend.extend_cli", "fine-tune a trained RoPE model under a scaling (PI, NTK, YaRN, Llama 3, LongRoPE, "
                                      "DroPE) at a longer length; before/after table by length"),
    "sample": ("posenc.study.sample", "continue a text prompt with a study's checkpoint (byte-level), streaming the output"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="posenc",
        description="Positional encodings for Transformer attention: inspect, train short / test long, benchmark.",
    )
    parser.add_argument("--version", action="version", version=f"posenc {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments = getattr(module, f"add_{name}_arguments", None) or getattr(module, "add_arguments")
        add_arguments(p)
        p.set_defaults(_run=getattr(module, f"run_{name}", getattr(module, "run", None)))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args._run(args) or 0)
    except UsageError as err:  # user errors: one clear line, no traceback
        print(f"posenc {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"posenc {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
