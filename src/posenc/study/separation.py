"""Which rows of a study differ beyond both of its noises, the evaluation text's and the training's.

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

from typing import Literal

from ..errors import UsageError
from .results import metric_of, shown

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


__all__ = ["Mark", "check_row", "figures_by_length", "mark", "markdown_versus", "matrix", "versus"]
