"""Which rows differ: two studies side by side, and the rows of one study that differ beyond both
of its noises.

**Two studies side by side** (``posenc report RUN_A RUN_B``).

- Same task, scored on the same windows (same corpus, validation bytes, sliding stride and
  evaluation lengths for a language-model study; same training length, evaluation lengths and
  sequence count for recall): per row present in both and per length, A, B and B - A with a paired
  95% bootstrap interval (:func:`posenc.study.bootstrap.difference`: each resample draws the same
  windows for both runs, so the text's own difficulty cancels and only the models' difference is
  left). Any other difference of configuration (steps, seed, model size, ...) is listed above the
  table: it is what the comparison is about. Runs scored on different windows are refused, with what
  differs: their numbers cannot be paired.
- One language-model study and one recall study: a combined summary per row (perplexity from the
  first, recall from the second), the two axes the question needs.

**Which rows of one study differ beyond both of its noises**, the evaluation text's and the training's (separation).

Two rows at one evaluation length are *separated* when both hold:

1. their 95% bootstrap intervals over the scored windows do not overlap (:mod:`.bootstrap`: the
   sampling noise of the finite evaluation text, for the seed mean), and
2. the ranges of their seeds' own numbers do not overlap (:mod:`.seeds`: the training noise, which
   the interval above does not contain).

Then every seed of one row lies on the same side of every seed of the other, and the seed means
differ by more than the text resolves. It is a deliberately conservative rule for a few seeds (three
seeds cannot estimate a standard deviation well enough for a t-test to mean much), so a row marked
``below`` another is a finding a reader may repeat; ``overlaps`` says only that this study does not
resolve the difference. With one seed, condition 2 cannot be checked, and nothing is separated.

The number compared is the one the study's tables show: perplexity for a language-model study (lower
is better), the far-distance accuracy for a recall study (higher is better). ``below``/``above``
refer to the number, not to which row is better.

Marks, for row A against row B at one length:

- ``below`` / ``above``: separated, A's number lower / higher than B's;
- ``overlaps``: not separated (either the intervals or the seed ranges overlap);
- ``one seed``: one of them has a single finished seed, so the rule cannot be applied;
- ``n/a``: one of them has no number at that length (a bounded table, a length not run).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from ..errors import UsageError
from . import bootstrap, rows, seeds
from .results import Paths, metric_of, shown

# What decides the windows a number was scored on: equal in both runs, or no pairing is possible.
WINDOWS_LM = ("task", "valid_bytes", "sliding", "eval_lengths", "data")
WINDOWS_RECALL = ("task", "train_length", "eval_lengths", "recall_sequences")
IGNORED = ("methods", "device", "preset")  # where it ran, and what it was started from, not what it is


def config_diff(a: dict, b: dict, keys: Iterable[str] | None = None) -> list[str]:
    """'key: A -> B' for each config field that differs (all fields, or ``keys``)."""
    a, b = a["config"], b["config"]
    names = keys or sorted((set(a) | set(b)) - set(IGNORED))
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in names if a.get(k) != b.get(k)]


def check_pairable(a: dict, b: dict, name_a: str, name_b: str) -> list[str]:
    """UsageError when runs of one task were scored on different windows; else the config
    differences to state (besides the methods).

    Raises:
        UsageError: the two runs were scored on different windows, so a pairwise comparison would
            be meaningless.
    """
    keys = WINDOWS_RECALL if metric_of(a) == "accuracy" else WINDOWS_LM
    blocking = config_diff(a, b, keys)
    if metric_of(a) != "accuracy" and a.get("corpus", {}).get("valid_sha256") != b.get("corpus", {}).get("valid_sha256"):
        blocking.append("the validation text (valid_sha256)")
    if blocking:
        raise UsageError(f"{name_a} and {name_b} were scored on different windows ({'; '.join(blocking)}), so their "
                         "numbers cannot be compared pairwise; compare runs of the same data and evaluation settings")
    return config_diff(a, b)


def _windows(results: dict, root: Path, method: str, length: int) -> list[dict] | None:
    """The per-window numbers of every finished seed of ``method`` at ``length``; None if any is missing."""
    entry = results["methods"][method]
    stem = rows.parse(method).stem
    out = []
    for run in seeds.runs(entry):
        if run.get("status") != "done":
            continue
        w = seeds.load_windows(Paths(root), stem, run.get("seed", results.get("seed", 0)), length)
        if w is None:
            return None
        out.append(w)
    return out or None


def differences(a: dict, root_a: Path, b: dict, root_b: Path) -> list[dict]:
    """Per common row and length: {"method", "length", "a", "b", "diff", "low", "high"} (perplexity, or
    far-distance accuracy for recall); low/high None when a window file is missing."""
    recall = metric_of(a) == "accuracy"
    out = []
    for method in [m for m in a["methods"] if m in b["methods"]]:
        rows_a = {r["length"]: r for r in shown(a["methods"][method])}
        rows_b = {r["length"]: r for r in shown(b["methods"][method])}
        for length in sorted(set(rows_a) & set(rows_b)):
            ra, rb = rows_a[length], rows_b[length]
            va = ra["distances"]["far"]["accuracy"] if recall and ra.get("accuracy") is not None else ra.get("perplexity")
            vb = rb["distances"]["far"]["accuracy"] if recall and rb.get("accuracy") is not None else rb.get("perplexity")
            item = {"method": method, "length": length, "a": va, "b": vb, "diff": None, "low": None, "high": None}
            if va is not None and vb is not None:
                item["diff"] = vb - va
                wa, wb = _windows(a, root_a, method, length), _windows(b, root_b, method, length)
                if wa and wb:
                    if recall:
                        args = ([w["far"]["correct"] for w in wa], [w["far"]["count"] for w in wa],
                                [w["far"]["correct"] for w in wb], [w["far"]["count"] for w in wb])
                        item["diff"], item["low"], item["high"] = bootstrap.difference(*args)
                    else:
                        args = ([w["nll"] for w in wa], [w["count"] for w in wa], [w["nll"] for w in wb],
                                [w["count"] for w in wb])
                        item["diff"], item["low"], item["high"] = bootstrap.difference(*args, transform=bootstrap.exp)
            out.append(item)
    return out


# -- separation: the rows of one study ------------------------------------------------------------

Mark = Literal["below", "above", "overlaps", "one seed", "n/a"]


def _figure(row: dict | None, recall: bool) -> dict | None:
    """The dict holding the shown number of a row at one length, its interval and its seed spread
    (keys value, low, high, seed_min, seed_max; None where missing), or None without a number."""
    if row is None:
        return None
    if recall:
        if row.get("accuracy") is None:
            return None
        d = row["distances"]["far"]
        return {"value": d["accuracy"], "low": d.get("acc_low"), "high": d.get("acc_high"),
                "seed_min": d.get("seed_min"), "seed_max": d.get("seed_max")}
    if row.get("perplexity") is None:
        return None
    return {"value": row["perplexity"], "low": row.get("ppl_low"), "high": row.get("ppl_high"),
            "seed_min": row.get("seed_min"), "seed_max": row.get("seed_max")}


def _apart(low_a: float, high_a: float, low_b: float, high_b: float) -> bool:
    """Closed ranges [low_a, high_a] and [low_b, high_b] share no point."""
    return high_a < low_b or high_b < low_a


def mark(a: dict | None, b: dict | None) -> Mark:
    """Row A against row B at one length (the figures of :func:`_figure`)."""
    if a is None or b is None:
        return "n/a"
    if a["seed_min"] is None or b["seed_min"] is None:
        return "one seed"
    if a["low"] is None or b["low"] is None:  # a window file missing: the text's noise is unknown
        return "overlaps"
    if not (_apart(a["low"], a["high"], b["low"], b["high"])
            and _apart(a["seed_min"], a["seed_max"], b["seed_min"], b["seed_max"])):
        return "overlaps"
    return "below" if a["value"] < b["value"] else "above"


def figures_by_length(results: dict, method: str) -> dict[int, dict | None]:
    """A row's shown figure per evaluation length (None where it has no number)."""
    recall = metric_of(results) == "accuracy"
    return {r["length"]: _figure(r, recall) for r in shown(results["methods"][method])}


def check_row(results: dict, row: str) -> None:
    """The one check of a ``--versus`` row, for the marks and the report alike.

    Raises:
        UsageError: ``row`` is not a row of the study.
    """
    if row not in results["methods"]:
        raise UsageError(f"versus: {row!r} is not a row of this study; its rows are "
                         f"{', '.join(results['methods'])}")


def versus(results: dict, other: str) -> dict[str, dict[int, Mark]]:
    """Every row of a study against the row ``other``, per evaluation length.

    Raises:
        UsageError: ``other`` is not a row of the study.
    """
    check_row(results, other)
    ref = figures_by_length(results, other)
    out = {}
    for method in results["methods"]:
        mine = figures_by_length(results, method)
        out[method] = {n: mark(mine.get(n), ref.get(n)) for n in sorted(set(mine) | set(ref))}
    return out


def matrix(results: dict, length: int) -> dict[str, dict[str, Mark]]:
    """Every row against every other at one length (``m[a][b]``: the mark of a against b)."""
    figs = {m: figures_by_length(results, m).get(length) for m in results["methods"]}
    return {a: {b: mark(figs[a], figs[b]) for b in figs if b != a} for a in figs}


def markdown_versus(results: dict, other: str) -> str:
    """A markdown table: rows x lengths, each cell the mark of the row against ``other``."""
    marks = versus(results, other)
    lengths = sorted({n for by in marks.values() for n in by})
    train_len = results["config"]["train_length"]
    head = ["method", *(f"{n}{'*' if n == train_len else ''}" for n in lengths)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, by in marks.items():
        if method == other:
            continue
        lines.append("| " + " | ".join([method, *(by.get(n, "n/a") for n in lengths)]) + " |")
    return "\n".join(lines)


__all__ = ["IGNORED", "WINDOWS_LM", "WINDOWS_RECALL", "Mark", "check_pairable", "check_row", "config_diff", "differences",
           "figures_by_length", "mark", "markdown_versus", "matrix", "versus"]
