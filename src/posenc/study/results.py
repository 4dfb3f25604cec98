"""A study's files: the layout of its output directory, ``results.json`` (read and checked), and the
tables and figure made from it.

    results.json          config, corpus fingerprint, versions, per method: loss curve, timing, eval
    results.csv           one row per method and evaluation length
    results.md            perplexity table (methods x lengths)
    extrapolation.png     perplexity vs evaluation length, training length marked
    checkpoints/M.safetensors + M.json    final weights + their LMConfig (posenc.load_checkpoint)
    state/M.pt            training state while M trains (model, optimizer, scheduler, RNG, step)
    .posenc-run           marker: posenc made this directory (it writes nowhere else)
    .posenc-lock          holds the pid of the run writing here (see posenc.files.RunDir)
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from ..files import lock_holder, write_text

SCHEMA = "posenc-study/1"


@dataclass
class Paths:
    """Where each file of a study lives under its output directory."""

    root: Path

    @property
    def results(self) -> Path:
        return self.root / "results.json"

    def checkpoint(self, method: str) -> Path:
        return self.root / "checkpoints" / f"{method}.safetensors"

    def state(self, method: str) -> Path:
        return self.root / "state" / f"{method}.pt"


def load_results(out: str | Path) -> dict | None:
    """The results dict of the study in ``out``; None when it has no results.json yet;
    UsageError saying what is wrong when the file is not a study's results."""
    path = Paths(Path(out)).results
    if not path.exists():
        return None
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UsageError(f"{path} is not valid JSON ({err}); it is damaged, or not a study's results") from None
    if not isinstance(results, dict) or results.get("schema") != SCHEMA:
        schema = results.get("schema") if isinstance(results, dict) else None
        raise UsageError(f"{path} is not a posenc study's results (schema {schema!r}, expected {SCHEMA!r})")
    problems = _problems(results)
    if problems:
        raise UsageError(f"{path} is not a complete posenc study result ({'; '.join(problems[:3])}); "
                         "it was edited or damaged")
    return results


def _problems(results: dict) -> list[str]:
    """What a results dict lacks of what resume, the tables and the report read."""
    out = []
    cfg = results.get("config")
    if not isinstance(cfg, dict):
        out.append("no config")
    else:
        out += [f"config has no {k}" for k in ("train_length", "steps", "batch_size", "eval_lengths", "methods")
                if k not in cfg]
    methods = results.get("methods")
    if not isinstance(methods, dict):
        return out + ["no methods"]
    for m, e in methods.items():
        if not isinstance(e, dict) or not isinstance(e.get("eval"), list) or not isinstance(e.get("train"), dict):
            out.append(f"method {m!r} has no train record or eval list")
        elif not all(isinstance(r, dict) and {"length", "perplexity", "status"} <= set(r) for r in e["eval"]):
            out.append(f"method {m!r} has an eval row without length, perplexity or status")
    return out


def run_status(results: dict, out: str | Path) -> str:
    """The status to show for a study: 'done', 'partial', 'running (pid N ...)', or 'interrupted'
    for a run that says running while no live process holds its directory's lock."""
    status = results.get("status", "?")
    if status != "running":
        return status
    holder = lock_holder(out)
    if holder is None:
        return "interrupted (resume with --resume)"
    return f"running (pid {holder.get('pid', '?')}, started {holder.get('started', '?')})"


def results_csv(results: dict) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["method", "train_length", "eval_length", "perplexity", "bits_per_byte", "loss", "tokens",
                "status", "train_time_s", "train_tokens_per_s", "parameters"])
    for method, e in results["methods"].items():
        for row in e["eval"]:
            w.writerow([method, results["config"]["train_length"], row["length"], row["perplexity"],
                        row["bits_per_byte"], row["loss"], row["tokens"], row["status"], e["train"]["time_s"],
                        e["train"]["tokens_per_s"], e["parameters"]])
    return buf.getvalue()


def seconds(t: float) -> str:
    """Three significant digits (0.0312, 5.36, 45.3), whole seconds from 100 on."""
    return f"{t:.0f}" if t >= 100 else f"{t:.3g}"


def markdown_table(results: dict, key: str = "perplexity") -> str:
    """Methods x evaluation lengths; a bounded method past its table shows 'n/a (> N)'."""
    lengths = sorted({r["length"] for e in results["methods"].values() for r in e["eval"]})
    train_len = results["config"]["train_length"]
    head = ["method", *(f"{n}{'*' if n == train_len else ''}" for n in lengths), "train s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, e in results["methods"].items():
        by = {r["length"]: r for r in e["eval"]}
        cells = []
        for n in lengths:
            r = by.get(n)
            if r is None:
                cells.append("")
            elif r[key] is None:
                cells.append(f"n/a (> {e['model'].get('max_positions') or train_len})")
            else:
                cells.append(f"{r[key]:.3f}")
        lines.append("| " + " | ".join([method, *cells, seconds(e["train"]["time_s"])]) + " |")
    return "\n".join(lines)


def write_outputs(results: dict, out: Path, table: bool = False) -> None:
    """results.csv and extrapolation.png (and results.md when ``table``) from results.json's
    content: the methods finished so far."""
    from .. import plots

    write_text(out / "results.csv", results_csv(results))
    plots.save(plots.extrapolation_figure(results), out / "extrapolation.png")
    if table:
        write_text(out / "results.md", markdown_table(results) + "\n")
