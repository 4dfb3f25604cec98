"""A study's files: the layout of its output directory, ``results.json`` (read and checked), and the
tables and figure made from it.

    results.json          config, corpus fingerprint, versions, per method: loss curve, timing, eval
    results.csv           one row per method and evaluation length
    results.md            perplexity table (methods x lengths)
    extrapolation.png     perplexity vs evaluation length, training length marked
    checkpoints/M.safetensors + M.json    final weights + their LMConfig (posenc.load_checkpoint)
    state/M.pt            training state while M trains (model, optimizer, scheduler, RNG, step)
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from ..files import write_text

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
    """The results dict of the study in ``out``; None when it has no results.json yet."""
    path = Paths(Path(out)).results
    if not path.exists():
        return None
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise UsageError(f"{path} is not valid JSON ({err}); cannot resume from it") from None
    if not isinstance(results, dict) or results.get("schema") != SCHEMA:
        schema = results.get("schema") if isinstance(results, dict) else None
        raise UsageError(f"{path} is not a posenc study ({schema!r}); cannot resume from it")
    return results


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
